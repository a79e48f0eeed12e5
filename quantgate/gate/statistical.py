"""The gate's statistical checks (pure): task-metric drops with harm tests and minimum detectable drops, and
teacher-forced fidelity against per-family limits and the noise floor.

Task checks (primary metrics, categories, recall, and the pooled binary test) answer two questions:
- non-inferiority: is the drop at the CI's worst end (or the point estimate, `bound: point`) within the limit?
  Then the check passes.
- harm: is the candidate significantly worse at all? One-sided tests, Holm-corrected so that the chance of
  rejecting a lossless candidate through any of them is at most `statistics.false_reject`. The pooled test gets
  `pooled_share` of that budget, the other checks share the rest. A significant drop fails the check: REJECT.
Neither: when the minimum detectable drop (MDD) at this n is above the limit, the check cannot prove the limit and
serves as a harm detector; it passes when fidelity has proved the candidate close to the baseline, and is
inconclusive otherwise. When the MDD is within the limit, a CI across the limit is inconclusive and names the
samples needed.

Fidelity checks judge a one-sided bound at level `fidelity.alpha`: within the limit passes, beyond it (the whole
interval) fails, across it is inconclusive. A noise floor above `max_floor_share` of the KL limit is inconclusive:
the gate cannot tell quantization from engine noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, TypeGuard

from quantgate.base.stats import holm, holm_level, mdd, mdd_binary, samples_for
from quantgate.fidelity.record import POOLED
from quantgate.base.pairedstat import PairedStat
from quantgate.gate.models import Bound, Check, FidelityEvidence, GateEvidence, Power
from quantgate.gate.policy import GatePolicy

Kind = Literal["relative", "absolute"]


def finite(x: float | None) -> TypeGuard[float]:
    return x is not None and not math.isnan(x)


def gap_of(ev: GateEvidence, slot: str, default: str) -> tuple[str, str | None]:
    """Why an evidence slot is empty and which file says so (GateEvidence.gaps), or `default` and no file."""
    g = ev.gaps.get(slot)
    return (g.reason, g.file) if g else (default, None)


def missing(name: str, required: bool, reason: str, file: str | None, limit=None, bound=None) -> Check:
    """A check without usable evidence: inconclusive when required (fail-closed, not harm), else skipped."""
    if required:
        return Check(name=name, measured=None, limit=limit, bound=bound, required=True, outcome="inconclusive",
                     evidence_file=file, reason=f"missing evidence (required): {reason}")
    return Check(name=name, measured=None, limit=limit, bound=bound, required=False, outcome="skipped",
                 evidence_file=file, reason=f"skipped (optional, no usable evidence): {reason}")


def drop_of(stat: PairedStat, kind: Kind, bound: Bound) -> tuple[float | None, str | None]:
    """(drop, None) or (None, why it cannot be measured). Positive drop = the candidate is worse."""
    edge = (stat.ci_low if stat.higher_is_better else stat.ci_high) if bound == "ci" else stat.delta
    if not finite(edge):
        return None, "no confidence interval in the evidence (bound: ci)" if bound == "ci" else "no delta in the evidence"
    drop = (-edge if stat.higher_is_better else edge) + 0.0  # + 0.0: no -0.0
    if kind == "absolute":
        return drop, None
    if not finite(stat.base_mean):
        return None, "no baseline mean for a relative limit"
    if stat.base_mean == 0:
        return (0.0 if drop <= 0 else math.inf), None
    return drop / abs(stat.base_mean), None


@dataclass
class TaskItem:
    """One task check before its outcome is known."""
    name: str
    stat: PairedStat | None
    kind: Kind
    limit: float
    bound: Bound
    required: bool
    pooled: bool = False
    why_missing: tuple[str, str | None] = ("", None)
    recall: bool = False  # a recall check: its own Holm family when the policy gives recall a share
    not_fed: str | None = None  # why no eval set can feed it (a category none of the sets has): skipped, not missing

    def family(self, recall_share: float) -> str:
        """Its Holm family: pooled, recall (only with a recall share; else among the others) or other."""
        return "pooled" if self.pooled else "recall" if self.recall and recall_share > 0 else "other"


def _power(item: TaskItem, alpha: float, power: float) -> Power:
    s = item.stat
    assert s is not None
    if s.binary and finite(s.discordance):
        m = mdd_binary(s.discordance, s.n, alpha, power)
    elif finite(s.sd_diff):
        m = mdd(s.sd_diff, s.n, alpha, power)
    else:
        m = None
    scale = abs(s.base_mean) if item.kind == "relative" and finite(s.base_mean) and s.base_mean else 1.0
    m_units = m / scale if m is not None else None
    below = m_units is not None and m_units > item.limit
    needs = samples_for(item.limit * scale, s.sd_diff or 0.0, alpha, power, binary=s.binary and finite(s.discordance),
                        discordance=s.discordance or 0.0) if item.limit > 0 else None
    return Power(n=s.n, alpha=round(alpha, 6), mdd=None if m_units is None else round(m_units, 6), power=power,
                 discordance=s.discordance, p_harm=s.p_harm, role="harm" if below or m is None else "non-inferiority",
                 limit_below_mdd=below, needs_samples=needs)


def _fmt(kind: Kind, x: float, signed: bool = True) -> str:
    return f"{x:.2%}" if kind == "relative" else f"{x:+.4f}" if signed else f"{x:.4f}"


def _task_check(item: TaskItem, drop: float, harmful: bool, pw: Power, proven: bool) -> Check:
    s = item.stat
    assert s is not None
    base = (f"baseline {s.base_mean:.4g}, candidate {s.cand_mean:.4g}, " if finite(s.base_mean) and finite(s.cand_mean)
            else "")
    what = "drop at the CI's worst end" if item.bound == "ci" else "drop (point estimate)"
    head = f"{base}n={s.n}: {what} {_fmt(item.kind, drop)}"
    mdd_txt = f"detects drops >= {_fmt(item.kind, pw.mdd)} at {pw.power:.0%} power" if pw.mdd is not None else \
        "no spread in the evidence to size its power"
    if drop <= item.limit:
        outcome, why = "pass", f"{head} <= limit {_fmt(item.kind, item.limit, False)}"
    elif harmful:
        outcome, why = "fail", (f"{head} > limit {_fmt(item.kind, item.limit, False)}; harm detected: one-sided "
                                f"p={pw.p_harm:.3g} <= {pw.alpha:.3g} (family-wise false-reject control)")
    elif pw.role == "harm" and proven:
        outcome, why = "pass", (f"{head} > limit {_fmt(item.kind, item.limit, False)}, but no harm detected (p={pw.p_harm:.3g}); "
                                f"at this n the check {mdd_txt}, above its limit, so fidelity carries the proof")
    elif pw.role == "harm":
        outcome, why = "inconclusive", (f"{head} > limit {_fmt(item.kind, item.limit, False)}, no harm detected; the check "
                                        f"{mdd_txt} and no fidelity proof passed: needs about {pw.needs_samples} "
                                        "paired samples")
    else:
        outcome, why = "inconclusive", (f"{head} > limit {_fmt(item.kind, item.limit, False)}, no harm detected: the "
                                        f"interval crosses the limit; needs about {max(pw.needs_samples or 0, s.n + 1)} "
                                        "paired samples")
    return Check(name=item.name, measured=round(drop, 6) if math.isfinite(drop) else "inf", limit=item.limit,
                 bound=item.bound, required=item.required, outcome=outcome, evidence_file=s.file, reason=why, power=pw)


def _budgets(items: list[TaskItem], policy: GatePolicy) -> dict[str, float]:
    """The false-reject budget of each Holm family: the pooled tests, the recall checks (when the policy gives them
    a share; else they are among the others) and the other task checks. The shares of the families present are
    scaled to add up to false_reject, so the budgets add up to it (a union bound over the families)."""
    st = policy.statistics
    shares = {"pooled": st.pooled_share, "recall": st.recall_share,
              "other": max(0.0, 1 - st.pooled_share - st.recall_share)}
    present = {i.family(st.recall_share) for i in items}
    total = sum(shares[g] for g in present)
    if total <= 0:
        return {g: st.false_reject for g in shares}
    return {g: st.false_reject * shares[g] / total if g in present else 0.0 for g in shares}


def task_checks(items: list[TaskItem], policy: GatePolicy, proven: bool) -> list[Check]:
    """Outcomes of every task check, with their harm tests Holm-corrected within their group."""
    budgets = _budgets(items, policy)
    usable = {i.name: i for i in items if i.stat is not None and i.stat.n >= policy.min_samples}
    out: list[Check] = []
    rejected: dict[str, bool] = {}
    levels: dict[str, float] = {}
    family = {n: i.family(policy.statistics.recall_share) for n, i in usable.items()}
    for group, alpha in budgets.items():
        members = {n: i for n, i in usable.items() if family[n] == group}
        ps = {n: (i.stat.p_harm if finite(i.stat.p_harm) else 1.0) for n, i in members.items()}  # type: ignore[union-attr]
        rejected.update(holm(ps, alpha) if alpha > 0 else {n: False for n in ps})
        for rank, n in enumerate(sorted(ps, key=lambda k: ps[k])):
            levels[n] = holm_level(rank, len(ps), alpha) if alpha > 0 else 0.0
    for item in items:
        if item.stat is None and item.not_fed:
            out.append(Check(name=item.name, measured="not applicable", limit=item.limit, bound=item.bound,
                             required=item.required, outcome="skipped", reason=item.not_fed))
            continue
        if item.stat is None:
            out.append(missing(item.name, item.required, *item.why_missing, limit=item.limit, bound=item.bound))
            continue
        if item.name not in usable:
            out.append(missing(item.name, item.required, f"{item.stat.n} paired samples, fewer than min_samples="
                               f"{policy.min_samples}", item.stat.file, item.limit, item.bound))
            continue
        drop, why = drop_of(item.stat, item.kind, item.bound)
        if drop is None:
            out.append(missing(item.name, item.required, why or "unmeasurable", item.stat.file, item.limit, item.bound))
            continue
        pw = _power(item, levels[item.name] or 1e-12, policy.statistics.power)
        out.append(_task_check(item, drop, rejected[item.name], pw, proven))
    return out


def _bounded(name: str, value: FidelityEvidence, which: Literal["kl", "top1"], limit: float, required: bool) -> Check:
    iv = value.kl if which == "kl" else value.top1
    one_sided = (1 + iv.level) / 2
    n = f"{value.n_tokens} tokens in {value.n_samples} samples"
    if value.estimator == "topk" and which == "kl":
        n += " (a top-k estimate from an older run: not an upper bound of the true KL)"
    if which == "kl":
        ok, bad = iv.high <= limit, iv.low > limit
        txt = (f"mean KL {iv.mean:.4g} nats ({one_sided * 100:.4g}% upper bound {iv.high:.4g}) over {n}; limit {limit:.4g}")
    else:
        ok, bad = iv.low >= limit, iv.high < limit
        txt = (f"top-1 agreement {iv.mean:.2%} ({one_sided * 100:.4g}% lower bound {iv.low:.2%}) over {n}; limit {limit:.2%}")
    outcome = "pass" if ok else "fail" if bad else "inconclusive"
    if outcome == "inconclusive":
        gap = abs(limit - iv.mean)  # the bound's margin on the limit's side shrinks like 1 / sqrt(n) (or faster)
        margin = iv.high - iv.mean if which == "kl" else iv.mean - iv.low
        need = max(math.ceil(value.n_samples * (margin / gap) ** 2), value.n_samples + 1) if gap > 0 else None
        txt += f": the interval crosses the limit; needs about {need} samples" if need else ": at the limit"
    elif outcome == "fail":
        txt += ": beyond the limit (the whole interval)"
    return Check(name=name, measured=round(iv.mean, 6), limit=limit, bound="ci", required=required, outcome=outcome,
                 evidence_file=value.file, reason=txt)


def _category_fidelity(policy: GatePolicy, fid: FidelityEvidence, family: str) -> list[Check]:
    """KL and top-1 of every category of the fidelity sample against the category's limits, each on its own
    one-sided bound: PROMOTE needs them all within (intersection-union: no multiplicity penalty). A category with
    too few samples to bound is INCONCLUSIVE and says how many it needs."""
    f = policy.fidelity
    assert f is not None
    out = []
    for cat, value in sorted(fid.by_category.items()):
        lim = f.limit_for(family, cat)
        if value.n_samples < f.min_category_samples:
            out.append(missing(f"fidelity:kl:{cat}", f.required, f"{value.n_samples} fidelity samples in category "
                               f"{cat}, fewer than fidelity.min_category_samples={f.min_category_samples}: needs "
                               f"{f.min_category_samples - value.n_samples} more there (raise fidelity.limit)",
                               fid.file, lim.max_kl, "ci"))
            continue
        out.append(_bounded(f"fidelity:kl:{cat}", value, "kl", lim.max_kl, f.required))
        if lim.min_top1 is not None:
            out.append(_bounded(f"fidelity:top1:{cat}", value, "top1", lim.min_top1, f.required))
    return out


def fidelity_checks(policy: GatePolicy, ev: GateEvidence, family: str | None) -> list[Check]:
    f = policy.fidelity
    assert f is not None
    if family is None or family not in f.families:
        why = f"no fidelity limit for family {family!r}" if family else f"scheme {ev.scheme!r} is in no family"
        return [missing("fidelity", f.required, f"{why}: add it to fidelity.families in the policy", None)]
    lim = f.families[family]
    if ev.fidelity is None:
        g = ev.gaps.get("fidelity")
        return [missing("fidelity", f.required, g.reason if g else "no fidelity comparison", g.file if g else None,
                        lim.max_kl)]
    if ev.floor is None:
        return [missing("fidelity:floor", f.required, "no noise floor measured: the gate cannot tell quantization "
                        "from engine noise", ev.fidelity.file, lim.max_kl)]
    floor_cap = f.max_floor_share * lim.max_kl
    floor = Check(name="fidelity:floor", measured=round(ev.floor.kl.mean, 6), limit=floor_cap, required=f.required,
                  outcome="pass" if ev.floor.kl.mean <= floor_cap else "inconclusive", evidence_file=ev.floor.file,
                  reason=f"noise floor (baseline vs itself on another execution path) KL {ev.floor.kl.mean:.4g}, top-1 "
                         f"{ev.floor.top1.mean:.2%}; at most {f.max_floor_share:.0%} of the KL limit {lim.max_kl:.4g}"
                  + ("" if ev.floor.kl.mean <= floor_cap else ": above it, so the gate cannot judge fidelity"))
    out = [floor, _bounded("fidelity:kl", ev.fidelity, "kl", lim.max_kl, f.required)]
    if lim.min_top1 is not None:
        out.append(_bounded("fidelity:top1", ev.fidelity, "top1", lim.min_top1, f.required))
    if f.per_category:
        out += _category_fidelity(policy, ev.fidelity, family)
    if ev.stream is not None and ev.stream.scope != POOLED:  # one slice's prefix: its pooled figures are the slice's
        why = (f"not judged: decided at slice {ev.stream.scope}'s streaming look ({ev.stream.n} of its "
               f"{ev.stream.total} prompts); the pooled checks read the whole stream")
        out = [c.model_copy(update={"outcome": "skipped", "measured": None, "reason": why})
               if c.name in ("fidelity:kl", "fidelity:top1") else c for c in out]
    if floor.outcome != "pass":
        out = [floor] + [c.model_copy(update={"outcome": "inconclusive", "reason": c.reason + " (not judged: the "
                                              "noise floor is too high)"}) for c in out[1:]]
    return out
