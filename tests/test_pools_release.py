"""A release across two "hosts" on Prefect work pools (quantgate.pools.executor), with real components: the session's
Prefect server, two process workers in two pools (one pinned to core 0, one to core 1, each with its own results
folder and QUANTGATE_HOME), an S3 API on loopback (moto's server, tests/_s3.py) as the results store, and the demo
model's baseline and INT8 W8A8 served by vLLM. Slow; CI runs it.

- each variant runs on its own worker (its server's log, its pinned cores);
- the candidate's host, lost mid-eval (every process of it SIGKILLed), is noticed, its child submitted again, and the
  replacement host asks only for the answers the lost one had not shared;
- everything the gate read is on the store: gated again from it alone, on a third results folder, the same decision;
- the same release again, on new hosts with empty results folders, reuses every stored result: no vLLM starts;
- the parent and the workers leave no process behind.
One release does all of it (a host loss costs a second server start, not a second release): CI's minutes.
bench/pools.py runs the losses by the count and the local executor beside the pools one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from _pools import lose_host, serving, stored_answers, worker
from _s3 import MOTO, aws_env, s3_server
from _shared import LAYER0_ONLY
from quantgate.base.objstore import ResultStore
from quantgate.base.procguard import remove_shm
from quantgate.base.paths import REPO
from quantgate.pools.child import pull_evidence, rel_key
from quantgate.serving.server import kill_tree

pytestmark = pytest.mark.skipif(not MOTO.exists(), reason="no .venv-s3 (scripts/setup.sh s3; `make test` builds it)")

CAND = "int8-w8a8"
SPEC = """\
version: 1
name: pools
model: demo
hardware: x86-cpu
context: 2048
concurrency: 4
schemes: [{cand}]
eval_sets: [{evalset}]
quantization:
  calibration: {{samples: 4, max_seq_length: 32}}
  overrides: {{{cand}: {{ignore: ['{ignore}']}}}}
eval: {{limit: 18, concurrency: 1}}
recall: {{lengths: [512], depths: [0, 100], kinds: [number], samples: 1}}
fidelity: {{draws: 1, limit: 12, context_prompts: 2, context_new_tokens: 32}}
perf: null
executor:
  kind: pools
  store: s3://{bucket}/releases
  pools: {{baseline: host-a, {cand}: host-b}}
  sync_s: 2
  lost_after_s: 20
"""
# eval concurrency 1 (not part of the cache key): the candidate's host is lost well before its 18th answer. Only
# decoder layer 0 is quantized, from 4 x 32 calibration tokens: host-b quantizes for real (on its one core, seconds
# instead of five minutes) and shares the checkpoint; what is tested is where things run and what is shared.


def _release(spec: Path, run_id: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantgate.cli.main", "release", str(spec), "--run-id", run_id],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=900)


def _children(api: str, run_id: str) -> list[dict]:
    """The measure-variant flow runs of one release (each attempt): their variant, pool and state."""
    runs = httpx.post(f"{api}/flow_runs/filter", json={"flow_runs": {"name": {"like_": f"{run_id}-"}}},
                      timeout=30).json()
    return [r for r in runs if r["parameters"].get("run_id") == run_id]


@pytest.fixture(scope="module")
def pools(tmp_path_factory, prefect_api, demo_model):
    root = tmp_path_factory.mktemp("pools")
    with s3_server(root / "moto.log") as s3:
        env = {**os.environ, **s3, "PREFECT_API_URL": prefect_api, "PYTHONUNBUFFERED": "1"}
        made = subprocess.run([sys.executable, "-m", "quantgate.cli.main", "pools", "setup", "host-a", "host-b"],
                              capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
        assert made.returncode == 0, made.stdout + made.stderr
        workers = [worker("host-a", 0, root, env), worker("host-b", 1, root, env)]
        spec = root / "pools.yaml"
        spec.write_text(SPEC.format(cand=CAND, evalset=REPO / "eval_sets" / "default.jsonl", bucket=s3["QG_TEST_BUCKET"],
                                     ignore=LAYER0_ONLY))
        parent = {**env, "QUANTGATE_RESULTS": str(root / "parent" / "results")}
        try:
            yield root, spec, parent, s3, workers
        finally:
            for proc, _ in workers:
                kill_tree(proc.pid)


def _lose_host_b_mid_eval(root: Path, run_id: str, parent: subprocess.Popen, s3: dict[str, str],
                          workers: list) -> tuple[str, list[str], list[psutil.Process]]:
    """Wait until host-b serves the candidate and has shared a few of its answers (of 18), then lose host-b with
    every process on it; returns the store key of the candidate's answers, the lines it held at that moment and the
    processes killed."""
    check = root / f"{run_id}-check" / "results"
    with aws_env(s3):
        store = ResultStore(f"s3://{s3['QG_TEST_BUCKET']}/releases", check)
        deadline = time.monotonic() + 600
        stored: list[str] = []
        while len(stored) < 3:  # a few answers shared, the rest still to come
            assert parent.poll() is None and time.monotonic() < deadline, "the candidate never got going"
            time.sleep(1)
            key, stored = stored_answers(store, check) if serving(workers[1][0]) else ("", [])
        doomed = lose_host(workers[1][0])
        key, stored = stored_answers(store, check)  # what the store held when the host went
    return key, stored, doomed


@pytest.mark.slow
@pytest.mark.timeout(1200)  # minutes alone; a hang must not eat the CI budget
def test_each_variant_runs_on_its_own_worker_a_lost_host_is_replaced_and_the_gate_reads_the_store(pools, prefect_api):
    """One release whose candidate's host is lost mid-eval and replaced, gated again from the store alone, then
    re-run on fresh hosts from the store."""
    root, spec, env, s3, workers = pools
    began = time.time()
    shm_before = set(os.listdir("/dev/shm"))
    t0 = time.monotonic()
    parent = subprocess.Popen([sys.executable, "-m", "quantgate.cli.main", "release", str(spec), "--run-id", "pools1"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    try:
        key, stored, doomed = _lose_host_b_mid_eval(root, "pools1", parent, s3, workers)
        assert 0 < len(stored) < 18, len(stored)
        lost_log = workers[1][1]
        workers[1] = worker("host-b", 1, root / "replacement", env)  # a new machine in the same pool
        out, _ = parent.communicate(timeout=900)
    finally:
        if parent.poll() is None:
            kill_tree(parent.pid)
        # a lost machine's /dev/shm goes with it; this stand-in host's stays behind on the test machine: its vLLM's
        # message queues and semaphores, which no guard of it lived to remove (nobody holds them now)
        remove_shm({f"/dev/shm/{n}" for n in set(os.listdir("/dev/shm")) - shm_before
                    if n.startswith(("psm_", "sem.mp-"))})
    took = time.monotonic() - t0
    logs = {"host-a": workers[0][1].read_text(errors="replace"), "lost host-b": lost_log.read_text(errors="replace"),
            "host-b": workers[1][1].read_text(errors="replace")}
    assert parent.returncode in (0, 3, 4), out[-4000:] + "".join(t[-2000:] for t in logs.values())
    summary = json.loads((root / "parent" / "results" / "runs" / "pools1" / "summary.json").read_text())
    print(f"\npools release: {summary['decision']} in {took:.0f} s, host-b lost with {len(stored)} answers shared; "
          f"{CAND}: {summary['candidates'][CAND]['reasons']}")
    assert summary["candidates"][CAND].get("failure") is None, summary["candidates"][CAND]
    # the lost child was noticed and submitted again; the replacement pulled what the lost one had shared
    assert re.search(rf"{CAND}: .*its host was lost .*submitting it again", out), out[-3000:]
    assert f"{CAND}: pulled what the store has" in logs["host-b"], logs["host-b"][-3000:]
    with aws_env(s3):
        final = ResultStore(f"s3://{s3['QG_TEST_BUCKET']}/releases", root / "final")
        assert final.pull(key.split("/evals/")[0]) is not None
        lines = (root / "final" / key).read_text().splitlines()
    ids = [json.loads(line)["id"] for line in lines]
    assert len(ids) == len(set(ids)) == 18  # every id once: none lost, none asked twice
    assert lines[:len(stored)] == stored  # the shared answers kept as they were, not asked again
    # each variant's child flow run ran on its pool, and its server on that worker's host (its results folder)
    children = sorted((c["parameters"]["variant"], c["work_pool_name"], c["state_type"])
                      for c in _children(prefect_api, "pools1"))
    assert children == [("baseline", "host-a", "COMPLETED"), (CAND, "host-b", "COMPLETED"), (CAND, "host-b", "CRASHED")]
    served = {name: re.findall(r"- (\S+): serving with `vllm serve", text) for name, text in logs.items()}
    assert served == {"host-a": ["baseline"], "lost host-b": [CAND], "host-b": [CAND]}, served
    # each child took its worker's one core as its slot (the server is bound to it and pinned there)
    for name, core in (("host-a", 0), ("host-b", 1)):
        assert re.search(rf"{name}: slot 0 \(cores {core}\)", logs[name]), name
    # everything the gate read is on the store: the run folder and every variant's evidence and cache, pulled into
    # a fresh results folder (a third host), gate the same
    check = root / "check" / "results"
    with aws_env({**s3, "QUANTGATE_RESULTS": str(check)}):
        store = ResultStore(f"s3://{s3['QG_TEST_BUCKET']}/releases", check)
        assert store.pull("runs/pools1") is not None
        for variant in ("baseline", CAND):
            ev = pull_evidence(store, check / "runs" / "pools1", variant)
            assert ev is not None and ev.cache.is_relative_to(check) and store.complete(rel_key(ev.cache)), variant
    (check / "runs" / "pools1" / "decision.json").unlink()
    regate = subprocess.run([sys.executable, "-m", "quantgate.cli.main", "gate", "--policy",
                             str(REPO / "releases" / "policies" / "default.yaml"), "--evidence",
                             str(check / "runs" / "pools1"), "--candidate", CAND], capture_output=True, text=True,
                            env={**env, "QUANTGATE_RESULTS": str(check)}, cwd=REPO, timeout=600)
    decided = json.loads((check / "runs" / "pools1" / "decision.json").read_text())
    assert decided["candidates"][CAND]["decision"] == summary["candidates"][CAND]["decision"], regate.stdout[-2000:] + regate.stderr[-2000:]

    # the same release again, on two new hosts with empty results folders: every result comes from the store (the
    # INT8 checkpoint too), no vLLM starts on either host
    for i, (name, core) in enumerate((("host-a", 0), ("host-b", 1))):
        kill_tree(workers[i][0].pid)
        workers[i] = worker(name, core, root / "fresh", env)
    t0 = time.monotonic()
    second = _release(spec, "pools2", env)
    took2 = time.monotonic() - t0
    assert second.returncode == parent.returncode, second.stdout[-3000:] + second.stderr[-3000:]
    summary2 = json.loads((root / "parent" / "results" / "runs" / "pools2" / "summary.json").read_text())
    print(f"re-run on new hosts: {summary2['decision']} in {took2:.0f} s")
    assert summary2["decision"] == summary["decision"]
    for variant in ("baseline", CAND):
        ev = json.loads((root / "parent" / "results" / "runs" / "pools2" / variant / "evidence.json").read_text())
        assert ev["served"] is False, variant
    logs = {name: log.read_text(errors="replace") for name, (_, log) in zip(("host-a", "host-b"), workers)}
    assert not any("serving with" in text for text in logs.values()), logs
    assert f"{CAND}: its checkpoint" in logs["host-b"] and "quantizing" not in logs["host-b"], logs["host-b"][-3000:]
    # nothing of the releases is left running: no vLLM, no child flow run process (started by this test: the
    # suite's shared servers, started before it under their own guards, still run)
    left = [p.info for p in psutil.process_iter(["pid", "cmdline", "create_time"])
            if (p.info["create_time"] or 0) >= began
            and any("vllm" in a or "measure_variant" in a for a in (p.info["cmdline"] or []))]
    assert not left, left
    assert not [p for p in doomed if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]  # the lost host's too
