"""Medians over repeated probe runs and candidate/baseline ratios with confidence intervals (pure: no I/O).

`compare(base, cand)` is what the gate's pay-off checks read (<run>/<candidate>/pay_off.json):
    {"concurrency": 8, "size_ratio": 0.42, "throughput_ratio": 1.31, "ttft_ratio": 0.9, ..., "by_concurrency": [...],
     "workload": "latency", "decide": [{"figure": "tpot_p50_ms", "at": "lowest", "concurrency": 1,
                                        "ratio": {"value": 0.41, "low": 0.38, "high": 0.45, "level": 0.9, ...}}],
     "slo_concurrency": {"baseline": 4, "candidate": 8}, "intervals": "welch-log", ...}
Ratios are candidate / baseline: < 1 is better for size and latencies, > 1 is better for throughput and KV capacity.
Headline ratios are of the medians; every ratio also has an interval over the repeats (`ci`, quantgate.perf.intervals):
unpaired by default, since a release serves the variants one after another with the same request set; `paired` when
they were served in turn, round by round. A ratio is None where either side lacks the figure; it is never guessed.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from quantgate.base.errors import QuantgateError, SettingError
from quantgate.perf.intervals import RatioCI, ratio_ci
from quantgate.perf.models import LOWER_IS_BETTER, Decide, LevelMedian, PerfResult, RunResult

METRICS = ("output_tok_s", "requests_s", "goodput_rps", "slo_attainment", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms",
           "itl_p95_ms", "tpot_p50_ms", "tpot_p95_ms", "e2el_p50_ms")
# ratio name -> the median it divides; output names a gate policy can refer to
RATIOS = {
    "throughput_ratio": "output_tok_s",
    "request_throughput_ratio": "requests_s",
    "ttft_ratio": "ttft_p50_ms",
    "ttft_p95_ratio": "ttft_p95_ms",
    "itl_ratio": "itl_p50_ms",
    "itl_p95_ratio": "itl_p95_ms",
    "tpot_ratio": "tpot_p50_ms",
    "goodput_ratio": "goodput_rps",
}
HIGHER_IS_BETTER = {"throughput_ratio": True, "request_throughput_ratio": True, "ttft_ratio": False, "ttft_p95_ratio": False,
                    "itl_ratio": False, "itl_p95_ratio": False, "tpot_ratio": False, "goodput_ratio": True,
                    "size_ratio": False, "kv_tokens_ratio": True}


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
                             fix="probe both with the same workload (num_prompts, input_len, output_len, seed)")
    notes = []
    if base.workload.tokenizer_sha256 != cand.workload.tokenizer_sha256:
        notes.append("tokenizer files differ: the random prompts may differ too (give both probes the baseline's tokenizer)")
    if base.repeats != cand.repeats:
        notes.append(f"repeats differ: {base.repeats} (baseline) vs {cand.repeats} (candidate)")
    return notes


def per_repeat(p: PerfResult, concurrency: int, metric: str) -> dict[int, float | None]:
    """repeat -> the figure of the run at `concurrency` (runs that completed nothing give None)."""
    return {r.repeat: getattr(r, metric) for r in p.runs if r.concurrency == concurrency}


def best_per_repeat(p: PerfResult, metric: str) -> dict[int, float | None]:
    """repeat -> the best value of the figure over all levels of that repeat (max, or min for a latency)."""
    pick = min if metric in LOWER_IS_BETTER else max
    out: dict[int, float | None] = {}
    for rep in sorted({r.repeat for r in p.runs}):
        vals = [getattr(r, metric) for r in p.runs if r.repeat == rep and getattr(r, metric) is not None]
        out[rep] = pick(vals) if vals else None
    return out


def interval(base: dict[int, float | None], cand: dict[int, float | None], level: float, paired: bool) -> RatioCI:
    """The ratio's interval over repeats; a side that measured exactly 0 every time (no request met the SLO)
    against a positive other side gives the ratio 0 or None without an interval, never a guess."""
    b, c = list(base.values()), list(cand.values())
    if paired:
        keys = sorted(set(base) & set(cand))
        b, c = [base[k] for k in keys], [cand[k] for k in keys]
    ci = ratio_ci(b, c, level=level, paired=paired)
    if ci.value is None and any(v == 0 for v in c) and all(v == 0 for v in c if v is not None) \
            and any(v is not None and v > 0 for v in b):
        return RatioCI(value=0.0, low=0.0, high=0.0, level=level, n_base=len(b), n_cand=len(c))
    return ci


def slo_concurrency(p: PerfResult) -> int | None:
    """The highest level whose requests met the SLO at the SLO's attainment (pooled over repeats); None: none did
    or no SLO."""
    slo = p.workload.slo
    if slo is None:
        return None
    ok = []
    for c in sorted({r.concurrency for r in p.runs}):
        rows = [r for r in p.runs if r.concurrency == c]
        sent = sum(r.completed + r.failed for r in rows)
        good = sum((r.slo_attainment or 0.0) * (r.completed + r.failed) for r in rows)
        if sent and rows and all(r.slo_attainment is not None for r in rows) and good / sent >= slo.attainment:
            ok.append(c)
    return max(ok) if ok else None


def decide_rows(base: PerfResult, cand: PerfResult, decide: list[Decide], common: list[int], level: float,
                paired: bool) -> list[dict]:
    """The profile's pay-off figures: where each is read, its medians and its ratio with the interval."""
    rows = []
    for d in decide:
        if d.at == "best":
            b, c, at = best_per_repeat(base, d.figure), best_per_repeat(cand, d.figure), None
        else:
            at = common[0] if d.at == "lowest" else common[-1]
            b, c = per_repeat(base, at, d.figure), per_repeat(cand, at, d.figure)
        rows.append({"figure": d.figure, "at": d.at, "concurrency": at, "lower_is_better": d.figure in LOWER_IS_BETTER,
                     "baseline": median_or_none(b.values()), "candidate": median_or_none(c.values()),
                     "ratio": interval(b, c, level, paired).model_dump(mode="json")})
    return rows


def compare(base: PerfResult, cand: PerfResult, at: int | None = None, *, level: float = 0.90,
            paired: bool = False) -> dict:
    """Ratios candidate/baseline per common concurrency level with their intervals, the headline at `at` (default:
    the highest common level), and the workload profile's pay-off figures (`decide`)."""
    notes = check_comparable(base, cand)
    bm = {m.concurrency: m for m in (base.medians or level_medians(base.runs))}
    cm = {m.concurrency: m for m in (cand.medians or level_medians(cand.runs))}
    common = sorted(set(bm) & set(cm))
    if not common:
        raise QuantgateError(f"no common concurrency level: baseline {sorted(bm)}, candidate {sorted(cm)}",
                             fix="probe both at the same concurrency levels")
    if at is None:
        at = common[-1]
    elif at not in common:
        raise SettingError(f"concurrency {at} was not probed on both sides (common levels: {common})", setting="at",
                             fix=f"use one of {common}")
    by = []
    for c in common:
        row: dict = {"concurrency": c}
        for name, metric in RATIOS.items():
            row[name] = ratio(getattr(cm[c], metric), getattr(bm[c], metric))
        row["ci"] = {name: interval(per_repeat(base, c, metric), per_repeat(cand, c, metric), level, paired).model_dump(mode="json")
                     for name, metric in RATIOS.items()}
        row["baseline"] = bm[c].model_dump(exclude={"concurrency"})
        row["candidate"] = cm[c].model_dump(exclude={"concurrency"})
        by.append(row)
    head = next(r for r in by if r["concurrency"] == at)
    kv_b = base.engine.kv_cache_tokens if base.engine else None
    kv_c = cand.engine.kv_cache_tokens if cand.engine else None
    return {
        "baseline": base.model, "candidate": cand.model, "concurrency": at, "workload": base.workload.profile,
        "size_ratio": ratio(cand.weights_bytes, base.weights_bytes),
        **{k: head[k] for k in RATIOS}, "ci": head["ci"],
        "kv_tokens_ratio": ratio(kv_c, kv_b),
        "decide": decide_rows(base, cand, base.workload.decide, common, level, paired),
        "slo": base.workload.slo.model_dump() if base.workload.slo else None,
        "slo_concurrency": {"baseline": slo_concurrency(base), "candidate": slo_concurrency(cand)},
        "intervals": {"level": level, "method": "paired-log" if paired else "welch-log",
                      "pairing": "by round (variants served in turn)" if paired else
                      "unpaired: the variants were served one after another with the same request set"},
        "repeats": min(base.repeats, cand.repeats),
        "probe_seconds": {"baseline": base.seconds, "candidate": cand.seconds},
        "higher_is_better": HIGHER_IS_BETTER,
        "by_concurrency": by,
        "notes": notes,
    }
