"""Which of a policy's checks a release's eval sets can feed (pure): said before any work, so that a team's own
set never meets "missing evidence (required)" only after an hour of serving.

A check is fed when some eval set has samples it reads, enough of them to judge (`min_samples`; fidelity's
`min_category_samples` per category of the fidelity sample). A required check that is not fed is INCONCLUSIVE on
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
from quantgate.gate.policy import GatePolicy

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
    """One per check the release cannot feed or feeds too thinly to judge, with the field that would feed it."""
    return [*_sections(policy, feed), *_tasks(policy, feed), *_categories(policy, feed), *_measurements(policy, feed)]


def _sections(policy: GatePolicy, feed: Feed) -> list[Unfed]:
    """A required check whose spec section is off."""
    out = []
    for check, section in SECTIONS.items():
        c = getattr(policy, check)
        if feed.measured is not None and c is not None and c.required and section not in feed.measured:
            out.append(_never(True, check, f"the spec measures no {section} (its `{section}` section is off)",
                              f"give the spec a `{section}` section, or set {check}.required false in the policy"))
    return out


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
    return out


def _measurements(policy: GatePolicy, feed: Feed) -> list[Unfed]:
    """The speed probe's repeats, the recall grid's needles per length, fidelity's samples per category."""
    out: list[Unfed] = []
    n_min, pay, r, f = policy.min_samples, policy.pay_off, policy.recall, policy.fidelity
    if pay is not None and pay.workloads and feed.perf_repeats is not None and feed.perf_repeats < 2 and \
            (pay.bound or policy.bound) == "ci":
        out.append(_never(pay.required, "pay_off speed", f"the probe runs {feed.perf_repeats} repeat a side, and a "
                          "speed ratio's interval needs 2 or more", "set perf.repeats to 2 or more (3 is the "
                          "profiles' own), or pay_off.bound: point"))
    if r is not None and feed.needles:
        short = {n: k for n, k in sorted(feed.needles.items()) if k < n_min}
        total = sum(feed.needles.values())
        if total < n_min or (len(feed.needles) > 1 and short):
            what = f"{total} recall needles in all" if total < n_min else \
                ", ".join(f"{k} needles at {n} tokens" for n, k in short.items())
            out.append(_never(r.required, "recall", f"{what}, fewer than min_samples={n_min} (each length is "
                              "judged on its own)", f"ask at least {n_min} needles per length (recall: more `depths`, "
                              "`kinds` or `samples`)"))
    if f is not None and f.per_category and feed.fidelity is not None:
        few = {cat: n for cat, n in sorted(feed.fidelity.items()) if n < f.min_category_samples}
        need = f"fewer than fidelity.min_category_samples={f.min_category_samples} in the policy"
        cats = {cat: n for cat, n in few.items() if not cat.startswith(CONTEXT_PREFIX)}
        if cats:
            out.append(_never(f.required, "fidelity per category", ", ".join(f"{cat} {n}" for cat, n in cats.items())
                              + f" fidelity samples, {need}", f"give those categories {f.min_category_samples} "
                              "samples each: a larger fidelity.limit in the spec, with eval.limit (and the eval "
                              "sets) holding that many"))
        lengths = {cat: n for cat, n in few.items() if cat.startswith(CONTEXT_PREFIX)}
        if lengths:  # a length's slice holds the haystacks sampled at it: fidelity.limit does not reach them
            out.append(_never(f.required, "fidelity per context length", ", ".join(
                f"{cat} {n}" for cat, n in lengths.items()) + f" haystack prompts, {need}",
                f"set fidelity.context_prompts to {f.min_category_samples} or more in the spec"))
    return out


def _never(required: bool, check: str, what: str, fix: str) -> Unfed:
    then = "INCONCLUSIVE on every run: this release cannot PROMOTE" if required else "skipped (optional)"
    return Unfed(f"{check}: {what}, so the check is {then}; fix: {fix}", blocks=required)
