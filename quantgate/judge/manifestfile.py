"""A judge run's `manifest.json` (quantgate.judge.run.run_judge): what is judged, by whom, with what, and how it ended.

Written three times through `JudgeManifest.write`: `running` before the first judge request, then `failed` (with the
`error`) or `complete`. Every field is optional so that an older or partial file still reads; the writer sets the
fields it knows and only the set ones are written, in this order (`error` only when failed). Read back by the next
run into the same folder (`read_judge_manifest`), which refuses a folder that holds a judge run of something else.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.fileio import write_json
from quantgate.base.typedfile import SetFields, read_model
from quantgate.evals.manifestfile import EvalsetRef  # the eval set both runs answered

_OPEN = ConfigDict(extra="allow")


class JudgeRunKey(BaseModel):
    """What the run is of: a folder holding a run with another key is refused."""
    model_config = _OPEN

    judge_sha256: str | None = Field(None, description="the judge template and sidecar together")
    judge_model: str | None = None
    evalset_sha256: str | None = None
    baseline: str | None = Field(None, description="the baseline eval run's cache key")
    candidate: str | None = Field(None, description="the candidate eval run's cache key")
    seed: int | None = None


class JudgeRef(BaseModel):
    """The judge's prompt template and its sidecar."""
    model_config = _OPEN

    path: str | None = None
    name: str | None = None
    version: int | None = None
    kind: str | None = Field(None, description="pairwise or reference")
    sha256: str | None = None


class JudgedRun(BaseModel):
    """One of the two eval runs compared: its folder and the model it served."""
    model_config = _OPEN

    dir: str | None = None
    model: str | None = None


class CalibrationUsed(BaseModel):
    """The calibration settings the run used (quantgate.judge.corrupt.CalibrationConfig), `bar` the one applied."""
    model_config = _OPEN

    seed: int | None = None
    per_type: int | None = None
    bar: float | None = None
    types: list[str] | None = None
    language_categories: list[str] | None = None


class JudgeManifest(SetFields):
    """<judge-dir>/manifest.json."""

    schema_: int | None = Field(None, alias="schema")
    status: str | None = Field(None, description="running, failed or complete")
    key: JudgeRunKey | None = None
    endpoint: str | None = Field(None, description="the judge server's base URL")
    judge: JudgeRef | None = None
    evalset: EvalsetRef | None = None
    baseline: JudgedRun | None = None
    candidate: JudgedRun | None = None
    calibration: CalibrationUsed | None = None
    margin: float | None = Field(None, description="non-inferiority margin on win rate - loss rate")
    limit: int | None = Field(None, description="judge the first N pairs; None: all")
    error: str | None = Field(None, description="failed: why")

    def write(self, path: Path) -> None:
        write_json(path, self.dump())


def read_judge_manifest(path: Path | str) -> JudgeManifest:
    """A judge run's manifest.json; RunFileError naming the file and field."""
    return read_model(path, JudgeManifest, "judge run manifest", "use a new output folder, or delete this one")
