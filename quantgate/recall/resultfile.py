"""The typed forms of a recall run's `cells.json` and a candidate's `delta.json`: quantgate.recall.run writes them
through `RecallCells.write` and `RecallDelta.write` (from quantgate.recall.score's `cells` and `compare`), and they
are read back through `load_recall_cells` and `load_recall_delta` by the recall cache test, the release summary's
costs, the CLI and the gate.

Means over no answered needle are null in the files and None here. Fields are declared in the files' order, so a
model writes the keys in the order the scorer makes them. Keys a later writer adds are kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.fileio import write_json
from quantgate.base.typedfile import read_model

_OPEN = ConfigDict(extra="allow")


class RecallOutcome(BaseModel):
    """Needles scored in a group (overall, a kind, a language): failed ones are counted and left out of the means."""
    model_config = _OPEN

    n: int = 0
    n_error: int = 0
    recall: float | None = None
    exact: float | None = None


class Cell(BaseModel):
    """One (length, depth, kind) cell: where it is, then its outcome (a RecallOutcome's fields, after the cell's
    place)."""
    model_config = _OPEN

    length: int
    depth: int | float
    kind: str
    n: int = 0
    n_error: int = 0
    recall: float | None = None
    exact: float | None = None


class RecallCells(BaseModel):
    """cells.json: the run's status and cost, and its outcomes overall, by kind, by language and per cell."""
    model_config = _OPEN

    status: str | None = None
    model: str | None = None
    endpoint: str | None = None
    grid: dict[str, object] = Field(default_factory=dict)
    cost: dict[str, Any] = Field(default_factory=dict)
    overall: RecallOutcome
    observations: dict[str, object] = Field(default_factory=dict)
    by_kind: dict[str, RecallOutcome] = Field(default_factory=dict)
    by_language: dict[str, RecallOutcome] = Field(default_factory=dict)
    cells: list[Cell] = Field(default_factory=list)

    def write(self, path: Path) -> None:
        """Every field, None included, in the file's order (quantgate.base.fileio.write_json)."""
        write_json(path, self.model_dump())


class KindDelta(BaseModel):
    model_config = _OPEN

    base: float | None = None
    cand: float | None = None
    delta: float | None = None


class OverallDelta(KindDelta):
    base_exact: float | None = None
    cand_exact: float | None = None
    delta_exact: float | None = None


class CellDelta(BaseModel):
    """One cell's delta: where it is and how many needles both answered, then an OverallDelta's fields."""
    model_config = _OPEN

    length: int
    depth: int | float
    kind: str
    n: int = 0
    base: float | None = None
    cand: float | None = None
    delta: float | None = None
    base_exact: float | None = None
    cand_exact: float | None = None
    delta_exact: float | None = None


class RecallDelta(BaseModel):
    """delta.json: candidate minus baseline over the needles both answered, overall, by kind and per cell."""
    model_config = _OPEN

    n_paired: int = 0
    n_base_only: int = 0
    n_cand_only: int = 0
    n_requests: int | None = None
    n_haystacks: int | None = None
    paired_within_haystack: dict[str, object] | None = None
    n_error_excluded: int = 0
    overall: OverallDelta
    by_kind: dict[str, KindDelta] = Field(default_factory=dict)
    cells: list[CellDelta] = Field(default_factory=list)
    regressions: list[str] = Field(default_factory=list)
    improvements: list[str] = Field(default_factory=list)
    baseline: str | None = Field(None, description="the baseline's recall folder")

    def write(self, path: Path) -> None:
        """Every field, None included, in the file's order (quantgate.base.fileio.write_json)."""
        write_json(path, self.model_dump())


def load_recall_cells(path: Path | str) -> RecallCells:
    """A recall run's cells.json, validated; QuantgateError naming the file and field when it does not fit."""
    return read_model(path, RecallCells, "recall cells", "re-run `quantgate recall` into that folder to rewrite it")


def load_recall_delta(path: Path | str) -> RecallDelta:
    """A candidate's recall delta.json, validated; QuantgateError naming the file and field when it does not fit."""
    return read_model(path, RecallDelta, "recall delta",
                      "re-run `quantgate recall --baseline ...` (or the release's compare step) to rewrite it")
