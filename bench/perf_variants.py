"""Serve a baseline and its quantized variants one at a time, probe each, print medians and candidate/baseline ratios.

    .venv/bin/python bench/perf_variants.py BASELINE_DIR [CANDIDATE_DIR ...] [--concurrency 1,4] [--repeats 3] [--rounds 1]
    .venv/bin/python bench/perf_variants.py BASELINE_DIR CANDIDATE_DIR --workload latency [--hardware x86-cpu] --rounds 2

Every variant gets the same workload (the baseline's tokenizer, same seed and lengths) and the same serving
arguments. With --rounds N the variants are served in turn N times (A B A B ...), so load drifting on a shared
machine hits every variant alike; all runs of a variant are pooled before the medians. Results land in
--out (default results/perf/<timestamp>/): <variant>/perf.json and <variant>.vs.baseline.json. With --workload the
probe is the release's (quant_recipes/workloads.yaml: levels, SLO, budget per round); the ratios get 90% intervals,
paired by round and repeat when --rounds > 1. The CPU model is printed with the figures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import write_json
from quantgate.base.paths import results_dir
from quantgate.perf.compare import compare, level_medians
from quantgate.perf.models import PerfResult
from quantgate.perf.probe import probe, run_probe
from quantgate.perf.workloads import PerfOverrides, settings
from quantgate.target.hardware import get_profile
from quantgate.serving.server import ServerConfig, VLLMServer

# CPU serving arguments: eager BF16 serves the demo model correctly (docs/design.md, 'Measured facts'; compiled BF16 does not)
CPU_ARGS = ["--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "2048"]


def pooled(parts: list[PerfResult]) -> PerfResult:
    """One result from several rounds: runs renumbered, medians over all of them."""
    runs = []
    for i, p in enumerate(parts):
        runs += [r.model_copy(update={"repeat": i * p.repeats + r.repeat}) for r in p.runs]
    first = parts[0]
    errors = [p.error for p in parts if p.error]
    return first.model_copy(update={"runs": runs, "medians": level_medians(runs), "repeats": sum(p.repeats for p in parts),
                                    "status": "error" if errors else "ok", "error": errors[0] if errors else None,
                                    "seconds": sum(p.seconds for p in parts)})


def fmt(v: float | None, d: int = 1) -> str:
    return "   -" if v is None else f"{v:.{d}f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", nargs="+", type=Path, help="baseline folder first, then candidate folders")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="runs per level each time a variant is served")
    ap.add_argument("--rounds", type=int, default=1, help="times each variant is served, in turn")
    ap.add_argument("--serve-args", default=" ".join(CPU_ARGS), help="extra `vllm serve` arguments, same for every variant")
    ap.add_argument("--dtypes", default=None, help="comma list, one per checkpoint: each variant's --dtype (a "
                    "release serves the CPU baseline in float32 and quantized variants in bfloat16)")
    ap.add_argument("--kv-gib", default="1", help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--workload", choices=["latency", "throughput", "fit"], default=None, help="probe this profile")
    ap.add_argument("--hardware", default="x86-cpu", help="hardware profile whose probe budget applies (--workload)")
    args = ap.parse_args()

    levels = [int(x) for x in args.concurrency.split(",")]
    out = args.out or results_dir() / "perf" / f"{dt.datetime.now():%Y%m%dT%H%M%S}"
    names = []
    for ck in args.checkpoints:  # unique, readable names: folder names, numbered if they repeat
        name = ck.resolve().name
        names.append(name if name not in names else f"{name}-{len(names)}")
    tokenizer = args.checkpoints[0]
    dtypes = args.dtypes.split(",") if args.dtypes else [None] * len(names)
    if len(dtypes) != len(names):
        ap.error(f"--dtypes gives {len(dtypes)} dtypes for {len(names)} checkpoints")
    parts: dict[str, list[PerfResult]] = {n: [] for n in names}
    for rnd in range(args.rounds):
        for name, ck, dtype in zip(names, args.checkpoints, dtypes):
            serve_args = args.serve_args.split()
            if dtype is not None:  # this variant's own dtype in place of the shared one
                if "--dtype" in serve_args:
                    serve_args[serve_args.index("--dtype") + 1] = dtype
                else:
                    serve_args += ["--dtype", dtype]
            cfg = ServerConfig(model=ck, name=name, args=serve_args, env={"VLLM_CPU_KVCACHE_SPACE": args.kv_gib})
            where = out / name / f"round{rnd}"
            print(f"[round {rnd + 1}/{args.rounds}] serving {name} ({ck}) ...", flush=True)
            try:
                with VLLMServer(cfg, log_path=where / "server.log") as srv:
                    io = dict(tokenizer=tokenizer, checkpoint=ck, server_log=srv.log_path, check=False)
                    if args.workload:
                        s = settings(args.workload, get_profile(args.hardware), PerfOverrides(repeats=args.repeats))
                        parts[name].append(run_probe(srv.endpoint, where, s, **io))
                    else:
                        parts[name].append(probe(srv.endpoint, where, concurrency=levels, num_prompts=args.num_prompts,
                                                 input_len=args.input_len, output_len=args.output_len, repeats=args.repeats, **io))
            except QuantgateError as exc:
                print(f"  {name}: {exc.render()}", flush=True)
    results = {n: pooled(p) for n, p in parts.items() if p}
    for name, res in results.items():
        write_json(out / name / "perf.json", res.model_dump(mode="json"))

    print(f"\nmedians of {args.repeats * args.rounds} run(s) per level; {args.num_prompts} prompts, "
          f"{args.input_len}->{args.output_len} tokens; results in {out}")
    print(f"{'variant':<28}{'conc':>5}{'tok/s':>9}{'req/s':>8}{'TTFT p50':>10}{'p95':>8}{'ITL p50':>9}{'p95':>8}{'err':>6}{'MiB':>8}{'KV tok':>9}")
    for name, res in results.items():
        for m in res.medians:
            kv = res.engine.kv_cache_tokens if res.engine else None
            print(f"{name:<28}{m.concurrency:>5}{fmt(m.output_tok_s):>9}{fmt(m.requests_s, 2):>8}{fmt(m.ttft_p50_ms, 0):>10}"
                  f"{fmt(m.ttft_p95_ms, 0):>8}{fmt(m.itl_p50_ms, 0):>9}{fmt(m.itl_p95_ms, 0):>8}{m.error_rate:>6.0%}"
                  f"{fmt((res.weights_bytes or 0) / 2**20, 0):>8}{kv or '-':>9}")
        if res.error:
            print(f"  error: {res.error}")
    base = results.get(names[0])
    if base is None or base.status != "ok":
        print("no usable baseline probe: no ratios")
        return 1
    print(f"\nratios candidate/baseline ({names[0]}):")
    print(f"{'variant':<28}{'conc':>5}{'size':>7}{'tok/s':>7}{'req/s':>7}{'TTFT':>7}{'TTFT95':>8}{'ITL':>7}{'ITL95':>7}")
    for name in names[1:]:
        if name not in results or results[name].status != "ok":
            print(f"{name:<28} (probe failed: no ratios)")
            continue
        cmp = compare(base, results[name], paired=args.rounds > 1)
        write_json(out / f"{name}.vs.baseline.json", cmp)
        for d in cmp["decide"]:
            r = d["ratio"]
            print(f"  {cmp['workload']} pay-off figure {d['figure']} (at {d['concurrency'] or 'best level'}): "
                  f"{fmt(r['value'], 3)} [{fmt(r['low'], 3)}, {fmt(r['high'], 3)}] ({r['method']}, {r['n_base']}+{r['n_cand']} runs)")
        for row in cmp["by_concurrency"]:
            print(f"{name:<28}{row['concurrency']:>5}{fmt(cmp['size_ratio'], 2):>7}{fmt(row['throughput_ratio'], 2):>7}"
                  f"{fmt(row['request_throughput_ratio'], 2):>7}{fmt(row['ttft_ratio'], 2):>7}{fmt(row['ttft_p95_ratio'], 2):>8}"
                  f"{fmt(row['itl_ratio'], 2):>7}{fmt(row['itl_p95_ratio'], 2):>7}")
        for note in cmp["notes"]:
            print(f"  note: {note}")
    print(f"\nCPU: {cpu_model()}; probe seconds per variant: "
          f"{', '.join(f'{n} {r.seconds:.0f}' for n, r in results.items())}")
    return 0


def cpu_model() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
