"""The serving manager under planner layouts, and when the server dies mid-request (real vLLM, slow)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path

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


def _threads(proc: psutil.Process) -> list[tuple[str, str, int]]:
    """(name, allowed cores, CPU ticks) of each thread of `proc`, read from /proc."""
    out = []
    for task in Path(f"/proc/{proc.pid}/task").iterdir():
        with contextlib.suppress(OSError):
            allowed = next(ln.split()[1] for ln in (task / "status").read_text().splitlines()
                           if ln.startswith("Cpus_allowed_list:"))
            stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out.append(((task / "comm").read_text().strip(), allowed, int(stat[11]) + int(stat[12])))
    return out


@pytest.mark.slow
def test_a_one_worker_cpu_plan_is_served_in_one_process_its_threads_on_the_slots_core(demo_model, tmp_path):
    """A one-worker CPU plan on the last core (as a release's second slot binds it): the engine process runs the
    model itself, no worker process is spawned, every thread of the engine is allowed that core only (the OpenMP
    binding quantgate set: vLLM binds only a worker process it spawns), and the answer is right."""
    plan = build_plan(demo_model, "x86-cpu", context=2048, concurrency=4, replicas=2)
    assert plan.layout.devices == 1 and all(r.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" for r in plan.replica_plans)
    assert any(d.choice.startswith("one process") for d in plan.decisions)
    core = max(os.sched_getaffinity(0))
    cfg = config_from_plan(plan, demo_model, "demo")
    cfg = cfg.model_copy(update={"env": {**cfg.env, "VLLM_CPU_OMP_THREADS_BIND": str(core)}})
    with VLLMServer(cfg, log_path=tmp_path / "one.log") as srv:
        resp = chat(srv, "demo")
        assert resp.status_code == 200 and "Paris" in resp.json()["choices"][0]["message"]["content"], resp.text
        tree = psutil.Process(srv.proc.pid).children(recursive=True)
        names = [p.name() for p in tree]
        assert not any("Worker" in n for n in names), names
        (engine,) = [p for p in tree if "EngineCor" in p.name()]
        threads = _threads(engine)
        assert sum(t for _, _, t in threads) > 0 and {a for _, a, _ in threads} == {str(core)}, threads
    assert f"OMP_PLACES={{{core}}}" in (tmp_path / "one.log").read_text()


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
