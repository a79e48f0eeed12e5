"""The promotion gate (pure, no I/O): a policy and one candidate's evidence in, PROMOTE or REJECT out.

Every check yields a row {name, measured, limit, bound, passed, evidence_file, reason}; `passed` is None for an
optional check without evidence (skipped). The candidate is promoted only when no check failed and at least one
passed. Fail-closed: a required check whose evidence is missing, errored (NaN, unreadable) or unreliable (an
uncalibrated judge, too few samples) fails, and its reason says which.

Drops are measured as "how much worse is the candidate", so positive is bad and a check passes when the measured
drop is at most the limit. For a higher-is-better metric the point drop is -delta and the `ci` drop is -ci_low
(the CI's worst end); relative drops divide by the baseline mean. The evidence (`GateEvidence`) is built from a
run folder by `quantgate.gate.evidence`.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from quantgate.gate.policy import Bound, DropLimit, GatePolicy

SCHEMA = 1


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Stat(_Model):
    """A paired comparison of the candidate with the baseline (means, delta = cand - base, CI of the delta)."""
    n: int = Field(ge=0)
    base: float | None = None
    cand: float | None = None
    delta: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    higher_is_better: bool = True
    file: str | None = None


class JudgeEvidence(_Model):
    counts_as_evidence: bool
    reason: str | None = None          # why calibration failed, when it did
    not_stronger: str | None = None    # why the judge is not known to be stronger, when it is not
    n: int = Field(0, ge=0)
    net: float | None = None           # win rate - loss rate
    lower_bound: float | None = None   # one-sided lower confidence bound of net
    file: str | None = None


class ParityEvidence(_Model):
    verdict: str
    reason: str = ""
    file: str | None = None


class RateEvidence(_Model):
    name: str                          # "<variant>/<eval set>"
    rate: float | None
    n: int = Field(0, ge=0)
    file: str | None = None


class Ratio(_Model):
    value: float | None
    file: str | None = None


class Gap(_Model):
    """Evidence that could not be used: why, and the file concerned."""
    reason: str
    file: str | None = None


class GateEvidence(_Model):
    """Everything the gate looks at for one candidate. Slots left empty explain themselves in `gaps`."""
    candidate: str
    scheme: str | None = None
    metrics: dict[str, dict[str, Stat]] = Field(default_factory=dict, description="eval set -> metric -> overall")
    categories: dict[str, dict[str, dict[str, Stat]]] = Field(default_factory=dict,
                                                              description="eval set -> category -> metric")
    recall: dict[str, Stat] = Field(default_factory=dict, description="'recall' and/or 'exact' -> overall")
    judge: JudgeEvidence | None = None
    parity: ParityEvidence | None = None
    error_rates: list[RateEvidence] = Field(default_factory=list)
    size_ratio: Ratio | None = None
    throughput_ratio: Ratio | None = None
    gaps: dict[str, Gap] = Field(default_factory=dict, description="slot (compare, recall, judge, parity, "
                                 "error_rate, size, throughput) -> why it is empty or incomplete")


class Check(_Model):
    name: str
    measured: float | str | None
    limit: float | str | None
    bound: Bound | None = None
    required: bool
    passed: bool | None
    evidence_file: str | None = None
    reason: str


class Decision(_Model):
    schema_version: int = SCHEMA
    decision: Literal["PROMOTE", "REJECT"]
    candidate: str
    scheme: str | None
    family: str | None
    policy: dict[str, str | int]
    checks: list[Check]
    reasons: list[str] = Field(description="the failed checks' reasons; empty on PROMOTE")

    @property
    def promoted(self) -> bool:
        return self.decision == "PROMOTE"


def _num(x: float | None) -> bool:
    return x is not None and not math.isnan(x)


def _gap(ev: GateEvidence, slot: str, default: str) -> tuple[str, str | None]:
    g = ev.gaps.get(slot)
    return (g.reason, g.file) if g else (default, None)


def _missing(name: str, required: bool, reason: str, file: str | None, limit=None, bound=None) -> Check:
    if required:
        return Check(name=name, measured=None, limit=limit, bound=bound, required=True, passed=False,
                     evidence_file=file, reason=f"missing evidence (required): {reason}")
    return Check(name=name, measured=None, limit=limit, bound=bound, required=False, passed=None,
                 evidence_file=file, reason=f"skipped (optional, no usable evidence): {reason}")


def drop_of(stat: Stat, kind: Literal["relative", "absolute"], bound: Bound) -> tuple[float | None, str | None]:
    """(drop, None) or (None, why it cannot be measured). Positive drop = the candidate is worse."""
    if bound == "ci":
        edge = stat.ci_low if stat.higher_is_better else stat.ci_high
        if not _num(edge):
            return None, "no confidence interval in the evidence (bound: ci)"
    else:
        edge = stat.delta
        if not _num(edge):
            return None, "no delta in the evidence"
    drop = (-edge if stat.higher_is_better else edge) + 0.0  # type: ignore[operator]  # + 0.0: no -0.0
    if kind == "absolute":
        return drop, None
    if not _num(stat.base):
        return None, "no baseline mean for a relative limit"
    if stat.base == 0:  # type: ignore[comparison-overlap]
        return (0.0 if drop <= 0 else math.inf), None
    return drop / abs(stat.base), None  # type: ignore[arg-type]


def drop_check(name: str, stat: Stat | None, kind: Literal["relative", "absolute"], limit: float, bound: Bound,
               required: bool, min_samples: int, why_missing: tuple[str, str | None]) -> Check:
    """One statistical check of a drop against its limit."""
    if stat is None:
        return _missing(name, required, why_missing[0], why_missing[1], limit, bound)
    if stat.n < min_samples:
        return _missing(name, required, f"{stat.n} paired samples, fewer than min_samples={min_samples}", stat.file,
                        limit, bound)
    drop, why = drop_of(stat, kind, bound)
    if drop is None:
        return _missing(name, required, why or "unmeasurable", stat.file, limit, bound)
    ok = drop <= limit
    what = f"{kind} drop" + (" at the CI's worst end" if bound == "ci" else " (point estimate)")
    base = f"baseline {stat.base:.4g}, candidate {stat.cand:.4g}, " if _num(stat.base) and _num(stat.cand) else ""
    return Check(name=name, measured=round(drop, 6) if math.isfinite(drop) else "inf", limit=limit, bound=bound,
                 required=required, passed=ok, evidence_file=stat.file,
                 reason=f"{base}n={stat.n}: {what} {drop:.2%} {'<=' if ok else '>'} limit {limit:.2%}"
                 if kind == "relative" else
                 f"{base}n={stat.n}: {what} {drop:+.4f} {'<=' if ok else '>'} limit {limit:.4f}")


def _primary(policy: GatePolicy, ev: GateEvidence, family: str | None) -> list[Check]:
    p = policy.primary
    assert p is not None
    bound = policy.bound_of(p)
    if family is None:
        why = f"scheme {ev.scheme!r} is in no family of the policy" if ev.scheme else "the candidate's scheme is unknown"
        return [Check(name="primary", measured=ev.scheme, limit=None, bound=bound, required=p.required,
                      passed=False if p.required else None, reason=f"{why}: add it to primary.families in the policy")]
    lim: DropLimit = p.families[family]
    out = []
    for metric in p.metrics:
        found = [(s, m[metric]) for s, m in sorted(ev.metrics.items()) if metric in m]
        if not found:
            out.append(drop_check(f"primary:{metric}", None, lim.kind, lim.value, bound, p.required, policy.min_samples,
                                  _gap(ev, "compare", f"no eval set measured {metric}")))
        for set_name, stat in found:
            out.append(drop_check(f"primary:{set_name}/{metric}", stat, lim.kind, lim.value, bound, p.required,
                                  policy.min_samples, ("", None)))
    return out


def _categories(policy: GatePolicy, ev: GateEvidence, family: str | None) -> list[Check]:
    out = []
    for cat, c in policy.categories.items():
        bound, limit = policy.bound_of(c), c.limit_for(family)
        found = [(s, cats[cat][c.metric]) for s, cats in sorted(ev.categories.items())
                 if c.metric in cats.get(cat, {})]
        if not found:
            out.append(drop_check(f"category:{cat}/{c.metric}", None, c.kind, limit, bound, c.required,
                                  policy.min_samples,
                                  _gap(ev, "compare", f"no eval set has category {cat} scored with {c.metric}")))
        for set_name, stat in found:
            out.append(drop_check(f"category:{set_name}/{cat}/{c.metric}", stat, c.kind, limit, bound, c.required,
                                  policy.min_samples, ("", None)))
    return out


def _recall(policy: GatePolicy, ev: GateEvidence) -> Check:
    r = policy.recall
    assert r is not None
    return drop_check(f"recall:{r.measure}", ev.recall.get(r.measure), r.kind, r.value, policy.bound_of(r), r.required,
                      policy.min_samples, _gap(ev, "recall", "no recall comparison (quantgate recall --baseline)"))


def _judge(policy: GatePolicy, ev: GateEvidence) -> Check:
    j = policy.judge
    assert j is not None
    bound, limit, name = policy.bound_of(j), -j.margin, "judge:non_inferiority"
    e = ev.judge
    if e is None:
        return _missing(name, j.required, *_gap(ev, "judge", "no judge report"), limit=limit, bound=bound)
    if not e.counts_as_evidence:
        return _missing(name, j.required, f"the judge failed calibration ({e.reason or 'unreliable'}): its verdicts "
                        "are not evidence", e.file, limit, bound)
    if e.not_stronger and not j.accept_not_stronger:
        return _missing(name, j.required, f"the judge is not known to be stronger than the judged model "
                        f"({e.not_stronger}); set judge.accept_not_stronger to accept it", e.file, limit, bound)
    value = e.lower_bound if bound == "ci" else e.net
    if not _num(value) or e.n < policy.min_samples:
        why = f"{e.n} judged pairs, fewer than min_samples={policy.min_samples}" if e.n < policy.min_samples \
            else "no net win rate / bound in the report"
        return _missing(name, j.required, why, e.file, limit, bound)
    ok = value > limit  # type: ignore[operator]
    what = "lower confidence bound of (win - loss)" if bound == "ci" else "win - loss (point estimate)"
    return Check(name=name, measured=round(value, 6), limit=limit, bound=bound, required=j.required, passed=ok,  # type: ignore[arg-type]
                 evidence_file=e.file, reason=f"n={e.n}: {what} {value:+.3f} {'>' if ok else '<='} -margin {limit:+.3f}")


def _error_rates(policy: GatePolicy, ev: GateEvidence) -> list[Check]:
    e = policy.error_rate
    assert e is not None
    if not ev.error_rates:
        return [_missing("error_rate", e.required, *_gap(ev, "error_rate", "no eval summary with an error rate"),
                         limit=e.max)]
    out = []
    for r in ev.error_rates:
        name = f"error_rate:{r.name}"
        if not _num(r.rate):
            out.append(_missing(name, e.required, "no error rate in the summary", r.file, e.max))
            continue
        ok = r.rate <= e.max  # type: ignore[operator]
        out.append(Check(name=name, measured=r.rate, limit=e.max, required=e.required, passed=ok, evidence_file=r.file,
                         reason=f"{r.rate:.2%} of {r.n} requests failed {'<=' if ok else '>'} limit {e.max:.2%}"))
    if "error_rate" in ev.gaps:  # some summaries could not be read: that part is missing
        out.append(_missing("error_rate:unreadable", e.required, *_gap(ev, "error_rate", ""), limit=e.max))
    return out


def _parity(policy: GatePolicy, ev: GateEvidence) -> Check:
    req = policy.engine_parity.required  # type: ignore[union-attr]
    p = ev.parity
    if p is None:
        return _missing("engine_parity", req, *_gap(ev, "parity", "no engine parity report for the baseline"), limit="pass")
    ok = p.verdict == "pass"
    return Check(name="engine_parity", measured=p.verdict, limit="pass", required=req, passed=ok, evidence_file=p.file,
                 reason=p.reason or f"verdict {p.verdict}")


def _pay_off(policy: GatePolicy, ev: GateEvidence) -> list[Check]:
    p = policy.pay_off
    assert p is not None
    out = []
    for name, limit, got, slot, at_most in (("pay_off:size_ratio", p.max_size_ratio, ev.size_ratio, "size", True),
                                            ("pay_off:throughput_ratio", p.min_throughput_ratio, ev.throughput_ratio,
                                             "throughput", False)):
        if limit is None:
            continue
        if got is None or not _num(got.value):
            why, file = _gap(ev, slot, f"no {slot} ratio (candidate / baseline)")
            out.append(_missing(name, p.required, why, file or (got.file if got else None), limit))
            continue
        v = got.value
        ok = v <= limit if at_most else v >= limit  # type: ignore[operator]
        rel = ("<=" if ok else ">") if at_most else (">=" if ok else "<")
        out.append(Check(name=name, measured=round(v, 6), limit=limit, required=p.required, passed=ok,  # type: ignore[arg-type]
                         evidence_file=got.file, reason=f"candidate / baseline {v:.3f} {rel} {limit:.3f}"))
    return out


def evaluate(policy: GatePolicy, evidence: GateEvidence, policy_ref: dict[str, str | int] | None = None) -> Decision:
    """Run every check the policy enables; PROMOTE only when none failed and at least one passed."""
    family = policy.primary.family_of(evidence.scheme) if policy.primary else None
    checks: list[Check] = []
    if policy.engine_parity is not None:
        checks.append(_parity(policy, evidence))
    if policy.error_rate is not None:
        checks += _error_rates(policy, evidence)
    if policy.primary is not None:
        checks += _primary(policy, evidence, family)
    checks += _categories(policy, evidence, family)
    if policy.recall is not None:
        checks.append(_recall(policy, evidence))
    if policy.judge is not None:
        checks.append(_judge(policy, evidence))
    if policy.pay_off is not None:
        checks += _pay_off(policy, evidence)
    reasons = [f"{c.name}: {c.reason}" for c in checks if c.passed is False]
    if not any(c.passed for c in checks):
        reasons.append("no check passed: the policy enables no check that had evidence")
    return Decision(decision="REJECT" if reasons else "PROMOTE", candidate=evidence.candidate, scheme=evidence.scheme,
                    family=family, policy={"name": policy.name, "version": policy.version, **(policy_ref or {})},
                    checks=checks, reasons=reasons)
