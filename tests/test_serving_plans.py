"""The serving manager under planner layouts, and when the server dies mid-request (real vLLM, slow)."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import psutil
import pytest

from quantgate.base.errors import QuantgateError
from quantgate.plan.build import build_plan
from quantgate.serving.server import VLLMServer, config_from_plan, port_is_free

ASK = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16, "temperature": 0}


def chat(srv, name: str, **extra) -> httpx.Response:
    return httpx.post(f"{srv.base_url}/chat/completions", json={"model": name, **ASK, **extra}, timeout=300,
                      headers={"Authorization": f"Bearer {srv.api_key}"})


@pytest.mark.slow
def test_pipeline_parallel_plan_is_served_and_answers(demo_model, tmp_path):
    # One replica must span both CPU workers; 9 heads rule out TP=2, so the planner picks PP=2 (docs/design.md, 'Measured facts': compiled FP32).
    plan = build_plan(demo_model, "x86-cpu", context=2048, concurrency=4, replicas=1)
    assert (plan.layout.tp, plan.layout.pp) == (1, 2)
    cfg = config_from_plan(plan, demo_model, "demo-pp")
    assert "--enforce-eager" not in cfg.args and cfg.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    with VLLMServer(cfg, log_path=tmp_path / "pp.log") as srv:
        resp = chat(srv, "demo-pp")
        assert resp.status_code == 200, resp.text
        assert "Paris" in resp.json()["choices"][0]["message"]["content"]
        log = (tmp_path / "pp.log").read_text()
        assert "--pipeline-parallel-size 2" in log.splitlines()[0]


@pytest.mark.slow
def test_killing_the_server_mid_request_is_reported_and_leaves_nothing(demo_model, vllm_server):
    with vllm_server(demo_model, name="demo") as srv:
        tree = [srv.proc.pid] + [c.pid for c in psutil.Process(srv.proc.pid).children(recursive=True)]
        outcome: dict = {}

        def long_request():
            try:
                outcome["response"] = chat(srv, "demo", max_tokens=1500, ignore_eos=True)
            except httpx.HTTPError as exc:
                outcome["error"] = exc

        t = threading.Thread(target=long_request)
        t.start()
        threading.Event().wait(3)  # the request is being decoded now
        os.kill(srv.proc.pid, signal.SIGKILL)  # the API server dies abruptly; its engine process is orphaned
        t.join(timeout=120)
        assert "error" in outcome or outcome["response"].status_code >= 500
        srv.proc.wait(timeout=30)  # SIGKILL is delivered asynchronously: the client may see the reset first
        with pytest.raises(QuantgateError, match=r"died \(exit code -9\); last log lines"):
            srv.raise_if_dead()
        port = srv.port
    assert port_is_free("127.0.0.1", port)
    left = [p for p in tree if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert left == [], f"processes left behind: {left}"
