"""`quantgate eval` and `quantgate compare`: thin commands over quantgate.evals.run (imports stay lazy)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Optional

import typer

from quantgate.base.fileio import resolve_api_key
from quantgate.evals.run import compare_dirs, run_eval


def eval_cmd(
    endpoint: Annotated[str, typer.Option(help="OpenAI-compatible server, e.g. http://127.0.0.1:8000")],
    model: Annotated[str, typer.Option(help="served model name")],
    evalset: Annotated[Path, typer.Option(help="eval set JSONL (with its .meta.yaml beside it)")],
    out: Annotated[Path, typer.Option(help="run directory; re-running into it resumes")],
    concurrency: Annotated[int, typer.Option(min=1, help="requests in flight")] = 16,
    limit: Annotated[Optional[int], typer.Option(min=1, help="N samples, round-robin over categories (CI subsets)")] = None,
    api_key_env: Annotated[Optional[str], typer.Option(help="environment variable holding the API key")] = None,
    model_hash: Annotated[Optional[str], typer.Option(help="checkpoint hash for the cache key (default: the name)")] = None,
    seed: Annotated[int, typer.Option(help="sampling seed sent with every request")] = 0,
    timeout: Annotated[float, typer.Option(help="seconds per request")] = 120.0,
    max_error_rate: Annotated[float, typer.Option(min=0.0, max=1.0, help="stop when this share of requests fails")] = 0.05,
    progress: Annotated[bool, typer.Option(help="show a progress bar")] = True,
) -> None:
    """Send an eval set to a running server, score the answers, write the run directory."""
    api_key = resolve_api_key(api_key_env)

    summary = run_eval(evalset, endpoint, model, out, concurrency=concurrency, limit=limit, api_key=api_key,
                       model_hash=model_hash, seed=seed, timeout_s=timeout, max_error_rate=max_error_rate,
                       progress=progress)
    print(f"{summary['n_answered']}/{summary['n_samples']} answered, error rate {summary['error_rate']:.1%} -> {out}")
    for name, m in summary["metrics"].items():
        cats = "  ".join(f"{c}={v['mean']:.3f}" for c, v in m["by_category"].items())
        print(f"  {name:<16} {m['overall']['mean']:.3f} (n={m['overall']['n']})  {cats}")


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def compare_cmd(
    base_dir: Annotated[Path, typer.Argument(help="baseline run directory")],
    cand_dir: Annotated[Path, typer.Argument(help="candidate run directory")],
    out: Annotated[Optional[Path], typer.Option(help="write the full comparison as JSON here")] = None,
    n_boot: Annotated[int, typer.Option(min=100, help="bootstrap resamples")] = 2000,
    seed: Annotated[int, typer.Option(help="bootstrap seed")] = 0,
) -> None:
    """Paired comparison of two runs: deltas with bootstrap CIs, McNemar p-values, regressions."""
    from rich.console import Console
    from rich.table import Table


    report = compare_dirs(base_dir, cand_dir, n_boot=n_boot, seed=seed)
    table = Table(title=f"{report['cand']['model']} vs {report['base']['model']} ({report['n_paired']} paired samples)")
    for col in ("metric", "category", "n", "base", "cand", "delta", "95% CI", "McNemar p"):
        table.add_column(col, justify="left" if col in ("metric", "category") else "right")
    for name, m in report["metrics"].items():
        for cat, s in [("ALL", m["overall"]), *m["by_category"].items()]:
            table.add_row(name if cat == "ALL" else "", cat, str(s["n"]), _fmt(s["base_mean"]), _fmt(s["cand_mean"]),
                          _fmt(s["delta"], "+.3f"), f"[{_fmt(s['ci_low'], '+.3f')}, {_fmt(s['ci_high'], '+.3f')}]",
                          _fmt(s.get("mcnemar_p"), ".3g"))
    console = Console()
    console.print(table)
    console.print(f"identical outputs: {_fmt(report['agreement']['overall'], '.1%')}; "
                  f"regressions (right in baseline, wrong in candidate): {len(report['regressions'])}")
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        console.print(f"written: {out}")
