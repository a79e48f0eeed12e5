"""Recall grid against a served model (adapter): data files, tokenizer, the client, JSON/JSONL and heatmaps.

Output directory:
    prompts.jsonl        one line per prompt: grid position, messages, expected values, measured placement
    answers.jsonl        raw answers from quantgate.evals.client (resumable: a re-run only asks what is missing)
    requests.jsonl       per request: prompt fields (no messages) + output, error, found, recall, exact
    cells.json           grid, overall, by kind, by language and per-cell recall (the numbers behind heatmap.png)
    heatmap.png          recall per (depth, length), one panel per kind
    delta.json, delta_heatmap.png   with a baseline directory: candidate minus baseline, paired by prompt id
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from quantgate.base.errors import QuantgateError
from quantgate.base.http import EndpointError, model_entry, read_results
from quantgate.base.paths import EVAL_SETS
from quantgate.base.yamlconfig import load_model
from quantgate.evals.client import ClientConfig, Request, run
from quantgate.recall import needle as nd, score as recall_score
from quantgate.recall.needle import NeedleData, RecallPrompt, TokenCounter

NEEDLES = EVAL_SETS / "recall_needles.yaml"
FILLER = EVAL_SETS / "recall_filler.txt"


def load_needle_data(path: Path = NEEDLES) -> NeedleData:
    return load_model(path, NeedleData)


def load_filler(path: Path = FILLER) -> list[str]:
    if not Path(path).is_file():
        raise QuantgateError("filler file not found", where=str(path), fix="pass an existing file with --filler")
    lines = [ln.strip() for ln in Path(path).read_text(encoding="utf-8").splitlines()]
    sentences = [ln for ln in lines if ln and not ln.startswith("#")]
    if not sentences:
        raise QuantgateError("no filler sentences (one per line, '#' starts a comment)", where=str(path), fix="add sentences")
    return sentences


def load_tokenizer(path: Path) -> tuple[TokenCounter, int | None]:
    """The model's tokenizer as a TokenCounter, and max_position_embeddings from config.json when present."""
    path = Path(path)
    if not path.is_dir():
        raise QuantgateError("tokenizer directory not found", where=f"--tokenizer {path}",
                             fix="give the model's folder (tokenizer files and chat template)")
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise QuantgateError("no tokenizer files (tokenizer.json, tokenizer_config.json, tokenizer.model) in the folder",
                             where=f"--tokenizer {path}", fix="give the served model's folder")
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # transformers raises many types (OSError, ValueError, ...) for a bad folder
        raise QuantgateError(f"cannot load a tokenizer: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                             where=f"--tokenizer {path}", fix="give the model's folder with tokenizer.json/tokenizer_config.json") from None
    if not getattr(tok, "chat_template", None):
        raise QuantgateError("the tokenizer has no chat template", where=f"--tokenizer {path}",
                             fix="use the folder of the served (instruct) model, which includes its chat template")

    def text(s: str) -> int:
        return len(tok.encode(s, add_special_tokens=False))

    def chat(messages: list[dict]) -> int:
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return len(tok.encode(rendered, add_special_tokens=False))

    max_pos = None
    cfg = path / "config.json"
    if cfg.is_file():
        max_pos = json.loads(cfg.read_text(encoding="utf-8")).get("max_position_embeddings")
    return TokenCounter(text=text, chat=chat), max_pos


def served_max_model_len(endpoint: str, model: str, api_key: str | None, timeout_s: float = 30.0) -> int | None:
    """max_model_len that an OpenAI-compatible server (vLLM) reports for `model` in /v1/models, if any."""
    try:
        return model_entry(endpoint, model, api_key, timeout_s, where=f"--endpoint {endpoint}").get("max_model_len")
    except EndpointError as exc:  # the same words, pointing at this command's options
        where, fix = ("--model", exc.fix) if exc.reason == "not_served" else (exc.where, f"{exc.fix}, or pass --max-model-len")
        raise QuantgateError(exc.message, where=where, fix=fix) from None


def _write_jsonl(path: Path, records: Sequence[dict]) -> None:
    with path.open("w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as fh:
        return [json.loads(ln) for ln in fh if ln.strip()]


def score_answers(prompts: Sequence[RecallPrompt], answers: dict[str, dict]) -> list[dict]:
    out = []
    for p in prompts:
        rec = {k: v for k, v in p.record().items() if k != "messages"}
        ans = answers.get(p.id) or {"output": None, "error": "no answer"}
        usage = ans.get("usage") or {}
        rec.update(output=ans.get("output"), error=ans.get("error"), finish_reason=ans.get("finish_reason"),
                   served_prompt_tokens=usage.get("prompt_tokens"), latency_s=ans.get("latency_s"))
        if rec["error"] is None:
            rec.update(recall_score.score(rec["output"] or "", p.expected, p.other_values))
        else:
            rec.update(found=None, recall=None, exact=None, others_found=None)
        out.append(rec)
    return out


def heatmap(cell_rows: Sequence[dict], path: Path, title: str, *, value: str = "recall", delta: bool = False) -> None:
    """One panel per kind: depth (rows) x length (columns), each cell annotated with its value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    kinds = list(dict.fromkeys(c["kind"] for c in cell_rows))
    lengths = sorted({c["length"] for c in cell_rows})
    depths = sorted({c["depth"] for c in cell_rows})
    fig, axes = plt.subplots(1, len(kinds), figsize=(1.5 + (0.9 * len(lengths) + 0.4) * len(kinds), 1.6 + 0.5 * len(depths)),
                             squeeze=False, sharey=True, layout="constrained")
    cmap, (vmin, vmax) = ("RdBu", (-1.0, 1.0)) if delta else ("viridis", (0.0, 1.0))
    for ax, kind in zip(axes[0], kinds):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for c in cell_rows:
            if c["kind"] == kind and c[value] is not None:
                grid[depths.index(c["depth"]), lengths.index(c["length"])] = c[value]
        im = ax.imshow(grid, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
        for (i, j), v in np.ndenumerate(grid):
            ax.text(j, i, "-" if np.isnan(v) else (f"{v:+.2f}" if delta else f"{v:.2f}"), ha="center", va="center",
                    fontsize=8, color="black" if delta or (not np.isnan(v) and v > 0.5) else "white")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths])
        ax.set_xlabel("prompt tokens")
        ax.set_title(kind)
    axes[0][0].set_ylabel("needle depth")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="recall, candidate - baseline" if delta else value)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def build_checked_grid(tokenizer: Path, lengths: Sequence[int], depths: Sequence[int], kinds: Sequence[str], samples: int, *,
                       seed: int, max_model_len: int, max_answer_tokens: int, source: str = "max_model_len",
                       needles: Path | None = None, filler: Path | None = None) -> tuple[list[RecallPrompt], dict]:
    """The prompts of a grid, every one checked to fit `max_model_len` (from `source`) before anything is sent."""
    data = load_needle_data(needles or NEEDLES)
    sentences = load_filler(filler or FILLER)
    counter, max_pos = load_tokenizer(tokenizer)
    if max_pos:
        nd.check_lengths(lengths, max_pos, max_answer_tokens, f"max_position_embeddings of {tokenizer}")
    nd.check_lengths(lengths, max_model_len, max_answer_tokens, source)
    prompts = nd.build_grid(lengths, depths, kinds, samples, seed=seed, data=data, filler=sentences, counter=counter)
    nd.check_fits(prompts, max_model_len, max_answer_tokens)
    grid = {"lengths": list(lengths), "depths": list(depths), "kinds": list(kinds), "samples": samples, "seed": seed,
            "max_model_len": max_model_len, "max_answer_tokens": max_answer_tokens, "tokenizer": str(tokenizer),
            "needles_version": data.version, "depth_tolerance_tokens": data.depth_tolerance_tokens}
    return prompts, grid


def compare_dirs(baseline: Path, candidate: Path, out: Path, model: str) -> dict:
    """Baseline vs candidate of two finished recall runs: copies the candidate's records into `out` with delta.json
    and the delta heatmap (the layout `quantgate recall --baseline` writes)."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    for name in ("requests.jsonl", "cells.json", "heatmap.png"):
        if (Path(candidate) / name).is_file():
            shutil.copy2(Path(candidate) / name, out / name)
    delta = recall_score.compare(read_jsonl(Path(baseline) / "requests.jsonl"), read_jsonl(Path(candidate) / "requests.jsonl"))
    delta["baseline"] = str(baseline)
    (out / "delta.json").write_text(json.dumps(delta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    heatmap(delta["cells"], out / "delta_heatmap.png", f"recall delta: {model} minus baseline", value="delta", delta=True)
    return delta


def run_recall(prompts: Sequence[RecallPrompt], out: Path, *, endpoint: str, model: str, api_key: str | None,
               grid: dict, max_answer_tokens: int, concurrency: int = 4, timeout_s: float = 300.0,
               max_error_rate: float = 0.05, progress: bool = True, baseline: Path | None = None) -> dict:
    """Ask every prompt (temperature 0), score, write the files above; returns cells.json's content."""
    base_records = None
    if baseline is not None:  # read before sending anything: a wrong path is bad input
        if not (Path(baseline) / "requests.jsonl").is_file():
            raise QuantgateError("no requests.jsonl in the baseline directory", where=f"--baseline {baseline}",
                                 fix="give the --out directory of a finished `quantgate recall` run")
        base_records = read_jsonl(Path(baseline) / "requests.jsonl")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / "prompts.jsonl", [p.record() for p in prompts])
    cfg = ClientConfig(endpoint=endpoint, model=model, api_key=api_key, concurrency=concurrency, timeout_s=timeout_s,
                       max_error_rate=max_error_rate, progress=progress)
    run([Request(p.id, p.messages, max_answer_tokens) for p in prompts], out / "answers.jsonl", cfg)
    records = score_answers(prompts, read_results(out / "answers.jsonl"))
    _write_jsonl(out / "requests.jsonl", records)
    summary = {"model": model, "endpoint": endpoint, "grid": grid, **recall_score.cells(records)}
    (out / "cells.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    heatmap(summary["cells"], out / "heatmap.png", f"recall: {model}")
    if base_records is not None:
        delta = recall_score.compare(base_records, records)
        delta["baseline"] = str(baseline)
        (out / "delta.json").write_text(json.dumps(delta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        heatmap(delta["cells"], out / "delta_heatmap.png", f"recall delta: {model} minus baseline", value="delta", delta=True)
        summary["delta"] = delta
    return summary
