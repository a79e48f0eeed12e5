"""`quantgate eval` and `quantgate compare`: thin commands over quantgate.evals.run, and over quantgate.evals.lmeval
for an lm-evaluation-harness task (`--lm-eval-task`)."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Annotated

import typer

from quantgate.base import progress as progress_lines
from quantgate.base.errors import ConfigError
from quantgate.base.fileio import resolve_api_key
from quantgate.base.http import Endpoint
from quantgate.base.pairedstat import PairedStat
from quantgate.evals.lmeval import run_lm_eval
from quantgate.evals.lmeval_tasks import DEFAULT_INCLUDE, find_tasks
from quantgate.evals.run import compare_dirs, run_eval


def eval_cmd(
    endpoint: Annotated[str, typer.Option(help="OpenAI-compatible server, e.g. http://127.0.0.1:8000")],
    model: Annotated[str, typer.Option(help="served model name")],
    out: Annotated[Path, typer.Option(help="run directory; re-running into it resumes")],
    evalset: Annotated[Path | None, typer.Option(help="eval set JSONL (with its .meta.yaml beside it)")] = None,
    lm_eval_task: Annotated[str | None, typer.Option(help="instead of --evalset: an lm-evaluation-harness task "
                                                        "(a `task:` name under --include-path), run by lm-eval")] = None,
    include_path: Annotated[Path, typer.Option(help="folder of lm-eval task files")] = DEFAULT_INCLUDE,
    num_fewshot: Annotated[int | None, typer.Option(min=0, help="lm-eval few-shot examples (default: the task's)")] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="requests in flight")] = 16,
    limit: Annotated[int | None, typer.Option(min=1, help="N samples, round-robin over categories (CI subsets); an lm-eval task: its first N documents")] = None,
    api_key_env: Annotated[str | None, typer.Option(help="environment variable holding the API key")] = None,
    model_hash: Annotated[str | None, typer.Option(help="checkpoint hash for the cache key (default: the name)")] = None,
    seed: Annotated[int, typer.Option(help="sampling seed sent with every request")] = 0,
    timeout: Annotated[float, typer.Option(help="seconds per request (eval sets; lm-eval: its own 300 s)")] = 120.0,
    max_error_rate: Annotated[float, typer.Option(min=0.0, max=1.0, help="stop when this share of requests fails")] = 0.05,
    progress: Annotated[bool, typer.Option(help="show a progress bar")] = True,
) -> None:
    """Send an eval set (or an lm-eval task) to a running server, score the answers, write the run directory."""
    if (evalset is None) == (lm_eval_task is None):
        raise ConfigError("give exactly one of --evalset or --lm-eval-task", where="--evalset/--lm-eval-task",
                          fix="e.g. --evalset eval_sets/default.jsonl, or --lm-eval-task qg_numbers")
    at = Endpoint(endpoint, model, resolve_api_key(api_key_env))
    if lm_eval_task is not None:
        shown = progress_lines.reporting(f"lm-eval {lm_eval_task}", print) if progress else contextlib.nullcontext()
        with shown:  # lines every 30 s, and a bar on a terminal
            summary = run_lm_eval(_task_file(include_path, lm_eval_task), lm_eval_task, at, out,
                                  model_hash=model_hash, limit=limit, num_fewshot=num_fewshot,
                                  concurrency=concurrency, max_error_rate=max_error_rate)
    else:
        assert evalset is not None  # exactly one of the two is given (checked above)
        summary = run_eval(evalset, at, out, concurrency=concurrency, limit=limit,
                           model_hash=model_hash, seed=seed, timeout_s=timeout, max_error_rate=max_error_rate,
                           progress=progress)
    print(f"{summary['n_answered']}/{summary['n_samples']} answered, error rate {summary['error_rate']:.1%} -> {out}")
    for name, m in summary["metrics"].items():
        cats = "  ".join(f"{c}={v['mean']:.3f}" for c, v in m["by_category"].items())
        print(f"  {name:<16} {m['overall']['mean']:.3f} (n={m['overall']['n']})  {cats}")


def _task_file(include: Path, task: str) -> Path:
    found = find_tasks(include) if include.is_dir() else {}
    if task not in found:
        raise ConfigError(f"no lm-eval task {task!r} under {include}; tasks found there: {', '.join(sorted(found)) or 'none'}",
                          where="--lm-eval-task", fix="name one of them, or point --include-path at your task folder")
    return found[task]


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def compare_cmd(
    base_dir: Annotated[Path, typer.Argument(help="baseline run directory")],
    cand_dir: Annotated[Path, typer.Argument(help="candidate run directory")],
    out: Annotated[Path | None, typer.Option(help="write the full comparison as JSON here")] = None,
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
        for cat, raw in [("ALL", m["overall"]), *m["by_category"].items()]:
            s = PairedStat.model_validate(raw)
            table.add_row(name if cat == "ALL" else "", cat, str(s.n), _fmt(s.base_mean), _fmt(s.cand_mean),
                          _fmt(s.delta, "+.3f"), f"[{_fmt(s.ci_low, '+.3f')}, {_fmt(s.ci_high, '+.3f')}]",
                          _fmt(s.mcnemar_p, ".3g"))
    console = Console()
    console.print(table)
    console.print(f"identical outputs: {_fmt(report['agreement']['overall'], '.1%')}; "
                  f"regressions (right in baseline, wrong in candidate): {len(report['regressions'])}")
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        console.print(f"written: {out}")
