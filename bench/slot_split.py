"""One variant on every core, or one variant per core at once? Eval throughput of the demo model under each split.

    .venv/bin/python bench/slot_split.py [--samples 120] [--cores 0,1]

Serves the demo model (FP32 eager, the release's baseline settings) and answers the same eval samples:
  A  one server bound to all the cores ("0-1")
  B  one server bound to one core ("0")
  C  one server per core ("0" and "1"), both answering at the same time
and prints samples per second of each, with the ratios the planner's rule needs (quant_recipes/planner.yaml,
`cpu_slot_split`): A/B is what a second core gives one server; C/A is what two concurrent variants gain over
two variants served one after the other on all cores. Ratios are from this one run, so load from other users of the
machine hits all three alike only roughly: repeat with --rounds.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quantgate.base.paths import EVAL_SETS
from quantgate.evals.run import run_eval
from quantgate.serving.server import ServerConfig, VLLMServer
from quantgate.target.catalogue import ensure_demo_model

ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "4608"]


def config(model: Path, name: str, bind: str) -> ServerConfig:
    return ServerConfig(model=model, name=name, args=ARGS, env={"VLLM_CPU_KVCACHE_SPACE": "1",
                                                                "VLLM_CPU_OMP_THREADS_BIND": bind})


def answer(srv: VLLMServer, name: str, out: Path, samples: int) -> tuple[float, float, float]:
    """(start, end, seconds) of one eval run of `samples` samples at concurrency 8."""
    t0 = time.monotonic()
    run_eval(EVAL_SETS / "default.jsonl", srv.endpoint, out, concurrency=8, limit=samples, progress=False)
    t1 = time.monotonic()
    return t0, t1, t1 - t0


def alone(model: Path, bind: str, tmp: Path, samples: int) -> float:
    with VLLMServer(config(model, "demo", bind), log_path=tmp / f"alone-{bind}.log") as srv:
        return answer(srv, "demo", tmp / f"alone-{bind}-{time.monotonic_ns()}", samples)[2]


def together(model: Path, binds: list[str], tmp: Path, samples: int) -> float:
    """Wall seconds until every server has answered `samples` samples, all started first, then asked at once."""
    servers = [VLLMServer(config(model, f"demo{i}", b), log_path=tmp / f"together-{b}.log") for i, b in enumerate(binds)]
    spans: list[tuple[float, float, float]] = []
    try:
        for s in servers:
            s.start()
        threads = [threading.Thread(target=lambda i=i, s=s: spans.append(
            answer(s, f"demo{i}", tmp / f"together-{i}-{time.monotonic_ns()}", samples))) for i, s in enumerate(servers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for s in servers:
            s.stop()
    if len(spans) != len(servers):
        raise SystemExit("a concurrent eval run failed (see the logs above)")
    return max(e for _, e, _ in spans) - min(s for s, _, _ in spans)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=120)
    ap.add_argument("--cores", default="0,1", help="the cores to split (two)")
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    cores = a.cores.split(",")
    model = ensure_demo_model()
    cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
    print(cpu)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for r in range(a.rounds):
            n = a.samples
            print(f"round {r + 1}: {n} samples each, concurrency 8", flush=True)
            all_cores = alone(model, f"{cores[0]}-{cores[-1]}", tmp, n)
            print(f"  A one server on cores {cores[0]}-{cores[-1]}: {all_cores:7.1f} s  {n / all_cores:5.2f} samples/s", flush=True)
            one_core = alone(model, cores[0], tmp, n)
            print(f"  B one server on core {cores[0]}:     {one_core:7.1f} s  {n / one_core:5.2f} samples/s", flush=True)
            split = together(model, cores, tmp, n)
            print(f"  C one server per core, at once: {split:7.1f} s  {len(cores) * n / split:5.2f} samples/s (all servers)")
            print(f"  A/B (a second core for one server): {one_core / all_cores:.2f}x")
            print(f"  C/A (concurrent vs one after the other on all cores): {2 * all_cores / split:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
