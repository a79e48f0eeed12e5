"""Start-up time and throughput of the demo model as 2 local nodes (PP=2 across node processes) vs one process.

    .venv/bin/python bench/multinode.py [--concurrency 1,4] [--num-prompts 16] [--repeats 2]

Both layouts serve the same checkpoint as the planner plans them (FP32 on CPU): the single process eager, the
2-node layout compiled (pipeline parallel must compile here; eager PP crashed on the first request).
`--compiled` compiles the single process too (a first compile takes minutes). Both get the same `vllm bench
serve` workload through quantgate's perf probe. The single process is the planner's one-node plan with one CPU
worker (`--gpus 1`), the 2-node layout is `--gpus 1 --nodes 2` on one host (one core per node). Start-up =
launch until the API answers with every node joined; the torch.compile cache (~/.cache/vllm) is warm after the
first start. Prints the figures and the 2-node/1-process ratios; results land in --out (default
results/bench/multinode-<timestamp>/).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quantgate.base.fileio import write_json
from quantgate.base.paths import results_dir
from quantgate.cli.plan import build_plan
from quantgate.perf.probe import probe
from quantgate.serving.multinode import MultiNodeServer, multinode_config_from_plan
from quantgate.serving.server import VLLMServer, config_from_plan
from quantgate.target.catalogue import ensure_demo_model


def servers(model: Path, out: Path, context: int, compiled: bool, timeout_s: float):
    """(name, server) for the one-process and the 2-node layout; neither is started yet."""
    one = build_plan(model, "x86-cpu", context=context, concurrency=4, gpus=1, replicas=1)
    two = build_plan(model, "x86-cpu", context=context, concurrency=4, gpus=1, nodes=2, replicas=1,
                     nodes_share_host=True, master_addr="127.0.0.1")
    single = config_from_plan(one, model, "demo", startup_timeout_s=timeout_s)
    if compiled:  # like the PP layout, which must compile (eager PP crashes on the first request here)
        single.args = [a for a in single.args if a != "--enforce-eager"]
    yield "1-process", VLLMServer(single, log_path=out / "1-process" / "server.log")
    yield "2-node", MultiNodeServer(multinode_config_from_plan(two, model, "demo", startup_timeout_s=timeout_s),
                                    log_dir=out / "2-node")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--compiled", action="store_true",
                    help="compile the single process too (the plan serves it eager); a first compile takes minutes")
    ap.add_argument("--startup-timeout", type=float, default=1200.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    model = ensure_demo_model()
    out = args.out or results_dir() / "bench" / f"multinode-{dt.datetime.now():%Y%m%dT%H%M%S}"
    levels = [int(x) for x in args.concurrency.split(",")]
    rows = {}
    for name, server in servers(model, out, args.context, args.compiled, args.startup_timeout):
        print(f"serving {name}: {' '.join(server.command)}", flush=True)
        t0 = time.perf_counter()
        with server as srv:
            startup = time.perf_counter() - t0
            res = probe(srv.endpoint, out / name, concurrency=levels, num_prompts=args.num_prompts,
                        input_len=args.input_len, output_len=args.output_len, repeats=args.repeats, tokenizer=model,
                        python=srv.config.python)
        rows[name] = (startup, {m.concurrency: m for m in res.medians})
        print(f"  {name}: healthy after {startup:.1f} s", flush=True)
    write_json(out / "summary.json", {n: {"startup_s": s, "medians": {c: m.model_dump() for c, m in ms.items()}}
                                      for n, (s, ms) in rows.items()})
    print(f"\n{args.num_prompts} prompts, {args.input_len}->{args.output_len} tokens, median of {args.repeats} run(s); {out}")
    print(f"{'layout':<11}{'start s':>8}{'conc':>6}{'tok/s':>8}{'req/s':>7}{'TTFT p50':>10}{'ITL p50':>9}")
    for name, (startup, medians) in rows.items():
        for c, m in medians.items():
            print(f"{name:<11}{startup:>8.1f}{c:>6}{m.output_tok_s or 0:>8.1f}{m.requests_s or 0:>7.2f}"
                  f"{m.ttft_p50_ms or 0:>10.0f}{m.itl_p50_ms or 0:>9.0f}")
    (s1, one), (s2, two) = rows["1-process"], rows["2-node"]
    print(f"\n2-node / 1-process: start-up x{s2 / s1:.2f}; " + "; ".join(
        f"throughput at concurrency {c} x{two[c].output_tok_s / one[c].output_tok_s:.2f}" for c in levels
        if one[c].output_tok_s and two[c].output_tok_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
