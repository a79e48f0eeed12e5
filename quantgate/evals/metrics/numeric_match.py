"""Numeric match: the last number in the prediction equals the reference's number within tolerance."""

from quantgate.evals.metrics import _base, _text


class NumericMatch(_base.PairwiseMetric):
    summary = "Last number in the reply equals the reference number (rel_tol 1e-6, abs_tol 1e-9 by default)."

    def pair(self, pred, ref, rel_tol=1e-6, abs_tol=1e-9, **kwargs):
        return _text.numeric_match(pred, ref, rel_tol, abs_tol)
