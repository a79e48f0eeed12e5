"""Sentence chrF from sacrebleu (character 6-grams, beta 2), scaled to [0, 1]; suits any script."""

import sacrebleu

from quantgate.evals.metrics import _base


class ChrF(_base.PairwiseMetric):
    summary = "Sentence-level chrF (sacrebleu), 0-1."

    def score_one(self, pred, refs, **kwargs):
        return sacrebleu.sentence_chrf(pred, list(refs)).score / 100.0
