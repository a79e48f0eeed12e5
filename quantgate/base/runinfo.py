"""A run's record of what it ran (`<run>/run.json`): the spec as loaded, where it came from, the code and package
versions, and the `ResolvedRelease`: what this machine decided for the spec when the run started.

Written once, by the release's first step (quantgate.release.steps.start_run); read by the gate (the spec's scheme
order), the report, the results store, the model card and the MLflow export, all through `load_run_record`.

Versioned: `schema_version` says which layout a file has, and `MIGRATIONS[v]` takes a version-v document to v+1, so a
run folder written by an older quantgate is read as the current model (the results store's database does the same
for its tables). Version 1 (before 2026-12-04) had no `schema_version` and no `resolved`, and kept the machine's
notes at the top (`machine`); its resolved record is rebuilt from what it has (the spec already held the resolved
hardware and schemes, `machine` becomes its notes), with what it did not record (the spec's own words) left None.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.fileio import write_json
from quantgate.base.runfiles import RUN
from quantgate.base.typedfile import read_migrated

SCHEMA = 2
_FIX = "a release writes run.json when it starts: re-run it with the same --run-id, or delete the damaged file"


class GitState(BaseModel):
    model_config = ConfigDict(extra="allow")

    commit: str | None = None
    dirty: bool | None = None


class ResolvedRelease(BaseModel):
    """What the machine decided for the spec at the run's start, beside what the spec said. The spec is resolved
    when it loads (quantgate.spec.schema); this is the record of it, computed once per run."""
    model_config = ConfigDict(extra="allow")

    hardware: str                                  # the hardware profile the release ran on
    hardware_written: str | None = None            # the spec's word for it: `auto` or a profile id
    schemes: list[str] = Field(default_factory=list)  # the schemes quantized and gated, in order
    schemes_written: Any = None                    # the spec's `schemes` as written: a list, `auto` or {auto: N}
    dropped: list[str] = Field(default_factory=list)  # listed schemes this machine cannot serve (skip_unsupported)
    candidates: list[str] = Field(default_factory=list)  # existing checkpoints and endpoints, by name
    serving_python: str | None = None              # the interpreter vLLM was started from (its vLLM: packages.vllm)
    notes: list[str] = Field(default_factory=list)  # each decision of `auto` and skip_unsupported, with its reason


class RunRecord(BaseModel):
    """run.json."""
    model_config = ConfigDict(extra="allow")

    schema_version: int = SCHEMA
    spec_file: str | None = None
    spec: dict[str, Any] = Field(default_factory=dict)  # the ReleaseSpec as loaded (resolved), as JSON
    git: GitState = Field(default_factory=GitState)
    packages: dict[str, str | None] = Field(default_factory=dict)  # the pipeline's, and the serving side's vllm
    resolved: ResolvedRelease | None = None


def _v1_to_v2(doc: dict[str, Any]) -> dict[str, Any]:
    doc = dict(doc)
    notes = doc.pop("machine", None) or []
    spec: dict[str, Any] = doc["spec"] if isinstance(doc.get("spec"), dict) else {}
    resolved = None
    if isinstance(spec.get("hardware"), str):
        resolved = {"hardware": spec["hardware"], "schemes": list(spec.get("schemes") or []),
                    "candidates": [c.get("name") for c in spec.get("candidates") or [] if isinstance(c, dict)],
                    "serving_python": (spec.get("serving") or {}).get("python"), "notes": list(notes)}
    return {**doc, "schema_version": 2, "resolved": resolved}


MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: _v1_to_v2}


def load_run_record(run: Path | str) -> RunRecord:
    """<run>/run.json at the current schema (older layouts migrated); RunFileError naming the file and field."""
    return read_migrated(Path(run) / RUN, RunRecord, "run record", _FIX, MIGRATIONS, SCHEMA)


def write_run_record(run: Path, record: RunRecord) -> Path:
    """<run>/run.json, its one writer."""
    write_json(run / RUN, record.model_dump(mode="json"))
    return run / RUN


__all__ = ["MIGRATIONS", "SCHEMA", "GitState", "ResolvedRelease", "RunRecord", "load_run_record", "write_run_record"]
