"""The typed form of `compare/<candidate>.json`: {eval set: quantgate.evals.compare.compare_runs output}.

Written by the release's compare step (quantgate.release.steps.compare_variants) as plain JSON; read back through
`load_comparison` by the gate and the report. Each statistic is the one paired model (quantgate.base.pairedstat);
values that compare_runs leaves undefined (a mean over no sample) are NaN in the file and stay NaN here; figures a
writer may omit default to None. Extra keys are kept, except in a statistic.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, RootModel

from quantgate.base.pairedstat import PairedStat, PooledStat
from quantgate.base.typedfile import read_model


class MetricComparison(BaseModel):
    model_config = ConfigDict(extra="allow")

    higher_is_better: bool = True
    binary: bool = False
    overall: PairedStat
    by_category: dict[str, PairedStat] = Field(default_factory=dict)


class OutputAgreement(BaseModel):
    """Share of samples whose two outputs are identical, overall and per category."""
    model_config = ConfigDict(extra="allow")

    overall: float | None = None
    by_category: dict[str, float | None] = Field(default_factory=dict)


class Flip(BaseModel):
    """A sample that went right -> wrong (a regression) or wrong -> right (a gain) on a binary metric."""
    model_config = ConfigDict(extra="allow")

    id: str | int
    category: str | None = None
    metric: str | None = None
    references: list[Any] = Field(default_factory=list)
    base_output: str | None = None
    cand_output: str | None = None


class SetComparison(BaseModel):
    """One eval set's paired comparison (quantgate.evals.compare.compare_runs)."""
    model_config = ConfigDict(extra="allow")

    n_base: int | None = None
    n_cand: int | None = None
    n_paired: int | None = None
    only_in_base: list[str | int] = Field(default_factory=list)
    only_in_cand: list[str | int] = Field(default_factory=list)
    bootstrap: dict[str, float | int] = Field(default_factory=dict)
    agreement: OutputAgreement | None = None
    metrics: dict[str, MetricComparison]
    regressions: list[Flip] = Field(default_factory=list)
    gains: list[Flip] = Field(default_factory=list)
    pooled: PooledStat | None = None


class Comparison(RootModel[dict[str, SetComparison]]):
    """compare/<candidate>.json: {eval set name: SetComparison} (in `root`)."""


def load_comparison(path: Path | str) -> Comparison:
    """compare/<candidate>.json, validated; QuantgateError naming the file and field when it does not fit."""
    return read_model(path, Comparison, "comparison",
                      "re-run the release's compare step (same --run-id) to rewrite compare/<candidate>.json")
