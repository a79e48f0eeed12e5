"""A/A speed windows under a load that starts half-way: does the side-by-side window hold 1.0, and the old path?

    .venv/bin/python bench/perf_aa.py [BASELINE_DIR] [--reps 20] [--rounds 3] [--workload latency] [--no-burn]

Two servers of the same checkpoint (the baseline and its A/A copy) are started once, pinned to the same cores, and
probed repetition after repetition exactly as a release's speed window probes a baseline and a candidate
(quantgate.perf.rounds: baseline, copy, baseline again per round; one probe repeat each; paired intervals). Half-way
through each window a CPU burner (one busy process per core, pinned to the same cores: a bounded local load) starts
and runs to the window's end. Beside it, the old path: the baseline probed with the profile's repeats before the
window (quiet, as a cached probe of an earlier release), the copy probed after the window with the burner on, and
the two compared unpaired (Welch), as a release did before the window.

A sound method holds 1.0 in its 90% interval in about 90% of the repetitions (95% one-sided at each end), whatever
the load does; the line printed per repetition and the summary say how often each did. The CPU model is printed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quantgate.base.paths import results_dir  # noqa: E402
from quantgate.perf.compare import compare  # noqa: E402
from quantgate.perf.probe import run_probe  # noqa: E402
from quantgate.perf.rounds import FIRST, SECOND, as_rounds, geometric_baseline, plan  # noqa: E402
from quantgate.perf.workloads import PerfOverrides, settings  # noqa: E402
from quantgate.serving.server import ServerConfig, VLLMServer  # noqa: E402
from quantgate.target.hardware import get_profile  # noqa: E402

CPU_ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "2048"]


def burn(cores: list[int], stop) -> None:
    """One busy loop per core, pinned there, until `stop` is set."""
    os.sched_setaffinity(0, set(cores))
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def cpu_model() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def holds_one(ci: dict) -> bool:
    return ci["low"] is not None and ci["high"] is not None and ci["low"] <= 1.0 <= ci["high"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("baseline", nargs="?", type=Path, default=None, help="checkpoint folder (default: the demo's)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workload", default="latency", choices=["latency", "throughput", "fit"])
    ap.add_argument("--hardware", default="x86-cpu")
    ap.add_argument("--no-burn", action="store_true", help="no load half-way (the quiet control)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.baseline is None:
        from quantgate.target.catalogue import ensure_demo_model
        args.baseline = ensure_demo_model()
    out = args.out or results_dir() / "bench" / f"perf_aa-{time.strftime('%Y%m%dT%H%M%S')}"
    full = settings(args.workload, get_profile(args.hardware), PerfOverrides())
    one = full.model_copy(update={"repeats": 1, "budget_s": full.budget_s / full.repeats if full.budget_s else None})
    cores = sorted(os.sched_getaffinity(0))
    print(f"CPU {cpu_model()}, cores {cores}; {args.workload} profile at {one.levels}; {args.rounds} rounds; "
          f"burner {'off' if args.no_burn else 'on from half-way'}; results in {out}", flush=True)
    window_ok = old_ok = 0
    with ExitStack() as stack:
        servers = {}
        for name in ("baseline", "copy"):
            cfg = ServerConfig(model=args.baseline, name=name, args=CPU_ARGS, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
            servers[name] = stack.enter_context(VLLMServer(cfg, log_path=out / name / "server.log"))

        def probe(name: str, where: Path, s=one):
            srv = servers[name]
            return run_probe(srv.base_url, name, where, s, tokenizer=args.baseline, api_key=srv.api_key,
                             checkpoint=args.baseline, server_log=srv.log_path, check=False)

        for rep in range(args.reps):
            here = out / f"rep{rep:02d}"
            cached = probe("baseline", here / "old-baseline", full)  # the old path's quiet, cached probe
            order = plan("baseline", ["copy"], args.rounds)
            got: dict[tuple[str, str | None], list] = {}
            stop, burner = multiprocessing.Event(), []
            for k, s in enumerate(order):
                if k == len(order) // 2 and not args.no_burn:
                    burner = [multiprocessing.Process(target=burn, args=([c], stop), daemon=True) for c in cores]
                    for b in burner:
                        b.start()
                got.setdefault((s.variant, s.half), []).append(
                    probe(s.variant, here / f"r{s.round}-{s.index}-{s.variant}"))
            old = probe("copy", here / "old-copy", full)  # the old path: the candidate probed now, under the load
            stop.set()
            for b in burner:
                b.join()
            a, b2 = as_rounds(got[("baseline", FIRST)]), as_rounds(got[("baseline", SECOND)])
            new = compare(geometric_baseline(a, b2), as_rounds(got[("copy", None)]), paired=True)["decide"]
            before = compare(cached, old)["decide"]
            w_hold = all(holds_one(d["ratio"]) for d in new)
            o_hold = all(holds_one(d["ratio"]) for d in before)
            window_ok += w_hold
            old_ok += o_hold
            fmt = "; ".join(f"{d['figure']} {d['ratio']['value']:.3f} [{d['ratio']['low']:.3f}, {d['ratio']['high']:.3f}]"
                            for d in new)
            fmt_old = "; ".join(f"{d['figure']} {d['ratio']['value']:.3f} [{d['ratio']['low']:.3f}, "
                                f"{d['ratio']['high']:.3f}]" for d in before)
            print(f"rep {rep + 1:2d}: window {fmt} {'holds 1' if w_hold else 'MISSES 1'} | old path {fmt_old} "
                  f"{'holds 1' if o_hold else 'MISSES 1'}", flush=True)
    n = args.reps
    print(f"\nA/A ratio's 90% interval holds 1.0: side-by-side window {window_ok}/{n} ({window_ok / n:.0%}); "
          f"old path (cached quiet baseline vs a candidate probed under load, unpaired) {old_ok}/{n} "
          f"({old_ok / n:.0%}); CPU {cpu_model()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
