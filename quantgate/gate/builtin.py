"""The gate's built-in measurement kinds (pure, no I/O): each judges its own evidence into checks, and the gate
(quantgate.gate.checks.evaluate) iterates them in order, then the kinds added as modules (quantgate.gate.kinds).

Each kind goes by one name, the prefix of its checks' names and its policy section's name: `engine_parity`,
`error_rate`, `evals` (the eval sets' `primary`, `pooled` and `category` checks, which read the comparison of the
eval sets), `fidelity`, `recall`, `judge`, `pay_off`. A kind returns its part of the decision as a `KindPart`:
checks judged on their own, and task checks (`items`) that the gate judges together with every other kind's, their
harm tests Holm-corrected within their groups (quantgate.gate.statistical.task_checks). A kind that proves the
candidate close to the baseline (fidelity, when every one of its checks passes) says so in `proof`: the task checks
accept such a proof for limits they cannot prove on their own samples.

The order of `BUILT_IN` is the order in which a decision lists the checks: every kind's `first` checks, then the
task checks, then every kind's `last` checks; the registered kinds' checks come last of all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from quantgate.gate import kinds
from quantgate.gate.models import Check, GateEvidence
from quantgate.gate.payoff import pay_off_checks
from quantgate.gate.policy import DropLimit, GatePolicy, own_metric
from quantgate.gate.statistical import TaskItem, fidelity_checks, finite, gap_of, missing


@dataclass(frozen=True)
class Judging:
    """What every kind judges: the policy, one candidate's evidence, and the family of its scheme (None: the
    policy's primary section names none for it)."""
    policy: GatePolicy
    evidence: GateEvidence
    family: str | None


@dataclass
class KindPart:
    """One kind's part of a decision: `first` (checks listed before the task checks), `items` (task checks, judged
    together with every kind's), `last` (checks listed after them), and `proof` (True: this kind proves the
    candidate close to the baseline; False: it could not; None: it proves nothing either way)."""
    first: list[Check] = field(default_factory=list)
    items: list[TaskItem] = field(default_factory=list)
    last: list[Check] = field(default_factory=list)
    proof: bool | None = None


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
                                why_missing=gap_of(ev, "compare", f"no eval set measured {metric}")))
        out += [TaskItem(f"primary:{s}/{metric}", st, lim.kind, lim.value, bound, p.required) for s, st in found]
    if policy.pooled is not None:
        if not ev.pooled:
            out.append(TaskItem("pooled", None, lim.kind, lim.value, bound, policy.pooled.required, pooled=True,
                                why_missing=gap_of(ev, "compare", "no eval set has binary-scored samples")))
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
                                why_missing=gap_of(ev, "compare", f"no eval set has category {cat} scored with {c.metric}")))
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
    why, file = gap_of(ev, "recall", "no recall comparison (quantgate recall --baseline)")
    if ev.kv_cache is not None:
        why = f"{why}; required because {_kv_change(ev)}"
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


def _kv_change(ev: GateEvidence) -> str:
    kv = ev.kv_cache
    assert kv is not None
    return f"the candidate's KV cache dtype is {kv.candidate}, the baseline's {kv.baseline}"


def _kv_without_recall(policy: GatePolicy, ev: GateEvidence) -> list[Check]:
    """A changed KV cache dtype under a policy without a recall check: undecided, never promoted (fail-closed)."""
    if ev.kv_cache is None or policy.recall is not None:
        return []
    return [missing("recall:kv_cache", True, f"{_kv_change(ev)}, which must pass long-context recall, and the policy "
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
        return missing(name, j.required, *gap_of(ev, "judge", "no judge report"), limit=limit, bound=bound)
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
        return [missing("error_rate", e.required, *gap_of(ev, "error_rate", "no eval summary with an error rate"),
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
        out.append(missing("error_rate:unreadable", e.required, *gap_of(ev, "error_rate", ""), limit=e.max))
    return out


def _parity(policy: GatePolicy, ev: GateEvidence) -> Check:
    req = policy.engine_parity.required  # type: ignore[union-attr]
    p = ev.parity
    if p is None:
        return missing("engine_parity", req, *gap_of(ev, "parity", "no engine parity report for the baseline"), limit="pass")
    return Check(name="engine_parity", measured=p.verdict, limit="pass", required=req,
                 outcome="pass" if p.verdict == "pass" else "fail", evidence_file=p.file,
                 reason=p.reason or f"verdict {p.verdict}")


def engine_parity(j: Judging) -> KindPart:
    return KindPart(first=[_parity(j.policy, j.evidence)] if j.policy.engine_parity is not None else [])


def error_rate(j: Judging) -> KindPart:
    return KindPart(first=_error_rates(j.policy, j.evidence) if j.policy.error_rate is not None else [])


def evals(j: Judging) -> KindPart:
    """The eval sets' checks: the primary metrics and the pooled test (for a scheme of a known family), and the
    policy's categories and the sets' own."""
    policy, ev = j.policy, j.evidence
    categories = _category_items(policy, ev, j.family)
    if policy.primary is None:
        return KindPart(items=categories)
    if j.family is None:
        return KindPart(first=[_unknown_family(policy, ev)], items=categories)
    return KindPart(items=_primary_items(policy, ev, j.family) + categories)


def fidelity(j: Judging) -> KindPart:
    if j.policy.fidelity is None:
        return KindPart()
    checks = fidelity_checks(j.policy, j.evidence, j.family)
    return KindPart(first=checks, proof=bool(checks) and all(c.outcome == "pass" for c in checks))


def recall(j: Judging) -> KindPart:
    return KindPart(items=_recall_items(j.policy, j.evidence), last=_kv_without_recall(j.policy, j.evidence))


def judge(j: Judging) -> KindPart:
    return KindPart(last=[_judge(j.policy, j.evidence)] if j.policy.judge is not None else [])


def pay_off(j: Judging) -> KindPart:
    return KindPart(last=pay_off_checks(j.policy, j.evidence) if j.policy.pay_off is not None else [])


def registered(j: Judging) -> KindPart:
    """The kinds added as modules, each with a section in the policy (quantgate.gate.kinds)."""
    return KindPart(last=kinds.checks(j.policy.kinds, j.evidence.kinds, j.evidence.gaps))


BUILT_IN: tuple[tuple[str, Callable[[Judging], KindPart]], ...] = (
    ("engine_parity", engine_parity), ("error_rate", error_rate), ("evals", evals), ("fidelity", fidelity),
    ("recall", recall), ("judge", judge), ("pay_off", pay_off))


def judge_all(j: Judging) -> list[KindPart]:
    """Every kind's part, built in first, in order, then the registered kinds'."""
    return [kind(j) for _, kind in BUILT_IN] + [registered(j)]
