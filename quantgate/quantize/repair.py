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

The release's repair rung (quantgate.release.repair_step) therefore measures instead of adding:

    order = order_for(gains, limits)             # by the share of each failing slice's limit a layer removes
    sizes = within_budget(order, extra, base_bytes, max_kept, max_ratio)   # how many may be kept
    pick = choose(measured, order, limits, sizes, margin)   # measured: k -> slice KL with order[:k] kept together
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

POOLED = "pooled"


def slice_kl(kl_sums: np.ndarray, tokens: np.ndarray, categories: list[str]) -> dict[str, float]:
    """Ratio-of-sums KL per category and pooled, as the gate reads it (of agreeing positions: the top-1 agreement)."""
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


def order_for(gains: dict[str, np.ndarray], limits: dict[str, float]) -> list[int]:
    """Layers by the KL they remove from the slices in `limits` (the failing ones), each slice's gain as a share of
    its limit, summed: a layer that helps the worst slice a little counts as much as one that helps a slice with
    twice its limit twice as much."""
    score = sum((np.asarray(gains[s], dtype=np.float64) / lim for s, lim in limits.items() if s in gains),
                start=np.zeros(len(next(iter(gains.values())))))
    return order_by(score)


SIZES = (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)


def within_budget(order: list[int], extra_bytes: list[int], candidate_bytes: int, max_kept: int,
                  max_size_ratio: float | None) -> list[int]:
    """The numbers of layers to try keeping (from SIZES, at most `max_kept` and the model's layers) whose top layers
    in `order` add at most (max_size_ratio - 1) x the candidate's bytes; None: no size budget."""
    out = []
    for k in SIZES:
        if k > min(max_kept, len(order)):
            break
        added = sum(extra_bytes[i] for i in order[:k])
        if max_size_ratio is not None and candidate_bytes + added > max_size_ratio * candidate_bytes:
            break
        out.append(k)
    return out


@dataclass(frozen=True)
class Choice:
    """The repair chosen: the layers kept, each slice's KL measured with them kept together, and whether every
    limited slice came out within `margin` x its limit (False: the largest repair the budget allows, which did
    not; the gate still decides it)."""
    keep: list[int]
    measured: dict[str, float]
    passes: bool


def choose(measured: dict[int, dict[str, float]], order: list[int], limits: dict[str, float], sizes: list[int],
           margin: float, agree: dict[int, dict[str, float]] | None = None,
           min_agree: dict[str, float] | None = None) -> Choice | None:
    """The fewest layers (k in `sizes`) whose measured KL, kept together, is within `margin` x the limit in every
    slice of `limits`, and whose top-1 agreement (`agree`) leaves at most `margin` x the disagreement each slice of
    `min_agree` allows; else the largest k measured (passes=False); None when nothing was measured."""
    if not 0 < margin <= 1:
        raise ValueError(f"margin must be in (0, 1], got {margin}")
    tried = [k for k in sizes if k in measured]

    def within(k: int) -> bool:
        kl_ok = all(measured[k].get(s, 0.0) <= margin * lim for s, lim in limits.items())
        return kl_ok and all(1 - (agree or {}).get(k, {}).get(s, 1.0) <= margin * (1 - m)
                             for s, m in (min_agree or {}).items())
    for k in tried:
        if within(k):
            return Choice(keep=order[:k], measured=measured[k], passes=True)
    if not tried:
        return None
    return Choice(keep=order[:tried[-1]], measured=measured[tried[-1]], passes=False)


def ranking_prompts(order: list[str], category: dict[str, str], sampled: set[str], slices: list[str],
                    per_slice: int) -> dict[str, list[str]]:
    """The first `per_slice` prompt ids of each slice in the stream `order` (a seeded random order within each slice,
    fixed before any value is seen: quantgate.fidelity.stream) among those `sampled`: the prompts that rank the
    layers, the same in every run whatever share of the sample a stopped sampling reached, and held out of the
    repaired candidate's fidelity sample."""
    out: dict[str, list[str]] = {s: [] for s in slices}
    for head in order:
        mine = out.get(category.get(head, ""))
        if mine is not None and len(mine) < per_slice and head in sampled:
            mine.append(head)
    return out


_LAYER = re.compile(r"^(.*\.layers\.)(\d+)\.")  # a decoder layer's module: <prefix>.layers.<i>.<rest>


def layer_of(name: str) -> tuple[int, str] | None:
    """(decoder layer index, the name's prefix up to and with `layers.<i>.`) of a module name; None outside them."""
    m = _LAYER.match(name)
    return (int(m.group(2)), m.group(1) + m.group(2) + ".") if m else None


def layer_patterns(layers: list[int], linear_names: list[str]) -> list[str]:
    """llmcompressor `ignore` entries that keep decoder layers `layers` at 16 bits: one `re:` prefix per layer, read
    from the model's own Linear names (`model.layers.3.mlp.up_proj` -> `re:model\\.layers\\.3\\.`)."""
    prefixes: dict[int, str] = {}
    for name in linear_names:
        if (found := layer_of(name)) is not None:
            prefixes.setdefault(*found)
    missing = [i for i in layers if i not in prefixes]
    if missing:
        raise ValueError(f"no Linear layer named like <...>.layers.<i>. for decoder layers {missing}")
    return ["re:" + re.escape(prefixes[i]) for i in layers]
