"""Medians over repeated probe runs and candidate/baseline ratios (pure: no I/O).

`compare(base, cand)` is what a gate check reads:
    {"concurrency": 8, "size_ratio": 0.42, "throughput_ratio": 1.31, "ttft_ratio": 0.9, ..., "by_concurrency": [...]}
Ratios are candidate / baseline: < 1 is better for size and latencies, > 1 is better for throughput and KV capacity.
A ratio is None where either side lacks the figure; it is never guessed.
"""

from __future__ import annotations

import statistics
from typing import Iterable

from quantgate.base.errors import QuantgateError
from quantgate.perf.models import LevelMedian, PerfResult, RunResult

METRICS = ("output_tok_s", "requests_s", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms", "tpot_p50_ms", "e2el_p50_ms")
# ratio name -> the median it divides; output names a gate policy can refer to
RATIOS = {
    "throughput_ratio": "output_tok_s",
    "request_throughput_ratio": "requests_s",
    "ttft_ratio": "ttft_p50_ms",
    "ttft_p95_ratio": "ttft_p95_ms",
    "itl_ratio": "itl_p50_ms",
    "itl_p95_ratio": "itl_p95_ms",
}
HIGHER_IS_BETTER = {"throughput_ratio": True, "request_throughput_ratio": True, "ttft_ratio": False, "ttft_p95_ratio": False,
                    "itl_ratio": False, "itl_p95_ratio": False, "size_ratio": False, "kv_tokens_ratio": True}


def median_or_none(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def level_medians(runs: list[RunResult]) -> list[LevelMedian]:
    """Per concurrency level, the median of each metric over the repeats; the error rate pools all requests."""
    out = []
    for c in sorted({r.concurrency for r in runs}):
        rows = [r for r in runs if r.concurrency == c]
        sent = sum(r.completed + r.failed for r in rows)
        out.append(LevelMedian(concurrency=c, repeats=len(rows), error_rate=sum(r.failed for r in rows) / sent if sent else 1.0,
                               **{m: median_or_none(getattr(r, m) for r in rows) for m in METRICS}))
    return out


def ratio(cand: float | int | None, base: float | int | None) -> float | None:
    if cand is None or base is None or base == 0:
        return None
    return round(cand / base, 4)


def first_error(runs: list[RunResult]) -> str | None:
    """The error message for the first level with failed requests, with its error rate; None when all succeeded."""
    for c in sorted({r.concurrency for r in runs}):
        rows = [r for r in runs if r.concurrency == c]
        failed, sent = sum(r.failed for r in rows), sum(r.completed + r.failed for r in rows)
        if failed:
            errs = next((e for r in rows for e in r.errors), "no error text")
            return (f"{failed} of {sent} requests failed at concurrency {c} (error rate {failed / sent:.1%}); "
                    f"first error: {errs}")
    return None


def check_comparable(base: PerfResult, cand: PerfResult, base_name: str = "baseline", cand_name: str = "candidate") -> list[str]:
    """Refuse probes that did not send the same work; return notes on softer differences."""
    for name, p in ((base_name, base), (cand_name, cand)):
        if p.status != "ok":
            raise QuantgateError(f"{name} probe did not succeed: {p.error}", where=name,
                                 fix="fix the server or the load and probe again; a failed probe has no throughput to compare")
    a, b = base.workload.identity(), cand.workload.identity()
    diff = [f"{k}: {a[k]!r} vs {b[k]!r}" for k in a if a[k] != b.get(k)]
    if diff:
        raise QuantgateError(f"{base_name} and {cand_name} were probed with different workloads ({'; '.join(diff)})",
                             where=f"{cand_name}: workload",
                             fix="probe both with the same --num-prompts/--input-len/--output-len/--seed")
    notes = []
    if base.workload.tokenizer_sha256 != cand.workload.tokenizer_sha256:
        notes.append("tokenizer files differ: the random prompts may differ too (pass the baseline's --tokenizer to both)")
    if base.repeats != cand.repeats:
        notes.append(f"repeats differ: {base.repeats} (baseline) vs {cand.repeats} (candidate)")
    return notes


def compare(base: PerfResult, cand: PerfResult, at: int | None = None) -> dict:
    """Ratios candidate/baseline per common concurrency level, and the headline at `at` (default: the highest common)."""
    notes = check_comparable(base, cand)
    bm = {m.concurrency: m for m in (base.medians or level_medians(base.runs))}
    cm = {m.concurrency: m for m in (cand.medians or level_medians(cand.runs))}
    common = sorted(set(bm) & set(cm))
    if not common:
        raise QuantgateError(f"no common concurrency level: baseline {sorted(bm)}, candidate {sorted(cm)}",
                             fix="probe both with the same --concurrency list")
    if at is None:
        at = common[-1]
    elif at not in common:
        raise QuantgateError(f"concurrency {at} was not probed on both sides (common levels: {common})", where="--at",
                             fix=f"use one of {common}")
    by = []
    for c in common:
        row: dict = {"concurrency": c}
        for name, metric in RATIOS.items():
            row[name] = ratio(getattr(cm[c], metric), getattr(bm[c], metric))
        row["baseline"] = bm[c].model_dump(exclude={"concurrency"})
        row["candidate"] = cm[c].model_dump(exclude={"concurrency"})
        by.append(row)
    head = next(r for r in by if r["concurrency"] == at)
    kv_b = base.engine.kv_cache_tokens if base.engine else None
    kv_c = cand.engine.kv_cache_tokens if cand.engine else None
    return {
        "baseline": base.model, "candidate": cand.model, "concurrency": at,
        "size_ratio": ratio(cand.weights_bytes, base.weights_bytes),
        **{k: head[k] for k in RATIOS},
        "kv_tokens_ratio": ratio(kv_c, kv_b),
        "repeats": min(base.repeats, cand.repeats),
        "higher_is_better": HIGHER_IS_BETTER,
        "by_concurrency": by,
        "notes": notes,
    }
