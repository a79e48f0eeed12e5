"""`quantgate recall`: the needle-in-a-haystack grid against a running server (logic in needle/recall modules).

Every check on the input (kinds, depths, lengths against the model's and the server's context, the tokenizer,
the baseline directory, prompts that would not fit) runs before the first chat request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import resolve_api_key
from quantgate.recall import needle as nd, run as rc


def recall(
    endpoint: Annotated[str, typer.Option(help="OpenAI-compatible server, e.g. http://127.0.0.1:8000")],
    model: Annotated[str, typer.Option(help="served model name")],
    tokenizer: Annotated[Path, typer.Option(help="the model's folder: tokenizer and chat template")],
    out: Annotated[Path, typer.Option(help="output directory; re-running into it resumes")],
    lengths: Annotated[str, typer.Option(help="prompt lengths in tokens, comma-separated")] = "1024,2048,4096",
    depths: Annotated[str, typer.Option(help="needle depths in percent, comma-separated")] = "0,25,50,75,100",
    kinds: Annotated[str, typer.Option(help="needle kinds: number,name,multilingual,multi")] = "number,name,multilingual,multi",
    samples: Annotated[int, typer.Option(min=1, help="prompts per (length, depth, kind) cell")] = 2,
    seed: Annotated[int, typer.Option(help="generator seed (same seed, same prompts)")] = 0,
    baseline: Annotated[Optional[Path], typer.Option(help="baseline run directory: also write deltas")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(min=1, help="served context (default: asked from the server)")] = None,
    max_answer_tokens: Annotated[int, typer.Option(min=1, help="answer tokens reserved in the context")] = 32,
    api_key_env: Annotated[Optional[str], typer.Option(help="environment variable holding the API key")] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="requests in flight")] = 4,
    timeout: Annotated[float, typer.Option(help="seconds per request")] = 300.0,
    needles: Annotated[Optional[Path], typer.Option(help="needle data YAML (default eval_sets/recall_needles.yaml)")] = None,
    filler: Annotated[Optional[Path], typer.Option(help="filler text (default eval_sets/recall_filler.txt)")] = None,
    progress: Annotated[bool, typer.Option(help="show a progress bar")] = True,
) -> None:
    """Long-context exact recall (needle in a haystack) per length, depth and needle kind; heatmaps + JSON."""
    kind_list = nd.parse_kinds(kinds)
    depth_list = nd.parse_ints(depths, "--depths", 0, 100)
    length_list = nd.parse_ints(lengths, "--lengths", 1)
    if max_model_len is not None:
        nd.check_lengths(length_list, max_model_len, max_answer_tokens, "--max-model-len")
    api_key = resolve_api_key(api_key_env)
    if baseline is not None and not (baseline / "requests.jsonl").is_file():
        raise QuantgateError("no requests.jsonl in the baseline directory", where=f"--baseline {baseline}",
                             fix="give the --out directory of a finished `quantgate recall` run")
    if max_model_len is None:
        max_model_len = rc.served_max_model_len(endpoint, model, api_key)
        if max_model_len is None:
            raise QuantgateError("the server does not report max_model_len", where=f"--endpoint {endpoint}",
                                 fix="pass --max-model-len (the served context)")
        source = f"max_model_len served at {endpoint}"
    else:
        source = "--max-model-len"
    prompts, grid = rc.build_checked_grid(tokenizer, length_list, depth_list, kind_list, samples, seed=seed,
                                          max_model_len=max_model_len, max_answer_tokens=max_answer_tokens,
                                          source=source, needles=needles, filler=filler)
    summary = rc.run_recall(prompts, out, endpoint=endpoint, model=model, api_key=api_key, grid=grid,
                            max_answer_tokens=max_answer_tokens, concurrency=concurrency, timeout_s=timeout,
                            progress=progress, baseline=baseline)
    o = summary["overall"]
    print(f"{o['n']} answered, {o['n_error']} failed; recall {_f(o['recall'])}, exact {_f(o['exact'])} -> {out}")
    for k, s in summary["by_kind"].items():
        print(f"  {k:<13} recall {_f(s['recall'])}  exact {_f(s['exact'])}  (n={s['n']})")
    if "delta" in summary:
        d = summary["delta"]["overall"]
        print(f"  vs baseline: {_f(d['base'])} -> {_f(d['cand'])} (delta {_f(d['delta'], '+.3f')},"
              f" {summary['delta']['n_paired']} paired, {len(summary['delta']['regressions'])} regressions)")


def _f(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)
