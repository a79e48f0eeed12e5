"""Paired comparison of two eval runs over the same ids, and the cache key of a run. Pure: no I/O.

A run's per-sample record: {"id", "category", "output", "scores": {metric: value}}. For every metric, overall and
per category: means, delta (candidate - baseline), a seeded paired-bootstrap CI of the delta, the spread of the
paired differences and a one-sided harm p-value (quantgate.base.stats); for binary metrics also the samples lost and
gained (McNemar). `pooled` is one binary measure per sample (the first binary metric the sample is scored with),
so that every sample of a set counts in one paired harm test. The flips ledger lists each sample that went from
right to wrong (`regressions`) or from wrong to right (`gains`), with both outputs.
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, NotRequired, Protocol, TypedDict

from quantgate.base.pairedstat import PairedStat
from quantgate.base.stats import harm_p_binary, harm_p_paired

CACHE_KEY_VERSION = 1


class MetricInfo(Protocol):  # read-only: frozen models (MetricSpec) fit it
    @property
    def higher_is_better(self) -> bool: ...
    @property
    def binary(self) -> bool: ...


# A paired statistic as the comparison file holds it: a quantgate.base.pairedstat.PairedStat's fields that
# paired_stats set (`pooled` adds `metrics_used`, samples per metric, first); read back through that model.
StatJSON = dict[str, object]


class MetricReport(TypedDict):
    higher_is_better: bool
    binary: bool
    overall: StatJSON
    by_category: dict[str, StatJSON]


class OutputAgreementStats(TypedDict):
    overall: float
    by_category: dict[str, float]


class FlipRow(TypedDict):
    """A sample that went right -> wrong (a regression) or wrong -> right (a gain) on one binary metric."""
    id: str
    category: str
    metric: str
    references: list[str]
    base_output: str | None
    cand_output: str | None


class SetReport(TypedDict):
    """compare_runs' result; compare_dirs (quantgate.evals.run) adds both runs' model and the eval set."""
    n_base: int
    n_cand: int
    n_paired: int
    only_in_base: list[str]
    only_in_cand: list[str]
    bootstrap: dict[str, float]
    agreement: OutputAgreementStats
    metrics: dict[str, MetricReport]
    regressions: list[FlipRow]
    gains: list[FlipRow]
    pooled: StatJSON | None
    base: NotRequired[dict[str, str | None]]
    cand: NotRequired[dict[str, str | None]]
    evalset: NotRequired[dict[str, object]]


class RunSummary(TypedDict):
    """summary.json of a scored run (quantgate.evals.run, quantgate.evals.lmeval)."""
    n_samples: int
    n_answered: int
    n_failed: int
    error_rate: float
    metrics: dict[str, dict]  # summarize


def cache_key(model_hash: str, evalset_hash: str, decoding: Mapping[str, Any], engine_version: str | None) -> str:
    """Key of a run's outputs: same model, eval set, decoding and engine -> same outputs, so reuse them."""
    blob = json.dumps(
        {"v": CACHE_KEY_VERSION, "model": model_hash, "evalset": evalset_hash, "decoding": dict(decoding),
         "engine": engine_version}, sort_keys=True, separators=(",", ":"),
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts b and c (binomial, p = 1/2)."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1))
    return min(1.0, 2 * tail / 2**n)


def bootstrap_ci(diffs: Sequence[float], *, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile CI of the mean of paired differences, resampling pairs with a seeded generator."""
    import numpy as np

    d = np.asarray(diffs, dtype=float)
    if d.size == 0:
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(n_boot, d.size))].mean(axis=1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return (float(lo), float(hi))


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def summarize(records: Sequence[Mapping], metrics: Sequence[str]) -> dict[str, dict]:
    """{metric: {"overall": {"n", "mean"}, "by_category": {cat: {"n", "mean"}}}} of one run's scores."""
    out: dict[str, dict] = {}
    for m in metrics:
        groups: dict[str, list[float]] = {}
        for r in records:
            if m in r["scores"]:
                groups.setdefault(r["category"], []).append(r["scores"][m])
        every = [v for vs in groups.values() for v in vs]
        out[m] = {"overall": {"n": len(every), "mean": _mean(every)},
                  "by_category": {c: {"n": len(vs), "mean": _mean(vs)} for c, vs in sorted(groups.items())}}
    return out


def _sd(xs: Sequence[float]) -> float:
    if len(xs) < 2:
        return math.nan
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def paired_stats(pairs: Sequence[tuple[float, float]], info: MetricInfo, *, n_boot: int = 2000, seed: int = 0,
                 level: float = 0.95) -> PairedStat:
    """Means, delta, bootstrap CI of (cand - base), spread of the drops and the one-sided harm p-value of (base, cand)
    pairs; for a binary metric also the samples lost and gained and the discordance. Only these fields are set (a
    comparison file holds them: `as_json`)."""
    base, cand = [p[0] for p in pairs], [p[1] for p in pairs]
    lo, hi = bootstrap_ci([c - b for b, c in pairs], n_boot=n_boot, seed=seed, level=level)
    sign = 1.0 if info.higher_is_better else -1.0
    drops = [sign * (b - c) for b, c in pairs]
    figures: dict[str, Any] = {"n": len(pairs), "base_mean": _mean(base), "cand_mean": _mean(cand),
                               "delta": _mean(cand) - _mean(base) if pairs else math.nan, "ci_low": lo, "ci_high": hi,
                               "sd_diff": _sd(drops)}
    if info.binary:
        good = 1.0 if info.higher_is_better else 0.0
        b = sum(1 for x, y in pairs if x == good and y != good)  # lost by the candidate
        c = sum(1 for x, y in pairs if x != good and y == good)  # gained by the candidate
        figures.update({"lost": b, "gained": c, "mcnemar_p": mcnemar_exact(b, c), "p_harm": harm_p_binary(b, c),
                        "discordance": (b + c) / len(pairs) if pairs else math.nan})
    else:
        figures["p_harm"] = harm_p_paired(drops, seed=seed)
    return PairedStat(**figures)


def as_json(stat: PairedStat) -> StatJSON:
    """A statistic as a comparison file holds it: the fields that were set, NaN kept (a mean over no sample)."""
    return stat.model_dump(exclude_unset=True)


class _Binary:
    higher_is_better = True
    binary = True


def _pooled(b_by: Mapping[str, Mapping], c_by: Mapping[str, Mapping], ids: Sequence[str],
            metrics: Mapping[str, MetricInfo], **kw: Any) -> StatJSON | None:
    """One binary, higher-is-better measure per sample (the first such metric in its scores), paired."""
    used: dict[str, int]
    pairs, used = [], {}
    for i in ids:
        name = next((m for m in b_by[i]["scores"] if m in metrics and metrics[m].binary and metrics[m].higher_is_better
                     and m in c_by[i]["scores"]), None)
        if name is not None:
            pairs.append((b_by[i]["scores"][name], c_by[i]["scores"][name]))
            used[name] = used.get(name, 0) + 1
    if not pairs:
        return None
    return {"metrics_used": used, **as_json(paired_stats(pairs, _Binary(), **kw))}


def _flips(b_by: Mapping[str, Mapping], c_by: Mapping[str, Mapping], ids: Sequence[str], name: str, info: MetricInfo,
           references: Mapping[str, Sequence[str]] | None) -> tuple[list[FlipRow], list[FlipRow]]:
    """Samples that went right -> wrong (regressions) and wrong -> right (gains) on one binary metric."""
    good = 1.0 if info.higher_is_better else 0.0
    lost: list[FlipRow]
    gained: list[FlipRow]
    lost, gained = [], []
    for i in ids:
        sb, sc = b_by[i]["scores"].get(name), c_by[i]["scores"].get(name)
        if sb is None or sc is None or (sb == good) == (sc == good):
            continue
        row: FlipRow = {"id": i, "category": b_by[i]["category"], "metric": name,
               "references": list((references or {}).get(i, [])),
               "base_output": b_by[i].get("output"), "cand_output": c_by[i].get("output")}
        (lost if sb == good else gained).append(row)
    return lost, gained


def compare_runs(
    base: Sequence[Mapping],
    cand: Sequence[Mapping],
    metrics: Mapping[str, MetricInfo],
    *,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
    references: Mapping[str, Sequence[str]] | None = None,
) -> SetReport:
    """Paired statistics of candidate vs baseline over the ids both runs scored (see the module docstring)."""
    b_by, c_by = {r["id"]: r for r in base}, {r["id"]: r for r in cand}
    ids = [i for i in b_by if i in c_by]
    by_cat: dict[str, list[str]] = {}
    for i in ids:
        by_cat.setdefault(b_by[i]["category"], []).append(i)

    def agreement(group: list[str]) -> float:
        return _mean([float(b_by[i].get("output") == c_by[i].get("output")) for i in group])

    result: SetReport = {
        "n_base": len(b_by), "n_cand": len(c_by), "n_paired": len(ids),
        "only_in_base": sorted(set(b_by) - set(c_by)), "only_in_cand": sorted(set(c_by) - set(b_by)),
        "bootstrap": {"n_boot": n_boot, "seed": seed, "level": level},
        "agreement": {"overall": agreement(ids), "by_category": {c: agreement(g) for c, g in sorted(by_cat.items())}},
        "metrics": {}, "regressions": [], "gains": [],
        "pooled": _pooled(b_by, c_by, ids, metrics, n_boot=n_boot, level=level, seed=seed + zlib.crc32(b"pooled")),
    }
    for name, info in metrics.items():
        def pairs(group: list[str], name: str = name) -> list[tuple[float, float]]:
            return [(b_by[i]["scores"][name], c_by[i]["scores"][name]) for i in group
                    if name in b_by[i]["scores"] and name in c_by[i]["scores"]]

        def stats(group: list[str], label: str, name: str = name, info: Any = info) -> StatJSON:
            return as_json(paired_stats(pairs(group), info, n_boot=n_boot, level=level,
                                        seed=seed + zlib.crc32(f"{name}/{label}".encode())))

        overall = stats(ids, "*")
        if overall["n"] == 0:
            continue
        result["metrics"][name] = {
            "higher_is_better": info.higher_is_better, "binary": info.binary, "overall": overall,
            "by_category": {c: stats(g, c) for c, g in sorted(by_cat.items()) if pairs(g)},
        }
        if info.binary:
            lost, gained = _flips(b_by, c_by, ids, name, info, references)
            result["regressions"] += lost
            result["gains"] += gained
    return result
