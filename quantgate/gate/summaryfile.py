"""The typed form of a release's `<run>/summary.json` (quantgate.release.steps.finish_run makes it, the publishing
and notify steps add their `PublishRecord`s and `NotifyRecord`s, then the flow writes it once with
`write_summary`). It lives here, below report/ and release/, so that the gate, the report and the release read and
write it through one model: `load_summary`, `write_summary`.

Keys a later writer adds are kept; every field defaults, since a candidate whose server failed has a short row.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.fileio import write_json
from quantgate.base.pairedstat import PairedStat
from quantgate.base.runfiles import SUMMARY
from quantgate.base.typedfile import read_model

_OPEN = ConfigDict(extra="allow")


class CandidateRow(BaseModel):
    """A candidate tried: scheme, size, headline figures and the gate's decision; or, when its server failed,
    the failure and its error file."""
    model_config = _OPEN

    scheme: str | None = None
    size_bytes: int | None = None
    size_ratio: float | None = None
    metrics: dict[str, PairedStat] = Field(default_factory=dict)  # `<eval set>/<metric>`: its headline()
    regressions: int | None = None
    agreement: dict[str, float | None] = Field(default_factory=dict)
    failure: str | None = None
    error: str | None = None
    decision: str | None = None
    reasons: list[str] = Field(default_factory=list)
    registry: str | None = None


class BaselineRow(BaseModel):
    model_config = _OPEN

    size_bytes: int | None = None
    parity: dict[str, object] | None = None


class PublishRecord(BaseModel):
    """One promoted entry published to one target (quantgate.publishing.publish.publish_one): status published,
    exists, skipped or failed, where it went, the error of a failure."""
    model_config = _OPEN

    candidate: str | None = None
    entry: str | None = None
    target: str | None = None
    status: str | None = None
    where: str | None = None
    error: str | None = None
    seconds: float | None = None


class NotifyRecord(BaseModel):
    """One webhook told of the decision (quantgate.publishing.webhook.send): delivered or failed, after how many
    attempts."""
    model_config = _OPEN

    url: str | None = None
    signed: bool = False
    delivery: str | None = None
    status: str | None = None
    http_status: int | None = None
    error: str | None = None
    attempts: int | None = None


def as_json(record: BaseModel) -> dict[str, object]:
    """A summary or record as its file holds it: the fields it was given (a short row stays short), JSON types."""
    return record.model_dump(mode="json", exclude_unset=True)


class Summary(BaseModel):
    """summary.json: the release's outcome."""
    model_config = _OPEN

    release: str | None = None
    run: str | None = None
    model: str | None = None
    hardware: str | None = None
    baseline: BaselineRow | None = None
    candidates: dict[str, CandidateRow] = Field(default_factory=dict)
    decision: str | None = None
    promoted: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    policy: dict[str, object] | None = None
    recall_cost: dict[str, dict[str, object]] = Field(default_factory=dict)
    ladder: list[dict[str, object]] | None = None
    publish: list[PublishRecord] | None = None
    notify: list[NotifyRecord] | None = None


def load_summary(path: Path | str) -> Summary:
    """A release's summary.json, validated; QuantgateError naming the file and field when it does not fit."""
    return read_model(path, Summary, "release summary",
                      "re-run the release with the same --run-id: its last steps rewrite summary.json")


def write_summary(run: Path, summary: Summary) -> Path:
    """<run>/summary.json, its one writer: the fields the summary was given (keys a later reader may want are
    kept)."""
    write_json(run / SUMMARY, as_json(summary))
    return run / SUMMARY
