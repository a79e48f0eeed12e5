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
from quantgate.gate.payoff import speed_check  # noqa: E402
from quantgate.perf.intervals import RatioCI  # noqa: E402
from quantgate.perf.models import SpeedFigure  # noqa: E402
from quantgate.perf.probe import load_result, run_probe  # noqa: E402
from quantgate.perf.rounds import as_rounds, geometric_baseline, plan  # noqa: E402
from quantgate.perf.workloads import PerfOverrides, settings  # noqa: E402
from quantgate.serving.kernel_probe import cpuinfo  # noqa: E402
from quantgate.serving.server import ServerConfig, VLLMServer  # noqa: E402
from quantgate.target.hardware import get_profile  # noqa: E402

CPU_ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "2048"]


def burn(cores: list[int], stop) -> None:
    """One busy loop per core, pinned there, until `stop` is set."""
    os.sched_setaffinity(0, set(cores))
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def holds_one(ci: dict) -> bool:
    return ci["low"] is not None and ci["high"] is not None and ci["low"] <= 1.0 <= ci["high"]


def analyze(here: Path, rounds: int) -> dict:
    """One repetition from its saved probes: each path's pay-off figures (ratio and 90% interval), and what the
    gate's speed check (demand 1.0x, the latency profile's) says of the A/A copy, against the A/A floor for the
    window. The copy is as fast as the baseline: PASS claims a speed-up that is not there, FAIL a slow-down."""
    first = as_rounds([load_result(here / f"r{r}-0-baseline") for r in range(rounds)])
    second = as_rounds([load_result(here / f"r{r}-2-baseline") for r in range(rounds)])
    copy = as_rounds([load_result(here / f"r{r}-1-copy") for r in range(rounds)])
    window = compare(geometric_baseline(first, second), copy, paired=True)
    floor = {d["figure"]: d["ratio"] for d in compare(first, second, paired=True)["decide"]}
    old = compare(load_result(here / "old-baseline"), load_result(here / "old-copy"))
    out = {}
    for path, doc in (("window", window), ("old", old)):
        rows = []
        for d in doc["decide"]:
            fig = SpeedFigure.model_validate(d)
            fl = RatioCI.model_validate(floor[d["figure"]]) if path == "window" else None
            check = speed_check(fig, "latency", 1.0, bound="ci", required=True, file=None, floor=fl, rounds=rounds)
            rows.append({"figure": d["figure"], "ratio": d["ratio"], "verdict": check.outcome})
        out[path] = rows
    return out


class Tally:
    """Per path: repetitions whose every figure's interval holds 1.0, and the gate's verdicts on the A/A copy."""

    def __init__(self) -> None:
        self.n = 0
        self.holds = {"window": 0, "old": 0}
        self.verdicts: dict[str, dict[str, int]] = {"window": {}, "old": {}}

    def add(self, rep: int, got: dict) -> None:
        self.n += 1
        line = []
        for path, rows in got.items():
            held = all(holds_one(r["ratio"]) for r in rows)
            self.holds[path] += held
            for r in rows:
                self.verdicts[path][r["verdict"]] = self.verdicts[path].get(r["verdict"], 0) + 1
            figs = "; ".join(f"{r['figure']} {r['ratio']['value']:.3f} [{r['ratio']['low']:.3f}, "
                             f"{r['ratio']['high']:.3f}] {r['verdict']}" for r in rows)
            line.append(f"{path} {figs} {'holds 1' if held else 'MISSES 1'}")
        print(f"rep {rep + 1:2d}: " + " | ".join(line), flush=True)

    def summary(self) -> None:
        n = self.n
        print(f"\n{n} repetitions, CPU {cpuinfo()[0]}")
        for path, what in (("window", "side-by-side window (paired by round, A/A floor)"),
                           ("old", "old path (a quiet probe first, as a cached one, vs the copy under load)")):
            v = self.verdicts[path]
            figs = sum(v.values()) or 1
            print(f"  {what}: every 90% interval holds 1.0 in {self.holds[path]}/{n} ({self.holds[path] / n:.0%}); "
                  f"gate on the A/A copy per figure: PASS {v.get('pass', 0)}/{figs} ({v.get('pass', 0) / figs:.0%}, "
                  f"a speed-up that is not there), FAIL {v.get('fail', 0)}/{figs}, INCONCLUSIVE "
                  f"{v.get('inconclusive', 0)}/{figs}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("baseline", nargs="?", type=Path, default=None, help="checkpoint folder (default: the demo's)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workload", default="latency", choices=["latency", "throughput", "fit"])
    ap.add_argument("--hardware", default="x86-cpu")
    ap.add_argument("--no-burn", action="store_true", help="no load half-way (the quiet control)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--analyze", type=Path, default=None, help="judge the saved probes of an earlier run's --out")
    args = ap.parse_args()
    if args.baseline is None:
        from quantgate.target.catalogue import ensure_demo_model
        args.baseline = ensure_demo_model()
    out = args.out or results_dir() / "bench" / f"perf_aa-{time.strftime('%Y%m%dT%H%M%S')}"
    full = settings(args.workload, get_profile(args.hardware), PerfOverrides())
    one = full.model_copy(update={"repeats": 1, "budget_s": full.budget_s / full.repeats if full.budget_s else None})
    cores = sorted(os.sched_getaffinity(0))
    tally = Tally()
    if args.analyze is not None:  # the probes of an earlier run, judged again
        done = [d for d in sorted(args.analyze.glob("rep*")) if (d / "old-copy" / "perf.json").is_file()]
        for rep, here in enumerate(done):
            tally.add(rep, analyze(here, args.rounds))
        tally.summary()
        return 0
    print(f"CPU {cpuinfo()[0]}, cores {cores}; {args.workload} profile at {one.levels}; {args.rounds} rounds; "
          f"burner {'off' if args.no_burn else 'on from half-way'}; results in {out}", flush=True)
    with ExitStack() as stack:
        servers = {}
        for name in ("baseline", "copy"):
            cfg = ServerConfig(model=args.baseline, name=name, args=CPU_ARGS, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
            servers[name] = stack.enter_context(VLLMServer(cfg, log_path=out / name / "server.log"))

        def probe(name: str, where: Path, s=one):
            srv = servers[name]
            return run_probe(srv.endpoint, where, s, tokenizer=args.baseline,
                             checkpoint=args.baseline, server_log=srv.log_path, check=False)

        for rep in range(args.reps):
            here = out / f"rep{rep:02d}"
            probe("baseline", here / "old-baseline", full)  # the old path's quiet probe, as a cached one
            order = plan("baseline", ["copy"], args.rounds)
            stop, burner = multiprocessing.Event(), []
            for k, s in enumerate(order):
                if k == len(order) // 2 and not args.no_burn:
                    burner = [multiprocessing.Process(target=burn, args=([c], stop), daemon=True) for c in cores]
                    for b in burner:
                        b.start()
                probe(s.variant, here / f"r{s.round}-{s.index}-{s.variant}")
            probe("copy", here / "old-copy", full)  # the old path: the candidate probed now, under the load
            stop.set()
            for b in burner:
                b.join()
            tally.add(rep, analyze(here, args.rounds))
    tally.summary()
    return 0


if __name__ == "__main__":
    sys.exit(main())
