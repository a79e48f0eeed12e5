"""Paired statistics and the cache key (pure functions)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from quantgate.evals.compare import bootstrap_ci, cache_key, compare_runs, mcnemar_exact, summarize

BINARY = SimpleNamespace(higher_is_better=True, binary=True)
GRADED = SimpleNamespace(higher_is_better=True, binary=False)


@pytest.mark.parametrize("b,c,p", [
    (0, 0, 1.0),
    (5, 0, 2 / 32),  # 2 * P(X <= 0), X ~ Bin(5, 1/2)
    (1, 4, 2 * 6 / 32),  # 2 * (1 + 5) / 2^5
    (4, 1, 2 * 6 / 32),  # symmetric
    (10, 10, 1.0),  # clipped at 1
    (0, 12, 2 / 4096),
])
def test_mcnemar_exact(b, c, p):
    assert mcnemar_exact(b, c) == pytest.approx(p)


def test_bootstrap_ci_is_seeded_and_sensible():
    diffs = [1.0, 0.0, 0.0, 1.0, -1.0, 0.0, 1.0, 0.0] * 10
    a, b = bootstrap_ci(diffs, seed=3), bootstrap_ci(diffs, seed=3)
    assert a == b and bootstrap_ci(diffs, seed=4) != a
    mean = sum(diffs) / len(diffs)
    assert a[0] < mean < a[1]
    narrow = bootstrap_ci(diffs * 10, seed=3)
    assert narrow[1] - narrow[0] < a[1] - a[0]
    assert bootstrap_ci([0.5] * 7) == (0.5, 0.5)
    assert all(math.isnan(x) for x in bootstrap_ci([]))


def rec(id_, cat, out, **scores):
    return {"id": id_, "category": cat, "output": out, "scores": scores}


BASE = [
    rec("q1", "facts", "Paris", em=1.0, rl=1.0),
    rec("q2", "facts", "Rome", em=1.0, rl=0.5),
    rec("q3", "math", "42", em=1.0, rl=0.0),
    rec("q4", "math", "7", em=0.0, rl=0.25),
    rec("q5", "math", "9", em=0.0, rl=0.5),  # not in the candidate
]
CAND = [
    rec("q1", "facts", "Paris", em=1.0, rl=1.0),
    rec("q2", "facts", "Milan", em=0.0, rl=0.0),
    rec("q3", "math", "41", em=0.0, rl=0.0),
    rec("q4", "math", "8", em=1.0, rl=0.75),
    rec("q6", "math", "1", em=1.0, rl=1.0),  # not in the baseline
]


def test_compare_runs_by_hand():
    r = compare_runs(BASE, CAND, {"em": BINARY, "rl": GRADED}, n_boot=500, seed=1,
                     references={"q2": ["Rome"], "q3": ["42"]})
    assert (r["n_paired"], r["only_in_base"], r["only_in_cand"]) == (4, ["q5"], ["q6"])
    assert r["agreement"]["overall"] == 0.25 and r["agreement"]["by_category"] == {"facts": 0.5, "math": 0.0}
    em = r["metrics"]["em"]
    want = {"n": 4, "base_mean": 0.75, "cand_mean": 0.5, "delta": -0.25, "lost": 2, "gained": 1}
    assert {k: em["overall"][k] for k in want} == want
    assert em["overall"]["mcnemar_p"] == pytest.approx(1.0)  # 2 * (1 + 3) / 8 clipped
    assert em["by_category"]["facts"]["delta"] == -0.5 and em["by_category"]["math"]["delta"] == 0.0
    assert em["overall"]["ci_low"] <= -0.25 <= em["overall"]["ci_high"]
    rl = r["metrics"]["rl"]
    assert rl["overall"]["delta"] == pytest.approx((0 - 0.5 + 0 + 0.5) / 4) and "mcnemar_p" not in rl["overall"]
    assert [(g["id"], g["metric"], g["base_output"], g["cand_output"], g["references"]) for g in r["regressions"]] == [
        ("q2", "em", "Rome", "Milan", ["Rome"]), ("q3", "em", "42", "41", ["42"])]


def test_lower_is_better_binary_counts_the_other_way():
    lower = SimpleNamespace(higher_is_better=False, binary=True)
    r = compare_runs([rec("a", "x", "o", err=0.0)], [rec("a", "x", "p", err=1.0)], {"err": lower}, n_boot=100)
    assert r["metrics"]["err"]["overall"]["lost"] == 1 and r["regressions"][0]["id"] == "a"


def test_identical_runs_have_zero_delta_and_full_agreement():
    r = compare_runs(BASE, BASE, {"em": BINARY}, n_boot=200)
    o = r["metrics"]["em"]["overall"]
    assert (o["delta"], o["ci_low"], o["ci_high"], o["mcnemar_p"]) == (0.0, 0.0, 0.0, 1.0)
    assert r["agreement"]["overall"] == 1.0 and r["regressions"] == []


def test_summarize():
    s = summarize(BASE, ["em", "rl"])
    assert s["em"]["overall"] == {"n": 5, "mean": 0.6}
    assert s["rl"]["by_category"]["math"] == {"n": 3, "mean": pytest.approx(0.25)}


def test_cache_key():
    key = cache_key("sha:m", "sha:e", {"temperature": 0.0, "seed": 0}, "0.32.0")
    assert key == cache_key("sha:m", "sha:e", {"seed": 0, "temperature": 0.0}, "0.32.0")  # order-free
    others = [cache_key("sha:m2", "sha:e", {"temperature": 0.0, "seed": 0}, "0.32.0"),
              cache_key("sha:m", "sha:e2", {"temperature": 0.0, "seed": 0}, "0.32.0"),
              cache_key("sha:m", "sha:e", {"temperature": 0.0, "seed": 1}, "0.32.0"),
              cache_key("sha:m", "sha:e", {"temperature": 0.0, "seed": 0}, "0.33.0")]
    assert len({key, *others}) == 5
