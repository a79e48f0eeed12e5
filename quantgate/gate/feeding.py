"""Which of a policy's checks a release's eval sets can feed (pure): said before any work, so that a team's own
set never meets "missing evidence (required)" only after an hour of serving.

A check is fed when some eval set has samples it reads, enough of them to judge (`min_samples`; fidelity's
`min_category_samples` per category of the fidelity sample, and enough that a candidate at half its limits could be
bounded inside them: quantgate.gate.sizing). A required check that is not fed is INCONCLUSIVE on
every run: the release can never PROMOTE, and `quantgate check` / `release --check` exit CANNOT_PROMOTE, so a CI job
that runs them before spending GPU hours learns it from the exit code. A category check whose category no set has
does not apply to the release (quantgate.gate.checks skips it), which is said too, with the closest category name
the sets do have: a misspelt name in the policy would otherwise go unnoticed. Every fix names the spec or policy
field that changes the outcome.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from quantgate.base.errors import did_you_mean
from quantgate.fidelity.core import CONTEXT_PREFIX
from quantgate.gate import kinds
from quantgate.gate.policy import GatePolicy, own_metric
from quantgate.gate.sizing import slice_samples_needed, too_small_to_bound

# Exit code of `quantgate check` and `quantgate release --check` for good files whose spec cannot PROMOTE as written
# (a required check unfed): beside 0 (good), 2 (bad input) and the release's own 1, 3, 4 and 5.
CANNOT_PROMOTE = 6


@dataclass(frozen=True)
class SetShape:
    """What one eval set offers the checks: per category, how many samples are scored with each metric."""
    name: str
    scored: dict[str, Counter[str]] = field(default_factory=dict)  # category -> metric -> samples

    def count(self, category: str | None = None, metric: str | None = None) -> int:
        """Samples of `category` (any when None) scored with `metric` (with any metric when None)."""
        cats = [self.scored.get(category, Counter())] if category is not None else list(self.scored.values())
        return sum(c[metric] if metric is not None else max(c.values(), default=0) for c in cats)


SECTIONS = {"recall": "recall", "fidelity": "fidelity", "judge": "judge", "pay_off": "perf"}  # check -> spec section


@dataclass(frozen=True)
class Feed:
    """What a release offers the policy's checks. `binary`: the binary metrics' names (the pooled test reads them);
    `fidelity`: category -> samples of the fidelity sample (None: the spec measures no fidelity); `measured`: the
    spec sections that measure something (recall, fidelity, judge, perf; None: not known, not said); `needles`:
    recall length -> needles the grid asks (None: no recall grid); `perf_repeats`: the speed probe's repeats."""
    sets: list[SetShape]
    binary: set[str]
    fidelity: dict[str, int] | None = None
    measured: set[str] | None = None
    needles: dict[int, int] | None = None
    perf_repeats: int | None = None


@dataclass(frozen=True)
class Unfed:
    """One check the release cannot feed, feeds too thinly to judge, or that does not apply to it. `blocks`: the
    check is required, so the release cannot PROMOTE as written."""
    line: str
    blocks: bool = False
    absent: tuple[str, str] | None = None  # a category check whose category no set has: (category, why)

    def __str__(self) -> str:
        return self.line


def unfed(policy: GatePolicy, feed: Feed) -> list[Unfed]:
    """One per check the release cannot feed or feeds too thinly to judge, with the field that would feed it: each
    measurement kind's own, in the order the gate judges the kinds (quantgate.gate.builtin.BUILT_IN; engine parity
    and error rates need nothing a spec can leave out), then the registered kinds'."""
    return [u for _, said in FEEDS for u in said(policy, feed)]


def _section_off(policy: GatePolicy, feed: Feed, check: str) -> list[Unfed]:
    """The check is required and its spec section (SECTIONS) is off."""
    c, section = getattr(policy, check), SECTIONS[check]
    if feed.measured is None or c is None or not c.required or section in feed.measured:
        return []
    return [_never(True, check, f"the spec measures no {section} (its `{section}` section is off)",
                   f"give the spec a `{section}` section, or set {check}.required false in the policy")]


def _evals(policy: GatePolicy, feed: Feed) -> list[Unfed]:
    return _tasks(policy, feed) + _categories(policy, feed)


def _fidelity(policy: GatePolicy, feed: Feed) -> list[Unfed]:
    f, out = policy.fidelity, _section_off(policy, feed, "fidelity")
    if f is not None and f.per_category and feed.fidelity is not None:
        out += _fidelity_slices(f.required, f.alpha, f.min_category_samples, feed.fidelity)
    return out


def _recall(policy: GatePolicy, feed: Feed) -> list[Unfed]:
    """The recall grid's needles per length: each length is judged on its own."""
    r, n_min, out = policy.recall, policy.min_samples, _section_off(policy, feed, "recall")
    if r is not None and feed.needles:
        short = {n: k for n, k in sorted(feed.needles.items()) if k < n_min}
        total = sum(feed.needles.values())
        if total < n_min or (len(feed.needles) > 1 and short):
            what = f"{total} recall needles in all" if total < n_min else \
                ", ".join(f"{k} needles at {n} tokens" for n, k in short.items())
            out.append(_never(r.required, "recall", f"{what}, fewer than min_samples={n_min} (each length is "
                              "judged on its own)", f"ask at least {n_min} needles per length (recall: more `depths`, "
                              "`kinds` or `samples`)"))
    return out


def _judge(policy: GatePolicy, feed: Feed) -> list[Unfed]:
    return _section_off(policy, feed, "judge")


def _pay_off(policy: GatePolicy, feed: Feed) -> list[Unfed]:
    """The speed probe's repeats: a speed ratio's interval needs two a side."""
    pay, out = policy.pay_off, _section_off(policy, feed, "pay_off")
    if pay is not None and pay.workloads and feed.perf_repeats is not None and feed.perf_repeats < 2 and \
            (pay.bound or policy.bound) == "ci":
        out.append(_never(pay.required, "pay_off speed", f"the probe runs {feed.perf_repeats} repeat a side, and a "
                          "speed ratio's interval needs 2 or more", "set perf.repeats to 2 or more (3 is the "
                          "profiles' own), or pay_off.bound: point"))
    return out


def _registered(policy: GatePolicy, feed: Feed) -> list[Unfed]:
    """The registered kinds the policy checks (quantgate.gate.kinds) that the spec does not measure."""
    if feed.measured is None:
        return []
    return [_never(required, name, what, fix) for name, required, what, fix in kinds.unfed(policy.kinds, feed.measured)
            if required]


def _tasks(policy: GatePolicy, feed: Feed) -> list[Unfed]:
    """The primary metrics and the pooled test: scored samples, enough of them."""
    out: list[Unfed] = []
    sets, n_min = feed.sets, policy.min_samples
    if policy.primary is not None:
        fed = {m: sum(s.count(metric=m) for s in sets) for m in policy.primary.metrics}
        if not any(fed.values()):
            out.append(_never(policy.primary.required, "primary", f"no sample of any eval set is scored with "
                              f"{' or '.join(policy.primary.metrics)}", "score samples with one of them (their "
                              "`metrics`), or list the sets' own metrics in the policy's primary.metrics"))
        thin = [f"{m} ({n})" for m, n in fed.items() if 0 < n < n_min]
        if thin:
            out.append(_never(policy.primary.required, "primary", f"{', '.join(thin)} scored samples, fewer than "
                              f"min_samples={n_min}", f"score at least {n_min} samples with each (more samples in the eval "
                              "sets, or a larger eval.limit in the spec; or a smaller min_samples in the policy)"))
    if policy.pooled is not None and not any(s.count(metric=m) for s in sets for m in feed.binary):
        out.append(_never(policy.pooled.required, "pooled", "no sample is scored with a binary metric "
                          f"({', '.join(sorted(feed.binary))})", "score some samples with one, or set "
                          "pooled.required false"))
    return out


def _categories(policy: GatePolicy, feed: Feed) -> list[Unfed]:
    """Each policy category: in no set (does not apply), too few samples scored with its metric, or fed."""
    out: list[Unfed] = []
    sets, n_min = feed.sets, policy.min_samples
    have = sorted({c for s in sets for c in s.scored})
    for cat, c in policy.categories.items():
        if not sets:
            out.append(_never(c.required, f"category:{cat}", "the spec lists no eval set",
                              "list eval sets in the spec's eval_sets"))
        elif not sum(s.count(cat) for s in sets):
            why = f"no eval set has category {cat!r}{did_you_mean(cat, have)} (the sets have: {', '.join(have) or 'none'})"
            out.append(Unfed(f"category:{cat}: does not apply: {why}; the check is skipped", absent=(cat, why)))
        elif (n := sum(s.count(cat, c.metric) for s in sets)) < n_min:
            what = f"no sample of category {cat!r} is scored with {c.metric}" if not n else \
                f"{n} samples of category {cat!r} scored with {c.metric}, fewer than min_samples={n_min}"
            out.append(_never(c.required, f"category:{cat}", what,
                              f"score at least {n_min} of them with {c.metric} (more samples in the eval sets, or a "
                              f"larger eval.limit in the spec), or change the policy's categories.{cat}.metric"))
    own = policy.own_categories
    for s, cat, metric, n in own_checks(policy, feed):
        if n < n_min:
            out.append(_never(own.required if own else False, f"category:{s}/{cat}", f"{n} samples of category "
                              f"{cat!r} scored with {metric}, fewer than min_samples={n_min} (own_categories)",
                              f"score at least {n_min} of them (more samples of {cat!r} in {s}, or a larger "
                              f"eval.limit in the spec), or set own_categories: null in the policy"))
    return out


def own_checks(policy: GatePolicy, feed: Feed) -> list[tuple[str, str, str, int]]:
    """(set, category, metric, samples) of each category a set has that the policy does not name, checked under
    `own_categories` with the metric that scores most of its samples (quantgate.gate.checks reads the same)."""
    if policy.own_categories is None:
        return []
    preferred = policy.primary.metrics if policy.primary else []
    out = []
    for shape in feed.sets:
        for cat, scored in sorted(shape.scored.items()):
            metric = own_metric(scored, preferred)
            if cat not in policy.categories and metric is not None:
                out.append((shape.name, cat, metric, scored[metric]))
    return out


def own_checks_line(policy: GatePolicy, feed: Feed) -> str | None:
    """What `check` lists of the own-category checks: each with its metric and samples, and the limit."""
    own, found = policy.own_categories, own_checks(policy, feed)
    if own is None or not found:
        return None
    limit = f"max {own.kind} drop {own.value:.0%}" + "".join(f", {f} {v:.0%}" for f, v in own.by_family.items())
    return (f"own categories checked (policy own_categories: {limit}; {'required' if own.required else 'optional'}): "
            + ", ".join(f"{s}/{cat} {metric} n={n}" for s, cat, metric, n in found))


# slice kind -> (its name's test, what its samples are, the field that grows it)
_SLICES = {"category": (False, "fidelity samples", "a larger fidelity.limit in the spec (about {n} prompts per "
                        "category), with eval.limit and the eval sets holding that many"),
           "context length": (True, "haystack prompts", "set fidelity.context_prompts to {n} or more in the spec")}


def _fidelity_slices(required: bool, alpha: float, least: int, slices: dict[str, int]) -> list[Unfed]:
    """Per slice kind (category; context length, whose slice holds the haystacks sampled at it, which fidelity.limit
    does not reach): slices with fewer than `least` (min_category_samples) samples, and slices with enough whose
    bound would still not come inside the limit for a candidate at half its limits (quantgate.gate.sizing, at the
    reference spread): such a release can PROMOTE only a candidate far closer than that."""
    out = []
    wide = too_small_to_bound({c: n for c, n in slices.items() if n >= least}, alpha, CONTEXT_PREFIX)
    for kind, (is_length, what, fix) in _SLICES.items():
        mine = {c: n for c, n in sorted(slices.items()) if c.startswith(CONTEXT_PREFIX) == is_length}
        few = {c: n for c, n in mine.items() if n < least}
        loose = {c: wide[c] for c in mine if c in wide}
        if not few and not loose:
            continue
        need = max(least, slice_samples_needed(alpha, haystack=is_length))
        if few:
            out.append(_never(required, f"fidelity per {kind}", ", ".join(f"{c} {n}" for c, n in few.items())
                              + f" {what}, fewer than fidelity.min_category_samples={least} in the policy",
                              fix.format(n=need)))
        if loose:
            then = (f"a candidate at half its limits would have its one-sided {1 - alpha:.0%} bound beyond them "
                    "(INCONCLUSIVE): this release can PROMOTE only a candidate far closer than its limits"
                    if required else "the optional check would be skipped for a candidate at half its limits")
            out.append(Unfed(f"fidelity per {kind}: " + ", ".join(f"{c} {mine[c]} (bound {v[0]:.2f}x the limit)"
                                                                  for c, v in loose.items())
                             + f" {what}, too few to bound: at the spread measured on the demo's candidates, "
                             f"{then}; fix: {fix.format(n=need)}", blocks=required))
    return out


def _never(required: bool, check: str, what: str, fix: str) -> Unfed:
    then = "INCONCLUSIVE on every run: this release cannot PROMOTE" if required else "skipped (optional)"
    return Unfed(f"{check}: {what}, so the check is {then}; fix: {fix}", blocks=required)


# each kind's feeding, by the kind's name, in the gate's order (quantgate.gate.builtin.BUILT_IN), registered kinds last
FEEDS = (("evals", _evals), ("fidelity", _fidelity), ("recall", _recall), ("judge", _judge), ("pay_off", _pay_off),
         ("registered", _registered))
