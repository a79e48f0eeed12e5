"""Which layers to keep at 16 bits so a rejected candidate passes (pure: numpy only).

A candidate REJECTed by fidelity fails some slices (categories, context lengths) by their KL. Keeping a decoder
layer at 16 bits removes part of that KL; quantgate.quantize.sensitivity measures how much per layer and slice
("keep:<l>" against "all", exact KL over the same sampled sequences). Here:

    gain = layer_gains(measured)                 # slice -> per-layer KL removed by keeping that layer
    plan = smallest_repair(measured, limits, max_kept=8, margin=0.8)

`smallest_repair` walks the layers in order of their pooled gain and keeps the fewest whose summed gains bring the
predicted KL of every slice under `margin` x its limit. It returns None when `max_kept` layers are not enough.
Summing assumes the gains add up, and on the demo's INT8 candidate they do not: each is measured with every other
layer quantized, and they overlap, so the sum overstated a 7-layer repair about twice (predicted pooled KL 0.0062,
measured 0.0112 on held-out sequences: bench/repair_sensitivity.py, docs/repair.md). Its plan is a starting point
to measure, not a result.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

POOLED = "pooled"


def slice_kl(kl_sums: np.ndarray, tokens: np.ndarray, categories: list[str]) -> dict[str, float]:
    """Ratio-of-sums KL per category and pooled, as the gate reads it."""
    kl_sums, tokens = np.asarray(kl_sums, dtype=np.float64), np.asarray(tokens, dtype=np.float64)
    if tokens.sum() <= 0:
        raise ValueError("no scored tokens")
    out = {POOLED: float(kl_sums.sum() / tokens.sum())}
    cats = np.asarray(categories)
    for c in sorted(set(categories)):
        sel = cats == c
        out[c] = float(kl_sums[sel].sum() / max(tokens[sel].sum(), 1e-30))
    return out


def layer_gains(kl: dict[str, np.ndarray], tokens: np.ndarray, categories: list[str], layers: int) -> dict[str, np.ndarray]:
    """slice -> [layers] KL removed by keeping each layer alone at 16 bits ("all" minus "keep:<l>"; 0 for a layer
    that was not measured)."""
    base = slice_kl(kl["all"], tokens, categories)
    out = {s: np.zeros(layers) for s in base}
    for i in range(layers):
        if f"keep:{i}" not in kl:
            continue
        kept = slice_kl(kl[f"keep:{i}"], tokens, categories)
        for s in base:
            out[s][i] = base[s] - kept[s]
    return out


@dataclass(frozen=True)
class RepairPlan:
    """The layers to keep (in the order they were added), and each slice's KL before and as predicted after."""
    keep: list[int]
    before: dict[str, float]
    predicted: dict[str, float]
    limits: dict[str, float]


def predict(before: dict[str, float], gains: dict[str, np.ndarray], keep: list[int]) -> dict[str, float]:
    """Each slice's KL with the layers in `keep` restored, if their gains add up (never below 0)."""
    return {s: max(before[s] - float(gains[s][keep].sum()) if keep else before[s], 0.0) for s in before}


def order_by(gains: np.ndarray) -> list[int]:
    """Layers by decreasing gain (ties: the lower index first)."""
    return sorted(range(len(gains)), key=lambda i: (-gains[i], i))


def smallest_repair(before: dict[str, float], gains: dict[str, np.ndarray], limits: dict[str, float], *,
                    order: list[int] | None = None, max_kept: int = 8, margin: float = 0.8) -> RepairPlan | None:
    """The fewest layers, taken in `order` (default: by pooled gain), whose predicted KL is within `margin` x the
    limit in every slice with a limit (a slice without one is not checked); None if `max_kept` are not enough."""
    if not 0 < margin <= 1:
        raise ValueError(f"margin must be in (0, 1], got {margin}")
    order = order_by(gains[POOLED]) if order is None else order
    for k in range(0, min(max_kept, len(order)) + 1):
        keep = order[:k]
        pred = predict(before, gains, keep)
        if all(pred[s] <= margin * lim for s, lim in limits.items() if s in pred):
            return RepairPlan(keep=keep, before=before, predicted=pred, limits=limits)
    return None


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        order = np.argsort(x, kind="mergesort")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=np.float64)
        for v in np.unique(x):
            tie = x == v
            r[tie] = r[tie].mean()
        return r
    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])
