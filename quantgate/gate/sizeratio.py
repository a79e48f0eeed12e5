"""Candidate / baseline checkpoint size: one precedence, used by the gate (gate.evidence) and the report
(report.runview), so both always show the same figure.

Most direct first: both checkpoints' measured bytes (evidence.json), then a ratio already stated for the run
(summary.json, or the pay-off figures the flow passed), then 1 / the quantization manifest's compression ratio.
"""

from __future__ import annotations

from quantgate.base.stats import num

SOURCES = ("sizes", "stated", "compression")


def size_ratio(candidate_bytes: object = None, baseline_bytes: object = None, stated: object = None,
               compression_ratio: object = None) -> tuple[float, str] | None:
    """(ratio, source) with source one of SOURCES, or None when no figure is usable (missing, zero or not a number)."""
    cs, bs = num(candidate_bytes), num(baseline_bytes)
    if cs and bs and cs > 0 and bs > 0:
        return cs / bs, "sizes"
    if (s := num(stated)) and s > 0:
        return s, "stated"
    if (c := num(compression_ratio)) and c > 0:
        return 1 / c, "compression"
    return None
