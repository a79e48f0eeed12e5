"""The typed form of `<run>/<candidate>/pay_off.json`: quantgate.perf.compare.compare's output plus the `file` of
the candidate's probe, written by the release's compare step. Read back through `load_pay_off` by the gate.

The gate's pay-off figures (quantgate.perf.models.PayOffFigures) are its core; the rest of the comparison (every
ratio, the intervals, the per-level rows) is typed loosely and kept as written.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ConfigDict, Field

from quantgate.base.typedfile import read_model
from quantgate.perf.models import PayOffFigures


class PayOff(PayOffFigures):
    """pay_off.json. `has_figures` says whether it holds a workload profile's figures (`decide`): a file from a
    caller that only states ratios has none."""
    model_config = ConfigDict(extra="allow")

    baseline: str | None = None
    candidate: str | None = None
    request_throughput_ratio: float | None = None
    ttft_ratio: float | None = None
    ttft_p95_ratio: float | None = None
    itl_ratio: float | None = None
    itl_p95_ratio: float | None = None
    tpot_ratio: float | None = None
    goodput_ratio: float | None = None
    ci: dict[str, object] = Field(default_factory=dict)
    slo: dict[str, object] | None = None
    intervals: dict[str, object] = Field(default_factory=dict)
    probe_seconds: dict[str, float | None] = Field(default_factory=dict)
    higher_is_better: dict[str, bool] = Field(default_factory=dict)
    by_concurrency: list[dict[str, object]] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)

    @property
    def has_figures(self) -> bool:
        return "decide" in self.model_fields_set

    def figures(self, file: str | None) -> PayOffFigures:
        """The gate's view: the pay-off figures, naming `file` when the document names none."""
        return PayOffFigures.model_validate({**self.model_dump(include=set(PayOffFigures.model_fields)),
                                             "file": self.file or file})


def load_pay_off(path: Path | str) -> PayOff:
    """A candidate's pay_off.json, validated; QuantgateError naming the file and field when it does not fit."""
    return read_model(path, PayOff, "pay-off figures", "re-run the release (same --run-id) to rewrite pay_off.json")
