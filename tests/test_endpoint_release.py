"""A release whose baseline is an existing endpoint and whose candidate an existing checkpoint folder reaches a
decision (issue 18, "variants from elsewhere"). Slow: real vLLM, real Prefect, real llmcompressor when no INT8
checkpoint of the demo model was made earlier in the session.

The endpoint is the session's `demo_server` (tests/conftest.py): a real vLLM server that this test process runs and
the release only reaches by URL, with its key in an environment variable, as it would a production server. The
candidate is an INT8 W8A8 checkpoint of the demo model given as `checkpoint:`, so the release serves it without
quantizing it: tests/test_quantize.py's when that ran in this session (tests/_shared.py), else one quantized here with
only layer 0 at 8 bits (a minute or two of llmcompressor instead of many; the format is what is tested)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _shared import CHECKPOINTS

from quantgate.base import http
from quantgate.base.paths import REPO, RELEASES
from quantgate.quantize.calibration import CalibrationSpec
from quantgate.quantize.recipes import RecipeOverrides
from quantgate.quantize.run import QuantizeRequest, quantize

KEY_VAR = "QG_TEST_ENDPOINT_BASELINE_KEY"
LAYER0 = r"re:model\.layers\.([1-9]|[12][0-9])\..*"
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
fidelity: {{limit: 4}}
policy: {policy}
"""


@pytest.fixture(scope="module")
def int8_checkpoint(demo_model, tmp_path_factory) -> Path:
    if "int8-w8a8" in CHECKPOINTS:
        return CHECKPOINTS["int8-w8a8"]
    req = QuantizeRequest(model=demo_model, scheme="int8-w8a8", out=tmp_path_factory.mktemp("ckpt") / "int8",
                          hardware="x86-cpu", overrides=RecipeOverrides(ignore=[LAYER0]),
                          calibration=CalibrationSpec(samples=4, max_seq_length=32))
    return quantize(req).out


@pytest.mark.slow
@pytest.mark.timeout(3600)  # a candidate server, an endpoint and Prefect on 2 shared cores: many minutes
def test_an_endpoint_baseline_and_a_checkpoint_candidate_reach_a_decision(demo_server, int8_checkpoint, tmp_path):
    pid = demo_server.proc.pid
    spec = tmp_path / "endpoint.yaml"
    spec.write_text(SPEC.format(ckpt=int8_checkpoint, url=demo_server.base_url, key=KEY_VAR,
                                evalset=REPO / "eval_sets" / "default.jsonl",
                                policy=RELEASES / "policies" / "endpoint.yaml"))
    env = {**os.environ, KEY_VAR: demo_server.api_key, "QUANTGATE_RESULTS": str(tmp_path / "results"),
           "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PYTHONUNBUFFERED": "1"}
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
    assert ev["variant"]["origin"] == "checkpoint" and ev["variant"]["path"] == str(int8_checkpoint)
    assert ev["serve_command"][:3] == ["vllm", "serve", str(int8_checkpoint)] and (run / "ext-int8" / "server.log").is_file()
    assert not (run / "ext-int8" / "quantization.json").exists() and (run / "ext-int8" / "checkpoint.json").is_file()
    steps = {r["step"]: r for r in json.loads((run / "timings.json").read_text())}
    assert steps["serve and measure baseline"]["slot"] is None and steps["serve and measure ext-int8"]["slot"]
    assert not [s for s in steps if s.startswith("quantize")]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["candidates"]["ext-int8"]["size_ratio"] is None and summary["baseline"]["size_bytes"] is None
    assert any("quantgate neither started nor stopped it" in n for n in summary["notes"])
    print(json.dumps({"decision": decision["decision"], "reasons": cand["reasons"][:3],
                      "wall_s": round(time.monotonic() - t0)}, indent=1))
