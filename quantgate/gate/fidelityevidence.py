"""Per-sample fidelity -> the gate's fidelity evidence (pure): pooled and per category (the eval set's categories
and the context lengths `context:<length>`), with one-sided bounds at a level (quantgate.fidelity.core.summarize)."""

from __future__ import annotations

from quantgate.fidelity.core import FidelityStats, SampleFidelity, summarize
from quantgate.gate.models import FidelityEvidence, Interval


def fidelity_evidence(samples: list[SampleFidelity], level: float, file: str | None,
                      estimator: str = "sampled-logratio") -> FidelityEvidence:
    """Per-sample fidelity -> the gate's evidence, pooled and per category, with cluster-bootstrap intervals at
    `level`. `estimator` says what the samples' kl_sum is ("topk": a run folder from before sampled continuations)."""
    s = summarize(samples, level=level)

    def iv(x) -> Interval:
        return Interval(mean=x.mean, low=x.low, high=x.high, level=x.level)

    def ev(x: FidelityStats, cats: dict) -> FidelityEvidence:
        return FidelityEvidence(n_samples=x.n_samples, n_tokens=x.n_tokens, kl=iv(x.kl), top1=iv(x.top1),
                                dnll=iv(x.dnll) if x.dnll is not None else None, kl_topk=x.kl_topk,
                                estimator=estimator, by_category=cats, file=file)

    return ev(s, {c: ev(x, {}) for c, x in s.by_category.items()})
