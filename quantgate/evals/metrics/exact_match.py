"""Normalized exact match: 1 when prediction and a reference agree after `_text.normalize`."""

from quantgate.evals.metrics import _base, _text


class ExactMatch(_base.PairwiseMetric):
    summary = "Normalized exact match (NFKC, lower case, no punctuation, no English articles)."

    def pair(self, pred, ref, **kwargs):
        return _text.exact_match(pred, ref)
