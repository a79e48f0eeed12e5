"""The release's judge step (quantgate.release.judge_step) against a remote judge endpoint (a fake OpenAI-compatible
server: the one mock allowed here, as a remote judge API cannot run in tests): the report lands where the gate
reads it, and a failed judge is recorded so that the gate shows why its evidence is missing."""

from __future__ import annotations

import json

import pytest
from _judge_fakes import FakeJudge, prefer, write_run

from quantgate.base.errors import ConfigError, QuantgateError
from quantgate.base.paths import EVAL_SETS, RELEASES
from quantgate.evals.dataset import load_evalset
from quantgate.gate.checks import evaluate
from quantgate.gate.evidence import collect
from quantgate.gate.policy import load_policy
from quantgate.judge.corrupt import calibration_pairs
from quantgate.judge.run import load_calibration_config
from quantgate.release import steps as rel
from quantgate.release.judge_step import api_key, failure, margin
from quantgate.spec.resolve import load_spec

CANDS = ["w4a16-gptq", "int8-w8a8"]
SPEC = f"""\
version: 1
name: t
model: demo
hardware: x86-cpu
schemes: [{', '.join(CANDS)}]
eval_sets: [{EVAL_SETS / 'default.jsonl'}]
"""


@pytest.fixture(scope="module")
def es():
    return load_evalset(EVAL_SETS / "default.jsonl")


def spec_with(tmp_path, judge: str, extra: str = ""):
    (tmp_path / "spec.yaml").write_text(SPEC + f"judge: {judge}\n" + extra)
    return load_spec(tmp_path / "spec.yaml")


def evidence(tmp_path, es):
    """Baseline and candidate Evidence over eval runs of 6 samples: the baseline answers the references; the first
    candidate spoils 4 answers, the second none. Also the answers a perfect judge must reject."""
    picked = [s for s in es.samples if s.category in ("arithmetic_numbers", "proper_nouns")][:6]
    outputs = {"baseline": {s.id: s.references[0] for s in picked},
               CANDS[0]: {s.id: s.references[0] if k % 3 == 0 else "wrong " + s.references[0] for k, s in enumerate(picked)},
               CANDS[1]: {s.id: s.references[0] for s in picked}}
    cal = calibration_pairs(es.samples, load_calibration_config().model_copy(update={"per_type": 1}))
    bad = {p.second for p in cal} | {o for o in outputs[CANDS[0]].values() if o.startswith("wrong ")}
    run = tmp_path / "run"
    evs = {}
    for name, outs in outputs.items():
        folder = write_run(tmp_path / "cache" / name, es, outs, name)
        variant = rel.Variant(name=name, path=tmp_path, scheme=None if name == "baseline" else name,
                              content_hash=name * 2, size_bytes=1)
        evs[name] = rel.Evidence(variant=variant, folder=run / name, cache=tmp_path / "cache" / name, serve_command=[],
                                 dtype=None, evals={"default": folder}, served=False)
    return run, evs, bad


def test_remote_judge_writes_the_report_the_gate_reads(tmp_path, es):
    run, evs, bad = evidence(tmp_path, es)
    with FakeJudge(prefer(bad)) as srv:
        spec = spec_with(tmp_path, f"{{endpoint: '{srv.url}', model: fake-model, calibration_per_type: 1, limit: 5}}")
        reports = rel.judge(spec, run, evs["baseline"], [evs[c] for c in CANDS], log=lambda m: None)
    assert reports == {c: run / c / "judge" / "report.json" for c in CANDS}
    spoilt = json.loads(reports[CANDS[0]].read_text())
    assert spoilt["calibration"]["reliable"] and spoilt["comparison"]["overall"]["n"] == 5  # `limit` pairs
    assert spoilt["comparison"]["overall"]["loss"]["count"] == 3 and spoilt["judge_not_stronger"] is None
    assert json.loads(reports[CANDS[1]].read_text())["comparison"]["overall"]["loss"]["count"] == 0
    assert spoilt["meta"]["endpoint"] == srv.url and spoilt["meta"]["judge_model"] == "fake-model"
    for c in CANDS:
        ev = collect(run, c)
        assert "judge" not in ev.gaps and ev.judge.counts_as_evidence and ev.judge.n == 5
        assert ev.judge.file == str(run / c / "judge" / "report.json") and failure(run, c) is None
    assert collect(run, CANDS[0]).judge.net == pytest.approx(-3 / 5)


def test_failed_judge_is_recorded_and_the_gate_fails_closed(tmp_path, es):
    run, evs, _ = evidence(tmp_path, es)
    spec = spec_with(tmp_path, "{endpoint: 'http://127.0.0.1:9', model: fake-model}")  # nothing listens there
    with pytest.raises(QuantgateError, match=r"the judge failed for w4a16-gptq, int8-w8a8: cannot reach") as exc:
        rel.judge(spec, run, evs["baseline"], [evs[c] for c in CANDS], log=lambda m: None)
    assert "cannot reach the server" in str(exc.value.__cause__)
    strict = load_policy(RELEASES / "policies" / "strict.yaml")  # requires the judge
    for c in CANDS:
        assert "cannot reach the server" in failure(run, c)
        ev = collect(run, c)
        assert ev.judge is None and "the judge run failed" in ev.gaps["judge"].reason
        check = next(k for k in evaluate(strict, ev).checks if k.name == "judge:non_inferiority")
        assert check.passed is False and "cannot reach the server" in check.reason


def test_judge_error_is_cleared_by_a_good_rerun(tmp_path, es):
    run, evs, bad = evidence(tmp_path, es)
    (run / CANDS[1] / "judge").mkdir(parents=True)
    (run / CANDS[1] / "judge" / "error.json").write_text(json.dumps({"error": "earlier attempt"}))
    with FakeJudge(prefer(bad)) as srv:
        spec = spec_with(tmp_path, f"{{endpoint: '{srv.url}', model: fake-model, calibration_per_type: 1}}")
        rel.judge(spec, run, evs["baseline"], [evs[CANDS[1]]], log=lambda m: None)
    assert failure(run, CANDS[1]) is None and collect(run, CANDS[1]).judge is not None


def test_api_key_from_the_named_variable(tmp_path, monkeypatch):
    spec = spec_with(tmp_path, "{endpoint: 'http://h:1/v1', model: m, api_key_env: QG_TEST_JUDGE_KEY}")
    monkeypatch.delenv("QG_TEST_JUDGE_KEY", raising=False)
    with pytest.raises(ConfigError) as err:
        rel.start_run(spec, tmp_path / "spec.yaml", "r1")  # refused before any work
    assert err.value.where == "release spec field 'judge.api_key_env'" and "QG_TEST_JUDGE_KEY" in err.value.message
    monkeypatch.setenv("QG_TEST_JUDGE_KEY", "s3cret")
    assert api_key(spec.judge) == "s3cret"


@pytest.mark.parametrize("judge_margin, policy, want", [
    (None, "default.yaml", 0.05),    # the policy's judge.margin: the gate's limit
    (None, "strict.yaml", 0.03),
    (0.2, "strict.yaml", 0.2),       # the spec's own wins
])
def test_margin_defaults_to_the_policy(tmp_path, judge_margin, policy, want):
    extra = f"policy: {RELEASES / 'policies' / policy}\n"
    m = "" if judge_margin is None else f", margin: {judge_margin}"
    assert margin(spec_with(tmp_path, f"{{serve: demo{m}}}", extra)) == want


def test_run_json_names_the_serving_vllm_beside_the_pipelines_packages(tmp_path, monkeypatch):
    """vLLM lives in its own environment: run.json's packages name its version too (the report's provenance)."""
    from quantgate.serving.env import serve_python, vllm_version

    monkeypatch.setenv("QUANTGATE_RESULTS", str(tmp_path / "results"))
    spec = spec_with(tmp_path, "{endpoint: 'http://h:1/v1', model: m, api_key_env: QG_TEST_JUDGE_KEY}")
    monkeypatch.setenv("QG_TEST_JUDGE_KEY", "s3cret")
    run = rel.start_run(spec, tmp_path / "spec.yaml", "r-versions")
    packages = json.loads((run / "run.json").read_text())["packages"]
    assert packages["vllm"] == vllm_version(serve_python()) and packages["vllm"] and packages["torch"]
