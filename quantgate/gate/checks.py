"""The promotion gate (pure, no I/O): a policy and one candidate's evidence in, PROMOTE, REJECT or INCONCLUSIVE out.

Every check yields a row {name, measured, limit, bound, outcome, evidence_file, reason, power}
(quantgate.gate.models). REJECT means harm was detected or a requirement failed; INCONCLUSIVE means the evidence
cannot decide (missing or unreliable evidence, too few samples, a noise floor above the limit): both are fail-closed,
neither is promoted, and the decision says which. The statistical checks are in quantgate.gate.statistical.

Drops are measured as "how much worse is the candidate", so positive is bad. For a higher-is-better metric the
point drop is -delta and the `ci` drop is -ci_low (the CI's worst end); relative drops divide by the baseline mean.
The evidence (`GateEvidence`) is built from a run folder by `quantgate.gate.evidence`; each measurement kind's checks
are its own (quantgate.gate.builtin, and quantgate.gate.kinds for the kinds added as modules): this module puts
their parts together and decides.
"""

from __future__ import annotations

from quantgate.fidelity.record import StreamLook
from quantgate.gate.builtin import Judging, judge_all
from quantgate.gate.models import Check, Decision, GateEvidence, Look, OperatingCharacteristics
from quantgate.gate.payoff import applied_workload
from quantgate.gate.policy import GatePolicy
from quantgate.gate.statistical import drop_of, task_checks

__all__ = ["Check", "Decision", "GateEvidence", "drop_of", "evaluate"]


NOT_APPLICABLE = {"engine_parity": ("parity", "engine_parity"), "pay_off:size_ratio": ("size", "size_ratio")}
SAID = {"skip": "accepted", "fail": "refused", "missing": "counted as missing evidence"}


def not_applicable(policy: GatePolicy, ev: GateEvidence, check: Check) -> Check:
    """A check whose evidence cannot exist for this candidate (a gap marked not applicable) as the policy's
    `not_applicable` rule says: missing (the missing-evidence rule: INCONCLUSIVE when required), skip or fail."""
    slot, rule_name = NOT_APPLICABLE.get(check.name, ("", ""))
    gap = ev.gaps.get(slot)
    if gap is None or not gap.not_applicable or check.outcome in ("pass", "fail"):
        return check
    rule = getattr(policy.not_applicable, rule_name)
    outcome = {"skip": "skipped", "fail": "fail"}.get(rule, "inconclusive" if check.required else "skipped")
    fix = f" (not_applicable.{rule_name}: skip would accept it)" if outcome == "inconclusive" else ""
    return check.model_copy(update={"outcome": outcome, "measured": "not applicable", "evidence_file": gap.file,
                                    "reason": f"{gap.reason}; {SAID[rule]} by the policy (not_applicable."
                                              f"{rule_name}: {rule}){fix}"})


DECIDED_EARLY = "skipped: decided early by fidelity"
# a check's name prefix -> the evidence slot (GateEvidence.gaps) it reads, where the two differ
EVIDENCE_SLOT = {"pay_off": "throughput", "primary": "compare", "pooled": "compare", "category": "compare"}


def decided_early(ev: GateEvidence, checks: list[Check]) -> list[Check]:
    """Checks whose step the release skipped on purpose (a gap marked `decided_early`: fidelity had decided a REJECT
    first) say so, as skipped, not as missing evidence. Only while a check fails: a skipped step could not change a
    REJECT, but without one (a policy re-read with other limits) the missing evidence stays missing (fail-closed)."""
    if not any(c.outcome == "fail" for c in checks):
        return checks
    out = []
    for c in checks:
        prefix = c.name.split(":", 1)[0]
        gap = ev.gaps.get(EVIDENCE_SLOT.get(prefix, prefix))
        if gap is not None and gap.decided_early and c.measured is None and c.outcome in ("inconclusive", "skipped"):
            c = c.model_copy(update={"outcome": "skipped", "evidence_file": gap.file,
                                     "reason": f"{DECIDED_EARLY}: the release did not run this step, as the failed "
                                               "checks decide the REJECT whatever it would show"})
        out.append(c)
    return out


def operating(policy: GatePolicy, look: Look | None = None, stream: StreamLook | None = None
              ) -> OperatingCharacteristics:
    st, f = policy.statistics, policy.fidelity
    note = (f"A lossless candidate (no true drop on any task measure, fidelity at the noise floor) is rejected by the "
            f"task checks' harm tests with probability at most {st.false_reject:.0%} (Holm, one-sided)")
    if f is not None:
        where = " pooled and in every category" if f.per_category else ""
        note += (f"; a candidate whose fidelity sits exactly at its limit{where} is promoted with probability at most "
                 f"{f.alpha:.0%} (one-sided bounds, intersection-union over the slices")
        note += (f"; over {look.of} planned looks, this is look {look.index}, judged at alpha {look.alpha:.4g} "
                 f"({look.spent:.4g} spent so far){_reweighted(look)}" if look else "") + ")"
        if stream is not None:
            note += (f"; decided at streaming look {stream.index} of {stream.of} ({stream.n} of {stream.total} prompts),"
                     f" judged at alpha {stream.alpha:.4g}: looks before the full sample only REJECT, so the "
                     "promise above holds over all of them")
    return OperatingCharacteristics(false_reject_bound=st.false_reject, false_promote_at_limit=f.alpha if f else 1.0,
                                    power=st.power, note=note + ". Minimum detectable drops are stated at "
                                    f"{st.power:.0%} power.")


def _reweighted(look: Look) -> str:
    if look.growth == 1.0:
        return ""
    return (f"; its pooled estimate weights each eval prompt {look.growth:.3g}x, as the last look's sample will hold "
            "them beside the same haystacks")


def _verdict(checks: list[Check]) -> tuple[str, list[str], str | None]:
    fails = [f"{c.name}: {c.reason}" for c in checks if c.outcome == "fail"]
    if fails:
        return "REJECT", fails, None
    unsure = [c for c in checks if c.outcome == "inconclusive"]
    if unsure:
        needs = [c.power.needs_samples for c in unsure if c.power and c.power.needs_samples]
        need_txt = f"about {max(needs)} paired samples" if needs else "the missing evidence named in the reasons"
        return "INCONCLUSIVE", [f"{c.name}: {c.reason}" for c in unsure], need_txt
    if not any(c.outcome == "pass" for c in checks):
        return "INCONCLUSIVE", ["no check passed: the policy enables no check that had evidence"], "evidence"
    return "PROMOTE", [], None


def evaluate(policy: GatePolicy, evidence: GateEvidence, policy_ref: dict[str, str | int] | None = None,
             look: Look | None = None) -> Decision:
    """Run every check the policy enables; REJECT on harm, INCONCLUSIVE on too little evidence, else PROMOTE.
    `look`: this decision's look of a sequential design (its fidelity intervals were computed at its share of
    alpha by the caller); recorded in the decision."""
    family = policy.primary.family_of(evidence.scheme) if policy.primary else None
    parts = judge_all(Judging(policy, evidence, family))  # every kind, in the order the decision lists them
    proofs = [p.proof for p in parts if p.proof is not None]
    items = [i for p in parts for i in p.items]
    checks = [c for p in parts for c in p.first] + task_checks(items, policy, bool(proofs) and all(proofs)) + \
        [c for p in parts for c in p.last]
    checks = decided_early(evidence, [not_applicable(policy, evidence, c) for c in checks])
    verdict, reasons, needs = _verdict(checks)
    return Decision(decision=verdict, candidate=evidence.candidate, scheme=evidence.scheme, family=family,
                    policy={"name": policy.name, "version": policy.version, **(policy_ref or {})}, checks=checks,
                    reasons=reasons, needs=needs, operating=operating(policy, look, evidence.stream),
                    workload=applied_workload(evidence), look=look, stream=evidence.stream)
