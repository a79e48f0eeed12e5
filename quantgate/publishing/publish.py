"""What goes out after a decision (adapter): the spec's `publish:` targets and `notify:` webhooks, and their records.

    publish:                               # every PROMOTE entry, after it is promoted, to each target in turn
      - folder: ../published               #   <folder>/<model>/<version>/ (relative to the spec file's folder)
      - url: memory://models               #   any fsspec URL: file:///..., s3://bucket/prefix (with s3fs), ...
      - hf_repo: my-org/demo-w4a16         #   a Hugging Face Hub model repository, through huggingface_hub,
        token_env: HF_TOKEN                #   with the token from this variable (default HF_TOKEN); without it the
        private: true                      #   publish fails (exit 5); a new repository is private by default
    notify:                                # after the gate, for every decision (PROMOTE, REJECT, INCONCLUSIVE)
      - url: https://ci.example/hooks/quantgate
        secret_env: QUANTGATE_WEBHOOK_SECRET   # HMAC-SHA256 of the body in X-Quantgate-Signature-256
        report_url: https://ci.example/runs/{run}/report.html   # the link sent with the decision
        timeout_s: 10                      # per attempt
        attempts: 5                        # retried on connection errors, timeouts, HTTP 5xx and 429

Each publish is recorded in <run>/publish.json (PublishLog: candidate, entry, target, status, where, error) and each
notification in <run>/notify.json (quantgate.publishing.webhook.NotifyLog); both are copied into <run>/summary.json with a note per
failure. A failure never un-does a promotion (the entry stays in the registry; `quantgate registry publish ENTRY
TARGET` retries it by hand) and is never swallowed: the release exits OUTBOUND_FAILED (5) instead of 0, and the
Prefect flow run ends Failed, named "Publish failed". A notify `secret_env` that is not set stops the release at its
start, before any work.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

import fsspec
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from quantgate.base.runfiles import NOTIFY, PUBLISH
from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import write_json
from quantgate.base.typedfile import read_model
from quantgate.gate.summaryfile import NotifyRecord, PublishRecord, Summary, as_json
from quantgate.publishing import registry, targets

ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
HF_TOKEN = "HF_TOKEN"
OUTBOUND_FAILED = 5  # exit code of `quantgate release`: PROMOTE, but a publish target or a notification failed
PUBLISH_FILE, NOTIFY_FILE = PUBLISH, NOTIFY


class PublishTarget(BaseModel):
    """One place every promoted entry goes: exactly one of `folder`, `url` or `hf_repo`."""

    model_config = ConfigDict(extra="forbid")

    folder: Path | None = Field(None, description="a folder; the entry goes to <folder>/<model>/<version>")
    url: str | None = Field(None, description="an fsspec URL (file://, memory://, s3://, ...); <url>/<model>/<version>")
    hf_repo: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$",
                                description="a Hugging Face Hub model repository, owner/name")
    token_env: str | None = Field(None, pattern=ENV_NAME, description="hf_repo: the variable holding the Hub token "
                                  "(default HF_TOKEN); not set at run time: this publish fails (exit 5), nothing is uploaded")
    private: bool | None = Field(None, description="hf_repo: a repository quantgate creates is private (default true)")

    @field_validator("folder")
    @classmethod
    def _relative_to_spec(cls, v: Path | None, info: ValidationInfo) -> Path | None:
        base = (info.context or {}).get("path")
        if v is None or v.is_absolute() or base is None:
            return v
        return (Path(base).parent / v).resolve()

    @field_validator("url")
    @classmethod
    def _known_protocol(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if "://" not in v:
            raise ValueError(f"{v!r} is not a URL: write `folder: {v}` for a local folder, or scheme://path")
        if v.startswith(targets.HUB):
            raise ValueError("hf:// URLs go through `hf_repo: OWNER/NAME` (with token_env and private)")
        protocol = v.split("://", 1)[0]
        try:
            fsspec.get_filesystem_class(protocol)
        except ValueError:
            raise ValueError(f"fsspec knows no protocol {protocol!r}") from None
        except ImportError as exc:
            raise ValueError(f"the fsspec backend for {protocol}:// is not installed here ({exc})") from None
        return v

    @model_validator(mode="after")
    def _exactly_one(self) -> PublishTarget:
        given = [k for k in ("folder", "url", "hf_repo") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"a publish target is exactly one of folder, url or hf_repo; got {given or 'none'}")
        if self.hf_repo is None and (self.token_env is not None or self.private is not None):
            raise ValueError("token_env and private apply to hf_repo targets only")
        return self

    @property
    def label(self) -> str:
        """How publish_entry and the records name this target."""
        if self.hf_repo is not None:
            return targets.HUB + self.hf_repo
        return str(self.folder) if self.folder is not None else str(self.url)


class RecordLog(BaseModel):
    """A run's log of outbound deliveries (publish.json, notify.json): the run id and one record per delivery."""
    model_config = ConfigDict(extra="allow")
    FILE: ClassVar[str]
    WHAT: ClassVar[tuple[str, str]]  # (what the file is, how it is made) for a reader's error

    run: str = Field(description="the run id (its folder's name)")
    records: list[Any] = Field(default_factory=list)

    def write(self, run: Path) -> None:
        """The records as as_json gives them (the fields each was given)."""
        write_json(Path(run) / self.FILE, self.model_dump(mode="json", exclude_unset=True))

    @classmethod
    def load(cls, run: Path | str) -> Self:
        return read_model(Path(run) / cls.FILE, cls, cls.WHAT[0], fix=f"it is written by {cls.WHAT[1]}; re-run the release")


class PublishLog(RecordLog):
    """<run>/publish.json: every publish of the run's promoted entries, in order."""
    FILE = PUBLISH_FILE
    WHAT = ("publish records", "a release whose spec has `publish:` targets")

    records: list[PublishRecord] = Field(default_factory=list)


class NotifySpec(BaseModel):
    """A webhook told of the decision after the gate (quantgate.publishing.webhook)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(pattern=r"^https?://", description="receives a POST of the decision as JSON")
    secret_env: str | None = Field(None, pattern=ENV_NAME, description="variable holding the HMAC key; the body's "
                                   "HMAC-SHA256 goes in X-Quantgate-Signature-256 (must be set when the release starts)")
    report_url: str | None = Field(None, description="link to the report sent with the decision; {run} becomes the run id")
    timeout_s: float = Field(10.0, gt=0, description="per attempt")
    attempts: int = Field(5, ge=1, le=20, description="retried on connection errors, timeouts, HTTP 5xx and 429")


def check_env(notify: list[NotifySpec]) -> None:
    """Refuse a release whose notify secret is not set, before any work (a decision would go out unsigned)."""
    for i, n in enumerate(notify):
        if n.secret_env and not os.environ.get(n.secret_env):
            raise QuantgateError(f"notify[{i}].secret_env names {n.secret_env}, which is not set", where=f"notify[{i}].secret_env",
                                 fix=f"export {n.secret_env}=... (the key the receiver checks signatures with), or remove secret_env")


def env_notes(publish: list[PublishTarget], notify: list[NotifySpec]) -> list[str]:
    """What the environment lacks right now for these targets and webhooks (for `quantgate release --check`)."""
    out = [f"publish: {t.label} would fail (exit 5): {t.token_env or HF_TOKEN} is not set" for t in publish
           if t.hf_repo is not None and not os.environ.get(t.token_env or HF_TOKEN)]
    return out + [f"notify[{i}]: {n.secret_env} is not set: the release would stop at its start" for i, n in enumerate(notify)
                  if n.secret_env and not os.environ.get(n.secret_env)]


def publish_one(entry: Path | str, target: PublishTarget, *, candidate: str, api: Any = None) -> PublishRecord:
    """Publish one entry to one target; the record (status published | exists | skipped | failed). Never raises for
    the target's own failure: the error is in the record, for the caller to report."""
    rec: dict[str, Any] = {"candidate": candidate, "entry": str(entry), "target": target.label, "status": None,
                           "where": None, "error": None}
    t0 = time.monotonic()
    token = None
    if target.hf_repo is not None:
        env = target.token_env or HF_TOKEN
        token = os.environ.get(env)
        if not token:  # a release that must ship is not done when it did not: a failure, never a quiet skip
            return PublishRecord(**rec | {"status": "failed", "error": f"{env} is not set: not uploaded to the Hub "
                                          f"(export {env}=<a Hub token with write access>, then `quantgate registry "
                                          f"publish {entry} {target.label}`)"})
    try:
        out = registry.publish_entry(entry, target.label, token=token, api=api,
                                     private=True if target.private is None else target.private)
    except Exception as exc:  # noqa: BLE001 - recorded and reported (exit code, flow state), never swallowed
        return PublishRecord(**rec | {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                                      "seconds": round(time.monotonic() - t0, 2)})
    return PublishRecord(**rec | {k: v for k, v in as_json(out).items() if k != "target"}
                         | {"seconds": round(time.monotonic() - t0, 2)})


def publish_run(targets_: list[PublishTarget], run: Path, promotions: Mapping[str, Path], *,
                api: Any = None) -> list[PublishRecord]:
    """Every promoted entry (`promotions`: candidate -> its registry entry's folder) to every target, in order;
    the records go to <run>/publish.json. `api`: a Hub client to use instead of huggingface_hub's HfApi (tests)."""
    records = [publish_one(str(entry), t, candidate=cand, api=api)
               for cand, entry in promotions.items() for t in targets_]
    PublishLog(run=Path(run).name, records=records).write(run)
    return records


def failures(summary: Summary) -> list[str]:
    """One line per publish or notification that failed, from a summary that holds their records."""
    out = [f"publish of {r.candidate} to {r.target} failed: {r.error}"
           for r in summary.publish or [] if r.status == "failed"]
    return out + [f"notification to {r.url} failed: {r.error}" for r in summary.notify or [] if r.status == "failed"]


def with_records(summary: Summary, key: Literal["publish", "notify"],
                 records: list[PublishRecord] | list[NotifyRecord]) -> Summary:
    """The summary with `records` under `key` and a note per failure (the flow writes summary.json once, after
    both)."""
    out = summary.model_copy(update={key: records})
    return out.model_copy(update={"notes": [n for n in summary.notes if n not in failures(summary)] + failures(out)})


def exit_code(summary: Summary, decision_code: int) -> int:
    """OUTBOUND_FAILED for a PROMOTE whose publishing or notification failed; else the decision's own code (a
    REJECT or INCONCLUSIVE keeps its code: the failure is printed and recorded)."""
    return OUTBOUND_FAILED if decision_code == 0 and failures(summary) else decision_code
