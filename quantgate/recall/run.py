"""Recall grid against a served model (adapter): data files, tokenizer, the paced client, JSON/JSONL and heatmaps.

Output directory:
    prompts.jsonl        one line per needle: grid position, request, haystack, messages, expected values, placement
    answers.jsonl        raw answers per request (quantgate.recall.client; resumable: a re-run asks only what is
                         missing or failed)
    requests.jsonl       one line per needle (one paired observation): its fields (no messages) + the answer of
                         its request, error, found, recall, exact
    cells.json           status ("complete" only when every needle has an answer), cost (cells, haystacks,
                         requests, needles, prompt tokens, the server's prefix-cache hits), grid, overall, by kind,
                         by language and per-cell recall (the numbers behind heatmap.png)
    heatmap.png          recall per (depth, length), one panel per kind
    delta.json, delta_heatmap.png   with a baseline directory: candidate minus baseline, paired by needle id
JSON files are written atomically: a reader sees the old file or the new one. `is_complete` is the cache's test.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from quantgate.base.runfiles import CELLS, DELTA, REQUESTS
from quantgate.base.errors import QuantgateError, SettingError
from quantgate.base.fileio import write_text
from quantgate.base.http import Endpoint, EndpointError, get, model_entry, read_results
from quantgate.base.paths import EVAL_SETS
from quantgate.base.yamlconfig import load_model
from quantgate.evals.client import ClientConfig, ErrorRateExceeded
from quantgate.recall import client as sender, haystack as hs, needle as nd, score as recall_score
from quantgate.recall.haystack import Ask
from quantgate.recall.needle import NeedleData, RecallPrompt, TokenCounter
from quantgate.recall.pace import Pacer
from quantgate.recall.resultfile import RecallCells, RecallDelta, load_recall_cells

NEEDLES = EVAL_SETS / "recall_needles.yaml"
FILLER = EVAL_SETS / "recall_filler.txt"


def load_needle_data(path: Path = NEEDLES) -> NeedleData:
    return load_model(path, NeedleData)


def load_filler(path: Path = FILLER) -> list[str]:
    if not Path(path).is_file():
        raise QuantgateError("filler file not found", where=str(path), fix="give an existing filler file (one sentence per line)")
    lines = [ln.strip() for ln in Path(path).read_text(encoding="utf-8").splitlines()]
    sentences = [ln for ln in lines if ln and not ln.startswith("#")]
    if not sentences:
        raise QuantgateError("no filler sentences (one per line, '#' starts a comment)", where=str(path), fix="add sentences")
    return sentences


def load_tokenizer(path: Path) -> tuple[TokenCounter, int | None]:
    """The model's tokenizer as a TokenCounter, and max_position_embeddings from config.json when present."""
    path = Path(path)
    if not path.is_dir():
        raise SettingError(f"tokenizer directory not found: {path}", setting="tokenizer",
                             fix="give the model's folder (tokenizer files and chat template)")
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise SettingError(f"no tokenizer files (tokenizer.json, tokenizer_config.json, tokenizer.model) in {path}",
                             setting="tokenizer", fix="give the served model's folder")
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - transformers raises many types (OSError, ValueError, ...) for a bad folder
        raise SettingError(f"cannot load a tokenizer from {path}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                             setting="tokenizer", fix="give the model's folder with tokenizer.json/tokenizer_config.json") from None
    if not getattr(tok, "chat_template", None):
        raise SettingError(f"the tokenizer in {path} has no chat template", setting="tokenizer",
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


def served_max_model_len(endpoint: Endpoint, timeout_s: float = 30.0) -> int | None:
    """max_model_len that an OpenAI-compatible server (vLLM) reports for its model in /v1/models, if any."""
    try:
        return model_entry(endpoint, timeout_s, where=f"endpoint {endpoint.url}").get("max_model_len")
    except EndpointError as exc:  # the same words, pointing at this command's options
        where, fix = ("--model", exc.fix) if exc.reason == "not_served" else (exc.where, f"{exc.fix}, or pass --max-model-len")
        raise QuantgateError(exc.message, where=where, fix=fix) from None


def _write_jsonl(path: Path, records: Sequence[dict]) -> None:
    """Atomically and durably (base.fileio.write_text): a reader (or a kill) never sees half of the file."""
    write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def read_jsonl(path: Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as fh:
        return [json.loads(ln) for ln in fh if ln.strip()]


def score_answers(prompts: Sequence[RecallPrompt], answers: dict[str, dict]) -> list[dict]:
    out = []
    for p in prompts:
        rec = {k: v for k, v in p.record().items() if k != "messages"}
        ans = answers.get(p.request) or {"output": None, "error": "no answer"}
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
                       needles: Path | None = None, filler: Path | None = None,
                       ask: Ask = "turns") -> tuple[list[RecallPrompt], dict]:
    """The needles of a grid in layout `ask` (quantgate.recall.haystack), every request checked to fit
    `max_model_len` (from `source`) with its answer cap before anything is sent."""
    data = load_needle_data(needles or NEEDLES)
    sentences = load_filler(filler or FILLER)
    counter, max_pos = load_tokenizer(tokenizer)
    if max_pos:
        nd.check_lengths(lengths, max_pos, max_answer_tokens, f"max_position_embeddings of {tokenizer}")
    nd.check_lengths(lengths, max_model_len, max_answer_tokens, source)
    prompts = hs.build_grid(lengths, depths, kinds, samples, seed=seed, ask=ask, data=data, filler=sentences,
                            counter=counter, max_answer_tokens=max_answer_tokens)
    nd.check_fits(prompts, max_model_len)
    grid = {"ask": ask, "lengths": list(lengths), "depths": list(depths), "kinds": list(kinds), "samples": samples,
            "seed": seed, "max_model_len": max_model_len, "max_answer_tokens": max_answer_tokens, "tokenizer": str(tokenizer),
            "needles_version": data.version, "depth_tolerance_tokens": data.depth_tolerance_tokens}
    return prompts, grid


def compare_dirs(baseline: Path, candidate: Path, out: Path, model: str) -> RecallDelta:
    """Baseline vs candidate of two finished recall runs: copies the candidate's records into `out` with delta.json
    and the delta heatmap (the layout `quantgate recall --baseline` writes)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in (REQUESTS, CELLS, "heatmap.png"):
        if (Path(candidate) / name).is_file():
            shutil.copy2(Path(candidate) / name, out / name)
    delta = _delta(read_jsonl(Path(baseline) / REQUESTS), read_jsonl(Path(candidate) / REQUESTS),
                   Path(baseline), out, model)
    return delta


def _delta(base_records: list[dict], records: list[dict], baseline: Path, out: Path, model: str) -> RecallDelta:
    scored = recall_score.compare(base_records, records)
    delta = RecallDelta.model_validate({**scored, "baseline": str(baseline)})
    delta.write(out / DELTA)
    heatmap(scored["cells"], out / "delta_heatmap.png", f"recall delta: {model} minus baseline", value="delta", delta=True)
    return delta


def is_complete(out: Path) -> bool:
    """Counts as done: cells.json says complete, and requests.jsonl holds that many needles, every one answered."""
    try:
        cells = load_recall_cells(Path(out) / CELLS)
        records = read_jsonl(Path(out) / REQUESTS)
    except (QuantgateError, OSError, ValueError):
        return False
    return (cells.status == "complete" and bool(records) and len(records) == cells.cost.get("needles")
            and all(r.get("error") is None for r in records))


def prefix_cache_counters(endpoint: str, api_key: str | None) -> dict[str, float] | None:
    """vLLM's prefix-cache counters from GET /metrics ({"queries", "hits"} in tokens, summed over engines), or None
    when the server does not expose them."""
    url = endpoint.rstrip("/").removesuffix("/v1") + "/metrics"
    try:
        resp = get(url, api_key, 10.0)
    except QuantgateError:
        return None
    if resp.status_code != 200:
        return None
    out = {"queries": 0.0, "hits": 0.0}
    seen = False
    for line in resp.text.splitlines():
        for key in out:
            if line.startswith((f"vllm:prefix_cache_{key}_total", f"vllm:prefix_cache_{key}{{")):
                out[key] += float(line.rsplit(" ", 1)[1])
                seen = True
    return out if seen else None


def _cache_use(before: dict | None, after: dict | None) -> dict:
    if before is None or after is None:
        return {"prefix_cache_queries": None, "prefix_cache_hits": None, "prefix_cache_hit_rate": None}
    q, h = after["queries"] - before["queries"], after["hits"] - before["hits"]
    return {"prefix_cache_queries": int(q), "prefix_cache_hits": int(h), "prefix_cache_hit_rate": round(h / q, 4) if q else None}


def jobs_of(prompts: Sequence[RecallPrompt]) -> list[sender.Job]:
    """One job per request (quantgate.recall.client decides which one fills a haystack's prefix)."""
    jobs: dict[str, sender.Job] = {}
    for p in prompts:
        if p.request not in jobs:
            jobs[p.request] = sender.Job(p.request, p.messages, p.max_tokens, max(p.prompt_tokens - p.shared_tokens, 1),
                                         p.haystack, p.prompt_tokens)
    return list(jobs.values())


def run_recall(prompts: Sequence[RecallPrompt], out: Path, *, endpoint: Endpoint,
               grid: dict, concurrency: int = 8, deadline_s: float = 300.0, max_error_rate: float = 0.05,
               baseline: Path | None = None, log: Callable[[str], None] | None = None) -> RecallCells:
    """Ask every request (temperature 0, paced: quantgate.recall.pace), score each needle, write the files above;
    returns cells.json's content (with a baseline, delta.json is beside it: load_recall_delta). Failed requests leave
    the run "partial": a re-run asks them again."""
    base_records = None
    if baseline is not None:  # read before sending anything: a wrong path is bad input
        if not (Path(baseline) / REQUESTS).is_file():
            raise SettingError(f"no requests.jsonl in the baseline directory {baseline}", setting="baseline",
                                 fix="give the output folder of a finished recall run")
        base_records = read_jsonl(Path(baseline) / REQUESTS)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / "prompts.jsonl", [p.record() for p in prompts])
    cfg = ClientConfig(endpoint=endpoint.url, model=endpoint.model, api_key=endpoint.api_key,
                       max_error_rate=max_error_rate, progress=False)
    pacer = Pacer(budget_s=deadline_s, max_requests=concurrency)
    before, t0, failure = prefix_cache_counters(endpoint.url, endpoint.api_key), time.monotonic(), None
    try:
        stats = sender.run(jobs_of(prompts), out / "answers.jsonl", cfg, pacer, log)
    except ErrorRateExceeded as exc:  # the answers so far are kept and scored; the run stays partial
        stats, failure = None, exc
    after = prefix_cache_counters(endpoint.url, endpoint.api_key)
    run_cost = {"wall_s": round(time.monotonic() - t0, 2), **_cache_use(before, after),
                **({k: getattr(stats, k) for k in ("skipped", "answered", "failed", "timeouts", "most_in_flight",
                                                   "most_tokens_in_flight", "rate")} if stats else {})}
    if run_cost.get("prefix_cache_hits") == 0 and any(p.shared_tokens for p in prompts):
        run_cost["note"] = ("the server's prefix cache served no token although the questions share their haystack: "
                            "serve with prefix caching on (vLLM: --enable-prefix-caching, its default)")
    summary = _finish(prompts, out, endpoint.model, endpoint.url, grid, run_cost)
    if base_records is not None:
        assert baseline is not None  # base_records are read from it
        _delta(base_records, read_jsonl(out / REQUESTS), Path(baseline), out, endpoint.model)
    if failure is not None:
        raise failure
    return summary


def _finish(prompts: Sequence[RecallPrompt], out: Path, model: str, endpoint: str, grid: dict,
            run_cost: dict) -> RecallCells:
    records = score_answers(prompts, read_results(out / "answers.jsonl"))
    _write_jsonl(out / REQUESTS, records)
    scored = recall_score.cells(records)
    status = "complete" if scored["overall"]["n_error"] == 0 else "partial"
    summary = RecallCells.model_validate({
        "status": status, "model": model, "endpoint": endpoint, "grid": grid,
        "cost": {**hs.cost(prompts), "run": run_cost,
                 "completion_tokens": sum(((r.get("usage") or {}).get("completion_tokens") or 0)
                                          for r in read_results(out / "answers.jsonl").values())},
        **scored})
    summary.write(out / CELLS)
    heatmap(scored["cells"], out / "heatmap.png", f"recall: {model}")
    return summary


def costs(folders: dict[str, Path | None]) -> dict[str, dict]:
    """{variant: cells.json's cost and status}, for a release's summary (variants without a recall run are left out)."""
    out = {}
    for name, folder in folders.items():
        try:
            cells = load_recall_cells(Path(folder) / CELLS) if folder else None
        except QuantgateError:
            cells = None
        if cells is not None:
            out[name] = {"status": cells.status, **cells.cost}
    return out
