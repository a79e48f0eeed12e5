"""The gate's fidelity checks alone, for a release that decides early (quantgate.release.early): the same
evidence reader and checks as the full gate, on the run's fidelity files as they are now."""

from __future__ import annotations

from pathlib import Path

from quantgate.gate.evidence import collect
from quantgate.gate.looks import spend
from quantgate.gate.models import Check
from quantgate.gate.policy import load_policy
from quantgate.gate.statistical import fidelity_checks


def early_fidelity_checks(run: Path | str, policy_path: Path | str, candidate: str, scheme: str | None,
                          looks: tuple[list[int], int] | None = None) -> list[Check]:
    """The candidate's fidelity checks as gate_run will judge them (<run>/fidelity/<candidate>.json and floor.json,
    at this look's share of alpha). A failed one is a REJECT that no other evidence can change (any failed check
    rejects); missing files fail nothing. [] without a fidelity section in the policy."""
    policy = load_policy(policy_path)
    if policy.fidelity is None:
        return []
    look = spend(policy.fidelity.alpha, *looks) if looks is not None else None
    level = 1 - 2 * (look.alpha if look else policy.fidelity.alpha)
    evidence = collect(run, candidate, fidelity_level=level, fidelity_growth=look.growth if look else 1.0
                       ).model_copy(update={"scheme": scheme})
    family = policy.primary.family_of(scheme) if policy.primary and scheme else None
    return fidelity_checks(policy, evidence, family)
