"""One paired statistic: a candidate compared with its baseline over the same units, on every floor.

The eval comparison (quantgate.evals.compare: compare/<candidate>.json), the gate's evidence (quantgate.gate.models:
metrics, categories, pooled, recall, a registered kind's comparison), summary.json's metric rows and the model card's
key scores all hold a `PairedStat`; a file keeps the fields its writer set (`model_dump(exclude_unset=True)`), so a
summary row stays the short `headline()`.

    n                      paired units (samples, needles, passages)
    base_mean, cand_mean   each side's mean over them
    delta                  cand_mean - base_mean, with ci_low..ci_high its interval
    sd_diff, p_harm        the spread of the paired drops and the one-sided p-value of "the candidate is worse"
    lost, gained           a binary measure's units lost and gained by the candidate, with mcnemar_p and discordance
    higher_is_better, binary, file    what the gate reads it as, and the file it came from

A mean over no unit is NaN in a comparison file and stays NaN here; the gate's evidence holds None instead.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

HEADLINE = ("n", "base_mean", "cand_mean", "delta", "ci_low", "ci_high", "mcnemar_p")


class PairedStat(BaseModel):
    """A paired comparison of a candidate with its baseline (see the module docstring)."""
    model_config = ConfigDict(extra="forbid")

    n: int = Field(0, ge=0)
    base_mean: float | None = None
    cand_mean: float | None = None
    delta: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    sd_diff: float | None = None
    lost: int | None = None
    gained: int | None = None
    mcnemar_p: float | None = None
    p_harm: float | None = None
    discordance: float | None = None
    higher_is_better: bool = True
    binary: bool = False
    file: str | None = None

    def headline(self) -> PairedStat:
        """Its headline figures only (a summary row, a card's score): the others left unset, so not written."""
        return PairedStat(**{k: getattr(self, k) for k in HEADLINE})


class PooledStat(PairedStat):
    """One binary measure per sample over a whole eval set; `metrics_used` counts the samples of each metric."""
    metrics_used: dict[str, int] = Field(default_factory=dict)
