"""quantgate.base.stats: the tests, power and multiplicity arithmetic behind the gate's stated error rates (pure)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from quantgate.base import stats


def test_binomial_tail_and_one_sided_mcnemar():
    assert stats.binom_tail(0, 5) == 1.0 and stats.binom_tail(6, 5) == 0.0
    assert stats.binom_tail(5, 5) == pytest.approx(1 / 32)
    assert stats.harm_p_binary(8, 0) == pytest.approx(0.5**8)      # 8 lost, none gained
    assert stats.harm_p_binary(0, 8) == 1.0                         # only gains: no evidence of harm
    assert stats.harm_p_binary(0, 0) == 1.0


def test_paired_harm_p_is_small_for_a_real_drop_and_large_for_noise():
    rng = np.random.default_rng(1)
    noise = rng.normal(0, 0.1, 200)
    assert stats.harm_p_paired(noise + 0.05) < 0.001
    assert stats.harm_p_paired(noise - 0.05) > 0.99
    assert stats.harm_p_paired([0.0] * 50) == 1.0
    small = [0.2, 0.1, 0.3, 0.25, 0.15, 0.2, 0.1, 0.3]              # permutation path: all positive
    assert stats.harm_p_paired(small) < 0.01
    assert stats.harm_p_paired(small, seed=3) == pytest.approx(stats.harm_p_paired(small, seed=3))


def test_minimum_detectable_drop_matches_the_normal_formula():
    k = stats.z(0.95) + stats.z(0.8)
    assert stats.mdd(0.3, 300, 0.05) == pytest.approx(k * 0.3 / math.sqrt(300))
    assert stats.mdd(0.3, 0, 0.05) == math.inf
    assert stats.mdd(0.3, 1200, 0.05) == pytest.approx(stats.mdd(0.3, 300, 0.05) / 2)  # 4x samples, half the drop


def test_binary_mdd_never_drops_below_the_minimal_discordance_bound():
    k = stats.z(0.95) + stats.z(0.8)
    assert stats.mdd_binary(0.0, 250, 0.05) == pytest.approx(k * k / 250)
    assert stats.mdd_binary(0.10, 250, 0.05) == pytest.approx(k * math.sqrt(0.10 / 250))


def test_samples_for_inverts_mdd():
    n = stats.samples_for(0.02, 0.3, 0.05)
    assert stats.mdd(0.3, n, 0.05) <= 0.02 < stats.mdd(0.3, n - 1, 0.05)
    nb = stats.samples_for(0.02, 0.0, 0.05, binary=True, discordance=0.06)
    assert stats.mdd_binary(0.06, nb, 0.05) <= 0.02 + 1e-12


@pytest.mark.parametrize(("ps", "rejected"), [
    ({"a": 0.01, "b": 0.04, "c": 0.5}, {"a": True, "b": False, "c": False}),   # 0.01 <= 0.05/3; 0.04 > 0.05/2
    ({"a": 0.01, "b": 0.02, "c": 0.03}, {"a": True, "b": True, "c": True}),    # 0.02 <= 0.025; 0.03 <= 0.05
    ({"a": 0.2}, {"a": False}),
    ({}, {}),
])
def test_holm(ps, rejected):
    assert stats.holm(ps, 0.05) == rejected
