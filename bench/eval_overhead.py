"""Whole-process wall time of `quantgate eval` vs a minimal raw async client, same items, decoding, concurrency.

Needs a running OpenAI-compatible server (vLLM). Prints each timing and the median ratio (target <= 1.10).
Both sides are fresh processes, so start-up counts. Runs alternate (raw, quantgate, quantgate, raw, ...) after one
discarded warm-up pass, so server-side prefix caching favours neither side.

    python bench/eval_overhead.py --endpoint http://127.0.0.1:8000 --model demo [--n 200] [--concurrency 16]

lm-evaluation-harness (`local-chat-completions`) is not installed in the pipeline environment, so that third
comparison from issue 5 is left out here.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The baseline: read the JSONL, send the same chat requests with the same decoding, keep nothing but a count.
RAW_CLIENT = r"""
import asyncio, json, os, sys
import httpx
evalset, endpoint, model, n, conc, default_max = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
rows = [json.loads(l) for l in open(evalset, encoding="utf-8") if l.strip()][:n]
key = os.environ.get("RAW_API_KEY")
async def main():
    sem = asyncio.Semaphore(conc)
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(timeout=120, limits=limits, headers={"Authorization": f"Bearer {key}"} if key else {}) as c:
        async def one(r):
            msgs = r.get("messages") or [{"role": "user", "content": r["prompt"]}]
            body = {"model": model, "messages": msgs, "max_tokens": r.get("max_tokens") or default_max,
                    "temperature": 0.0, "top_p": 1.0, "seed": 0}
            async with sem:
                resp = await c.post(endpoint.rstrip("/").removesuffix("/v1") + "/v1/chat/completions", json=body)
                return resp.status_code == 200
        ok = await asyncio.gather(*(one(r) for r in rows))
    print(sum(ok), "ok of", len(rows))
asyncio.run(main())
"""


CPU: dict[str, list[float]] = {"raw": [], "qg": []}


def timed(cmd: list[str], env: dict[str, str], side: str = "") -> float:
    """Wall seconds of one child process; its CPU seconds (user + system) go to CPU[side]."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    if side:
        CPU[side].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--evalset", type=Path, default=REPO / "eval_sets" / "default.jsonl")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each side")
    ap.add_argument("--api-key-env", default=None)
    args = ap.parse_args()

    import yaml

    meta = yaml.safe_load(args.evalset.with_name(args.evalset.name.removesuffix(".jsonl") + ".meta.yaml").read_text())
    env = dict(os.environ)
    if args.api_key_env:
        env["RAW_API_KEY"] = os.environ[args.api_key_env]
    raw = [sys.executable, "-c", RAW_CLIENT, str(args.evalset), args.endpoint, args.model, str(args.n),
           str(args.concurrency), str(meta.get("default_max_tokens", 32))]
    work = Path(tempfile.mkdtemp(prefix="qg-bench-"))

    def quantgate(i: int) -> list[str]:
        cmd = [sys.executable, "-m", "quantgate.cli", "eval", "--endpoint", args.endpoint, "--model", args.model,
               "--evalset", str(args.evalset), "--out", str(work / f"run{i}"), "--limit", str(args.n),
               "--concurrency", str(args.concurrency), "--no-progress"]
        return cmd + (["--api-key-env", args.api_key_env] if args.api_key_env else [])

    timed(raw, env)  # warm-up: server caches, OS file cache
    t_raw, t_qg = [], []
    for i in range(args.repeats):
        order = [("raw", None), ("qg", i)] if i % 2 == 0 else [("qg", i), ("raw", None)]
        for side, k in order:
            if side == "raw":
                t_raw.append(timed(raw, env, "raw"))
            else:
                t_qg.append(timed(quantgate(k), env, "qg"))
            print(f"  {side:<4} {(t_raw if side == 'raw' else t_qg)[-1]:.2f} s", flush=True)
    mr, mq = statistics.median(t_raw), statistics.median(t_qg)
    print(f"items={args.n} concurrency={args.concurrency} repeats={args.repeats}")
    print(f"raw async client : median {mr:.2f} s  {[round(t, 2) for t in t_raw]}")
    print(f"quantgate eval   : median {mq:.2f} s  {[round(t, 2) for t in t_qg]}")
    print(f"client CPU seconds (user+sys), median: raw {statistics.median(CPU['raw']):.2f}, "
          f"quantgate {statistics.median(CPU['qg']):.2f}")
    print(f"ratio quantgate/raw = {mq / mr:.3f}  (target <= 1.10); quantgate's extra time {mq - mr:+.2f} s")
    print("lm-evaluation-harness local-chat-completions: not installed in this environment, not measured")


if __name__ == "__main__":
    main()
