"""Token F1: overlap of normalized tokens (CJK characters count one each)."""

from quantgate.evals.metrics import _base, _text


class TokenF1(_base.PairwiseMetric):
    summary = "Token-level F1 over normalized tokens."

    def pair(self, pred, ref, **kwargs):
        return _text.token_f1(pred, ref)
