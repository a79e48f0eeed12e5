"""The judge run's manifest.json and the human review's review_key.json and human.json, written and read through
their models (quantgate.judge.manifestfile, quantgate.judge.reviewfile): the same keys in the same order as the
dicts they replace, a newer writer's keys kept, and a bad file refused naming it."""

from __future__ import annotations

import json
import math

import pytest

from quantgate.base.errors import QuantgateError
from quantgate.judge.manifestfile import (CalibrationUsed, EvalsetRef, JudgedRun, JudgeManifest, JudgeRef, JudgeRunKey,
                                          read_judge_manifest)
from quantgate.judge.review import human_summary, load_key
from quantgate.judge.reviewfile import HumanReview, ReviewItem, ReviewKey
from quantgate.judge.run import _claim

KEY = JudgeRunKey(judge_sha256="j", judge_model="m", evalset_sha256="e", baseline="kb", candidate=None, seed=0)


def _manifest() -> JudgeManifest:
    return JudgeManifest(schema=1, status="running", key=KEY, endpoint="http://x/v1",
                         judge=JudgeRef(path="judges/pairwise.md", name="pairwise", version=1, kind="pairwise",
                                        sha256="j"),
                         evalset=EvalsetRef(path="eval_sets/default.jsonl", name="default", version=2),
                         baseline=JudgedRun(dir="b", model="base"), candidate=JudgedRun(dir="c", model=None),
                         calibration=CalibrationUsed(seed=0, per_type=2, bar=0.8, types=["number"],
                                                     language_categories=["multilingual"]),
                         margin=0.05, limit=None)


def test_the_manifest_keeps_the_writers_order_and_adds_error_only_when_failed(tmp_path):
    m = _manifest()
    m.write(tmp_path / "manifest.json")
    doc = json.loads((tmp_path / "manifest.json").read_text())
    assert list(doc) == ["schema", "status", "key", "endpoint", "judge", "evalset", "baseline", "candidate",
                         "calibration", "margin", "limit"]
    assert list(doc["key"]) == ["judge_sha256", "judge_model", "evalset_sha256", "baseline", "candidate", "seed"]
    assert doc["candidate"] == {"dir": "c", "model": None} and doc["limit"] is None  # None written where set
    assert list(doc["calibration"]) == ["seed", "per_type", "bar", "types", "language_categories"]
    failed = m.model_copy(update={"status": "failed", "error": "why"}).dump()
    assert list(failed)[-1] == "error" and failed["status"] == "failed"
    assert "error" not in m.model_copy(update={"status": "complete"}).dump()
    assert read_judge_manifest(tmp_path / "manifest.json") == m


def test_a_newer_writers_keys_are_kept(tmp_path):
    doc = _manifest().dump() | {"extra": {"a": 1}}
    doc["key"] |= {"new": 2}
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    m = read_judge_manifest(tmp_path / "manifest.json")
    assert m.dump()["extra"] == {"a": 1} and m.key is not None and m.key.model_dump()["new"] == 2


def test_claim_refuses_another_runs_folder_and_names_a_bad_manifest(tmp_path):
    _manifest().write(tmp_path / "manifest.json")
    assert _claim(tmp_path, KEY) == tmp_path / "manifest.json"  # the same run: resumed
    with pytest.raises(QuantgateError, match=r"differs in: judge_model, seed"):
        _claim(tmp_path, KEY.model_copy(update={"judge_model": "other", "seed": 1}))
    (tmp_path / "manifest.json").write_text('{"key": {"seed": "not a number"}}')
    with pytest.raises(QuantgateError) as err:
        _claim(tmp_path, KEY)
    assert "judge run manifest" in err.value.message and "key.seed" in err.value.render()


def test_the_review_key_is_written_as_json_dumps_wrote_it(tmp_path):
    key = ReviewKey(schema=1, seed=3, items={"R001": ReviewItem(pair_id="näme-1", a="baseline"),
                                             "R002": ReviewItem(pair_id="p2", a="candidate")})
    key = key.model_copy(update={"pairs_sha256": "abc"})
    key.write(tmp_path / "review_key.json")
    old = {"schema": 1, "seed": 3, "items": {"R001": {"pair_id": "näme-1", "a": "baseline"},
                                             "R002": {"pair_id": "p2", "a": "candidate"}}, "pairs_sha256": "abc"}
    assert (tmp_path / "review_key.json").read_text(encoding="utf-8") == json.dumps(old, indent=2) + "\n"
    assert load_key(tmp_path) == key


def test_a_review_key_field_of_the_wrong_type_is_named(tmp_path):
    (tmp_path / "review_key.json").write_text(json.dumps({"seed": "x", "items": {"R001": {"pair_id": "p", "a": "baseline"}}}))
    with pytest.raises(QuantgateError) as err:
        load_key(tmp_path)
    assert "field 'seed'" in err.value.render() and "seed" in err.value.message


def test_human_review_keeps_the_order_and_nan_rates(tmp_path):
    h = human_summary({"p1": "candidate", "p2": "tie"}, {"p1": "second", "p2": None}, n_exported=3, n_blank=1)
    doc = h.dump()
    assert list(doc) == ["n_exported", "n_reviewed", "n_blank", "rates", "agreement"]
    assert list(doc["rates"]) == ["win", "tie", "loss"]
    assert list(doc["rates"]["win"]) == ["count", "rate", "ci_low", "ci_high"]
    assert list(doc["agreement"]) == ["n", "agree", "rate", "ci_low", "ci_high"]
    assert doc["agreement"]["n"] == 1 and doc["agreement"]["agree"] == 1 and doc["rates"]["tie"]["rate"] == 0.5
    empty = human_summary({}, {}, n_exported=0, n_blank=0)
    empty.write(tmp_path / "human.json")
    assert '"rate": NaN' in (tmp_path / "human.json").read_text()
    back = HumanReview.model_validate_json((tmp_path / "human.json").read_text())
    rate = back.rates.win.rate
    assert rate is not None and math.isnan(rate) and back.n_reviewed == 0
