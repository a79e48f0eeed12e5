"""A candidate whose vLLM server cannot start or dies is that candidate's failure, not the release's.

Fast: the gate rejects a candidate with <run>/<candidate>/error.json (the reason and the log tail), whatever its
other evidence, and the other candidates are gated as before; the summary and the report show it.
Slow (real vLLM): a vLLM server that cannot load its model is a ServingFailure with its log. A real release whose
added candidate's server is SIGKILLed at its first request (as a W4A16 server dies by itself on an AVX2 CPU) is in
tests/test_release_e2e.py: it reuses that module's cached baseline and INT8 candidate instead of a release of its own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _gate_fixtures import make_run

from quantgate.evals.comparefile import Comparison, load_comparison
from quantgate.gate.summaryfile import as_json, write_summary
from quantgate.base.errors import QuantgateError
from quantgate.base.paths import RELEASES
from quantgate.gate.evidence import gate_run
from quantgate.gate.failurefile import CANDIDATE_ERROR
from quantgate.release import steps as rel
from quantgate.spec.resolve import load_spec
from quantgate.release.variants import ServingFailure, WatchedServer, failed_evidence, make_server
from quantgate.serving.server import ServerConfig, VLLMServer

POLICY = RELEASES / "policies" / "default.yaml"
LOG = ["INFO loading model", "ERROR EngineCore failed to start.", "AttributeError: '_C' object has no attribute "
       "'cpu_gemm_wna16'"]
SPEC = "version: 1\nname: t\nmodel: demo\nhardware: x86-cpu\nschemes: [w4a16-gptq, int8-w8a8]\nrecall: null\n"


def failure(run: Path, name: str, phase: str = "start") -> rel.Evidence:
    """A recorded server failure of candidate `name`, through the release's own recorder (failed_evidence)."""
    log = run / name / "server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("\n".join(LOG) + "\n")
    server = VLLMServer(ServerConfig(model=run / "ckpt", name=name, args=["--dtype", "bfloat16"], dtype="bfloat16"),
                        log_path=log)  # never started
    cause = QuantgateError(f"vLLM server for {run / 'ckpt'} exited with code 1 while starting; last log lines:\n"
                           + "\n".join(LOG), where=str(log))
    variant = rel.Variant(name=name, path=run / "ckpt", scheme=name, content_hash="0" * 64, size_bytes=1)
    return failed_evidence(variant, run / name, run / "cache", ServingFailure(phase, cause, server), log=lambda s: None)


def test_a_failed_candidate_is_rejected_with_its_reason_and_the_other_is_still_gated(tmp_path):
    run = make_run(tmp_path)  # w4a16-gptq: complete evidence the default policy promotes
    ev = failure(run, "int8-w8a8")
    err = json.loads((run / "int8-w8a8" / CANDIDATE_ERROR).read_text())
    assert err["phase"] == "start" and err["log_tail"][-1] == LOG[-1] and err["server_log"].endswith("server.log")
    assert ev.failure == err["error"] and ev.failure.startswith("the vLLM server of int8-w8a8 could not start: ")
    assert ev.dtype == "bfloat16"  # the activation dtype its server was started with, its config's value
    decisions, path = gate_run(run, POLICY, ["w4a16-gptq", "int8-w8a8"])
    by = {d.candidate: d for d in decisions}
    assert by["w4a16-gptq"].decision == "PROMOTE" and by["int8-w8a8"].decision == "REJECT"
    serving = by["int8-w8a8"].checks[0]
    assert (serving.name, serving.outcome, serving.measured) == ("serving", "fail", "start")
    assert serving.evidence_file == str(run / "int8-w8a8" / CANDIDATE_ERROR)
    assert "no attribute 'cpu_gemm_wna16'" in serving.reason  # the log line that says why
    assert by["int8-w8a8"].reasons[0] == f"serving: {serving.reason}"
    doc = json.loads(path.read_text())
    assert doc["decision"] == "PROMOTE" and doc["candidates"]["int8-w8a8"]["decision"] == "REJECT"
    assert json.loads((run / "int8-w8a8" / "decision.json").read_text())["decision"] == "REJECT"


def test_a_server_that_died_rejects_even_a_candidate_whose_other_evidence_passes(tmp_path):
    run = make_run(tmp_path)
    failure(run, "w4a16-gptq", phase="measure")
    (decision,), _ = gate_run(run, POLICY, ["w4a16-gptq"])
    assert decision.decision == "REJECT" and decision.checks[0].measured == "measure"
    assert [r.split(":")[0] for r in decision.reasons] == ["serving"]  # its other checks pass: the failure is why
    assert all(c.outcome == "pass" for c in decision.checks[1:] if c.required)


@pytest.mark.parametrize("text, said", [("{not json", "corrupt JSON"),
                                         ('{"candidate": "w4a16-gptq", "phase": "start"}', "field error")])
def test_an_unreadable_error_record_still_rejects_and_says_what_is_wrong_with_it(tmp_path, text, said):
    run = make_run(tmp_path)
    (run / "w4a16-gptq" / CANDIDATE_ERROR).write_text(text)
    (decision,), _ = gate_run(run, POLICY, ["w4a16-gptq"])
    assert decision.decision == "REJECT" and "error record is unreadable" in decision.reasons[0]
    assert said in decision.reasons[0], decision.reasons[0]


def test_summary_and_report_show_the_failed_candidate(tmp_path):
    from quantgate.report.page import write_report

    (tmp_path / "spec.yaml").write_text(SPEC)
    spec = load_spec(tmp_path / "spec.yaml")
    run = make_run(tmp_path)
    (run / "run.json").write_text(json.dumps({"spec": spec.model_dump(mode="json")}))
    failed = failure(run, "int8-w8a8")
    assert rel.compare_variants(failed, failed, run).root == {} and not (run / "compare" / "int8-w8a8.json").exists()
    decisions = rel.gate(spec, run, ["w4a16-gptq", "int8-w8a8"])
    rel.record_decisions(spec, run, decisions)
    evidence = json.loads((run / "w4a16-gptq" / "evidence.json").read_text())
    good = rel.Evidence(variant=rel.Variant(name="w4a16-gptq", path=tmp_path, scheme="w4a16-gptq",
                                            content_hash="1" * 64, size_bytes=400),
                        folder=run / "w4a16-gptq", cache=tmp_path, serve_command=[], dtype=None,
                        evals=evidence["evals"], served=False)
    base = good.model_copy(update={"variant": good.variant.model_copy(update={"name": "baseline", "size_bytes": 1000}),
                                   "folder": run / "baseline"})
    measured = [(good, load_comparison(run / "compare" / "w4a16-gptq.json")), (failed, Comparison({}))]
    typed = rel.finish_run(spec, run, base, measured, decisions, {})
    write_summary(run, typed)
    summary = as_json(typed)
    row = summary["candidates"]["int8-w8a8"]
    assert row["decision"] == "REJECT" and row["failure"] == failed.failure and row["error"].endswith(CANDIDATE_ERROR)
    assert summary["candidates"]["w4a16-gptq"]["decision"] == "PROMOTE" and summary["decision"] == "PROMOTE"
    assert any(n.startswith("int8-w8a8 was not measured: the vLLM server of int8-w8a8 could not start")
               for n in summary["notes"])
    html, md = write_report(run)
    assert "int8-w8a8" in md.read_text() and "could not start" in md.read_text()


def test_the_baseline_failing_is_the_release_failing(tmp_path):
    with pytest.raises(ServingFailure):
        exc = ServingFailure("start", QuantgateError("exited"), VLLMServer(ServerConfig(model=tmp_path),
                                                                             log_path=tmp_path / "l.log"))
        failed_evidence(rel.Variant(name="baseline", path=tmp_path, content_hash="0", size_bytes=1), tmp_path,
                        tmp_path, exc, baseline=True)
    assert not (tmp_path / CANDIDATE_ERROR).exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_server_that_exits_at_start_is_a_serving_failure_with_its_log(tmp_path):
    """A real vLLM process that cannot load its model: the start-up error comes back as ServingFailure("start")."""
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "no-such-architecture"}')
    server = make_server(ServerConfig(model=bad, name="broken", args=["--max-model-len", "256"],
                                      env={"VLLM_CPU_KVCACHE_SPACE": "1"}), tmp_path)
    assert isinstance(server, WatchedServer)
    with pytest.raises(ServingFailure) as err:
        with server:
            pytest.fail("a server without a model answered")
    assert err.value.phase == "start" and err.value.log_path == tmp_path / "server.log"
    assert "exited with code" in err.value.message and "no-such-architecture" in err.value.message
    assert err.value.command[:2] == ["vllm", "serve"] and not server.alive()
