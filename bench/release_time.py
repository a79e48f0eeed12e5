"""How long the demo release takes, where the time goes, and how busy the cores are: first run, unchanged re-run,
and the same release with one more candidate.

    .venv/bin/python bench/release_time.py [--spec releases/demo.yaml] [--add int8-w8a8] [--keep DIR]

Starts from a state where the environments and the demo model are cached (QUANTGATE_HOME) and nothing else is: the
results go to a fresh temporary folder (QUANTGATE_RESULTS), so every checkpoint is quantized and every variant is
served and measured. Then:
  1. `quantgate release SPEC` (first run)
  2. the same command again (unchanged re-run: everything from the cache)
  3. SPEC with one more candidate in `schemes` (--add) and `ladder: false`, so that it is tried: what adding a
     candidate costs
  4. with --full: SPEC with `decide_early: false` from nothing cached, the full release; the first run's time to
     verdict (a REJECT at a streaming look) is printed as a share of it
  5. with --ladder SCHEME: a ladder of two rungs (SPEC's first scheme, then SCHEME) from nothing cached
For each run it prints the per-step table (start, seconds, served or cached), the critical path (the chain of steps
that the wall time waited on), the cores kept busy (CPU seconds of the whole process tree / wall seconds, over the
run and over the serve-and-measure windows, sampled from /proc with psutil every second) and the prompt tokens each
variant's steps sent (from the answers' usage and the perf runs). Ratios are from this one run; the machine may be
shared, so say so next to the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's quantgate, whichever checkout the environment was installed from

from quantgate.serving.cpu_kernels import resolve_hardware, split_schemes  # noqa: E402


class TreeCpu:
    """CPU seconds of a process and all its descendants, sampled every `every_s`: (time, cumulative) pairs.
    A process that ends between samples loses at most its last interval."""

    def __init__(self, pid: int, every_s: float = 1.0):
        self.pid, self.every_s = pid, every_s
        self.last: dict[tuple[int, float], float] = {}
        self.total = 0.0
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _tick(self) -> None:
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                t = p.cpu_times()
                key = (p.pid, p.create_time())
            except psutil.Error:
                continue
            now = t.user + t.system
            self.total += max(0.0, now - self.last.get(key, 0.0))
            self.last[key] = now
        self.samples.append((time.time(), self.total))

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            self._tick()

    def __enter__(self) -> TreeCpu:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def between(self, t0: float, t1: float) -> float:
        """CPU seconds spent between two Unix times (from the nearest samples)."""
        before = max((c for t, c in self.samples if t <= t0), default=0.0)
        after = max((c for t, c in self.samples if t <= t1), default=before)
        return after - before


def release(spec: Path, run_id: str, env: dict) -> tuple[int, float, TreeCpu, str]:
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "quantgate.cli.main", "release", str(spec), "--run-id", run_id],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    with TreeCpu(proc.pid) as cpu:
        out, _ = proc.communicate()
    return proc.returncode, time.time() - t0, cpu, out


def critical_path(rows: list[dict], slack_s: float = 2.0) -> list[dict]:
    """Back from the step that ended last: each time, the step that ended last before this one began."""
    left = sorted(rows, key=lambda r: r["end"])
    path = [left[-1]] if left else []
    while True:
        start = path[-1]["start"]
        before = [r for r in left if r["end"] <= start + slack_s and r is not path[-1] and r not in path]
        if not before:
            return list(reversed(path))
        path.append(max(before, key=lambda r: r["end"]))


# One file per kind of record, so that no request is counted twice: a recall run keeps the same requests in
# prompts.jsonl, answers.jsonl and requests.jsonl; an eval run its answers in results.jsonl (scores.jsonl repeats them).
COUNTED = {"results.jsonl", "answers.jsonl", "logprobs.jsonl"}


def _record_tokens(rec: dict) -> int:
    """Prompt tokens of one record: an answer's usage.prompt_tokens, or a fidelity dump's token ids."""
    usage = rec.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        return usage["prompt_tokens"]
    return len(rec["ids"]) if isinstance(rec.get("ids"), list) else 0


def prompt_tokens(folder: Path) -> int:
    """Prompt tokens a measurement folder sent: answers' usage (evals, recall), fidelity's scored sequences and
    the perf runs' total_input_tokens. Tokens served from vLLM's prefix cache count too: this is the work asked."""
    total = 0
    for f in (f for f in folder.rglob("*.jsonl") if f.name in COUNTED):
        for line in f.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            total += _record_tokens(rec) if isinstance(rec, dict) else 0
    for f in folder.rglob("raw/*.json"):
        try:
            total += int(json.loads(f.read_text()).get("total_input_tokens") or 0)
        except (OSError, ValueError, AttributeError):
            pass
    return total


def tokens_by_step(run: Path) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for ev_file in sorted(run.glob("*/evidence.json")):
        ev = json.loads(ev_file.read_text())
        cache = Path(ev["cache"])
        parts = {"evals": cache / "evals", "fidelity": cache / "fidelity", "recall": Path(ev["recall"]) if ev.get("recall") else None,
                 "perf": Path(ev["perf"]) if ev.get("perf") else None}
        out[ev["variant"]["name"]] = {k: prompt_tokens(p) for k, p in parts.items() if p is not None and p.exists()}
    return out


def show(label: str, spec: Path, results: Path, run_id: str, env: dict) -> float:
    rc, wall, cpu, out = release(spec, run_id, env)
    print(f"\n== {label}: `quantgate release {spec.name}` exit {rc}, {wall:.1f} s wall, "
          f"{cpu.total:.0f} CPU s, cores busy {cpu.total / wall:.2f}")
    run = results / "runs" / run_id
    try:
        rows = json.loads((run / "timings.json").read_text())
    except OSError:
        print(out[-4000:])
        return wall
    t0 = min(r["start"] for r in rows)
    print(f"  {'start':>7}  {'seconds':>8}  {'cores':>5}  step")
    for r in rows:
        busy = cpu.between(r["start"], r["end"]) / max(r["end"] - r["start"], 1e-9)
        note = {True: " (served)", False: " (from cache)"}.get(r.get("served"), "")
        print(f"  {r['start'] - t0:7.1f}  {r['seconds']:8.1f}  {busy:5.2f}  {r['step']}{note}" + (f" [{r['slot']}]" if r.get("slot") else ""))
    path = critical_path(rows)
    print("  critical path: " + " -> ".join(f"{r['step']} ({r['seconds']:.0f} s)" for r in path))
    serve = [r for r in rows if r["step"].startswith("serve and measure") and r.get("served")]
    if serve:
        a, b = min(r["start"] for r in serve), max(r["end"] for r in serve)
        print(f"  serve-and-measure window {b - a:.0f} s: cores busy {cpu.between(a, b) / (b - a):.2f}")
    for ev_file in sorted(run.glob("*/evidence.json")):  # the time to verdict of a candidate rejected early
        ev = json.loads(ev_file.read_text())
        row = next((r for r in rows if r["step"] == f"serve and measure {ev['variant']['name']}"), None)
        if ev.get("decided") and row is not None:
            print(f"  {ev['variant']['name']}: REJECT decided by fidelity, its measurement ended at "
                  f"{row['end'] - t0:.0f} s (of {wall:.0f} s)")
        for step, why in (ev.get("skipped") or {}).items():
            print(f"  {ev['variant']['name']}: {step} skipped: {why[:120]}")
    try:  # the time to verdict of a REJECT decided at a streaming look (quantgate.gate.stream)
        decided = json.loads((run / "decision.json").read_text())["candidates"]
    except (OSError, KeyError, ValueError):
        decided = {}
    for name, d in decided.items():
        if (look := d.get("stream")) is not None:
            print(f"  {name}: time to verdict {look['elapsed_s']:.0f} s ({look['elapsed_s'] / wall:.0%} of this "
                  f"release's {wall:.0f} s): streaming look {look['index']} of {look['of']} of {look['scope']}, "
                  f"{look['n']} of {look['total']} prompts")
    for variant, parts in tokens_by_step(run).items():
        print(f"  prompt tokens, {variant}: " + ", ".join(f"{k} {v:,}" for k, v in parts.items()))
    if rc not in (0, 3, 4):
        print(out[-4000:])
    return wall


def runs_here(scheme: str, spec: dict) -> bool:
    """Whether `scheme` is kept for this machine by the spec's hardware profile and the kernel probe."""
    hardware = resolve_hardware(spec["hardware"], None)[0]
    return scheme in split_schemes(hardware, [scheme], None)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", type=Path, default=REPO / "releases" / "demo.yaml")
    ap.add_argument("--add", default="w4a16-gptq", help="the candidate added for the third run (it must run on this "
                                                        "machine: W4A16 needs an AVX-512 CPU)")
    ap.add_argument("--keep", type=Path, default=None, help="results folder to use and keep (default: a temporary one)")
    ap.add_argument("--full", action="store_true", help="also the spec with `decide_early: false` from nothing cached: "
                                                        "the full release that the time to verdict is compared with")
    ap.add_argument("--ladder", default=None, metavar="SCHEME", help="also a ladder of two rungs from nothing cached: "
                                                                     "the spec's first scheme, then SCHEME")
    a = ap.parse_args()
    cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
    print(f"{cpu}; {os.cpu_count()} logical CPUs; load average {os.getloadavg()[0]:.2f} at start (the machine may be shared)")
    with tempfile.TemporaryDirectory(prefix="release-time-") as tmp:
        results = a.keep or Path(tmp) / "results"
        if results.exists() and any(results.iterdir()):
            raise SystemExit(f"{results} is not empty: the first run must start with nothing cached")
        env = {**os.environ, "QUANTGATE_RESULTS": str(results), "PREFECT_HOME": str(Path(tmp) / "prefect"),
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        spec = yaml.safe_load(a.spec.read_text())
        first = show("first run (environments and model cached, nothing else)", a.spec, results, "first", env)
        verdict = first_verdict(results / "runs" / "first")
        again = show("unchanged re-run", a.spec, results, "again", env)
        print(f"  re-run / first: {again / first:.1%}")
        # beside the spec, so that its relative paths (eval sets, policy) mean the same; removed at the end
        added_spec = a.spec.with_name(f".{a.spec.stem}-added-{os.getpid()}.yaml")
        spec["schemes"] = [*dict.fromkeys([*spec["schemes"], a.add])]
        if not runs_here(a.add, spec):
            print(f"\n== with one more candidate: skipped, {a.add} does not run on this machine (see `quantgate schemes`)")
        else:
            added_spec.write_text(yaml.safe_dump({**spec, "ladder": False}, sort_keys=False))  # every scheme is tried
            try:
                added = show(f"with one more candidate ({a.add})", added_spec, results, "added", env)
            finally:
                added_spec.unlink(missing_ok=True)
            print(f"  adding a candidate / first run: {added / first:.1%}")
        base = yaml.safe_load(a.spec.read_text())
        if a.full:
            full = fresh("full release (decide_early: false, nothing cached)", a.spec, {**base, "decide_early": False},
                         Path(tmp), env)
            if verdict is not None:
                print(f"  time to verdict of the first run / full release: {verdict:.0f} s / {full:.0f} s = "
                      f"{verdict / full:.1%}")
        if a.ladder and runs_here(a.ladder, base):
            rungs = {**base, "schemes": [base["schemes"][0], a.ladder], "ladder": True}
            fresh(f"a ladder of two rungs ({' -> '.join(rungs['schemes'])}, nothing cached)", a.spec, rungs, Path(tmp),
                  env)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


def first_verdict(run: Path) -> float | None:
    """Seconds from the release's start to its first candidate's verdict at a streaming look, if one was."""
    try:
        decided = json.loads((run / "decision.json").read_text())["candidates"]
    except (OSError, KeyError, ValueError):
        return None
    seconds = [d["stream"]["elapsed_s"] for d in decided.values() if d.get("stream")]
    return min(seconds) if seconds else None


def fresh(label: str, beside: Path, spec: dict, tmp: Path, env: dict) -> float:
    """`spec` released from nothing cached (its own results folder), written beside `beside` so that its relative
    paths mean the same; its wall time."""
    name = label.split(" (")[0].replace(" ", "-")
    path = beside.with_name(f".{beside.stem}-{name}-{os.getpid()}.yaml")
    results = tmp / f"results-{name}"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    try:
        return show(label, path, results, name, {**env, "QUANTGATE_RESULTS": str(results)})
    finally:
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    raise SystemExit(main())
