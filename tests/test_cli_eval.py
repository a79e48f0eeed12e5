"""`quantgate eval` and `quantgate compare` end to end against fake servers (the real-vLLM runs are separate)."""

from __future__ import annotations

import json

import pytest
import typer
from _fake_openai import FakeServer
from typer.testing import CliRunner

from quantgate.base.errors import QuantgateError
from quantgate.base.paths import EVAL_SETS
from quantgate.cli.eval import compare_cmd, eval_cmd
from quantgate.evals.dataset import load_evalset

EVALSET = EVAL_SETS / "default.jsonl"
app = typer.Typer()
app.command("eval")(eval_cmd)
app.command("compare")(compare_cmd)


@pytest.fixture(scope="module")
def answers():
    es = load_evalset(EVALSET, with_dataset=False)
    return {s.prompt: (s.id, s.references[0], s.metrics) for s in es.samples}


def evaluate(server, out, *extra):
    args = ["eval", "--endpoint", server.url, "--model", "fake-model", "--evalset", str(EVALSET), "--out", str(out),
            "--concurrency", "16", "--no-progress", *extra]
    return CliRunner().invoke(app, args)


def test_eval_then_compare(tmp_path, answers):
    damaged = {sid for sid, _, _ in answers.values() if int(sid[-3:]) % 10 == 0}
    with FakeServer() as base:
        base.answer = lambda p: answers[p][1]  # the reference itself: every metric scores 1
        r = evaluate(base, tmp_path / "base")
        assert r.exit_code == 0, r.output
        calls = len(base.requests)
        r = evaluate(base, tmp_path / "base")  # a re-run resumes: nothing left to ask
        assert r.exit_code == 0 and len(base.requests) == calls == 300
        r = evaluate(base, tmp_path / "base", "--model-hash", "sha256:other")
        assert isinstance(r.exception, QuantgateError) and "holds a run of something else" in str(r.exception)
    with FakeServer() as cand:
        cand.answer = lambda p: "I do not know." if answers[p][0] in damaged else answers[p][1]
        assert evaluate(cand, tmp_path / "cand").exit_code == 0

    summary = json.loads((tmp_path / "base" / "summary.json").read_text())
    assert summary["n_answered"] == 300 and summary["error_rate"] == 0.0
    assert all(m["overall"]["mean"] == pytest.approx(1.0) for m in summary["metrics"].values())
    manifest = json.loads((tmp_path / "base" / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["engine_version"] == "fake-1.0"

    r = CliRunner().invoke(app, ["compare", str(tmp_path / "base"), str(tmp_path / "cand"), "--out", str(tmp_path / "c.json")])
    assert r.exit_code == 0, r.output
    assert "McNemar" in r.output and "regressions" in r.output
    report = json.loads((tmp_path / "c.json").read_text())
    assert report["n_paired"] == 300
    assert report["agreement"]["overall"] == pytest.approx(1 - len(damaged) / 300)
    binary = {"exact_match", "numeric_match", "choice_accuracy"}
    expect = {sid for p, (sid, _, metrics) in answers.items() if sid in damaged and binary & set(metrics)}
    assert {g["id"] for g in report["regressions"]} == expect
    g = report["regressions"][0]
    assert g["cand_output"] == "I do not know." and g["base_output"] == g["references"][0]
    em = report["metrics"]["exact_match"]["overall"]
    assert em["delta"] < 0 and em["ci_high"] < 0 and em["gained"] == 0 and em["mcnemar_p"] < 0.05
    assert report["metrics"]["rouge_l"]["by_category"]["summarization"]["delta"] < 0


def test_limit_and_refusals(tmp_path, monkeypatch):
    with FakeServer() as server:
        r = evaluate(server, tmp_path / "a", "--limit", "5")
        assert r.exit_code == 0 and len(server.requests) == 5
        monkeypatch.delenv("QG_TEST_KEY", raising=False)
        r = evaluate(server, tmp_path / "b", "--api-key-env", "QG_TEST_KEY")
        assert "QG_TEST_KEY is not set" in str(r.exception)
        r = CliRunner().invoke(app, ["eval", "--endpoint", server.url, "--model", "other", "--evalset", str(EVALSET),
                                     "--out", str(tmp_path / "c")])
        assert "model 'other' is not served; served: fake-model" in str(r.exception)
        server.max_model_len = 40  # shorter than some prompts + max_tokens
        r = evaluate(server, tmp_path / "d")
        assert "exceeds the served context of 40" in str(r.exception)


def test_failing_server_stops_the_run_and_marks_it_failed(tmp_path):
    with FakeServer() as server:
        server.default_action = "400"
        r = evaluate(server, tmp_path / "x", "--limit", "40")
    assert "requests failed (100.0%)" in str(r.exception)
    assert json.loads((tmp_path / "x" / "manifest.json").read_text())["status"] == "failed"
    r = CliRunner().invoke(app, ["compare", str(tmp_path / "x"), str(tmp_path / "x")])
    assert "not 'complete'" in str(r.exception)


def test_registered_in_the_main_cli():
    from quantgate.cli.main import COMMANDS

    assert (COMMANDS["eval"].target(), COMMANDS["compare"].target()) == (eval_cmd, compare_cmd)
