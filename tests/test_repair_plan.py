"""Choosing the layers to keep at 16 bits (quantgate.quantize.repair): slices as ratios of sums, per-layer gains, the
smallest repair within the limits, and the rank correlation the bench uses."""

from __future__ import annotations

import numpy as np
import pytest

from quantgate.quantize.repair import POOLED, layer_gains, order_by, predict, slice_kl, smallest_repair, spearman

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
