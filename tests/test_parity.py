"""Engine parity: per-prompt first divergence, shares, verdict against the policy file."""

from __future__ import annotations

import pytest

from quantgate.base.errors import QuantgateError
from quantgate.base.yamlconfig import load_model
from quantgate.parity.core import POLICY_FILE, ParityPolicy, check_parity, compare_sequences

POLICY = ParityPolicy(agree_prefix_tokens=4, min_agree_share=0.9)
REF = [list(range(i, i + 10)) for i in range(10)]


@pytest.mark.parametrize("served,reference,prefix,div", [
    ([1, 2, 3], [1, 2, 3], 3, None),
    ([1, 2, 9], [1, 2, 3], 2, 2),
    ([7, 2, 3], [1, 2, 3], 0, 0),
    ([1, 2], [1, 2, 3], 2, 2),          # stopped early: diverges where the shorter one ends
    ([], [], 0, None),
])
def test_compare_sequences(served, reference, prefix, div):
    assert compare_sequences(served, reference) == (prefix, div)


def test_identical_engine_passes():
    r = check_parity(REF, REF, POLICY)
    assert r.verdict == "pass" and r.identical_share == 1 and all(p.first_divergence is None for p in r.per_prompt)


def test_late_divergence_agrees_but_is_not_identical():
    served = [s[:] for s in REF]
    served[3][6] = -1
    r = check_parity(served, REF, POLICY)
    assert r.verdict == "pass" and r.identical_share == 0.9 and r.agree_share == 1.0
    assert r.per_prompt[3].first_divergence == 6 and r.per_prompt[3].matching_prefix == 6


@pytest.mark.parametrize("broken,verdict", [(1, "pass"), (2, "fail")])
def test_threshold(broken, verdict):
    served = [s[:] for s in REF]
    for i in range(broken):
        served[i][1] = -1  # diverges at token 1, before agree_prefix_tokens
    r = check_parity(served, REF, POLICY, prompt_ids=[f"p{i}" for i in range(10)])
    assert r.verdict == verdict and r.agree_share == pytest.approx(1 - broken / 10)
    if verdict == "fail":
        assert "engine problem" in r.reason and "prompt p0 diverges at token 1" in r.reason


def test_wrong_engine_fails_everywhere():
    r = check_parity([[0] * 10 for _ in REF], REF, POLICY)
    assert r.verdict == "fail" and r.agree_share == 0.0 and r.identical_share == 0.0
    assert r.per_prompt[0].matching_prefix == 1  # one matching token is far short of agreement


def test_bad_input():
    with pytest.raises(QuantgateError, match="2 served outputs vs 1"):
        check_parity([[1], [2]], [[1]], POLICY)
    with pytest.raises(QuantgateError, match="no prompts"):
        check_parity([], [], POLICY)


def test_policy_file_loads():
    p = load_model(POLICY_FILE, ParityPolicy)
    assert 0 < p.min_agree_share <= 1 and p.agree_prefix_tokens >= 1
