"""`quantgate perf` (probe one served variant, optionally under a workload profile) and `quantgate perf-compare`
(candidate/baseline ratios with their intervals)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from quantgate.base.errors import ConfigError
from quantgate.base.fileio import resolve_api_key, write_json
from quantgate.base.http import Endpoint
from quantgate.perf.compare import compare
from quantgate.perf.models import SLO, PerfResult, ProbeSettings
from quantgate.perf.probe import load_result, probe, run_probe
from quantgate.perf.workloads import WORKLOADS, PerfOverrides, settings, write_requests
from quantgate.target.hardware import get_profile


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"bad concurrency list {text!r}", where="--concurrency", fix="comma-separated integers, e.g. 1,8,32") from None
    if not levels or min(levels) < 1:
        raise ConfigError(f"bad concurrency list {text!r}", where="--concurrency", fix="comma-separated integers >= 1, e.g. 1,8,32")
    return levels


FIXED_DEFAULTS = {"concurrency": [1, 8, 32], "num_prompts": 64, "input_len": 128, "output_len": 32, "repeats": 3}


def workload_settings(workload: str, hardware: str | None, overrides: PerfOverrides) -> ProbeSettings:
    """The probe of `--workload` on `--hardware`; the options given on the command line override the profile."""
    if workload not in WORKLOADS:
        raise ConfigError(f"unknown workload {workload!r}", where="--workload", fix=f"use one of {', '.join(WORKLOADS)}")
    if hardware is None:
        raise ConfigError("--workload needs --hardware: the probe's budget is set per hardware", where="--hardware",
                          fix="pass a profile id of quant_recipes/hardware.yaml, e.g. --hardware x86-cpu")
    return settings(workload, get_profile(hardware), overrides)


def show(result: PerfResult, console: Console) -> None:
    t = Table(title=f"{result.model}: medians of {result.repeats} run(s), {result.workload.num_prompts} prompts "
                    f"{result.workload.input_len}->{result.workload.output_len} tokens")
    for col in ("conc.", "out tok/s", "req/s", "goodput req/s", "SLO met", "TTFT p50/p95 ms", "ITL p50/p95 ms", "errors"):
        t.add_column(col, justify="right")

    def f(v: float | None, d: int = 1) -> str:
        return "-" if v is None else f"{v:.{d}f}"

    for m in result.medians:
        t.add_row(str(m.concurrency), f(m.output_tok_s), f(m.requests_s, 2), f(m.goodput_rps, 2),
                  "-" if m.slo_attainment is None else f"{m.slo_attainment:.0%}", f"{f(m.ttft_p50_ms, 0)} / {f(m.ttft_p95_ms, 0)}",
                  f"{f(m.itl_p50_ms, 0)} / {f(m.itl_p95_ms, 0)}", f"{m.error_rate:.0%}")
    console.print(t)
    show_cost(result, console)
    if result.weights_bytes is not None:
        console.print(f"weights on disk: {result.weights_bytes / 2**20:.1f} MiB")
    if result.engine:
        e = result.engine
        console.print(f"engine: weights {e.weights_gib} GiB, KV cache {e.kv_cache_gib} GiB = {e.kv_cache_tokens} tokens "
                      f"({e.kv_max_concurrency}x {e.max_model_len}-token requests)")
    if result.planner:
        p = result.planner
        console.print(f"planner: KV {p.kv_pool_gib_per_replica:.2f} GiB = {p.kv_tokens_per_replica} tokens per replica")


def show_cost(result: PerfResult, console: Console) -> None:
    """What the probe cost and saw: time against its budget, where a sweep stopped, engine metrics."""
    sw, em = result.sweep, result.engine_metrics
    if result.workload.profile:
        console.print(f"workload profile: {result.workload.profile}; SLO {result.workload.slo.model_dump() if result.workload.slo else None}")
    budget = f" of a {sw.budget_s:g} s budget{' (over)' if sw.over_budget else ''}" if sw and sw.budget_s else ""
    console.print(f"probe cost: {result.seconds:.1f} s{budget}" + (f", warm-up {sw.warmup_s:.1f} s" if sw and sw.warmup_s else ""))
    if sw and sw.stopped:
        console.print(f"sweep stopped: {sw.stopped}")
    if sw and sw.skipped:
        console.print(f"runs skipped: {len(sw.skipped)} ({sw.skipped[0].reason})")
    if em and em.samples:
        def pct(x: float | None) -> str:
            return "-" if x is None else f"{x:.1%}"

        console.print(f"engine: KV cache usage max {pct(em.kv_usage_max)}, preemptions {em.preemptions}, prefix-cache hit "
                      f"rate {pct(em.prefix_hit_rate)} ({em.samples} /metrics samples)")
    elif em and em.error:
        console.print(f"engine metrics: {em.error}")


def perf(
    endpoint: str = typer.Option(..., "--endpoint", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1"),
    model: str = typer.Option(..., "--model", help="served model name"),
    out: Path = typer.Option(..., "--out", help="folder for perf.json and the raw vLLM results"),
    concurrency: str | None = typer.Option(None, "--concurrency", help="comma-separated concurrency levels [default: "
                                           "1,8,32, or the workload profile's]"),
    tokenizer: Path | None = typer.Option(None, "--tokenizer", help="tokenizer folder (default: the server's model folder, if here)"),
    num_prompts: int | None = typer.Option(None, "--num-prompts", help="requests per level and repeat [default: 64, or the budget's]"),
    input_len: int | None = typer.Option(None, "--input-len", help="prompt tokens per request (random dataset) [default: 128, or the budget's]"),
    output_len: int | None = typer.Option(None, "--output-len", help="output tokens per request (EOS ignored) [default: 32, or the budget's]"),
    repeats: int | None = typer.Option(None, "--repeats", help="runs per level; medians are reported [default: 3, or the budget's]"),
    seed: int = typer.Option(0, "--seed"),
    warmups: int = typer.Option(2, "--warmups", help="unmeasured requests before each run"),
    api_key_env: str | None = typer.Option(None, "--api-key-env", help="environment variable holding the API key"),
    checkpoint: Path | None = typer.Option(None, "--checkpoint", help="checkpoint folder: weights size on disk"),
    server_log: Path | None = typer.Option(None, "--server-log", help="vLLM server log: engine memory for weights and KV"),
    plan: Path | None = typer.Option(None, "--plan", help="plan JSON (quantgate plan --out): the planner's KV capacity"),
    workload: str | None = typer.Option(None, "--workload", help=f"workload profile ({', '.join(WORKLOADS)}; "
                                        "quant_recipes/workloads.yaml): its levels, SLO and budget; options given override"),
    hardware: str | None = typer.Option(None, "--hardware", help="hardware profile id whose probe budget applies (with --workload)"),
    ttft_ms: float | None = typer.Option(None, "--slo-ttft-ms", help="SLO: time to first token per request (with --workload)"),
    tpot_ms: float | None = typer.Option(None, "--slo-tpot-ms", help="SLO: time per output token per request (with --workload)"),
    budget_s: float | None = typer.Option(None, "--budget-s", help="no run starts after this many seconds (with --workload)"),
    lengths_from: Path | None = typer.Option(None, "--lengths-from", help="eval set JSONL: send its prompts (their own "
                                             "lengths) instead of random ones, each generating --output-len tokens (with --workload)"),
) -> None:
    """Probe a served variant with vLLM's benchmark client: throughput, goodput, TTFT/ITL, memory; writes OUT/perf.json.
    With --workload, the profile decides the levels (a sweep that stops at saturation for `throughput`), the SLO,
    repeats and the time budget; --concurrency, --repeats, --num-prompts, --input-len and --output-len given override it."""
    at = Endpoint(endpoint, model, resolve_api_key(api_key_env))
    io: dict[str, Any] = dict(tokenizer=tokenizer, checkpoint=checkpoint, server_log=server_log, plan=plan)
    given = {"concurrency": parse_levels(concurrency) if concurrency is not None else None, "num_prompts": num_prompts,
             "input_len": input_len, "output_len": output_len, "repeats": repeats}
    if workload is None:
        fixed: dict[str, Any] = {**FIXED_DEFAULTS, **{k: v for k, v in given.items() if v is not None}}
        result = probe(at, out, seed=seed, warmups=warmups, **fixed, **io)
    else:
        slo = {k: v for k, v in (("ttft_ms", ttft_ms), ("tpot_ms", tpot_ms)) if v is not None}
        over = PerfOverrides(slo=SLO(**slo) if slo else None, budget_s=budget_s, **{k: v for k, v in given.items() if v is not None})
        s = workload_settings(workload, hardware, over)
        if lengths_from is not None:
            s = s.model_copy(update={"requests": str(write_requests(lengths_from, Path(out) / "requests.json"))})
        result = run_probe(at, out, s, **io)
    show(result, Console())
    print(f"wrote {Path(out) / 'perf.json'}")


def _ci(r: dict) -> str:
    if r.get("value") is None:
        return "-"
    ends = f" [{r['low']:.3f}, {r['high']:.3f}]" if r.get("low") is not None else " (no interval: < 2 runs a side)"
    return f"{r['value']:.3f}{ends}"


def show_comparison(result: dict, console: Console) -> None:
    """The workload profile's pay-off figures, then every ratio per level, each with its interval."""
    iv = result["intervals"]
    console.print(f"candidate {result['candidate']} / baseline {result['baseline']}: {iv['level']:.0%} intervals "
                  f"({iv['method']}; {iv['pairing']}), size ratio {result['size_ratio']}, KV tokens ratio "
                  f"{result['kv_tokens_ratio']}")
    if result.get("decide"):
        t = Table(title=f"pay-off figures of the {result['workload']} profile (candidate / baseline)")
        for col in ("figure", "at", "baseline", "candidate", "ratio [interval]", "better"):
            t.add_column(col, justify="right")
        for d in result["decide"]:
            at = f"c={d['concurrency']}" if d["concurrency"] is not None else "best level"
            t.add_row(d["figure"], at, f"{d['baseline']}", f"{d['candidate']}", _ci(d["ratio"]), "lower" if d["lower_is_better"] else "higher")
        console.print(t)
    t = Table(title="ratios per concurrency level (candidate / baseline)")
    names = ("throughput_ratio", "goodput_ratio", "ttft_ratio", "tpot_ratio", "itl_p95_ratio")
    for col in ("conc.", *names):
        t.add_column(col, justify="right")
    for row in result["by_concurrency"]:
        t.add_row(str(row["concurrency"]), *(_ci(row["ci"][n]) for n in names))
    console.print(t)
    if result["slo_concurrency"]:
        console.print(f"highest concurrency meeting the SLO: {result['slo_concurrency']}")
    for n in result["notes"]:
        console.print(f"note: {n}")


def perf_compare(
    base_dir: Path = typer.Argument(..., help="baseline probe folder (or its perf.json)"),
    cand_dir: Path = typer.Argument(..., help="candidate probe folder (or its perf.json)"),
    at: int | None = typer.Option(None, "--at", help="concurrency of the headline ratios (default: highest common)"),
    out: Path | None = typer.Option(None, "--out", help="also write the comparison JSON here"),
    level: float = typer.Option(0.90, "--level", help="two-sided level of the intervals (0.90: each end a one-sided 95% bound)"),
    paired: bool = typer.Option(False, "--paired", help="pair repeat i of both probes (variants served in turn, round by round)"),
    as_json: bool = typer.Option(False, "--json", help="print the comparison as JSON instead of tables"),
) -> None:
    """Candidate/baseline ratios of two probes with confidence intervals over the repeats (size, throughput, goodput,
    TTFT, TPOT, ITL, KV capacity) and the workload profile's pay-off figures."""
    if not 0 < level < 1:
        raise ConfigError(f"--level {level} is not between 0 and 1", where="--level", fix="e.g. --level 0.9")
    result = compare(load_result(base_dir), load_result(cand_dir), at=at, level=level, paired=paired)
    if out:
        write_json(out, result)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        show_comparison(result, Console(width=160))
