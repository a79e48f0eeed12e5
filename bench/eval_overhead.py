"""Whole-process wall time of `quantgate eval` and of lm-eval vs a minimal raw async client, same items and decoding.

Needs a running OpenAI-compatible server (vLLM). All sides answer the same first N items of the eval set (written to
a temporary eval set beside its sidecar) with the same decoding (temperature 0, top_p 1, seed 0, the item's
max_tokens, no stop strings) and the same number of requests in flight:
  raw       a ~20-line httpx script: read the JSONL, post the chat requests, count the 200s
  quantgate `python -m quantgate.cli.main eval` into a fresh run directory (scores and writes everything it normally does)
  lmeval    lm-evaluation-harness's `local-chat-completions` backend with `--apply_chat_template`, on the task in
            bench/lmeval/ (one copy per distinct max_tokens), from the separate `.venv-lmeval` (scripts/setup.sh lmeval)
Every run is a fresh process, so start-up counts. One discarded warm-up run of each side comes first (server caches,
OS file cache, `datasets` cache); then the order rotates every repeat. After each run the server's own request
counter (/metrics, vllm:request_success_total) must have grown by N: proof that every side sent N requests to it.
Prints each timing, the median per side, each median's ratio to raw, and which is within the 1.10 target.

    python bench/eval_overhead.py --endpoint http://127.0.0.1:8000 --model demo --api-key-env KEY_VAR \
        [--n 200] [--concurrency 16] [--repeats 3] [--sides raw,quantgate,lmeval]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parent.parent
TARGET = 1.10
LMEVAL_TASK = REPO / "bench" / "lmeval" / "quantgate_items.yaml"

# The baseline: read the JSONL, send the same chat requests with the same decoding, keep nothing but a count.
RAW_CLIENT = r"""
import asyncio, json, os, sys
import httpx
evalset, endpoint, model, conc, default_max = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
rows = [json.loads(l) for l in open(evalset, encoding="utf-8") if l.strip()]
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


def write_subset(evalset: Path, n: int, work: Path) -> tuple[Path, list[dict], int]:
    """The first n lines of the eval set as a set of its own (same sidecar); (path, rows, default max_tokens)."""
    lines = [line for line in evalset.read_text(encoding="utf-8").splitlines() if line.strip()][:n]
    sidecar = evalset.with_name(evalset.name.removesuffix(".jsonl") + ".meta.yaml")
    folder = work / "evalset"
    folder.mkdir()
    path = folder / evalset.name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    (folder / sidecar.name).write_text(sidecar.read_text(encoding="utf-8"), encoding="utf-8")
    default_max = int(yaml.safe_load(sidecar.read_text(encoding="utf-8")).get("default_max_tokens", 32))
    return path, [json.loads(line) for line in lines], default_max


def write_lmeval_tasks(rows: list[dict], default_max: int, folder: Path) -> list[str]:
    """One lm-eval task per distinct max_tokens (lm-eval sets it per task, quantgate per item); returns task names."""
    template = yaml.safe_load(LMEVAL_TASK.read_text(encoding="utf-8"))
    groups: dict[int, list[dict]] = {}
    for r in rows:
        turns = r.get("messages") or [{"role": "user", "content": r["prompt"]}]
        if len(turns) != 1 or turns[0]["role"] != "user":
            sys.exit(f"item {r['id']}: lm-eval's chat task sends one user turn; this item has {len(turns)} messages")
        refs = r.get("references") or [""]
        groups.setdefault(r.get("max_tokens") or default_max, []).append(
            {"id": r["id"], "text": turns[0]["content"], "target": refs[0]})
    folder.mkdir()
    names = []
    for max_tokens, docs in sorted(groups.items()):
        name = f"{template['task']}_{max_tokens}"
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
        task = {**template, "task": name, "dataset_kwargs": {"data_files": {"test": str(data)}},
                "generation_kwargs": {**template["generation_kwargs"], "max_gen_toks": max_tokens}}
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(task, sort_keys=False), encoding="utf-8")
        names.append(name)
    return names


def lmeval_answered(out: Path) -> int:
    """Samples with a non-empty response in lm-eval's --log_samples files."""
    count = 0
    for f in out.rglob("samples_*.jsonl"):
        for line in f.read_text(encoding="utf-8").splitlines():
            resps = json.loads(line).get("filtered_resps") or [""]
            count += bool(resps[0])
    return count


def server_requests(endpoint: str, key: str | None) -> float | None:
    """The server's count of finished requests (vLLM's Prometheus counter); None when it does not expose one."""
    root = endpoint.rstrip("/").removesuffix("/v1")
    try:
        text = httpx.get(root + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=10).text
    except httpx.HTTPError:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:request_success_total")]
    return sum(values) if values else None


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds user+system, stdout) of one child process; exits on failure."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, proc.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--endpoint", required=True, help="server root, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", required=True, help="served model name")
    ap.add_argument("--evalset", type=Path, default=REPO / "eval_sets" / "default.jsonl")
    ap.add_argument("--n", type=int, default=200, help="the first N items of the eval set")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each side")
    ap.add_argument("--api-key-env", default=None, help="environment variable holding the server's API key")
    ap.add_argument("--sides", default="raw,quantgate,lmeval", help="comma-separated; raw is always run")
    ap.add_argument("--lm-eval", type=Path, default=REPO / ".venv-lmeval" / "bin" / "lm-eval")
    args = ap.parse_args()

    key = os.environ[args.api_key_env] if args.api_key_env else None
    # offline: nobody waits on a hub look-up; RAW_API_KEY for the raw client, OPENAI_API_KEY is what lm-eval reads
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           **({"RAW_API_KEY": key, "OPENAI_API_KEY": key} if key else {})}
    sides = ["raw"] + [s for s in args.sides.split(",") if s and s != "raw"]
    if unknown := set(sides) - {"raw", "quantgate", "lmeval"}:
        sys.exit(f"--sides: unknown {', '.join(sorted(unknown))}; choose from raw, quantgate, lmeval")
    if "lmeval" in sides and not args.lm_eval.is_file():
        print(f"lm-eval: {args.lm_eval} missing (build it: scripts/setup.sh lmeval); that side is left out")
        sides.remove("lmeval")
    work = Path(tempfile.mkdtemp(prefix="qg-bench-"))
    subset, rows, default_max = write_subset(args.evalset, args.n, work)
    tasks = write_lmeval_tasks(rows, default_max, work / "lmeval_tasks") if "lmeval" in sides else []
    n = len(rows)

    def command(side: str, run: str) -> list[str]:
        if side == "raw":
            return [sys.executable, "-c", RAW_CLIENT, str(subset), args.endpoint, args.model, str(args.concurrency),
                    str(default_max)]
        if side == "quantgate":
            return [sys.executable, "-m", "quantgate.cli.main", "eval", "--endpoint", args.endpoint, "--model", args.model,
                    "--evalset", str(subset), "--out", str(work / run), "--concurrency", str(args.concurrency),
                    "--no-progress", *(["--api-key-env", args.api_key_env] if args.api_key_env else [])]
        if side == "lmeval":
            base_url = args.endpoint.rstrip("/").removesuffix("/v1") + "/v1/chat/completions"
            return [str(args.lm_eval), "run", "--model", "local-chat-completions", "--model_args",
                    f"model={args.model},base_url={base_url},num_concurrent={args.concurrency},max_retries=3,"
                    "tokenized_requests=False,seed=0", "--apply_chat_template", "--tasks", *tasks,
                    "--include_path", str(work / "lmeval_tasks"), "--output_path", str(work / run), "--log_samples"]
        raise AssertionError(side)

    def one(side: str, run: str) -> tuple[float, float]:
        before = server_requests(args.endpoint, key)
        wall, cpu, out = timed(command(side, run), env)
        after = server_requests(args.endpoint, key)
        seen = None if before is None or after is None else round(after - before)
        if seen is not None and seen != n:
            sys.exit(f"{side}: the server counted {seen} finished requests during the run, expected {n}")
        if side == "lmeval" and lmeval_answered(work / run) != n:
            sys.exit(f"lmeval: {lmeval_answered(work / run)} of {n} samples answered in {work / run}")
        if side == "raw" and not out.startswith(f"{n} ok"):
            sys.exit(f"raw: {out.strip()}")
        print(f"  {side:<9} {wall:6.2f} s  (client CPU {cpu:5.2f} s, server counted {seen if seen is not None else '?'}"
              " requests)", flush=True)
        return wall, cpu

    print(f"items={n} (first {n} of {args.evalset.name}) concurrency={args.concurrency} repeats={args.repeats} "
          f"sides={','.join(sides)}; warm-up:")
    for side in sides:
        one(side, f"warmup-{side}")
    walls: dict[str, list[float]] = {s: [] for s in sides}
    cpus: dict[str, list[float]] = {s: [] for s in sides}
    for i in range(args.repeats):
        print(f"repeat {i + 1}:")
        for side in sides[i % len(sides):] + sides[:i % len(sides)]:
            wall, cpu = one(side, f"run{i}-{side}")
            walls[side].append(wall)
            cpus[side].append(cpu)

    raw = statistics.median(walls["raw"])
    print(f"\nitems={n} concurrency={args.concurrency} repeats={args.repeats} endpoint={args.endpoint} "
          f"(run outputs: {work})")
    for side in sides:
        med = statistics.median(walls[side])
        print(f"{side:<9} median {med:6.2f} s  client CPU {statistics.median(cpus[side]):5.2f} s  "
              f"{[round(t, 2) for t in walls[side]]}")
    for side in sides[1:]:
        ratio = statistics.median(walls[side]) / raw
        verdict = "within" if ratio <= TARGET else "ABOVE"
        print(f"ratio {side}/raw = {ratio:.3f}  ({verdict} the {TARGET:.2f} target; {ratio * raw - raw:+.2f} s)")


if __name__ == "__main__":
    main()
