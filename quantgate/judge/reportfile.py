"""The typed form of the judge's `report.json` (quantgate.judge.run.run_judge writes it; `quantgate review import`
adds `human`). Read back through `load_judge_report` by the gate, the release's judge step, the CLI and the report.

Rates over no pair are NaN in the file and stay NaN here. Only the calibration and the comparison's overall
non-inferiority are required (the gate's evidence); the rest defaults, and keys a later writer adds are kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.typedfile import read_model

_OPEN = ConfigDict(extra="allow", populate_by_name=True)


class CalibrationGroup(BaseModel):
    """Accuracy of the judge on calibration pairs (all of them, or one corruption type)."""
    model_config = _OPEN

    n: int = 0
    correct: int = 0
    accuracy: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    invalid: int = 0


class Calibration(CalibrationGroup):
    bar: float | None = None
    reliable: bool = False
    by_type: dict[str, CalibrationGroup] = Field(default_factory=dict)
    reason: str | None = None


class Rate(BaseModel):
    """Count and rate of one outcome (win, tie, loss) with its Wilson interval."""
    model_config = _OPEN

    count: int = 0
    rate: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None


class Rates(BaseModel):
    model_config = _OPEN

    n: int = 0
    invalid: int = 0
    win: Rate = Field(default_factory=Rate)
    tie: Rate = Field(default_factory=Rate)
    loss: Rate = Field(default_factory=Rate)


class NonInferiority(BaseModel):
    """One-sided test that win - loss lies above -margin (quantgate.judge.core.non_inferiority)."""
    model_config = _OPEN

    n: int = 0
    net: float | None = None
    lower_bound: float | None = None
    margin: float | None = None
    p_value: float | None = None
    alpha: float | None = None
    non_inferior: bool = False


class OverallRates(Rates):
    non_inferiority: NonInferiority


class WorstLoss(BaseModel):
    model_config = _OPEN

    pair_id: str
    category: str | None = None
    question: str | None = None
    reference: str | None = None
    baseline: str | None = None
    candidate: str | None = None
    labels: dict[str, str | None] = Field(default_factory=dict)
    score_drop: float | None = None


class JudgeComparison(BaseModel):
    """Candidate vs baseline, judged pairwise in both orders (quantgate.judge.core.summarize_comparison)."""
    model_config = _OPEN

    n_pairs: int = 0
    n_identical: int = 0
    n_judged: int = 0
    invalid_pairs: int = 0
    invalid_rate: float = 0.0
    position_consistency: float | None = None
    overall: OverallRates
    winners: dict[str, str | None] = Field(default_factory=dict)
    by_category: dict[str, Rates] = Field(default_factory=dict)
    worst_losses: list[WorstLoss] = Field(default_factory=list)


class JudgeReport(BaseModel):
    """<candidate>/judge/report.json."""
    model_config = _OPEN

    schema_version: int | None = Field(default=None, alias="schema")
    calibration: Calibration
    comparison: JudgeComparison
    parse: dict[str, int] = Field(default_factory=dict)
    counts_as_evidence: bool = False
    judge_not_stronger: str | None = None
    skipped_ids: list[Any] = Field(default_factory=list)
    meta: dict[str, Any] = Field(default_factory=dict)
    human: dict[str, Any] | None = None

    def to_file(self) -> dict[str, Any]:
        """The content to write back: the keys the file had (plus any set since), under their file names."""
        return self.model_dump(by_alias=True, exclude_unset=True)


def load_judge_report(path: Path | str) -> JudgeReport:
    """A judge report.json, validated; QuantgateError naming the file and field when it does not fit."""
    return read_model(path, JudgeReport, "judge report",
                      "re-run `quantgate judge` (or the release with the same --run-id) to rewrite the report")
