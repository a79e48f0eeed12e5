"""Statistics with stated error rates (pure): one-sided paired tests, minimum detectable drops, sample sizes and
multiplicity control. Domain-free: differences are "candidate minus baseline" of anything.

The gate asks two questions of a paired comparison, and each has its own error rate:
- harm: is the candidate worse at all? A one-sided test of "no drop"; its false-alarm rate is the chance that a
  lossless candidate is rejected, controlled across all such tests with Holm's procedure;
- size: how small a drop could this sample have detected? The minimum detectable drop (MDD) at level alpha and a
  stated power, from the observed spread of the differences.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from statistics import NormalDist

import numpy as np

POWER = 0.8
_N = NormalDist()


def z(p: float) -> float:
    """The standard normal quantile."""
    return _N.inv_cdf(p)


def binom_tail(k: int, n: int) -> float:
    """P(X >= k) for X ~ Binomial(n, 1/2), exactly."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    return min(1.0, sum(math.comb(n, i) for i in range(k, n + 1)) / 2**n)


def harm_p_binary(lost: int, gained: int) -> float:
    """One-sided exact McNemar p-value of "the candidate loses more samples than it gains" (lost: right in the
    baseline, wrong in the candidate; gained: the reverse)."""
    return binom_tail(lost, lost + gained)


def harm_p_paired(drops: Sequence[float], *, n_perm: int = 4000, seed: int = 0, normal_from: int = 30) -> float:
    """One-sided p-value of "the mean drop is above 0" (drop = baseline - candidate for a higher-is-better measure):
    the normal approximation of the paired mean from `normal_from` pairs on, a seeded sign-flip permutation test
    below that (distribution-free for small samples; reproducible either way)."""
    d = np.asarray(drops, dtype=float)
    if d.size == 0 or not np.any(d):
        return 1.0
    obs = d.mean()
    if d.size >= normal_from:
        se = d.std(ddof=1) / math.sqrt(d.size)
        return 1.0 - _N.cdf(obs / se) if se > 0 else (0.0 if obs > 0 else 1.0)
    signs = np.random.default_rng(seed).choice((-1.0, 1.0), size=(n_perm, d.size))
    return float((1 + np.sum((signs * d).mean(axis=1) >= obs - 1e-12)) / (n_perm + 1))


def mdd(sd: float, n: int, alpha: float, power: float = POWER) -> float:
    """Minimum detectable mean drop of a one-sided paired test at level alpha with the given power, for paired
    differences of standard deviation `sd` (normal approximation). inf for n = 0."""
    if n <= 0:
        return math.inf
    return (z(1 - alpha) + z(power)) * sd / math.sqrt(n)


def mdd_binary(discordance: float, n: int, alpha: float, power: float = POWER) -> float:
    """Minimum detectable drop of a paired binary measure (accuracy), absolute. The spread of the differences is
    the observed discordance (share of samples that changed either way), but never less than the drop itself:
    a drop of D makes at least D of the samples discordant, so with nothing discordant observed the answer is
    (z_a + z_b)^2 / n, not 0."""
    if n <= 0:
        return math.inf
    k = z(1 - alpha) + z(power)
    return max(k * math.sqrt(max(discordance, 0.0) / n), k * k / n)


def samples_for(drop: float, sd: float, alpha: float, power: float = POWER, *, binary: bool = False,
                discordance: float = 0.0) -> int:
    """Paired samples a one-sided test needs to detect a mean drop of `drop` at level alpha with `power`."""
    if drop <= 0:
        return 0
    k = z(1 - alpha) + z(power)
    if binary:
        var = max(discordance, drop)
        return math.ceil(k * k * var / drop**2)
    return math.ceil((k * sd / drop) ** 2)


def holm(pvalues: Mapping[str, float], alpha: float) -> dict[str, bool]:
    """Holm's step-down procedure: which hypotheses are rejected with family-wise error at most alpha."""
    order = sorted(pvalues, key=lambda k: pvalues[k])
    m, out, stopped = len(order), {}, False
    for i, key in enumerate(order):
        stopped = stopped or pvalues[key] > alpha / (m - i)
        out[key] = not stopped
    return out


def holm_level(rank: int, m: int, alpha: float) -> float:
    """The level Holm applies to the hypothesis of the given rank (0 = smallest p) among m."""
    return alpha / (m - rank)


def num(x: object) -> float | None:
    """A JSON value as a number: ints and floats (NaN excluded) as float; bools, strings, None and the rest as None.
    Evidence files are read with it, so a missing or mistyped figure is a gap, never a silent coercion."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x) else None
