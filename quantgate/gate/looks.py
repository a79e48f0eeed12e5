"""Every look spends its share (pure): the fidelity error budget of a sequential design, split across its looks.

A release that widens an INCONCLUSIVE candidate's fidelity sample (the spec's `adaptive`) looks at the evidence
more than once, and each look is one more chance to promote a candidate that sits exactly at its limit. Judging
every look at the policy's full `alpha` lets that chance grow with each look (measured: 0.060 for one look at 120
samples, 0.091 with one widening to 240). Here the looks are planned before the first one, from the spec, and
look k's bounds are judged at its share of alpha, in proportion to the samples it adds (linear alpha spending in
the information fraction t = n_k / n_K):

    share_k = alpha * (n_k - n_{k-1}) / n_K,    with n_0 = 0,  so that  share_1 + ... + share_K = alpha.

A promotion needs some look's bounds within the limits; by the union bound, the chance that any look promotes a
candidate at its limit is at most the sum of the shares: alpha, whatever the correlation between looks (they share
samples). Re-deciding on the same fidelity sample (a look where only the eval sets grew) spends nothing: the same
data at the same level gives the same bounds. The shares and the look are recorded in decision.json.
"""

from __future__ import annotations

from quantgate.base.errors import QuantgateError
from quantgate.gate.models import Look


def plan(sizes: list[int]) -> list[int]:
    """The distinct, growing fidelity sample sizes of the planned looks (a look that adds no sample is no look)."""
    out: list[int] = []
    for n in sizes:
        if n < 1:
            raise QuantgateError(f"a look needs at least one sample, got {n}", where="gate looks")
        if not out or n > out[-1]:
            out.append(n)
    return out


def shares(alpha: float, planned: list[int]) -> list[float]:
    """Each planned look's alpha: linear spending in the information fraction; they add up to alpha."""
    looks = plan(planned)
    total = looks[-1]
    return [alpha * (n - prev) / total for prev, n in zip([0, *looks[:-1]], looks)]


def spend(alpha: float, planned: list[int], n: int) -> Look:
    """The look whose fidelity sample has `n` samples, in the plan `planned` (sizes per look), with its share.
    A size outside the plan is refused: its level would be unaccounted for."""
    looks = plan(planned)
    if n not in looks:
        raise QuantgateError(f"fidelity sample of {n} is no planned look ({looks})", where="gate looks",
                             fix="a look's size must come from the spec's plan (fidelity.limit and adaptive)")
    k = looks.index(n)
    parts = shares(alpha, looks)
    return Look(index=k + 1, of=len(looks), alpha=round(parts[k], 10), spent=round(sum(parts[: k + 1]), 10),
                planned=looks, shares=[round(x, 10) for x in parts])


def repair_split(alpha: float, share: float) -> tuple[Look, Look]:
    """A repair rung is one more look at the same question (is this scheme within the limits?): the rejected
    candidate is judged at (1 - share) x alpha and its repair at share x alpha, planned before either, so that the
    two together promote a candidate at its limit at most alpha of the time (the union bound, as above). Returns
    (the candidate's look, the repair's look)."""
    if not 0 < share < 1:
        raise QuantgateError(f"a repair's share of alpha must be in (0, 1), got {share}", where="gate looks")
    parts = [round(alpha * (1 - share), 10), round(alpha * share, 10)]
    return (Look(index=1, of=2, alpha=parts[0], spent=parts[0], shares=parts),
            Look(index=2, of=2, alpha=parts[1], spent=round(alpha, 10), shares=parts))


__all__ = ["plan", "repair_split", "shares", "spend"]
