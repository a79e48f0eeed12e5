"""One-sided bounds for ratio-of-sums means over clustered samples (pure: numpy only).

Each sample i contributes column sums y_ij (KL sum, top-1 agreements, dNLL sum) over n_i tokens; the estimate of
column j is R_j = sum_i y_ij / sum_i n_i. Whole samples are resampled (a cluster bootstrap: tokens of one sample
are not independent). `ratio_bounds` returns a lower and an upper bound per column, each one-sided at
(1 + level) / 2: level 0.90 gives a 95% lower and a 95% upper bound, read separately.

Methods (`METHODS`; `ratio_bounds_all` gives several from the same resamples, for bench/fidelity_coverage.py):

- `percentile`: quantiles of the resampled R*. Under-covers the upper bound for right-skewed per-sample KL.
- `bca`: bias-corrected and accelerated percentile (jackknife acceleration; leave-one-out ratios are exact).
- `delta_t`: R -/+ t_{n-1} x SE, with the linearization (delta-method) standard error of a ratio,
  SE^2 = n / (n - 1) x sum_i r_i^2 / (sum_i n_i)^2, r_i = y_i - R n_i.
- `boot_t`: studentized bootstrap: t* = (R* - R) / SE*, SE* the same linearization SE computed on each
  resample; upper = R - q_alpha(t*) SE, lower = R - q_{1-alpha}(t*) SE.
- `boot_t_skew` (CHOSEN): `boot_t` with a documented small-sample and skew correction: each side's margin
  (distance from R) is multiplied by kappa = 1 + SKEW_C x sqrt(g / n) + SMALL_C / n, where g is the skewness of the
  r_i towards that side (max(skew, 0) for the upper bound, max(-skew, 0) for the lower), and it is never narrower
  than `delta_t`. No method above reaches its nominal coverage for heavy-tailed per-sample KL at 30-300 samples
  (a sample that misses the tail looks lighter than it is); the constants are the smallest round values that
  bring every cell of bench/fidelity_coverage.py to nominal at one-sided 0.95 (calibrated there, checked on other
  spreads: docs/fidelity-bounds.md). Other levels use the same kappa (not calibrated).

Every bound is moved to hold the estimate itself (low <= R <= high). Degenerate inputs give the estimate as both
bounds: one sample (no spread can be estimated), or a column with no spread (identical per-token means).
"""

from __future__ import annotations

import math
from functools import lru_cache
from statistics import NormalDist

import numpy as np

METHODS = ("percentile", "bca", "delta_t", "boot_t", "boot_t_skew")
CHOSEN = "boot_t_skew"
SKEW_C = 3.0    # kappa's skew term: SKEW_C x sqrt(max(skew, 0) / n)
SMALL_C = 12.0  # kappa's small-sample term: SMALL_C / n
CHUNK = 256  # resamples per chunk: the count matrix holds CHUNK x n values at a time
_N = NormalDist()


@lru_cache(maxsize=512)
def t_quantile(p: float, df: int) -> float:
    """Student-t quantile for an integer df >= 1 (exact CDF: Abramowitz & Stegun 26.7.3/26.7.4, then bisection)."""
    if not 0.0 < p < 1.0 or df < 1:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df >= 1, got p={p}, df={df}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_quantile(1.0 - p, df)

    def cdf(t: float) -> float:  # P(T <= t) for t >= 0
        theta = math.atan(t / math.sqrt(df))
        c2, s = math.cos(theta) ** 2, math.sin(theta)
        if df % 2:  # odd: A = 2/pi (theta + sin cos (1 + 2/3 cos^2 + ... (2.4...(df-3))/(1.3...(df-2)) cos^(df-3)))
            term, acc = 1.0, 1.0 if df > 1 else 0.0
            for k in range(1, (df - 1) // 2):
                term *= c2 * (2 * k) / (2 * k + 1)
                acc += term
            a = 2.0 / math.pi * (theta + s * math.cos(theta) * acc)
        else:  # even: A = sin (1 + 1/2 cos^2 + 1.3/(2.4) cos^4 + ... up to cos^(df-2))
            term = acc = 1.0
            for k in range(1, df // 2):
                term *= c2 * (2 * k - 1) / (2 * k)
                acc += term
            a = s * acc
        return 0.5 + a / 2.0

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
        if hi - lo <= 1e-12 * hi:
            break
    return (lo + hi) / 2.0


def _resample(sums: np.ndarray, tokens: np.ndarray, n_boot: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(delta, se) per resample and column: delta = R* - R, se = SE*. The resampled sums come from one matrix
    product of the draw counts with the per-sample moments of the residuals e_i = y_i - R n_i (centred first, so
    a column near a constant, such as top-1 agreement near 1, keeps its precision)."""
    n, m = sums.shape
    est = sums.sum(axis=0) / tokens.sum()
    e = sums - tokens[:, None] * est
    cols = np.ascontiguousarray(np.column_stack([tokens, e, e * e, e * tokens[:, None], tokens * tokens]).T)
    rng = np.random.default_rng(seed)
    deltas, ses = [], []
    for start in range(0, n_boot, CHUNK):
        c = min(CHUNK, n_boot - start)
        idx = rng.integers(0, n, size=(c, n)) + (np.arange(c) * n)[:, None]
        counts = np.bincount(idx.ravel(), minlength=c * n).reshape(c, n).astype(np.float64)
        s = np.einsum("bn,kn->bk", counts, cols)  # not `@`: BLAS threads contend on a shared machine (10-40x)
        tok = s[:, 0]
        keep = tok > 0  # a resample of zero-token samples only has no ratio
        tok, s = tok[keep], s[keep]
        d = s[:, 1:1 + m] / tok[:, None]
        ss = s[:, 1 + m:1 + 2 * m] - 2 * d * s[:, 1 + 2 * m:1 + 3 * m] + d * d * s[:, -1:]
        deltas.append(d)
        ses.append(np.sqrt(np.maximum(ss, 0.0) * (n / (n - 1))) / tok[:, None])
    return np.concatenate(deltas), np.concatenate(ses)


def _jackknife_accel(sums: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """BCa acceleration per column from the exact leave-one-out ratios."""
    rest = tokens.sum() - tokens
    ok = rest > 0
    if ok.sum() < 2:
        return np.zeros(sums.shape[1])
    loo = (sums.sum(axis=0) - sums[ok]) / rest[ok][:, None]
    u = loo.mean(axis=0) - loo
    den = 6.0 * (u * u).sum(axis=0) ** 1.5
    return np.where(den > 0, (u ** 3).sum(axis=0) / np.where(den > 0, den, 1.0), 0.0)


def _bca(delta: np.ndarray, accel: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """BCa quantiles of delta (lower at alpha, upper at 1 - alpha) per column."""
    b = len(delta)
    z_a = _N.inv_cdf(alpha)
    lo, hi = np.empty(delta.shape[1]), np.empty(delta.shape[1])
    for j in range(delta.shape[1]):
        below = (np.count_nonzero(delta[:, j] < 0) + 0.5 * np.count_nonzero(delta[:, j] == 0)) / b
        z0 = _N.inv_cdf(min(max(below, 0.5 / b), 1 - 0.5 / b))
        qs = []
        for z in (z_a, -z_a):
            den = 1.0 - accel[j] * (z0 + z)
            adj = z0 + (z0 + z) / den if den > 0 else math.copysign(math.inf, z)
            qs.append(min(max(_N.cdf(adj) if math.isfinite(adj) else float(adj > 0), 0.0), 1.0))
        lo[j], hi[j] = np.quantile(delta[:, j], qs)
    return lo, hi


def ratio_bounds_all(sums: np.ndarray, tokens: np.ndarray, level: float = 0.90, n_boot: int = 2000,
                     seed: int = 0, methods: tuple[str, ...] = METHODS) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(low, high) per column for each of `methods`, all from the same resamples (see the module docstring)."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method {unknown[0]!r}; one of {', '.join(METHODS)}")
    sums = np.asarray(sums, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.float64)
    if sums.ndim != 2 or tokens.shape != (sums.shape[0],):
        raise ValueError(f"sums must be (n, m) and tokens (n,), got {sums.shape} and {tokens.shape}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    total = tokens.sum()
    if total <= 0:
        raise ValueError("no tokens: the ratio is undefined")
    n, m = sums.shape
    est = sums.sum(axis=0) / total
    if n < 2 or n_boot < 1:
        return {k: (est.copy(), est.copy()) for k in methods}
    alpha = (1.0 - level) / 2.0
    resid = sums - tokens[:, None] * est
    m2 = (resid * resid).mean(axis=0)
    se = np.sqrt(m2 * n * (n / (n - 1))) / total
    flat = se <= 1e-12 * np.abs(est)  # identical per-token means (rounding only): no spread
    delta, se_b = _resample(sums, tokens, n_boot, seed)
    if len(delta) == 0:
        return {k: (est.copy(), est.copy()) for k in methods}
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    if "percentile" in methods:
        out["percentile"] = tuple(est + q for q in np.quantile(delta, [alpha, 1.0 - alpha], axis=0))
    if "bca" in methods:
        out["bca"] = tuple(est + q for q in _bca(delta, _jackknife_accel(sums, tokens), alpha))
    tq = t_quantile(1.0 - alpha, n - 1)
    out["delta_t"] = (est - tq * se, est + tq * se)
    if "boot_t" in methods or "boot_t_skew" in methods:
        # A resample can have (almost) no spread: top-1 agreement near 1 over few samples, each resampled one
        # agreeing everywhere (SE* = 0, t* infinite). SE* is floored at SE / sqrt(n): large but finite t*. On the
        # coverage grid the floor holds in under 3% of the resamples and changed no bound's verdict.
        floor = se / math.sqrt(n)
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.nan_to_num(delta / np.maximum(se_b, floor), nan=0.0, posinf=0.0, neginf=0.0)  # se = 0: flat
        q_lo, q_hi = np.quantile(t, [alpha, 1.0 - alpha], axis=0)
        below, above = np.maximum(q_hi * se, 0.0), np.maximum(-q_lo * se, 0.0)  # margins under and over est
        out["boot_t"] = (est - below, est + above)
        with np.errstate(divide="ignore", invalid="ignore"):
            skew = np.where(m2 > 0, (resid ** 3).mean(axis=0) / np.where(m2 > 0, m2, 1.0) ** 1.5, 0.0)
        kappa = lambda g: 1.0 + SKEW_C * np.sqrt(np.maximum(g, 0.0) / n) + SMALL_C / n  # noqa: E731
        out["boot_t_skew"] = (np.minimum(est - below * kappa(-skew), out["delta_t"][0]),
                              np.maximum(est + above * kappa(skew), out["delta_t"][1]))
    res = {}
    for k in methods:
        lo, hi = out[k]
        lo, hi = np.where(flat, est, lo), np.where(flat, est, hi)
        res[k] = (np.minimum(lo, est), np.maximum(hi, est))
    return res


def ratio_bounds(sums: np.ndarray, tokens: np.ndarray, level: float = 0.90, n_boot: int = 2000, seed: int = 0,
                 method: str = CHOSEN) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) per column of `sums` (n samples x m columns) over `tokens` (n,): each a one-sided bound at
    (1 + level) / 2 for the ratio mean sum(sums[:, j]) / sum(tokens); deterministic for a seed."""
    return ratio_bounds_all(sums, tokens, level, n_boot, seed, (method,))[method]
