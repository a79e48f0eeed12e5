"""The promotion gate (pure, no I/O): a policy and one candidate's evidence in, PROMOTE, REJECT or INCONCLUSIVE out.

Every check yields a row {name, measured, limit, bound, outcome, evidence_file, reason, power}
(quantgate.gate.models). REJECT means harm was detected or a requirement failed; INCONCLUSIVE means the evidence
cannot decide (missing or unreliable evidence, too few samples, a noise floor above the limit): both are fail-closed,
neither is promoted, and the decision says which. The statistical checks are in quantgate.gate.statistical.

Drops are measured as "how much worse is the candidate", so positive is bad. For a higher-is-better metric the
point drop is -delta and the `ci` drop is -ci_low (the CI's worst end); relative drops divide by the baseline mean.
The evidence (`GateEvidence`) is built from a run folder by `quantgate.gate.evidence`.
"""

from __future__ import annotations

from quantgate.gate import kinds
from quantgate.fidelity.record import StreamLook
from quantgate.gate.models import Check, Decision, GateEvidence, Look, OperatingCharacteristics
from quantgate.gate.payoff import applied_workload, pay_off_checks
from quantgate.gate.policy import DropLimit, GatePolicy, own_metric
from quantgate.gate.statistical import TaskItem, drop_of, fidelity_checks, finite, missing, task_checks

__all__ = ["Check", "Decision", "GateEvidence", "drop_of", "evaluate"]


def _gap(ev: GateEvidence, slot: str, default: str) -> tuple[str, str | None]:
    g = ev.gaps.get(slot)
    return (g.reason, g.file) if g else (default, None)


def _primary_items(policy: GatePolicy, ev: GateEvidence, family: str) -> list[TaskItem]:
    p = policy.primary
    assert p is not None
    lim: DropLimit = p.families[family]
    bound, out = policy.bound_of(p), []
    measured = {m for per_set in ev.metrics.values() for m in per_set}
    for metric in p.metrics:
        found = [(s, m[metric]) for s, m in sorted(ev.metrics.items()) if metric in m]
        if not found and measured & set(p.metrics):  # the primary metrics are those of the list a set measures
            out.append(TaskItem(f"primary:{metric}", None, lim.kind, lim.value, bound, p.required, not_fed=(
                f"not applicable: no eval set of this release is scored with {metric} (primary metrics are every "
                f"listed metric a set measures; measured here: {', '.join(sorted(measured & set(p.metrics)))})")))
        elif not found:
            out.append(TaskItem(f"primary:{metric}", None, lim.kind, lim.value, bound, p.required,
                                why_missing=_gap(ev, "compare", f"no eval set measured {metric}")))
        out += [TaskItem(f"primary:{s}/{metric}", st, lim.kind, lim.value, bound, p.required) for s, st in found]
    if policy.pooled is not None:
        if not ev.pooled:
            out.append(TaskItem("pooled", None, lim.kind, lim.value, bound, policy.pooled.required, pooled=True,
                                why_missing=_gap(ev, "compare", "no eval set has binary-scored samples")))
        out += [TaskItem(f"pooled:{s}", st, lim.kind, lim.value, bound, policy.pooled.required, pooled=True)
                for s, st in sorted(ev.pooled.items())]
    return out


def _category_items(policy: GatePolicy, ev: GateEvidence, family: str | None) -> list[TaskItem]:
    out = []
    for cat, c in policy.categories.items():
        bound, limit = policy.bound_of(c), c.limit_for(family)
        found = [(s, cats[cat][c.metric]) for s, cats in sorted(ev.categories.items()) if c.metric in cats.get(cat, {})]
        if not found and ev.categories and not any(cat in cats for cats in ev.categories.values()):
            have = sorted({k for cats in ev.categories.values() for k in cats})
            out.append(TaskItem(f"category:{cat}/{c.metric}", None, c.kind, limit, bound, c.required, not_fed=(
                f"not applicable: no eval set of this release has category {cat!r} (its sets have: "
                f"{', '.join(have)}); the policy's category checks apply to the categories a set has")))
        elif not found:
            out.append(TaskItem(f"category:{cat}/{c.metric}", None, c.kind, limit, bound, c.required,
                                why_missing=_gap(ev, "compare", f"no eval set has category {cat} scored with {c.metric}")))
        out += [TaskItem(f"category:{s}/{cat}/{c.metric}", st, c.kind, limit, bound, c.required) for s, st in found]
    return out + _own_category_items(policy, ev, family)


def _own_category_items(policy: GatePolicy, ev: GateEvidence, family: str | None) -> list[TaskItem]:
    """One check per category a set has that the policy does not name (`own_categories`), with the metric that
    scores most of its samples (gate.policy.own_metric)."""
    own = policy.own_categories
    if own is None:
        return []
    bound, limit, out = policy.bound_of(own), own.limit_for(family), []
    preferred = policy.primary.metrics if policy.primary else []
    for s, cats in sorted(ev.categories.items()):
        for cat, stats in sorted(cats.items()):
            metric = own_metric({m: st.n for m, st in stats.items()}, preferred)
            if cat not in policy.categories and metric is not None:
                out.append(TaskItem(f"category:{s}/{cat}/{metric}", stats[metric], own.kind, limit, bound, own.required))
    return out


def _recall_items(policy: GatePolicy, ev: GateEvidence) -> list[TaskItem]:
    """The recall check; required whatever the policy says when the candidate's KV cache dtype differs from the
    baseline's (an FP8 KV cache must pass long-context recall before it ships)."""
    r = policy.recall
    if r is None:
        return []
    why, file = _gap(ev, "recall", "no recall comparison (quantgate recall --baseline)")
    if ev.kv_cache is not None:
        why = f"{why}; required because {kv_change(ev)}"
    required = r.required or ev.kv_cache is not None
    overall = TaskItem(f"recall:{r.measure}", ev.recall.get(r.measure), r.kind, r.value, policy.bound_of(r),
                       required, why_missing=(why, file), recall=True)
    # every context length on its own as well (recall per needle): harm confined to the longest contexts is a
    # fraction of the overall figure, and a harm test per length finds it; the recall checks are a Holm family of
    # their own when the policy gives them a share of the false-reject budget (statistics.recall_share)
    by_length = [TaskItem(f"recall:{r.measure}@{n}", st, r.kind, r.value, policy.bound_of(r), required, recall=True)
                 for n, st in sorted(ev.recall_by_length.items(), key=lambda kv: int(kv[0]))
                 if r.measure == "recall"] if len(ev.recall_by_length) > 1 else []
    return [overall, *by_length]


def kv_change(ev: GateEvidence) -> str:
    kv = ev.kv_cache
    assert kv is not None
    return f"the candidate's KV cache dtype is {kv.candidate}, the baseline's {kv.baseline}"


def _kv_without_recall(policy: GatePolicy, ev: GateEvidence) -> list[Check]:
    """A changed KV cache dtype under a policy without a recall check: undecided, never promoted (fail-closed)."""
    if ev.kv_cache is None or policy.recall is not None:
        return []
    return [missing("recall:kv_cache", True, f"{kv_change(ev)}, which must pass long-context recall, and the policy "
                    "has no recall check: add a `recall` section to the policy", ev.kv_cache.file)]


def _unknown_family(policy: GatePolicy, ev: GateEvidence) -> Check:
    p = policy.primary
    assert p is not None
    why = f"scheme {ev.scheme!r} is in no family of the policy" if ev.scheme else "the candidate's scheme is unknown"
    return Check(name="primary", measured=ev.scheme, limit=None, bound=policy.bound_of(p), required=p.required,
                 outcome="inconclusive" if p.required else "skipped",
                 reason=f"{why}: add it to primary.families in the policy")


def _judge(policy: GatePolicy, ev: GateEvidence) -> Check:
    j = policy.judge
    assert j is not None
    bound, limit, name = policy.bound_of(j), -j.margin, "judge:non_inferiority"
    e = ev.judge
    if e is None:
        return missing(name, j.required, *_gap(ev, "judge", "no judge report"), limit=limit, bound=bound)
    if not e.counts_as_evidence:
        return missing(name, j.required, f"the judge failed calibration ({e.reason or 'unreliable'}): its verdicts "
                       "are not evidence", e.file, limit, bound)
    if e.judged and e.invalid / e.judged > j.max_invalid_rate:  # a judge run that mostly failed: never a pass
        return Check(name=name, measured=None, limit=limit, bound=bound, required=j.required, outcome="inconclusive",
                     evidence_file=e.file, reason=f"{e.invalid} of {e.judged} judged pairs ({e.invalid / e.judged:.1%}) "
                     f"have no valid verdict, above the cap of {j.max_invalid_rate:.1%} (judge.max_invalid_rate): the "
                     "valid rest is no fair sample; fix the judge's template or model and re-run the judge")
    if e.not_stronger and not j.accept_not_stronger:
        return missing(name, j.required, f"the judge is not known to be stronger than the judged model "
                       f"({e.not_stronger}); set judge.accept_not_stronger to accept it", e.file, limit, bound)
    value = e.lower_bound if bound == "ci" else e.net
    if not finite(value) or e.n < policy.min_samples:
        why = f"{e.n} judged pairs, fewer than min_samples={policy.min_samples}" if e.n < policy.min_samples \
            else "no net win rate / bound in the report"
        return missing(name, j.required, why, e.file, limit, bound)
    assert value is not None and e.net is not None
    upper = e.net + (e.net - e.lower_bound) if bound == "ci" and finite(e.lower_bound) else e.net  # symmetric bound
    outcome = "pass" if value > limit else "fail" if upper <= limit else "inconclusive"
    what = "lower confidence bound of (win - loss)" if bound == "ci" else "win - loss (point estimate)"
    tail = {"pass": "", "fail": ": the judge prefers the baseline beyond the margin",
            "inconclusive": ": the interval crosses the margin"}[outcome]
    return Check(name=name, measured=round(value, 6), limit=limit, bound=bound, required=j.required, outcome=outcome,
                 evidence_file=e.file, reason=f"n={e.n}: {what} {value:+.3f} {'>' if value > limit else '<='} "
                                              f"-margin {limit:+.3f}{tail}")


def _error_rates(policy: GatePolicy, ev: GateEvidence) -> list[Check]:
    e = policy.error_rate
    assert e is not None
    if not ev.error_rates:
        return [missing("error_rate", e.required, *_gap(ev, "error_rate", "no eval summary with an error rate"),
                        limit=e.max)]
    out = []
    for r in ev.error_rates:
        name = f"error_rate:{r.name}"
        if not finite(r.rate):
            out.append(missing(name, e.required, "no error rate in the summary", r.file, e.max))
            continue
        ok = r.rate <= e.max
        out.append(Check(name=name, measured=r.rate, limit=e.max, required=e.required, outcome="pass" if ok else "fail",
                         evidence_file=r.file,
                         reason=f"{r.rate:.2%} of {r.n} requests failed {'<=' if ok else '>'} limit {e.max:.2%}"))
    if "error_rate" in ev.gaps:  # some summaries could not be read: that part is missing
        out.append(missing("error_rate:unreadable", e.required, *_gap(ev, "error_rate", ""), limit=e.max))
    return out


def _parity(policy: GatePolicy, ev: GateEvidence) -> Check:
    req = policy.engine_parity.required  # type: ignore[union-attr]
    p = ev.parity
    if p is None:
        return missing("engine_parity", req, *_gap(ev, "parity", "no engine parity report for the baseline"), limit="pass")
    return Check(name="engine_parity", measured=p.verdict, limit="pass", required=req,
                 outcome="pass" if p.verdict == "pass" else "fail", evidence_file=p.file,
                 reason=p.reason or f"verdict {p.verdict}")


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
    checks: list[Check] = []
    if policy.engine_parity is not None:
        checks.append(_parity(policy, evidence))
    if policy.error_rate is not None:
        checks += _error_rates(policy, evidence)
    fidelity = fidelity_checks(policy, evidence, family) if policy.fidelity is not None else []
    proven = bool(fidelity) and all(c.outcome == "pass" for c in fidelity)
    items: list[TaskItem] = []
    if policy.primary is not None and family is None:
        checks.append(_unknown_family(policy, evidence))
    elif policy.primary is not None:
        items += _primary_items(policy, evidence, family)  # type: ignore[arg-type]
    items += _category_items(policy, evidence, family) + _recall_items(policy, evidence)
    checks += fidelity + task_checks(items, policy, proven) + _kv_without_recall(policy, evidence)
    if policy.judge is not None:
        checks.append(_judge(policy, evidence))
    if policy.pay_off is not None:
        checks += pay_off_checks(policy, evidence)
    checks += kinds.checks(policy.kinds, evidence.kinds, evidence.gaps)
    checks = decided_early(evidence, [not_applicable(policy, evidence, c) for c in checks])
    verdict, reasons, needs = _verdict(checks)
    return Decision(decision=verdict, candidate=evidence.candidate, scheme=evidence.scheme, family=family,
                    policy={"name": policy.name, "version": policy.version, **(policy_ref or {})}, checks=checks,
                    reasons=reasons, needs=needs, operating=operating(policy, look, evidence.stream),
                    workload=applied_workload(evidence), look=look, stream=evidence.stream)
