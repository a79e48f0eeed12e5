"""`quantgate recall`: the needle-in-a-haystack grid against a running server (logic in quantgate.recall).

Every check on the input (kinds, depths, lengths against the model's and the server's context, the tokenizer,
the baseline directory, prompts that would not fit) runs before the first chat request.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from quantgate.base.runfiles import CELLS, DELTA, REQUESTS
from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import resolve_api_key
from quantgate.base.http import Endpoint
from quantgate.recall import haystack as hs, needle as nd, run as rc
from quantgate.recall.resultfile import RecallCells, RecallDelta, load_recall_cells, load_recall_delta


def recall(
    endpoint: Annotated[str, typer.Option(help="OpenAI-compatible server, e.g. http://127.0.0.1:8000")],
    model: Annotated[str, typer.Option(help="served model name")],
    tokenizer: Annotated[Path, typer.Option(help="the model's folder: tokenizer and chat template")],
    out: Annotated[Path, typer.Option(help="output directory; re-running into it resumes")],
    lengths: Annotated[str, typer.Option(help="prompt lengths in tokens, comma-separated")] = "1024,2048,4096",
    depths: Annotated[str, typer.Option(help="needle depths in percent, comma-separated")] = "0,25,50,75,100",
    kinds: Annotated[str, typer.Option(help="needle kinds: number,name,multilingual,multi")] = "number,name,multilingual,multi",
    samples: Annotated[int, typer.Option(min=1, help="needles per (length, depth, kind) cell")] = 2,
    ask: Annotated[str, typer.Option(help="layout: turns (one haystack per length, kind and sample holding a needle "
                                          "at every depth, one question each), together (one question for all), "
                                          "single (one needle per haystack)")] = "turns",
    seed: Annotated[int, typer.Option(help="generator seed (same seed, same prompts)")] = 0,
    baseline: Annotated[Path | None, typer.Option(help="baseline run directory: also write deltas")] = None,
    max_model_len: Annotated[int | None, typer.Option(min=1, help="served context (default: asked from the server)")] = None,
    max_answer_tokens: Annotated[int, typer.Option(min=1, help="answer cap per needle (each request gets what its needles need, at most this)")] = 32,
    api_key_env: Annotated[str | None, typer.Option(help="environment variable holding the API key")] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="most requests in flight (fewer when prompts are long)")] = 8,
    deadline: Annotated[float, typer.Option(min=1, help="seconds the work in flight may take at the measured prefill "
                                                        "rate; deadlines are sized from it")] = 300.0,
    needles: Annotated[Path | None, typer.Option(help="needle data YAML (default eval_sets/recall_needles.yaml)")] = None,
    filler: Annotated[Path | None, typer.Option(help="filler text (default eval_sets/recall_filler.txt)")] = None,
    progress: Annotated[bool, typer.Option(help="print progress lines (counts, rate, ETA) on stderr")] = True,
) -> None:
    """Long-context exact recall (needle in a haystack) per length, depth and needle kind; heatmaps + JSON."""
    if ask not in hs.ASK:
        raise QuantgateError(f"unknown layout {ask!r}", where="--ask", fix=f"use one of: {', '.join(hs.ASK)}")
    kind_list = nd.parse_kinds(kinds)
    depth_list = nd.parse_ints(depths, "--depths", 0, 100)
    length_list = nd.parse_ints(lengths, "--lengths", 1)
    if max_model_len is not None:
        nd.check_lengths(length_list, max_model_len, max_answer_tokens, "--max-model-len")
    at = Endpoint(endpoint, model, resolve_api_key(api_key_env))
    if baseline is not None and not (baseline / REQUESTS).is_file():
        raise QuantgateError("no requests.jsonl in the baseline directory", where=f"--baseline {baseline}",
                             fix="give the --out directory of a finished `quantgate recall` run")
    if max_model_len is None:
        max_model_len = rc.served_max_model_len(at)
        if max_model_len is None:
            raise QuantgateError("the server does not report max_model_len", where=f"--endpoint {endpoint}",
                                 fix="pass --max-model-len (the served context)")
        source = f"max_model_len served at {endpoint}"
    else:
        source = "--max-model-len"
    prompts, grid = rc.build_checked_grid(tokenizer, length_list, depth_list, kind_list, samples, seed=seed,
                                          max_model_len=max_model_len, max_answer_tokens=max_answer_tokens,
                                          source=source, needles=needles, filler=filler, ask=ask)  # type: ignore[arg-type]
    rc.run_recall(prompts, out, endpoint=at, grid=grid,
                  concurrency=concurrency, deadline_s=deadline, baseline=baseline,
                  log=(lambda line: print(line, file=sys.stderr)) if progress else None)
    _report(load_recall_cells(out / CELLS), load_recall_delta(out / DELTA) if baseline is not None else None, out)


def _report(cells: RecallCells, delta: RecallDelta | None, out: Path) -> None:
    o, c = cells.overall, cells.cost
    print(f"{o.n} needles answered, {o.n_error} failed ({cells.status}); recall {_f(o.recall)}, "
          f"exact {_f(o.exact)} -> {out}")
    hit = c["run"].get("prefix_cache_hit_rate")
    print(f"  cost: {c['cells']} cells, {c['haystacks']} haystacks, {c['requests']} requests, {c['needles']} needles; "
          f"{c['prompt_tokens']} prompt tokens sent, about {c['prompt_tokens_computed']} to compute; "
          f"{c['run']['wall_s']:.0f} s; prefix-cache hit rate {'-' if hit is None else f'{hit:.0%}'}")
    for k, s in cells.by_kind.items():
        print(f"  {k:<13} recall {_f(s.recall)}  exact {_f(s.exact)}  (n={s.n})")
    if delta is not None:
        d = delta.overall
        print(f"  vs baseline: {_f(d.base)} -> {_f(d.cand)} (delta {_f(d.delta, '+.3f')},"
              f" {delta.n_paired} paired, {len(delta.regressions)} regressions)")


def _f(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)
