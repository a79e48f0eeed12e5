"""Sentence BLEU from sacrebleu (exponential smoothing, effective order), scaled to [0, 1].

References containing CJK characters are tokenized per character ('char'), others with sacrebleu's '13a'.
All references of a sample are scored together, as BLEU defines multi-reference scoring.
"""

import sacrebleu

from quantgate.evals.metrics import _base, _text


class Bleu(_base.PairwiseMetric):
    summary = "Sentence-level BLEU (sacrebleu), 0-1."

    def score_one(self, pred, refs, **kwargs):
        tokenize = "char" if any(_text.has_cjk(r) for r in refs) else "13a"
        return sacrebleu.sentence_bleu(pred, list(refs), tokenize=tokenize).score / 100.0
