"""One eval run in a directory: ask the server, score, summarize; and load two run directories to compare.

Layout of a run directory:
  manifest.json   what was run (eval set hash and version, model, decoding, engine version, cache key), status
  results.jsonl   one client record per answered sample (append-only; resumable, see quantgate.evals.client)
  scores.jsonl    {id, category, scores: {metric: value}, references} per answered sample
  summary.json    per metric: overall and per-category means; counts and error rate
Re-running into the same directory resumes; a directory made for another model/set/decoding/engine is refused.

Status in manifest.json: "complete" only when every sample was answered. A run with failed requests within the
client's error-rate limit is "partial": it is scored and summarized (summary.json counts the failures, and the gate
reads them), it can be compared, but it is never reused as finished: the next run into the directory asks the
failed ids again and keeps the answered ones. Above the limit the run stops with status "failed".
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

from quantgate.base.runfiles import MANIFEST, RESULTS, SCORES, SUMMARY
from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import write_json, write_text
from quantgate.base.http import Endpoint, EndpointError, get_json, model_entry, read_results
from quantgate.evals import scoring
from quantgate.evals.client import ClientConfig, ErrorRateExceeded, Request, run
from quantgate.evals.compare import RunSummary, SetReport, cache_key, compare_runs, summarize
from quantgate.evals.dataset import load_evalset, stratified_subset
from quantgate.evals.manifestfile import ClientStats, EvalManifest, EvalsetRef, read_manifest, read_status
from quantgate.evals.metrics import load_table

MANIFEST_SCHEMA = 1
USABLE = ("complete", "partial")  # statuses whose scores can be read; only "complete" is finished work


class _Background:
    """Run a function in a daemon thread; `result()` waits and re-raises its exception here."""
    def __init__(self, fn: Callable[[], Any]) -> None:
        self.error: BaseException | None = None
        self.value: Any = None

        def work() -> None:
            try:
                self.value = fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised in result()
                self.error = exc

        self.thread = threading.Thread(target=work, name="quantgate-eval-loader", daemon=True)
        self.thread.start()

    def result(self):
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.value


class ServerInfo(TypedDict):
    max_model_len: int | None  # as the server's model list gives it
    engine_version: str | None


def probe_server(endpoint: Endpoint, timeout_s: float = 10.0) -> ServerInfo:
    """Check that the server answers and serves its model; return its max_model_len and engine version if given."""
    entry = model_entry(endpoint, timeout_s)
    try:
        version = get_json(endpoint.base.removesuffix("/v1") + "/version", endpoint.api_key, timeout_s)
    except EndpointError:
        version = None
    engine = version.get("version") if isinstance(version, dict) else None
    return {"max_model_len": entry.get("max_model_len"), "engine_version": engine}


def _manifest(es, cfg: ClientConfig, server: ServerInfo, *, model_hash: str | None, limit: int | None,
              n_samples: int) -> EvalManifest:
    """What a run is (the cache key says it in one string), as manifest.json records it while running."""
    key = cache_key(model_hash or f"name:{cfg.model}", es.sha256, cfg.decoding(), server["engine_version"])
    return EvalManifest(
        schema=MANIFEST_SCHEMA, status="running", cache_key=key,
        evalset=EvalsetRef(path=str(es.path), name=es.meta.name, version=es.meta.version, sha256=es.sha256),
        model=cfg.model, model_hash=model_hash, endpoint=cfg.endpoint, engine_version=server["engine_version"],
        decoding=cfg.decoding(), default_max_tokens=es.meta.default_max_tokens, limit=limit,
        n_samples=n_samples, started_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )


def _claim(out: Path, manifest: EvalManifest) -> Path:
    """Write the manifest into `out` (new or resumed run); refuse a directory that holds a run of something else."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / MANIFEST
    if path.is_file() and (prev := read_manifest(path)).cache_key != manifest.cache_key:
        was, now = prev.dump(), manifest.dump()
        diff = [k for k in ("evalset", "model", "model_hash", "decoding", "engine_version") if was.get(k) != now.get(k)]
        raise QuantgateError(f"this directory holds a run of something else (differs in: {', '.join(diff) or 'key'})",
                             where=str(path), fix="use a new output folder, or delete this one")
    manifest.write(path)
    return path


def _score(out: Path, samples, metrics: list[str]) -> RunSummary:
    """Score the answered samples into scores.jsonl and summarize them into summary.json; returns the summary."""
    records = read_results(out / RESULTS)
    wanted = {s.id for s in samples}
    outputs = {i: r["output"] for i, r in records.items() if i in wanted and r.get("error") is None}
    scores = scoring.score_samples(samples, outputs)
    write_text(out / SCORES, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in scores))
    failed = len(samples) - len(outputs)
    summary: RunSummary = {"n_samples": len(samples), "n_answered": len(outputs), "n_failed": failed,
               "error_rate": failed / len(samples) if samples else 0.0, "metrics": summarize(scores, metrics)}
    write_json(out / SUMMARY, summary)
    return summary


def run_eval(
    evalset: Path | str,
    endpoint: Endpoint,
    out: Path | str,
    *,
    concurrency: int = 16,
    limit: int | None = None,
    model_hash: str | None = None,
    seed: int = 0,
    timeout_s: float = 120.0,
    max_error_rate: float = 0.05,
    progress: bool = True,
) -> RunSummary:
    """Answer, score and summarize an eval set against a running server; returns the summary."""
    out = Path(out)
    server = probe_server(endpoint)
    es = load_evalset(evalset, max_context=server["max_model_len"], with_dataset=False)
    samples = stratified_subset(es.samples, limit)
    metrics = sorted({m for s in samples for m in s.metrics})
    # `datasets` and `evaluate` load while the client waits on the server
    loader = _Background(lambda: (es.load_dataset(), [scoring.load_metric(m) for m in metrics]))
    cfg = ClientConfig(endpoint=endpoint.url, model=endpoint.model, api_key=endpoint.api_key, concurrency=concurrency,
                       timeout_s=timeout_s, seed=seed, max_error_rate=max_error_rate, progress=progress)
    manifest = _manifest(es, cfg, server, model_hash=model_hash, limit=limit, n_samples=len(samples))
    manifest_path = _claim(out, manifest)
    requests = [Request(s.id, s.chat(), es.max_tokens(s)) for s in samples]
    try:
        stats = run(requests, out / RESULTS, cfg)
        loader.result()
        summary = _score(out, samples, metrics)
    except ErrorRateExceeded as exc:
        failed = {"status": "failed", "error": exc.message, "error_rate": exc.share}
        manifest.model_copy(update=failed).write(manifest_path)
        raise
    except Exception as exc:  # the manifest says why, not `running` forever; an interrupt leaves it running
        why = exc.render() if isinstance(exc, QuantgateError) else f"{type(exc).__name__}: {exc}"
        manifest.model_copy(update={"status": "failed", "error": why}).write(manifest_path)
        raise
    status = "complete" if summary["n_failed"] == 0 else "partial"  # partial: the failed ids are asked again next run
    client = ClientStats(answered_now=stats.answered, failed_now=stats.failed, skipped=stats.skipped,
                         elapsed_s=round(stats.elapsed_s, 3))
    manifest.model_copy(update={"status": status, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                "n_failed": summary["n_failed"], "client": client}).write(manifest_path)
    return summary


def is_complete(run_dir: Path | str) -> bool:
    """True when the run directory holds finished work: every sample answered (status "complete"). A cache asks
    this: anything else is run again."""
    return read_status(run_dir) == "complete"


def is_scored(run_dir: Path | str) -> bool:
    """True when the run's answers are scored and can be read (load_run): complete, or partial (some requests
    failed; the gate counts them). Whoever waits for another run's answers asks this, not is_complete: a partial
    run is final for the release that made it."""
    return read_status(run_dir) in USABLE


def load_run(run_dir: Path | str) -> tuple[dict, list[dict]]:
    """(manifest, records with id, category, output, scores) of a scored run directory: complete, or partial (some
    requests failed; their samples have no output and count in summary.json's n_failed). The manifest is read
    through its model (evals.manifestfile) and handed on as a dict (the judge and compare_dirs index it)."""
    run_dir = Path(run_dir)
    manifest = read_manifest(run_dir / MANIFEST)
    if manifest.status not in USABLE:
        raise QuantgateError(f"run status is {manifest.status!r}, not 'complete' or 'partial'",
                             where=str(run_dir / MANIFEST),
                             fix="re-run `quantgate eval` with the same --out to finish it")

    results = read_results(run_dir / RESULTS)
    records = []
    path = run_dir / SCORES
    if not path.is_file():
        raise QuantgateError("missing file", where=str(path), fix="re-run `quantgate eval` with the same --out")
    for no, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise QuantgateError(f"invalid JSON: {exc.msg}", where=f"{path}:{no}") from None
        records.append({**rec, "output": results.get(rec["id"], {}).get("output")})
    return manifest.dump(), records


def compare_dirs(base_dir: Path | str, cand_dir: Path | str, *, n_boot: int = 2000, seed: int = 0) -> SetReport:
    """Compare two run directories of the same eval set (refused when the eval set hashes differ)."""
    bm, base = load_run(base_dir)
    cm, cand = load_run(cand_dir)
    if bm["evalset"]["sha256"] != cm["evalset"]["sha256"]:
        raise QuantgateError("the two runs used different eval sets (sha256 differs)", where=f"{base_dir} vs {cand_dir}",
                             fix="evaluate both models on the same eval set file")
    refs = {r["id"]: r.get("references", []) for r in base}
    table = load_table()
    used = sorted({m for r in base for m in r["scores"]})
    report = compare_runs(base, cand, {m: table[m] for m in used}, n_boot=n_boot, seed=seed, references=refs)
    report["base"] = {k: bm.get(k) for k in ("model", "model_hash", "engine_version", "cache_key")}
    report["cand"] = {k: cm.get(k) for k in ("model", "model_hash", "engine_version", "cache_key")}
    report["evalset"] = bm["evalset"]
    return report
