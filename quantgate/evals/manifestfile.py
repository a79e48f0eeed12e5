"""An eval run directory's manifest.json: what was run and how it ended (status), one model per writer.

- `EvalManifest`: a JSONL eval set's run (quantgate.evals.run);
- `LmEvalManifest`: an lm-evaluation-harness task's run (quantgate.evals.lmeval), `kind: "lm_eval"`.
Their keys come in different orders, hence two models. Every field is optional so that an older or partial file still
reads; a writer sets the fields it knows (None included) and only those are written, in the model's order.
`read_manifest` reads either (by `kind`); `read_status` is the lenient status check of the caches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Discriminator, Field, RootModel, Tag

from quantgate.base.fileio import write_json
from quantgate.base.runfiles import MANIFEST
from quantgate.base.typedfile import RunFileError, SetFields, read_model


class _Manifest(SetFields):
    def write(self, path: Path) -> None:
        write_json(path, self.dump())


class EvalsetRef(BaseModel):
    """The JSONL eval set that was run."""
    model_config = ConfigDict(extra="allow")

    path: str | None = None
    name: str | None = None
    version: int | None = None
    sha256: str | None = None


class ClientStats(BaseModel):
    """What the eval client did in the run that finished the directory."""
    model_config = ConfigDict(extra="allow")

    answered_now: int | None = None
    failed_now: int | None = None
    skipped: int | None = None      # answered by an earlier run
    elapsed_s: float | None = None


class EvalManifest(_Manifest):
    """manifest.json of a JSONL eval set's run (quantgate.evals.run)."""
    schema_: int | None = Field(None, alias="schema")
    status: str | None = None        # running, complete, partial or failed
    cache_key: str | None = None     # model, eval set, decoding and engine in one string
    evalset: EvalsetRef | None = None
    model: str | None = None         # the served model name
    model_hash: str | None = None
    endpoint: str | None = None
    engine_version: Any = None       # what the server's /version said
    decoding: dict[str, object] | None = None
    default_max_tokens: int | None = None
    limit: int | None = None
    n_samples: int | None = None
    started_at: str | None = None
    error: str | None = None         # failed: why
    error_rate: float | None = None  # failed: the share of failed requests
    finished_at: str | None = None
    n_failed: int | None = None
    client: ClientStats | None = None


class LmEvalTaskRef(BaseModel):
    """The lm-eval task that was run; `sha256` is quantgate.evals.lmeval_tasks.task_digest."""
    model_config = ConfigDict(extra="allow")

    path: str | None = None
    name: str | None = None
    task: str | None = None
    sha256: str | None = None
    version: Any = None              # the task's metadata version, as its file gives it


class LmEvalManifest(_Manifest):
    """manifest.json of an lm-eval task's run (quantgate.evals.lmeval)."""
    schema_: int | None = Field(None, alias="schema")
    kind: str = "lm_eval"
    status: str | None = None        # running, complete, partial or failed
    cache_key: str | None = None
    evalset: LmEvalTaskRef | None = None
    model: str | None = None
    model_hash: str | None = None
    endpoint: str | None = None
    engine_version: Any = None
    decoding: dict[str, object] | None = None
    limit: int | None = None
    started_at: str | None = None
    n_samples: int | None = None
    n_failed: int | None = None
    filter: str | None = None        # the lm-eval filter whose answers were scored
    samples_file: str | None = None  # lm-eval's per-sample log that was read
    elapsed_s: float | None = None
    error: str | None = None
    error_rate: float | None = None
    finished_at: str | None = None


def _kind(doc: Any) -> str:
    kind = doc.get("kind") if isinstance(doc, dict) else getattr(doc, "kind", None)
    return "lm_eval" if kind == "lm_eval" else "set"


class AnyManifest(RootModel[Annotated[Annotated[EvalManifest, Tag("set")] | Annotated[LmEvalManifest, Tag("lm_eval")],
                                      Discriminator(_kind)]]):
    """Either manifest, by its `kind`."""


def read_manifest(path: Path | str) -> EvalManifest | LmEvalManifest:
    """An eval run's manifest.json; RunFileError naming the file and field."""
    return read_model(path, AnyManifest, "eval run manifest", "re-run `quantgate eval` with the same --out").root


def parse_manifest(doc: Any) -> EvalManifest | LmEvalManifest:
    """An eval run's manifest already read as JSON (pydantic.ValidationError when it does not fit)."""
    return AnyManifest.model_validate(doc).root


def read_status(run_dir: Path | str) -> str | None:
    """The run's status; None when its manifest is missing, unreadable or does not fit."""
    try:
        return read_manifest(Path(run_dir) / MANIFEST).status
    except RunFileError:
        return None
