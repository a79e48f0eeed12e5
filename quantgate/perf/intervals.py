"""Confidence intervals of candidate/baseline speed ratios over repeated probe runs (pure: no I/O).

A speed figure (tokens/s, goodput, a latency percentile) is measured once per repeat. Its ratio candidate/baseline
is estimated on the log scale, where a ratio is a difference of means:
- unpaired (the default of a release: the variants are served one after another, so repeat i of the baseline and
  repeat i of the candidate share the request set but not the moment): Welch's t interval of
  mean(log cand) - mean(log base), with the Welch-Satterthwaite degrees of freedom;
- paired (the variants were served in turn, round by round: `bench/perf_variants.py --rounds N`): a t interval of
  the mean per-round log ratio, which cancels drift that hits both variants of a round alike.
The interval is then exponentiated: `value` is the ratio of geometric means, `low`/`high` its two-sided `level`
interval (each end a one-sided (1 + level) / 2 bound, as the gate's other checks read them). Fewer than two runs on
either side give the point ratio with no interval: the gate cannot judge its worst end.
"""

from __future__ import annotations

import math
import statistics
from typing import Literal
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

Method = Literal["welch-log", "paired-log", "point"]


class RatioCI(BaseModel):
    """candidate / baseline of one figure, with its interval (None where it cannot be computed)."""
    model_config = ConfigDict(extra="forbid")

    value: float | None = Field(description="ratio of geometric means over the runs")
    low: float | None = None
    high: float | None = None
    level: float = Field(0.90, gt=0, lt=1)
    method: Method = "point"
    n_base: int = 0
    n_cand: int = 0
    df: float | None = None


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta function, evaluated by the modified Lentz method."""
    tiny = 1e-300

    def guard(v: float) -> float:
        return tiny if abs(v) < tiny else v

    c, d = 1.0, 1.0 / guard(1.0 - (a + b) * x / (a + 1.0))
    h = d
    for m in range(1, 400):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 / guard(1.0 + num * d)
            c = guard(1.0 + num / c)
            h *= d * c
        if abs(d * c - 1.0) < 1e-13:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` (> 0, not necessarily whole) degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t (bisection on t_cdf; exact to about 1e-9)."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(100):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo < 1e-10 * max(1.0, hi):
            break
    return (lo + hi) / 2.0


def _logs(values: Sequence[float | None]) -> list[float]:
    return [math.log(v) for v in values if v is not None and v > 0]


def ratio_ci(base: Sequence[float | None], cand: Sequence[float | None], *, level: float = 0.90,
             paired: bool = False) -> RatioCI:
    """candidate / baseline of one figure from its per-run values (see the module doc). Missing or non-positive
    values are left out; with `paired`, only positions where both sides have a value count."""
    if paired:
        pairs = [(b, c) for b, c in zip(base, cand) if b is not None and c is not None and b > 0 and c > 0]
        diffs = [math.log(c) - math.log(b) for b, c in pairs]
        if not diffs:
            return RatioCI(value=None, level=level)
        mean = statistics.fmean(diffs)
        if len(diffs) < 2:
            return RatioCI(value=math.exp(mean), level=level, n_base=1, n_cand=1)
        se, df = statistics.stdev(diffs) / math.sqrt(len(diffs)), len(diffs) - 1.0
        return _interval(mean, se, df, level, "paired-log", len(diffs), len(diffs))
    lb, lc = _logs(base), _logs(cand)
    if not lb or not lc:
        return RatioCI(value=None, level=level, n_base=len(lb), n_cand=len(lc))
    mean = statistics.fmean(lc) - statistics.fmean(lb)
    if len(lb) < 2 or len(lc) < 2:
        return RatioCI(value=math.exp(mean), level=level, n_base=len(lb), n_cand=len(lc))
    vb, vc = statistics.variance(lb) / len(lb), statistics.variance(lc) / len(lc)
    se = math.sqrt(vb + vc)
    df = (vb + vc) ** 2 / (vb ** 2 / (len(lb) - 1) + vc ** 2 / (len(lc) - 1)) if se > 0 else len(lb) + len(lc) - 2.0
    return _interval(mean, se, df, level, "welch-log", len(lb), len(lc))


def _interval(mean: float, se: float, df: float, level: float, method: Method, nb: int, nc: int) -> RatioCI:
    q = t_quantile((1.0 + level) / 2.0, df) * se
    return RatioCI(value=math.exp(mean), low=math.exp(mean - q), high=math.exp(mean + q), level=level, method=method,
                   n_base=nb, n_cand=nc, df=round(df, 3))
