"""Choice accuracy: the letter the reply picks (see `_text.choice_letter`) equals the reference letter."""

from quantgate.evals.metrics import _base, _text


class ChoiceAccuracy(_base.PairwiseMetric):
    summary = "Multiple-choice accuracy on the extracted choice letter."

    def pair(self, pred, ref, letters="ABCDEFGH", **kwargs):
        return _text.choice_accuracy(pred, ref, letters)
