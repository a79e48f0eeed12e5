"""The adaptive design (spec `adaptive`): how an INCONCLUSIVE candidate's samples grow, and the fidelity sample
sizes of every look, planned from the spec before the first one (the gate spends its fidelity alpha across them:
quantgate.gate.looks)."""

from __future__ import annotations


from quantgate.evals.dataset import load_evalset
from quantgate.spec.schema import ReleaseSpec


def _grow(current: int | None, budget: int | None, available: int) -> int | None:
    """The next sample count: twice the current one (or all available), within the budget; None: cannot grow."""
    now = current or available
    if budget is None or now >= min(budget, available):
        return None
    return min(budget, available, max(2 * now, now + 1))


def widen(spec: ReleaseSpec, decisions: list) -> ReleaseSpec | None:
    """The spec with more eval and fidelity samples when a candidate is INCONCLUSIVE and the `adaptive` budget and
    the eval sets allow more; None when there is nothing to add (the decision stands)."""
    if not any(d.decision == "INCONCLUSIVE" for d in decisions):
        return None
    return _widened(spec)


def fidelity_looks(spec: ReleaseSpec) -> list[int] | None:
    """The fidelity sample size (fidelity.limit, or every prompt) of each look the adaptive design may take,
    planned from the spec before the first look: the gate spends its fidelity alpha across them
    (quantgate.gate.looks). None without fidelity."""
    if spec.fidelity is None:
        return None
    s: ReleaseSpec | None
    sizes, s = [], spec
    for _ in range(1 + (spec.adaptive.rounds if spec.adaptive else 0)):
        sizes.append(fidelity_size(s))
        if (s := _widened(s)) is None:
            break
    return sizes


def fidelity_size(spec: ReleaseSpec) -> int:
    """This spec's fidelity sample size as a look counts it: fidelity.limit, or every eval prompt when it has none."""
    assert spec.fidelity is not None
    return spec.fidelity.limit or max(1, sum(len(load_evalset(p, with_dataset=False).samples) for p in spec.eval_sets))


def _widened(spec: ReleaseSpec) -> ReleaseSpec | None:
    a = spec.adaptive
    if a is None:
        return None
    available = min((len(load_evalset(p, with_dataset=False).samples) for p in spec.eval_sets), default=0)
    update: dict[str, object] = {}  # ReleaseSpec fields: the widened settings
    limit = spec.eval.limit
    if (n := _grow(spec.eval.limit, a.max_eval_samples, available)) is not None:
        update["eval"] = spec.eval.model_copy(update={"limit": n})
        limit = n
    if spec.fidelity is not None:
        reach = limit or available
        if (k := _grow(spec.fidelity.limit, a.max_fidelity_samples, reach * max(len(spec.eval_sets), 1))) is not None:
            update["fidelity"] = spec.fidelity.model_copy(update={"limit": k})
    return spec.model_copy(update=update) if update else None


__all__ = ["fidelity_looks", "fidelity_size", "widen"]
