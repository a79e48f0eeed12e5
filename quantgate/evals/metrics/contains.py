"""Answer contained: 1 when a reference appears, as whole normalized tokens, inside the prediction.

Small chat models answer "The capital of Italy is Rome." to "answer with the city name only": exact match calls
that wrong, this metric does not, and it still fails a wrong or misspelt name.
"""

from quantgate.evals.metrics import _base, _text


class Contains(_base.PairwiseMetric):
    summary = "Reference contained in the prediction as whole normalized tokens (substring for CJK)."

    def pair(self, pred, ref, **kwargs):
        return _text.contains(pred, ref)
