"""The gate's fidelity checks alone, for a release that decides early (quantgate.release.early): the same
evidence reader and checks as the full gate, on the run's fidelity files as they are now."""

from __future__ import annotations

from pathlib import Path

from quantgate.fidelity.record import FidelityRecord
from quantgate.gate.evidence import collect
from quantgate.gate.fidelityevidence import fidelity_evidence
from quantgate.gate.looks import spend
from quantgate.gate.models import Check, GateEvidence
from quantgate.gate.policy import GatePolicy, load_policy
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


def stream_checks(policy: GatePolicy, candidate: str, scheme: str | None, record: FidelityRecord,
                  floor: FidelityRecord, files: tuple[str, str]) -> list[Check]:
    """The candidate's fidelity checks at a streaming look (quantgate.gate.stream): `record` holds the look's
    prefix and its `stream` look, `floor` the noise floor; judged as the gate judges the same files (`files`:
    where they will be) at the look's share of alpha. [] without a fidelity section in the policy."""
    if policy.fidelity is None or record.stream is None:
        return []
    level = 1 - 2 * record.stream.alpha
    evidence = GateEvidence(candidate=candidate, scheme=scheme, stream=record.stream,
                            fidelity=fidelity_evidence(record.samples, level, files[0], estimator=record.kl_estimator),
                            floor=fidelity_evidence(floor.samples, level, files[1], estimator=floor.kl_estimator))
    family = policy.primary.family_of(scheme) if policy.primary and scheme else None
    return fidelity_checks(policy, evidence, family)
