"""A release on work pools against the same release on one host, two releases at once on the same pools, and host
losses mid-variant, with real components: a Prefect server, two process workers standing in for two hosts (pinned to
cores 0 and 1), moto's S3 server as the results store, the demo model served by vLLM.

    .venv/bin/python bench/pools.py [--limit 30] [--lost 3] [--skip-local]

1. local vs pools: the same spec (baseline + INT8 W8A8) with `executor: local` (2 cores, one variant at a time, the
   planner's rule) and with `executor: pools` (baseline on host-a, INT8 on host-b): decision and wall time of each.
2. two releases at once on the pools (eval limits that differ, so both must serve), every vLLM process's CPU
   affinity sampled twice a second: the most servers seen on one core at one moment (must be 1).
3. `--lost N` times: a new checkpoint candidate on host-b, the host SIGKILLed whole once it has shared some answers,
   a replacement host started; answers shared before the loss, answers at the end, unique ids, and whether the shared
   ones were kept as they were (not asked again).
Prints a table per part and the CPU model. tests/test_pools_release.py runs one release, its re-run and one loss.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import psutil  # noqa: E402

from _pools import lose_host, prefect_server, serving, stored_answers, worker  # noqa: E402
from _s3 import aws_env, s3_server  # noqa: E402
from faults import cpu_model  # noqa: E402  (bench/faults.py: this folder is on the path)
from quantgate.base.objstore import ResultStore  # noqa: E402
from quantgate.quantize.calibration import CalibrationSpec  # noqa: E402
from quantgate.pools.child import periodic  # noqa: E402
from quantgate.quantize.recipes import RecipeOverrides  # noqa: E402
from quantgate.quantize.run import QuantizeRequest, quantize  # noqa: E402
from quantgate.serving.server import kill_tree  # noqa: E402
from quantgate.target.catalogue import ensure_demo_model  # noqa: E402

SPEC = """\
version: 1
name: {name}
model: demo
hardware: x86-cpu
context: 2048
concurrency: 4
schemes: [{schemes}]
{candidates}eval_sets: [{evalset}]
quantization:
  calibration: {{samples: 16, max_seq_length: 128}}
eval: {{limit: {limit}}}
recall: {{lengths: [512], depths: [0, 100], kinds: [number], samples: 1}}
fidelity: {{draws: 1, limit: {limit}, context_prompts: 2, context_new_tokens: 32}}
perf: null
executor:
  kind: {kind}
  store: s3://{bucket}/releases
  pools: {{baseline: host-a, int8-w8a8: host-b, default: host-b}}
  sync_s: 2
  lost_after_s: 20
"""


def spec_file(root: Path, name: str, kind: str, limit: int, bucket: str, candidates: str = "",
              schemes: str = "int8-w8a8") -> Path:
    path = root / f"{name}.yaml"
    path.write_text(SPEC.format(name=name, kind=kind, limit=limit, bucket=bucket, candidates=candidates,
                                schemes=schemes, evalset=REPO / "eval_sets" / "default.jsonl"))
    return path


def release(spec: Path, run_id: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "quantgate.cli.main", "release", str(spec), "--run-id", run_id],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)


def finish(proc: subprocess.Popen, results: Path, run_id: str, t0: float) -> dict:
    out, _ = proc.communicate(timeout=3600)
    summary_file = results / "runs" / run_id / "summary.json"
    if not summary_file.is_file():
        raise RuntimeError(f"{run_id} ended {proc.returncode} without a summary:\n{out[-3000:]}")
    summary = json.loads(summary_file.read_text())
    return {"run": run_id, "decision": summary["decision"], "exit": proc.returncode,
            "seconds": round(time.monotonic() - t0, 1), "out": out}


class AffinitySampler:
    """Every vLLM process's CPU affinity, per sample; per core the most distinct servers seen at one moment (a
    server: the outermost vLLM process of a tree, with its engine cores and workers)."""

    def __init__(self) -> None:
        self.most: dict[int, int] = {}
        self.samples = 0

    def sample(self) -> None:
        per_core: dict[int, set[int]] = {}
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if not any("vllm" in a for a in p.info["cmdline"] or []):
                    continue
                server = p
                while (up := server.parent()) is not None and any("vllm" in a for a in up.cmdline()):
                    server = up
                for core in p.cpu_affinity():
                    per_core.setdefault(core, set()).add(server.pid)
            except psutil.Error:
                continue
        self.samples += 1
        for core, servers in per_core.items():
            self.most[core] = max(self.most.get(core, 0), len(servers))


def part_local_vs_pools(root: Path, env: dict, s3: dict, limit: int, skip_local: bool) -> list[dict]:
    rows = []
    if not skip_local:
        local_env = {**env, "QUANTGATE_RESULTS": str(root / "local" / "results")}
        t0 = time.monotonic()
        rows.append({"executor": "local", **finish(release(spec_file(root, "cmp", "local", limit, s3["QG_TEST_BUCKET"]),
                                                           "cmp-local", local_env), root / "local" / "results",
                                                   "cmp-local", t0)})
    parent = root / "parent" / "results"
    t0 = time.monotonic()
    rows.append({"executor": "pools", **finish(release(spec_file(root, "cmp", "pools", limit, s3["QG_TEST_BUCKET"]),
                                                       "cmp-pools", {**env, "QUANTGATE_RESULTS": str(parent)}),
                                               parent, "cmp-pools", t0)})
    return rows


def part_two_at_once(root: Path, env: dict, s3: dict, limit: int) -> dict:
    parent = root / "parent" / "results"
    specs = [spec_file(root, f"twin{i}", "pools", limit + 6 * (i + 1), s3["QG_TEST_BUCKET"]) for i in range(2)]
    t0 = time.monotonic()
    sampler = AffinitySampler()
    with periodic(0.5, sampler.sample, "affinity-sampler"):
        procs = [release(s, f"twin{i}", {**env, "QUANTGATE_RESULTS": str(parent)}) for i, s in enumerate(specs)]
        done = [finish(p, parent, f"twin{i}", t0) for i, p in enumerate(procs)]
    return {"decisions": [d["decision"] for d in done], "seconds": [d["seconds"] for d in done],
            "most_servers_per_core": sampler.most, "samples": sampler.samples}


def part_lost(root: Path, env: dict, s3: dict, workers: list, cycle: int, limit: int) -> dict:
    """One host loss: a fresh checkpoint candidate (its own calibration seed: new weights, new cache key)."""
    ckpt = quantize(QuantizeRequest(model=ensure_demo_model(), scheme="int8-w8a8", out=root / f"l{cycle}",
                                    hardware="x86-cpu", overrides=RecipeOverrides(
                                        ignore=[rf"re:model\.layers\.([{cycle % 9 + 1}-9]|[12][0-9])\..*"]),
                                    calibration=CalibrationSpec(samples=4, max_seq_length=32))).out
    name = f"l{cycle}"
    spec = spec_file(root, f"lost{cycle}", "pools", limit, s3["QG_TEST_BUCKET"], schemes="",
                     candidates=f"candidates:\n  - {{name: {name}, checkpoint: {ckpt}}}\n")
    parent = root / "parent" / "results"
    t0 = time.monotonic()
    proc = release(spec, f"lost{cycle}", {**env, "QUANTGATE_RESULTS": str(parent)})
    check = root / f"lost{cycle}-check"
    with aws_env(s3):
        store = ResultStore(f"s3://{s3['QG_TEST_BUCKET']}/releases", check)
        stored: list[str] = []
        while len(stored) < max(3, limit // 4):
            if proc.poll() is not None:
                raise RuntimeError(f"lost{cycle} ended before the loss:\n{proc.stdout.read()[-3000:] if proc.stdout else ''}")
            time.sleep(1)
            key, stored = stored_answers(store, check) if serving(workers[1][0]) else ("", [])
        doomed = lose_host(workers[1][0])
        key, stored = stored_answers(store, check)
        workers[1] = worker("host-b", 1, root / f"replacement{cycle}", env)
        result = finish(proc, parent, f"lost{cycle}", t0)
        final = ResultStore(f"s3://{s3['QG_TEST_BUCKET']}/releases", root / f"lost{cycle}-final")
        final.pull(key.split("/evals/")[0])
        lines = (root / f"lost{cycle}-final" / key).read_text().splitlines()
    ids = [json.loads(line)["id"] for line in lines]
    left = [p.pid for p in doomed if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    return {"cycle": cycle, "shared_before_loss": len(stored), "final": len(lines), "unique": len(set(ids)),
            "kept": lines[:len(stored)] == stored, "resubmitted": "submitting it again" in result["out"],
            "decision": result["decision"], "seconds": result["seconds"], "left_running": left}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=30, help="eval samples per release (fidelity the same)")
    ap.add_argument("--lost", type=int, default=3, help="host losses to run")
    ap.add_argument("--skip-local", action="store_true", help="skip the local executor's run")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="quantgate-pools-bench-"))
    print(f"bench/pools.py in {root}; CPU: {cpu_model()}", flush=True)
    with prefect_server(root) as api, s3_server(root / "moto.log") as s3:
        env = {**os.environ, **s3, "PREFECT_API_URL": api, "PYTHONUNBUFFERED": "1"}
        setup = subprocess.run([sys.executable, "-m", "quantgate.cli.main", "pools", "setup", "host-a", "host-b"],
                               capture_output=True, text=True, env=env, cwd=REPO)
        assert setup.returncode == 0, setup.stdout + setup.stderr
        workers = [worker("host-a", 0, root, env), worker("host-b", 1, root, env)]
        try:
            for row in part_local_vs_pools(root, env, s3, args.limit, args.skip_local):
                print(f"1. {row['executor']:5s} decision {row['decision']:12s} exit {row['exit']}  {row['seconds']:7.1f} s",
                      flush=True)
            twins = part_two_at_once(root, env, s3, args.limit)
            print(f"2. two releases at once: decisions {twins['decisions']}, {twins['seconds']} s; most vLLM servers "
                  f"on one core at one moment: {twins['most_servers_per_core']} ({twins['samples']} samples)", flush=True)
            for cycle in range(args.lost):
                r = part_lost(root, env, s3, workers, cycle, args.limit)
                print(f"3. loss {cycle + 1}/{args.lost}: shared before {r['shared_before_loss']:3d}  final {r['final']:3d}"
                      f"  unique {r['unique']:3d}  kept {r['kept']}  resubmitted {r['resubmitted']}  decision "
                      f"{r['decision']}  {r['seconds']:.0f} s  processes left {len(r['left_running'])}", flush=True)
        finally:
            for proc, _ in workers:
                kill_tree(proc.pid)
    print(f"CPU: {cpu_model()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
