"""Per-sample fidelity -> the gate's fidelity evidence (pure): pooled and per category (the eval set's categories
and the context lengths `context:<length>`), with one-sided bounds at a level (quantgate.fidelity.core.summarize).

An interim look of an adaptive plan holds fewer eval prompts than the last one beside the same haystacks, so its
plain pooled mean is a haystack-heavier mix than the quantity the last look judges. With `growth` (how many times
this look's eval prompts the last look will hold: quantgate.gate.models.Look.growth) every eval prompt is weighted
by it in the pooled figures, so that each look estimates the same pooled quantity; the slices are unchanged."""

from __future__ import annotations

from quantgate.fidelity.core import CONTEXT_PREFIX, FidelityStats, SampleFidelity, summarize
from quantgate.gate.models import FidelityEvidence, Interval


def fidelity_evidence(samples: list[SampleFidelity], level: float, file: str | None,
                      estimator: str = "sampled-logratio", growth: float = 1.0) -> FidelityEvidence:
    """Per-sample fidelity -> the gate's evidence, pooled and per category, with cluster-bootstrap intervals at
    `level`. `estimator` says what the samples' kl_sum is ("topk": a run folder from before sampled continuations);
    `growth` weights the eval prompts in the pooled figures (see the module docstring)."""
    weights = {x.category: growth for x in samples if not x.category.startswith(CONTEXT_PREFIX)} \
        if growth != 1.0 else None
    s = summarize(samples, level=level, pooled_weights=weights)

    def iv(x) -> Interval:
        return Interval(mean=x.mean, low=x.low, high=x.high, level=x.level)

    def ev(x: FidelityStats, cats: dict) -> FidelityEvidence:
        return FidelityEvidence(n_samples=x.n_samples, n_tokens=x.n_tokens, kl=iv(x.kl), top1=iv(x.top1),
                                dnll=iv(x.dnll) if x.dnll is not None else None, kl_topk=x.kl_topk,
                                estimator=estimator, by_category=cats, file=file)

    return ev(s, {c: ev(x, {}) for c, x in s.by_category.items()})
