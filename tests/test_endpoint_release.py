"""A release whose baseline is an existing endpoint and whose candidate an existing checkpoint folder reaches a
decision (issue 18, "variants from elsewhere"). Slow: real vLLM, real Prefect, real llmcompressor (the session's
layer-0 INT8 checkpoint).

The endpoint is the session's `demo_server` (tests/conftest.py): a real vLLM server that this test process runs and
the release only reaches by URL, with its key in an environment variable, as it would a production server. The
candidate is an INT8 W8A8 checkpoint of the demo model given as `checkpoint:`, so the release serves it without
quantizing it: the session's `layer0_int8` (tests/conftest.py), only layer 0 at 8 bits (seconds of llmcompressor; the
format is what is tested)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quantgate.base import http
from quantgate.base.paths import REPO, RELEASES

KEY_VAR = "QG_TEST_ENDPOINT_BASELINE_KEY"
SPEC = """\
version: 1
name: endpoint-e2e
model: demo
hardware: x86-cpu
context: 1024
concurrency: 2
schemes: []
candidates:
  - {{name: ext-int8, checkpoint: {ckpt}}}
baseline: {{endpoint: {url}, model: demo, api_key_env: {key}}}
eval_sets: [{evalset}]
eval: {{limit: 8, concurrency: 4}}
recall: {{lengths: [512], depths: [0, 100], kinds: [number], samples: 1}}
perf: {{concurrency: [1], num_prompts: 4, input_len: 32, output_len: 8, repeats: 1}}
fidelity: {{limit: 4, draws: 1, context_prompts: 4, context_new_tokens: 64}}
policy: {policy}
"""


@pytest.mark.slow
@pytest.mark.timeout(3600)  # a candidate server, an endpoint and Prefect on 2 shared cores: many minutes
def test_an_endpoint_baseline_and_a_checkpoint_candidate_reach_a_decision(demo_server, layer0_int8, prefect_api,
                                                                           tmp_path):
    pid = demo_server.proc.pid
    spec = tmp_path / "endpoint.yaml"
    spec.write_text(SPEC.format(ckpt=layer0_int8, url=demo_server.base_url, key=KEY_VAR,
                                evalset=REPO / "eval_sets" / "default.jsonl",
                                policy=RELEASES / "policies" / "endpoint.yaml"))
    env = {**os.environ, KEY_VAR: demo_server.api_key, "QUANTGATE_RESULTS": str(tmp_path / "results"),
           "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PYTHONUNBUFFERED": "1", "PREFECT_API_URL": prefect_api}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "quantgate.cli.main", "release", str(spec), "--run-id", "ep"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=3400)
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode in (0, 3, 4), out  # a decision (PROMOTE, REJECT, INCONCLUSIVE), not a failed step
    run = tmp_path / "results" / "runs" / "ep"
    decision = json.loads((run / "decision.json").read_text())
    cand = decision["candidates"]["ext-int8"]
    assert cand["scheme"] == "int8-w8a8" and cand["family"] == "int8"  # detected from the folder's config.json
    checks = {c["name"]: c for c in cand["checks"]}
    for name in ("engine_parity", "pay_off:size_ratio"):  # named in the decision as not applicable, and accepted
        assert checks[name]["outcome"] == "skipped" and checks[name]["measured"] == "not applicable", checks[name]
        assert checks[name]["reason"].startswith("not applicable: endpoint:"), checks[name]
    assert [c for c in checks if c.startswith("error_rate:ext-int8")] and checks["fidelity:kl"]["measured"] is not None
    assert proc.returncode == {"PROMOTE": 0, "REJECT": 3, "INCONCLUSIVE": 4}[decision["decision"]]

    # the endpoint: measured where it runs, never started or stopped by quantgate; its process is the same
    base = json.loads((run / "baseline" / "evidence.json").read_text())
    assert base["variant"]["origin"] == "endpoint" and base["serve_command"] == [] and base["parity"] is None
    assert set(base["not_applicable"]) == {"parity", "size"} and Path(base["cache"]).parent == run / "endpoints"
    assert not (run / "baseline" / "server.log").exists() and not (run / "baseline" / "plan.json").exists()
    log = (run / "baseline" / "endpoint.log").read_text().splitlines()
    assert "entry: not started by quantgate" in log[0] and all("exit: not stopped by quantgate" in x for x in log[1:])
    assert demo_server.proc.pid == pid and demo_server.alive()
    assert "demo" in http.served_models(demo_server.base_url, demo_server.api_key)
    perf = json.loads((Path(base["perf"]) / "perf.json").read_text())
    assert perf["status"] == "ok" and perf["checkpoint"] is None  # probed through its URL, no weights here

    # the checkpoint: served by quantgate on a slot like a quantized scheme, never quantized
    ev = json.loads((run / "ext-int8" / "evidence.json").read_text())
    assert ev["variant"]["origin"] == "checkpoint" and ev["variant"]["path"] == str(layer0_int8)
    assert ev["serve_command"][:3] == ["vllm", "serve", str(layer0_int8)] and (run / "ext-int8" / "server.log").is_file()
    assert not (run / "ext-int8" / "quantization.json").exists() and (run / "ext-int8" / "checkpoint.json").is_file()
    steps = {r["step"]: r for r in json.loads((run / "timings.json").read_text())}
    assert steps["serve and measure baseline"]["slot"] is None and steps["serve and measure ext-int8"]["slot"]
    assert not [s for s in steps if s.startswith("quantize")]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["candidates"]["ext-int8"]["size_ratio"] is None and summary["baseline"]["size_bytes"] is None
    assert any("quantgate neither started nor stopped it" in n for n in summary["notes"])
    print(json.dumps({"decision": decision["decision"], "reasons": cand["reasons"][:3],
                      "wall_s": round(time.monotonic() - t0)}, indent=1))


RACE_SPEC = """\
version: 1
name: endpoint-twice
model: demo
hardware: x86-cpu
schemes: []
candidates:
  - {{name: prod, endpoint: {url}, model: demo, api_key_env: {key}, scheme: int8-w8a8}}
baseline: {{endpoint: {url}, model: demo, api_key_env: {key}}}
eval_sets: [{evalset}]
eval: {{limit: 4, concurrency: 4}}
recall: null
perf: null
fidelity: null
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_endpoint_named_twice_in_a_run_is_measured_once(demo_server, demo_model, tmp_path, monkeypatch):
    """The baseline endpoint and a candidate at the same URL and model, measured at once in two threads as the flow
    runs them: one measures the real server, the other waits on the same folder's lock and reads its results
    (no double measurement, no half-written folder read)."""
    from concurrent.futures import ThreadPoolExecutor

    from quantgate.evals.run import is_complete
    from quantgate.release import schedule
    from quantgate.release import steps as rel
    from quantgate.spec.resolve import load_spec
    from quantgate.release.variants import baseline_for, external_variant

    monkeypatch.setenv(KEY_VAR, demo_server.api_key)
    monkeypatch.setenv("QUANTGATE_RESULTS", str(tmp_path / "results"))
    path = tmp_path / "twice.yaml"
    path.write_text(RACE_SPEC.format(url=demo_server.base_url, key=KEY_VAR, evalset=REPO / "eval_sets" / "default.jsonl"))
    spec = load_spec(path)
    run = tmp_path / "run"
    logs: list[str] = []
    variants = [baseline_for(spec, demo_model), external_variant(spec, "prod", demo_model, run)]
    schedule.preload_libraries()  # as the flow does before its job threads import them
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(rel.serve_and_evaluate, rel.MeasureRequest(spec, v, run, parity=v.name == "baseline",
                                                                       tokenizer=demo_model), log=logs.append)
                for v in variants]
        base, prod = (j.result() for j in jobs)
    assert base.cache == prod.cache and base.cache.parent == run / "endpoints"  # one folder for the one endpoint
    assert sorted([base.served, prod.served]) == [False, True], logs  # measured by one, read by the other
    assert base.evals == prod.evals and is_complete(base.evals["default"])
    ids = [json.loads(x)["id"] for x in (base.evals["default"] / "results.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 4  # each sample asked once
    assert any("every result is cached" in line for line in logs), logs
