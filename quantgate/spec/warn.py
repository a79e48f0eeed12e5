"""What a release spec's sample sizes and eval sets leave unproven or unfed, said before any work (`quantgate
check`, `release --check` and the start of a release): the policy's task checks whose limits the sizes cannot prove,
and the checks that the eval sets cannot feed or feed too thinly to judge (quantgate.gate.feeding)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path

from quantgate.evals.dataset import Sample, load_evalset, stratified_subset
from quantgate.evals.metrics import load_table
from quantgate.evals.setsource import set_names
from quantgate.fidelity.core import CONTEXT_PREFIX
from quantgate.gate.feeding import Feed, SetShape, Unfed, own_checks_line, unfed
from quantgate.gate.policy import GatePolicy, load_policy
from quantgate.gate.sizing import sizing
from quantgate.gate.sizing import warnings as size_warnings
from quantgate.spec.schema import ReleaseSpec, in_window, policy_path


def eval_subsets(spec: ReleaseSpec) -> dict[Path, list[Sample]]:
    """Each eval set's samples as the release asks them (`eval.limit`, stratified), read once for the warnings."""
    return {p: stratified_subset(load_evalset(p, with_dataset=False).samples, spec.eval.limit) for p in spec.eval_sets}


def sizing_warnings(spec: ReleaseSpec, subsets: Mapping[Path, list[Sample]] | None = None) -> list[str]:
    """The task checks whose limits this spec's sample sizes cannot prove (they then only detect harm), per family
    of the spec's schemes: said at the start of a release, so that nobody reads a pass as a proven limit.
    `subsets`: eval_subsets(spec), when the caller has them."""
    policy = load_policy(policy_path(spec))
    if policy.primary is None:
        return []
    counts: dict[str, int] = {}
    for samples in (eval_subsets(spec) if subsets is None else subsets).values():
        counts["primary"] = counts.get("primary", 0) + len(samples)
        named = set(policy.categories) if policy.own_categories is None else {s.category for s in samples}
        for cat in named:
            n = sum(1 for s in samples if s.category == cat)
            if n:
                counts[f"category:{cat}"] = counts.get(f"category:{cat}", 0) + n
    if policy.pooled is not None and "primary" in counts:
        counts["pooled"] = counts["primary"]
    families = {f for s in [*spec.schemes, *(c.scheme for c in spec.candidates)] if (f := policy.primary.family_of(s))}
    return [f"{f}: {w}" for f in sorted(families) for w in size_warnings(sizing(policy, f, counts))]


def feed_warnings(spec: ReleaseSpec, subsets: Mapping[Path, list[Sample]] | None = None) -> list[Unfed]:
    """The policy's checks that this spec's eval sets cannot feed, or feed too thinly to judge
    (quantgate.gate.feeding): said at `--check`, `quantgate check` and the start of a release.
    `subsets`: eval_subsets(spec), when the caller has them."""
    policy, feed = _feed(spec, subsets)
    return unfed(policy, feed)


def own_categories(spec: ReleaseSpec, subsets: Mapping[Path, list[Sample]] | None = None) -> str | None:
    """The line that lists the checks of the sets' own categories (policy `own_categories`), or None."""
    return own_checks_line(*_feed(spec, subsets))


def say_before_work(spec: ReleaseSpec, warn: Callable[[str], None], info: Callable[[str], None]) -> None:
    """At the start of a release: the checks its eval sets cannot feed, the limits its sizes cannot prove (`warn`),
    and the own categories checked (`info`); the eval sets read once for all three."""
    subsets = eval_subsets(spec)
    for check in feed_warnings(spec, subsets):
        warn(f"unfed check: {check}")
    for warning in sizing_warnings(spec, subsets):
        warn(f"sample size: {warning}")
    if (own := own_categories(spec, subsets)) is not None:
        info(own)


def _feed(spec: ReleaseSpec, subsets: Mapping[Path, list[Sample]] | None) -> tuple[GatePolicy, Feed]:
    """The policy and what the spec's eval sets and sections offer its checks."""
    policy = load_policy(policy_path(spec))
    shapes: list[SetShape] = []
    everything: list[Sample] = []
    names = dict(zip(spec.eval_sets, set_names(spec.eval_sets)))
    for path, samples in (eval_subsets(spec) if subsets is None else subsets).items():
        scored: dict[str, Counter[str]] = {}
        for s in samples:
            scored.setdefault(s.category, Counter()).update(set(s.metrics))
        shapes.append(SetShape(names[path], scored))
        everything += samples
    fidelity = None
    if spec.fidelity is not None:
        fidelity = Counter(s.category for s in stratified_subset(everything, spec.fidelity.limit))
        if spec.recall is not None and spec.fidelity.context_prompts:  # its haystacks: a slice per recall length
            fidelity.update({f"{CONTEXT_PREFIX}{n}": spec.fidelity.context_prompts for n in spec.recall.lengths})
    binary = {name for name, m in load_table().items() if m.binary}
    measured = {name for name in ("recall", "fidelity", "judge", "perf") if getattr(spec, name) is not None}
    measured |= set(spec.measure)  # the registered kinds' sections (quantgate.spec.kinds)
    r = spec.recall
    needles = {n: len(r.depths) * len(r.kinds) * r.samples for n in r.lengths} if r is not None else None
    repeats = None if spec.perf is None else spec.perf.rounds if in_window(spec) else \
        spec.perf.settings(spec.workload, spec.hardware, spec.concurrency).repeats  # the window: a repeat per round
    return policy, Feed(shapes, binary, fidelity, measured, needles, repeats)
