"""Engine parity: per-prompt first divergence, shares, verdict against the policy file."""

from __future__ import annotations

import json

import pytest

from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import write_json
from quantgate.base.yamlconfig import load_model
from quantgate.parity.core import POLICY_FILE, ParityPolicy, check_parity, compare_sequences
from quantgate.parity.engine import ParityRecord, PromptTexts, load_parity, passed

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


def test_parity_json_is_written_and_read_through_its_record(tmp_path):
    """parity.json: the report's keys, then dtype, served_dtype, device, template_mismatch and texts, in that order,
    None kept; read back through ParityRecord; a pass that is no record is not reused."""
    report = check_parity([[1, 2, 3], [1, 9]], [[1, 2, 3], [1, 2]], POLICY, ["a", "b"])
    device = {"device": "cpu", "dtype": "float32", "physical_gpu": None, "reason": "no GPU"}
    texts = {"a": {"served": "Paris.", "reference": "Paris."}, "b": {"served": "x", "reference": "ü"}}
    ParityRecord(**dict(report), dtype="float32", served_dtype="auto", device=device, template_mismatch=["b"],
                 texts={k: PromptTexts(**v) for k, v in texts.items()}).write(tmp_path)
    write_json(tmp_path / "old.json", {**report.model_dump(), "dtype": "float32", "served_dtype": "auto",
                                       "device": device, "template_mismatch": ["b"], "texts": texts})
    assert (tmp_path / "parity.json").read_bytes() == (tmp_path / "old.json").read_bytes()  # the dict it replaced
    record = load_parity(tmp_path)
    assert record.verdict == report.verdict == "fail" and record.texts["b"].reference == "ü"
    assert record.model_dump(exclude_unset=True) == json.loads((tmp_path / "parity.json").read_text())
    assert not passed(tmp_path)
    write_json(tmp_path / "parity.json", {**record.model_dump(), "verdict": "pass", "later": 1})
    assert passed(tmp_path) and load_parity(tmp_path).model_extra == {"later": 1}  # a newer writer's key is kept
    write_json(tmp_path / "parity.json", {"verdict": "pass"})
    assert not passed(tmp_path)
    with pytest.raises(QuantgateError, match="engine parity record: unexpected content in field prompts"):
        load_parity(tmp_path)
