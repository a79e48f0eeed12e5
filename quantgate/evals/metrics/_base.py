"""The shared shape of quantgate's `evaluate` metric modules: one score per (prediction, references) pair.

Each module file beside this one defines one subclass and is loaded by path with `evaluate.load(path)`.
`compute(predictions=[...], references=[[...], ...])` returns {"score": mean, "scores": [per-sample]}, all in
[0, 1], so one call scores a whole run and the paired statistics get per-sample values.
"""

from __future__ import annotations

import datasets
import evaluate

from quantgate.evals.metrics import _text


class PairwiseMetric(evaluate.Metric):
    """Subclasses set `summary` and implement `pair(pred, ref, **kwargs) -> float`; references take the best."""
    summary = ""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=self.summary,
            citation="",
            inputs_description="predictions: list of str; references: list of lists of str (one or more per sample)",
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Sequence(datasets.Value("string"))}
            ),
        )

    def pair(self, pred: str, ref: str, **kwargs) -> float:
        raise NotImplementedError

    def score_one(self, pred: str, refs: list[str], **kwargs) -> float:
        return _text.best(self.pair, pred, refs, **kwargs)

    def _compute(self, predictions, references, **kwargs):
        scores = [float(self.score_one(p or "", list(r), **kwargs)) for p, r in zip(predictions, references)]
        return {"score": sum(scores) / len(scores) if scores else float("nan"), "scores": scores}
