"""ROUGE-L: F-measure of the longest common token subsequence (implemented in `_text.rouge_l`)."""

from quantgate.evals.metrics import _base, _text


class RougeL(_base.PairwiseMetric):
    summary = "ROUGE-L F-measure on lower-cased word tokens."

    def pair(self, pred, ref, beta=1.0, **kwargs):
        return _text.rouge_l(pred, ref, beta)
