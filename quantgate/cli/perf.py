"""`quantgate perf` (probe one served variant) and `quantgate perf-compare` (candidate/baseline ratios)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from quantgate.base.errors import ConfigError
from quantgate.base.fileio import resolve_api_key, write_json
from quantgate.perf.compare import compare
from quantgate.perf.models import PerfResult
from quantgate.perf.probe import load_result, probe


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"bad concurrency list {text!r}", where="--concurrency", fix="comma-separated integers, e.g. 1,8,32") from None
    if not levels or min(levels) < 1:
        raise ConfigError(f"bad concurrency list {text!r}", where="--concurrency", fix="comma-separated integers >= 1, e.g. 1,8,32")
    return levels


def show(result: PerfResult, console: Console) -> None:
    t = Table(title=f"{result.model}: medians of {result.repeats} run(s), {result.workload.num_prompts} prompts "
                    f"{result.workload.input_len}->{result.workload.output_len} tokens")
    for col in ("conc.", "out tok/s", "req/s", "TTFT p50/p95 ms", "ITL p50/p95 ms", "errors"):
        t.add_column(col, justify="right")

    def f(v: float | None, d: int = 1) -> str:
        return "-" if v is None else f"{v:.{d}f}"

    for m in result.medians:
        t.add_row(str(m.concurrency), f(m.output_tok_s), f(m.requests_s, 2), f"{f(m.ttft_p50_ms, 0)} / {f(m.ttft_p95_ms, 0)}",
                  f"{f(m.itl_p50_ms, 0)} / {f(m.itl_p95_ms, 0)}", f"{m.error_rate:.0%}")
    console.print(t)
    if result.weights_bytes is not None:
        console.print(f"weights on disk: {result.weights_bytes / 2**20:.1f} MiB")
    if result.engine:
        e = result.engine
        console.print(f"engine: weights {e.weights_gib} GiB, KV cache {e.kv_cache_gib} GiB = {e.kv_cache_tokens} tokens "
                      f"({e.kv_max_concurrency}x {e.max_model_len}-token requests)")
    if result.planner:
        p = result.planner
        console.print(f"planner: KV {p.kv_pool_gib_per_replica:.2f} GiB = {p.kv_tokens_per_replica} tokens per replica")


def perf(
    endpoint: str = typer.Option(..., "--endpoint", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1"),
    model: str = typer.Option(..., "--model", help="served model name"),
    out: Path = typer.Option(..., "--out", help="folder for perf.json and the raw vLLM results"),
    concurrency: str = typer.Option("1,8,32", "--concurrency", help="comma-separated concurrency levels"),
    tokenizer: Path | None = typer.Option(None, "--tokenizer", help="tokenizer folder (default: the server's model folder, if here)"),
    num_prompts: int = typer.Option(64, "--num-prompts", help="requests per level and repeat"),
    input_len: int = typer.Option(128, "--input-len", help="prompt tokens per request (random dataset)"),
    output_len: int = typer.Option(32, "--output-len", help="output tokens per request (EOS ignored)"),
    repeats: int = typer.Option(3, "--repeats", help="runs per level; medians are reported"),
    seed: int = typer.Option(0, "--seed"),
    warmups: int = typer.Option(2, "--warmups", help="unmeasured requests before each run"),
    api_key_env: str | None = typer.Option(None, "--api-key-env", help="environment variable holding the API key"),
    checkpoint: Path | None = typer.Option(None, "--checkpoint", help="checkpoint folder: weights size on disk"),
    server_log: Path | None = typer.Option(None, "--server-log", help="vLLM server log: engine memory for weights and KV"),
    plan: Path | None = typer.Option(None, "--plan", help="plan JSON (quantgate plan --out): the planner's KV capacity"),
) -> None:
    """Probe a served variant with vLLM's benchmark client: throughput, TTFT/ITL, memory; writes OUT/perf.json."""
    api_key = resolve_api_key(api_key_env)
    result = probe(endpoint, model, out, concurrency=parse_levels(concurrency), num_prompts=num_prompts, input_len=input_len,
                   output_len=output_len, repeats=repeats, seed=seed, warmups=warmups, tokenizer=tokenizer, api_key=api_key,
                   checkpoint=checkpoint, server_log=server_log, plan=plan)
    show(result, Console())
    print(f"wrote {Path(out) / 'perf.json'}")


def perf_compare(
    base_dir: Path = typer.Argument(..., help="baseline probe folder (or its perf.json)"),
    cand_dir: Path = typer.Argument(..., help="candidate probe folder (or its perf.json)"),
    at: int | None = typer.Option(None, "--at", help="concurrency of the headline ratios (default: highest common)"),
    out: Path | None = typer.Option(None, "--out", help="also write the comparison JSON here"),
) -> None:
    """Candidate/baseline ratios of two probes (size, throughput, TTFT, ITL, KV capacity) as JSON."""
    result = compare(load_result(base_dir), load_result(cand_dir), at=at)
    if out:
        write_json(out, result)
    print(json.dumps(result, indent=2))
