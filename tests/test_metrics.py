"""Metric modules, loaded by path through Hugging Face `evaluate`, on hand-computed cases."""

from __future__ import annotations

import math

import pytest

from quantgate.evals.metrics import _text, load_table

E = math.exp(-0.25)  # BLEU brevity penalty for a 4-token hypothesis against a 5-token reference

# (metric, prediction, references, expected) -- each expected value worked out by hand in the comment
CASES = [
    ("contains", "The capital of Italy is Rome.", ["Rome"], 1.0),
    ("contains", "Romeo and Juliet", ["Rome"], 0.0),  # whole tokens only
    ("contains", "It is Mexico City, of course", ["Mexico City"], 1.0),
    ("contains", "Mexico is big", ["Mexico City"], 0.0),
    ("contains", "答案是北京。", ["北京"], 1.0),  # CJK: substring
    ("contains", "", ["Rome"], 0.0),
    ("exact_match", "The Paris!", ["paris"], 1.0),  # article, case and punctuation dropped
    ("exact_match", "Paris, France", ["Paris"], 0.0),
    ("exact_match", "ÉTÉ", ["été"], 1.0),  # case folded, accents kept
    ("exact_match", "ete", ["été"], 0.0),
    ("exact_match", "Newton", ["Isaac Newton", "Newton"], 1.0),  # best over references
    ("token_f1", "red blue green", ["blue yellow"], 0.4),  # P=1/3 R=1/2
    ("token_f1", "go go go", ["go"], 0.5),  # multiset overlap 1: P=1/3 R=1
    ("token_f1", "猫是黑的", ["猫是黑色的"], 8 / 9),  # CJK per character: P=1 R=4/5
    ("token_f1", "", ["x"], 0.0),
    ("rouge_l", "the cat was found under the bed", ["the cat was under the bed"], 12 / 13),  # LCS 6: P=6/7 R=1
    ("rouge_l", "w x y z", ["x z q"], 4 / 7),  # LCS 2: P=1/2 R=2/3
    ("rouge_l", "z y x", ["x y z"], 1 / 3),  # LCS 1
    ("numeric_match", "The answer is 1,082.", ["1082"], 1.0),  # thousands separator
    ("numeric_match", "17 + 25 = 42", ["42"], 1.0),  # the last number counts
    ("numeric_match", "42 is 17+25", ["42"], 0.0),
    ("numeric_match", "\u221296", ["-96"], 1.0),  # Unicode minus
    ("numeric_match", "97.6", ["97.60"], 1.0),
    ("numeric_match", "4.75", ["4.7500001"], 1.0),  # within rel_tol 1e-6
    ("numeric_match", "4.75", ["4.76"], 0.0),
    ("numeric_match", "no digits", ["5"], 0.0),
    ("choice_accuracy", "B) dolphin", ["B"], 1.0),
    ("choice_accuracy", "The answer is D.", ["D"], 1.0),
    ("choice_accuracy", "b", ["B"], 1.0),
    ("choice_accuracy", "A dolphin is a mammal, so B.", ["B"], 1.0),  # 'A' here is an article, B ends the reply
    ("choice_accuracy", "dolphin", ["B"], 0.0),
    ("choice_accuracy", "(C)", ["B"], 0.0),
    ("bleu", "the cat sat on the mat", ["the cat sat on the mat"], 1.0),
    ("bleu", "a b c d", ["a b c d e"], E),  # all n-gram precisions 1, brevity penalty exp(1 - 5/4)
    ("bleu", "猫是黑的", ["猫是黑色的"], (1 * 2 / 3 * 1 / 2 * 1 / 2) ** 0.25 * E),  # chars; 4-gram 0/1 smoothed to 1/2
    ("chrf", "Le chat est noir.", ["Le chat est noir."], 1.0),
    ("chrf", "ab", ["abc"], 7 / 11),  # orders 1-2: P=1, R=(2/3+1/2)/2=7/12; F_beta2 = 5PR/(4P+R)
]


@pytest.fixture(scope="module")
def loaded():
    from quantgate.evals.scoring import load_metric

    return {name: load_metric(name) for name in load_table()}


@pytest.mark.parametrize("metric,pred,refs,expected", CASES)
def test_metric_modules_on_hand_computed_cases(loaded, metric, pred, refs, expected):
    out = loaded[metric].compute(predictions=[pred], references=[refs])
    assert out["scores"] == [pytest.approx(expected, abs=1e-9)]
    assert out["score"] == pytest.approx(expected, abs=1e-9)


def test_every_table_metric_has_cases_and_batch_scores_are_per_sample(loaded):
    assert {c[0] for c in CASES} == set(load_table())
    for name, module in loaded.items():
        cases = [c for c in CASES if c[0] == name]
        out = module.compute(predictions=[c[1] for c in cases], references=[c[2] for c in cases])
        assert out["scores"] == pytest.approx([c[3] for c in cases], abs=1e-9)
        assert out["score"] == pytest.approx(sum(c[3] for c in cases) / len(cases), abs=1e-9)


def test_modules_are_loaded_once(loaded):
    from quantgate.evals.scoring import load_metric

    assert load_metric("bleu") is loaded["bleu"]


def test_metrics_and_transformers_tokenizers_work_in_one_process(tmp_path):
    # regression: an earlier import shortcut for `evaluate` broke `from transformers import AutoTokenizer` afterwards,
    # and the release flow scores evals and builds recall prompts in the same process
    import subprocess
    import sys

    code = ("from quantgate.evals.scoring import load_metric; load_metric('exact_match');"
            "from transformers import AutoTokenizer, PreTrainedTokenizerFast; print(AutoTokenizer.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "AutoTokenizer", out.stderr[-2000:]


@pytest.mark.parametrize("text,expected", [
    ("1,234,567 and 3.5", [1234567.0, 3.5]),
    ("3-4", [3.0, 4.0]),  # a hyphen between digits is not a sign
    ("x=-2, y=.5", [-2.0, 0.5]),
    ("v2 and 10", [10.0]),  # digits glued to a word are not numbers
])
def test_number_extraction(text, expected):
    assert _text.numbers(text) == expected


def test_lcs_length():
    assert _text.lcs_length(list("ABCBDAB"), list("BDCABA")) == 4  # the textbook example
    assert _text.lcs_length([], ["a"]) == 0
