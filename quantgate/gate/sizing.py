"""Sizing an eval set for a policy (pure): the minimum detectable drop of each task check at a sample size, and the
sample size each limit needs before the check can prove it rather than only detect harm.

Fidelity slices are sized the same way from a reference spread (`SPREAD`): the one-sided bound a candidate at half
its limits would get at n samples, as quantgate.fidelity.bounds computes it (`fidelity_bound_share`).

The task figures assume a binary measure (accuracy) with baseline accuracy `base` and a share `discordance` of samples
that change either way between baseline and candidate (5-10% is typical of a good 8-bit candidate on a small
model); each check's level is its share of the policy's false-reject budget, as the gate spends it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from quantgate.base.stats import mdd_binary, samples_for
from quantgate.fidelity.bounds import SKEW_C, SMALL_C, t_quantile
from quantgate.gate.policy import GatePolicy

# The per-sample spread of fidelity figures: (coefficient of variation, skewness) of a sample's ratio residual
# (y_i - R n_i, quantgate.fidelity.bounds) over R x mean(n_i), per slice kind and measure (top-1: its disagreement
# share). Skewness as measured on the demo's INT8 candidate (bench/data/demo_int8_fidelity_shape*.json, 300 eval
# prompts and 30-36 haystacks each); each cv is the smallest (in steps of 0.05) whose prediction sits at or above
# the median of the gate's own bound on random subsets of both shapes at every size bench/fidelity_sizing.py tries
# (the measured cvs are 0.77-0.79 for prompts' KL, 0.39-0.48 for haystacks'). A team's own slices may spread more:
# the prediction is a floor, not a promise.
SPREAD = {"prompt": {"kl": (0.95, 1.2), "top1": (0.55, 1.3)}, "haystack": {"kl": (0.65, 0.35), "top1": (0.5, 2.0)}}
GOOD = 0.5  # the candidate a slice's size is judged for: at half of each limit (the OC bench's "good")


@dataclass(frozen=True)
class Sizing:
    check: str
    n: int
    limit: float                 # relative drop
    mdd: float                   # relative drop detectable at 80% power (the policy's power)
    needs: int                   # paired samples for mdd <= limit

    @property
    def below(self) -> bool:
        return self.limit < self.mdd


def _levels(policy: GatePolicy, n_other: int) -> tuple[float, float]:
    """(the pooled test's level, each other check's first-step Holm level), as quantgate.gate.statistical spends
    them (the recall checks' own share, when the policy gives one, is not the others')."""
    st = policy.statistics
    other = 1 - st.recall_share if policy.recall is not None else 1.0
    if policy.pooled is None:
        return st.false_reject, st.false_reject * other / max(n_other, 1)
    return st.false_reject * st.pooled_share, st.false_reject * (other - st.pooled_share) / max(n_other, 1)


def sizing(policy: GatePolicy, family: str, counts: dict[str, int], *, base: float = 0.4,
           discordance: float = 0.10) -> list[Sizing]:
    """One row per task check named in `counts` ({"pooled": n, "primary": n, "category:<name>": n, ...})."""
    p_alpha, o_alpha = _levels(policy, len([k for k in counts if k != "pooled"]))
    out = []
    for check, n in counts.items():
        limit = _limit(policy, family, check)
        if limit is None:
            continue
        alpha = p_alpha if check == "pooled" else o_alpha
        rel = mdd_binary(discordance, n, alpha, policy.statistics.power) / base
        need = samples_for(limit * base, 0.0, alpha, policy.statistics.power, binary=True, discordance=discordance)
        out.append(Sizing(check=check, n=n, limit=limit, mdd=rel, needs=need))
    return out


def _limit(policy: GatePolicy, family: str, check: str) -> float | None:
    if check in ("pooled", "primary") and policy.primary and family in policy.primary.families:
        lim = policy.primary.families[family]
        return lim.value if lim.kind == "relative" else None
    if check.startswith("category:"):
        c = policy.categories.get(check.split(":", 1)[1]) or policy.own_categories
        return c.limit_for(family) if c and c.kind == "relative" else None
    return None


def warnings(rows: list[Sizing]) -> list[str]:
    """One line for the checks whose limits are below what their n can detect (empty when every limit is provable)."""
    below = [r for r in rows if r.below]
    if not below:
        return []
    parts = "; ".join(f"{r.check} limit {r.limit:.1%} < {_mdd(r.mdd)} at n={r.n} (needs ~{r.needs})" for r in below)
    return [f"{len(below)} task checks cannot prove their limits at this size and only detect harm, so fidelity "
            f"carries the proof: {parts}"]


def _mdd(mdd: float) -> str:
    """The minimum detectable drop in words: a relative drop above 100% is no drop a score can have."""
    return f"MDD {mdd:.1%}" if mdd <= 1 else "MDD > 100% (not even a total loss would be detected)"


def recall_sizing(policy: GatePolicy, n: int, *, other_checks: int, base: float = 0.5, discordance: float = 0.10,
                  design_effect: float = 1.0, recall_checks: int = 1) -> Sizing | None:
    """The recall check at `n` paired needles: its minimum detectable drop in its limit's unit (absolute by default;
    a relative limit divides by the baseline recall `base`), at its share of the budget: the recall family's
    (statistics.recall_share over `recall_checks`: overall and per length) when the policy gives one, else among
    `other_checks` non-pooled task checks (recall included). Needles that share a haystack count as
    n / `design_effect` independent ones (quantgate.recall.score.cluster_effect measures it). None when the policy
    has no recall check."""
    r = policy.recall
    if r is None:
        return None
    st = policy.statistics
    alpha = st.false_reject * st.recall_share / max(recall_checks, 1) if st.recall_share > 0 else \
        _levels(policy, other_checks)[1]
    scale = base if r.kind == "relative" else 1.0
    n_eff = max(1, int(n / max(design_effect, 1.0)))
    m = mdd_binary(discordance, n_eff, alpha, policy.statistics.power) / scale
    need = samples_for(r.value * scale, 0.0, alpha, policy.statistics.power, binary=True, discordance=discordance)
    return Sizing(check="recall", n=n, limit=r.value, mdd=m, needs=math.ceil(need * max(design_effect, 1.0)))


def fidelity_bound_share(n: int, alpha: float, cv: float, skew: float, at: float = GOOD) -> float:
    """The one-sided bound of a slice of `n` samples whose true figure sits at `at` x its limit (KL: above it;
    top-1: its disagreement), as a share of the limit, at level `alpha` with the chosen bound's margin
    (boot_t_skew: kappa x t x SE, its SE from the spread `cv`). At 1 or more, the slice cannot be bounded inside its
    limit for such a candidate: INCONCLUSIVE at best."""
    if n < 2:
        return math.inf
    kappa = 1 + SKEW_C * math.sqrt(max(skew, 0.0) / n) + SMALL_C / n
    return at * (1 + kappa * t_quantile(1 - alpha, n - 1) * cv / math.sqrt(n))


def fidelity_samples_needed(alpha: float, cv: float, skew: float, at: float = GOOD, most: int = 100_000) -> int:
    """The smallest slice size at which `fidelity_bound_share` is below 1."""
    n = 2
    while n < most and fidelity_bound_share(n, alpha, cv, skew, at) >= 1:
        n += 1
    return n


def slice_samples_needed(alpha: float, haystack: bool) -> int:
    """The samples a slice of this kind needs before a candidate at half its limits is bounded inside them."""
    kind = SPREAD["haystack" if haystack else "prompt"]
    return max(fidelity_samples_needed(alpha, *kind[m]) for m in kind)


def too_small_to_bound(slices: dict[str, int], alpha: float, haystack_prefix: str) -> dict[str, tuple[float, int]]:
    """The fidelity slices (name -> samples) whose bound, for a candidate at half its limits with the reference
    spread, would not come inside the limit: name -> (the bound as a share of the limit, the samples it needs)."""
    out = {}
    for name, n in slices.items():
        kind = SPREAD["haystack" if name.startswith(haystack_prefix) else "prompt"]
        share = max(fidelity_bound_share(n, alpha, *kind[m]) for m in kind)
        if share >= 1:
            out[name] = (share, slice_samples_needed(alpha, name.startswith(haystack_prefix)))
    return out
