"""vLLM's Prometheus `/metrics` text -> the engine figures the probe records (pure: no I/O).

The probe reads `/metrics` before its first run, about once a second while it runs and after its last run
(quantgate.perf.probe). Names are those of vLLM 0.32's v1 engine (vllm/v1/metrics/loggers.py); a counter is
exported with the suffix `_total`, and every series carries labels (model_name, engine): values of one name are
summed over its label sets, so several engines (data parallel) count together.
- gauges, sampled: `vllm:kv_cache_usage_perc` (0..1), `vllm:num_requests_running`, `vllm:num_requests_waiting`;
- counters, as the difference between the last and the first reading: `vllm:num_preemptions_total`,
  `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` (tokens).
A name the server does not export stays None: never 0.
"""

from __future__ import annotations

import math
import statistics

from quantgate.perf.models import EngineMetrics, LevelEngine

KV_USAGE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
WANTED = (KV_USAGE, RUNNING, WAITING, PREEMPTIONS, PREFIX_QUERIES, PREFIX_HITS)


def parse(text: str, names: tuple[str, ...] = WANTED) -> dict[str, float]:
    """name -> value summed over its label sets, for the `names` found in a Prometheus text exposition."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        brace, space = line.find("{"), line.find(" ")
        labelled = brace >= 0 and (space < 0 or brace < space)
        name = line[:brace] if labelled else line[:space] if space >= 0 else line
        if name not in names:
            continue
        rest = line[line.rfind("}") + 1:] if labelled else line[len(name):]
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        if math.isfinite(value):
            out[name] = out.get(name, 0.0) + value
    return out


def _delta(first: dict[str, float], last: dict[str, float], name: str) -> float | None:
    if name not in first or name not in last:
        return None
    return max(last[name] - first[name], 0.0)


def _max(values: list[float]) -> float | None:
    return max(values) if values else None


def summarize(samples: list[tuple[int | None, dict[str, float]]], error: str | None = None) -> EngineMetrics:
    """Samples in time order as (concurrency level running then, or None between runs; parsed /metrics) ->
    the probe's engine figures: KV usage max and mean, preemptions and prefix-cache hits during the probe, and per
    level the highest KV usage and queue seen."""
    if not samples:
        return EngineMetrics(error=error or "no /metrics sample")
    first, last = samples[0][1], samples[-1][1]
    kv = [s[KV_USAGE] for _, s in samples if KV_USAGE in s]
    queries, hits = _delta(first, last, PREFIX_QUERIES), _delta(first, last, PREFIX_HITS)
    by_level: dict[int, LevelEngine] = {}
    for level in sorted({lv for lv, _ in samples if lv is not None}):
        rows = [s for lv, s in samples if lv == level]
        by_level[level] = LevelEngine(kv_usage_max=_max([r[KV_USAGE] for r in rows if KV_USAGE in r]),
                                      running_max=_max([r[RUNNING] for r in rows if RUNNING in r]),
                                      waiting_max=_max([r[WAITING] for r in rows if WAITING in r]))
    return EngineMetrics(samples=len(samples), kv_usage_max=_max(kv),
                         kv_usage_mean=round(statistics.fmean(kv), 6) if kv else None,
                         preemptions=_delta(first, last, PREEMPTIONS), prefix_cache_queries=queries,
                         prefix_cache_hits=hits, prefix_hit_rate=round(hits / queries, 6) if queries and hits is not None else None,
                         by_level=by_level, error=error)
