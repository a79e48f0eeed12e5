"""Choosing the layers to keep at 16 bits (quantgate.quantize.repair): slices as ratios of sums, per-layer gains, the
smallest repair within the limits, and the rank correlation the bench uses."""

from __future__ import annotations

import numpy as np
import pytest

from quantgate.quantize.preflight import matches
from quantgate.quantize.repair import (POOLED, choose, layer_gains, layer_patterns, order_by, order_for, predict,
                                       ranking_prompts, slice_kl, smallest_repair, spearman, within_budget)

CATS = ["a", "a", "b", "b"]
TOKENS = np.array([10.0, 30.0, 20.0, 20.0])


def test_slices_are_ratios_of_sums_not_means_of_ratios():
    got = slice_kl(np.array([1.0, 1.0, 4.0, 0.0]), TOKENS, CATS)
    assert got == pytest.approx({POOLED: 6 / 80, "a": 2 / 40, "b": 4 / 40})


def test_a_layers_gain_is_the_kl_its_restoring_removes_in_each_slice():
    kl = {"all": np.array([1.0, 1.0, 4.0, 0.0]), "keep:0": np.array([0.5, 0.5, 4.0, 0.0]),
          "keep:1": np.array([1.0, 1.0, 1.0, 0.0])}
    g = layer_gains(kl, TOKENS, CATS, 2)
    assert g["a"] == pytest.approx([1 / 40, 0.0]) and g["b"] == pytest.approx([0.0, 3 / 40])
    assert g[POOLED] == pytest.approx([1 / 80, 3 / 80]) and order_by(g[POOLED]) == [1, 0]


def _case():
    before = {POOLED: 0.030, "a": 0.045, "b": 0.015}
    gains = {POOLED: np.array([0.010, 0.002, 0.006]), "a": np.array([0.004, 0.001, 0.030]),
             "b": np.array([0.010, 0.000, 0.001])}
    return before, gains


def test_the_smallest_repair_brings_every_limited_slice_under_the_margin():
    before, gains = _case()
    limits = {POOLED: 0.02, "a": 0.02, "b": 0.02}
    plan = smallest_repair(before, gains, limits, margin=0.8)  # pooled order: 0, 2, 1
    # layer 0 alone leaves slice a at 0.041; with layer 2 every slice is under 0.8 x 0.02
    assert plan is not None and plan.keep == [0, 2]
    assert plan.predicted == pytest.approx({POOLED: 0.014, "a": 0.011, "b": 0.004})
    tight = smallest_repair(before, gains, limits, margin=0.5)  # 0.010: pooled 0.012 with all three, not enough
    assert tight is None


def test_the_order_decides_which_layers_and_too_few_allowed_is_none():
    before, gains = _case()
    limits = {POOLED: 0.02, "a": 0.02, "b": 0.02}
    by_a = smallest_repair(before, gains, limits, order=[2, 0, 1], margin=0.8)
    assert by_a is not None and by_a.keep[:2] == [2, 0]
    assert smallest_repair(before, gains, limits, max_kept=1, margin=0.8) is None
    nothing = smallest_repair(before, gains, {"b": 0.02})  # only b is limited, and it already passes
    assert nothing is not None and nothing.keep == []
    with pytest.raises(ValueError, match="margin"):
        smallest_repair(before, gains, limits, margin=0)


def test_predictions_add_the_gains_and_never_go_below_zero():
    before, gains = _case()
    assert predict(before, gains, [0, 1, 2])["b"] == pytest.approx(0.004)
    assert predict({"x": 0.01}, {"x": np.array([0.02])}, [0]) == {"x": 0.0}
    assert predict(before, gains, [])[POOLED] == before[POOLED]


def test_spearman_is_the_correlation_of_ranks_ties_averaged():
    assert spearman(np.array([1.0, 2, 3, 4]), np.array([10.0, 30, 20, 40])) == pytest.approx(1 - 6 * 2 / (4 * 15))
    assert spearman(np.array([5.0, 4, 3]), np.array([1.0, 2, 3])) == pytest.approx(-1.0)
    ties = spearman(np.array([1.0, 1, 2, 3]), np.array([1.0, 2, 3, 4]))
    assert ties == pytest.approx(np.corrcoef([0.5, 0.5, 2, 3], [0, 1, 2, 3])[0, 1])
    assert np.isnan(spearman(np.ones(5), np.arange(5.0)))


# The release's repair rung measures the top-k sets instead of adding gains (quantgate.release.repair_step).

def test_layers_are_ordered_by_the_share_of_each_failing_limit_they_remove():
    _, gains = _case()
    # a's limit is half b's: layer 2's 0.030 of a (1.5 limits) outranks layer 0's 0.004 + 0.010 of a and b (0.45)
    assert order_for(gains, {"a": 0.02, "b": 0.04}) == [2, 0, 1]
    assert order_for(gains, {"b": 0.02}) == [0, 2, 1]  # only b fails: b's gains alone


def test_the_budget_bounds_the_sizes_tried_by_count_and_bytes():
    order, extra = [2, 0, 1, 3, 4], [10, 10, 30, 10, 10]
    assert within_budget(order, extra, 100, max_kept=8, max_size_ratio=None) == [1, 2, 3, 4]  # 5 layers: 5 not in SIZES
    assert within_budget(order, extra, 100, max_kept=2, max_size_ratio=None) == [1, 2]
    # the first layer kept (2) adds 30 bytes: 1.3x; with 0 as well 1.4x
    assert within_budget(order, extra, 100, max_kept=8, max_size_ratio=1.35) == [1]
    assert within_budget(order, extra, 100, max_kept=8, max_size_ratio=1.2) == []


def test_the_fewest_layers_measured_within_the_margin_are_chosen_else_the_largest_tried():
    order, lim = [4, 1, 0, 2], {POOLED: 0.02, "m": 0.02}
    measured = {1: {POOLED: 0.013, "m": 0.030}, 2: {POOLED: 0.012, "m": 0.0139}, 4: {POOLED: 0.010, "m": 0.011}}
    got = choose(measured, order, lim, [1, 2, 4], margin=0.7)
    assert got is not None and got.keep == [4, 1] and got.passes and got.measured["m"] == 0.0139
    strict = choose(measured, order, lim, [1, 2, 4], margin=0.5)  # 0.011 > 0.010: none passes, the largest is tried
    assert strict is not None and strict.keep == [4, 1, 0, 2] and not strict.passes
    assert choose({}, order, lim, [], margin=0.7) is None
    with pytest.raises(ValueError):
        choose(measured, order, lim, [1], margin=0)


def test_ranking_prompts_are_the_first_sampled_of_each_slice_in_the_stream_order():
    order = ["a3", "b1", "a1", "c1", "a2", "b2", "a4"]  # the stream: seeded, fixed before any value is seen
    category = {p: p[0] for p in order}
    got = ranking_prompts(order, category, set(order), ["a", "b", "d"], 2)
    assert got == {"a": ["a3", "a1"], "b": ["b1", "b2"], "d": []}  # c: not a slice to rank on
    # a stopped sampling that has not reached a1 yet: the next one of a in the stream instead
    assert ranking_prompts(order, category, set(order) - {"a1"}, ["a"], 2) == {"a": ["a3", "a2"]}


def test_kept_layers_become_ignore_prefixes_that_match_that_layer_only():
    names = ["model.layers.1.mlp.up_proj", "model.layers.12.self_attn.q_proj", "lm_head"]
    pats = layer_patterns([1, 12], names)
    assert pats == [r"re:model\.layers\.1\.", r"re:model\.layers\.12\."]
    assert matches("model.layers.1.mlp.up_proj", pats[0]) and not matches("model.layers.12.self_attn.q_proj", pats[0])
    with pytest.raises(ValueError, match=r"\[3\]"):
        layer_patterns([3], names)


def test_the_chosen_set_must_also_leave_room_in_top1_agreement():
    order, lim = [4, 1, 0, 2], {POOLED: 0.02}
    measured = {1: {POOLED: 0.010}, 2: {POOLED: 0.009}, 4: {POOLED: 0.008}}
    agree = {1: {POOLED: 0.94, "m": 0.90}, 2: {POOLED: 0.96, "m": 0.945}, 4: {POOLED: 0.97, "m": 0.96}}
    # min 0.93 in m: at margin 0.7, at most 0.049 disagreement: 0.945 is not enough (0.055), 0.96 is
    got = choose(measured, order, lim, [1, 2, 4], 0.7, agree, {POOLED: 0.93, "m": 0.93})
    assert got is not None and got.keep == [4, 1, 0, 2] and got.passes
    assert choose(measured, order, lim, [1, 2, 4], 0.7).keep == [4]  # KL alone: one layer
