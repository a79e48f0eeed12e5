"""Two children of releases on work pools that land on one host never serve on one core (quantgate.release.
pools_child.host_slot): the host's Prefect global concurrency limit (a real Prefect server, the session's) queues
them, and the per-core lock files pick disjoint cores. Real processes, each pinned as its worker would be."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from quantgate.base.paths import REPO

CHILD = """
import json, os, sys, time
from quantgate.spec.resolve import load_spec
from quantgate.pools.child import host_slot
from quantgate.target.catalogue import ensure_demo_model
spec, out = load_spec(sys.argv[1]), sys.argv[2]
with host_slot(spec, ensure_demo_model(), lambda m: None) as slot:
    start = time.time()
    time.sleep(2)
    with open(out, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "start": start, "end": time.time(), "cores": slot.devices,
                            "bind": slot.env}) + "\\n")
"""

SPEC = """\
version: 1
name: limits
model: demo
hardware: x86-cpu
context: 1024
schemes: [int8-w8a8]
eval_sets: [{evalset}]
recall: null
"""


@pytest.mark.slow
def test_children_on_one_host_take_turns_on_its_cores(tmp_path, prefect_api, demo_model):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.format(evalset=REPO / "eval_sets" / "default.jsonl"))
    out = tmp_path / "slots.jsonl"
    host = f"test-{uuid.uuid4().hex[:8]}"  # a fresh limit, made by the first child with the host's one core
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "QUANTGATE_HOST": host, "PYTHONPATH": str(REPO),
           "QUANTGATE_HOME": str(tmp_path / "home")}
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "models").symlink_to(demo_model.parent)
    procs = [subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", CHILD, str(spec), str(out)], env=env)
             for _ in range(3)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0]
    rows = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["start"])
    assert [r["cores"] for r in rows] == [[0]] * 3 and all(r["bind"] == {"VLLM_CPU_OMP_THREADS_BIND": "0"} for r in rows)
    for before, after in zip(rows, rows[1:]):  # one at a time on core 0
        assert after["start"] >= before["end"] - 0.05, rows
