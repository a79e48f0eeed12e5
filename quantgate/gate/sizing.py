"""Sizing an eval set for a policy (pure): the minimum detectable drop of each task check at a sample size, and the
sample size each limit needs before the check can prove it rather than only detect harm.

The figures assume a binary measure (accuracy) with baseline accuracy `base` and a share `discordance` of samples
that change either way between baseline and candidate (5-10% is typical of a good 8-bit candidate on a small
model); each check's level is its share of the policy's false-reject budget, as the gate spends it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from quantgate.base.stats import mdd_binary, samples_for
from quantgate.gate.policy import GatePolicy


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
        c = policy.categories.get(check.split(":", 1)[1])
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
