"""Which prompts the baseline samples first (pure): the stream order and the noise floor's prompts.

The baseline samples the noise floor's prompts first (a streaming look needs the floor), then the rest in stream
order (quantgate.base.subsets.interleave over the prompts, a prompt's draws together): every prefix of the stream is
a stratified random sample of the whole, which a streaming look reads (quantgate.gate.stream). Both are fixed by
the prompts' ids and categories before anything is sampled.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from quantgate.base.subsets import interleave, order
from quantgate.fidelity.core import CONTEXT_PREFIX
from quantgate.fidelity.run import stratified
from quantgate.fidelity.sampling import Prompt

DRAW = "#"  # a prompt's k-th sampled continuation is the sequence <prompt id>#<k>
FLOOR_CONTEXT = 1  # haystack sequences per context length in the floor's subset (each is a long prefill on the
# baseline's own slot, beside its sampling)


def stream_order(prompts: list[Prompt]) -> list[Prompt]:
    """The prompts in stream order (quantgate.base.subsets.interleave over the prompts, a prompt's draws together):
    every prefix is a stratified random sample of the whole, which a streaming look reads (quantgate.gate.stream)."""
    groups: dict[str, list[Prompt]] = {}
    for p in prompts:
        groups.setdefault(p.id.split(DRAW, 1)[0], []).append(p)
    heads = interleave([g[0] for g in groups.values()], lambda p: _ranked_id(p.id), lambda p: p.category)
    return [p for h in heads for p in sorted(groups[h.id.split(DRAW, 1)[0]], key=lambda p: p.id)]


def _ranked_id(pid: str) -> str:
    """The id a prompt ranks by in its category: without its draw and its "<eval set>/" prefix (as eval.limit
    ranks a sample)."""
    return pid.split(DRAW, 1)[0].split("/", 1)[-1]


def stream_ids(prompts: list[Prompt]) -> list[str]:
    """The prompt ids (draws merged) in stream order: what a FidelityRecord's `draw.order` holds for a stream."""
    out: list[str] = []
    for p in stream_order(prompts):
        head = p.id.split(DRAW, 1)[0]
        if not out or out[-1] != head:
            out.append(head)
    return out


def floor_ids(items: Iterable[Any], limit: int | None) -> set[str]:
    """The ids of the prompts (or sample lines: anything with an id and a category, attributes or keys) whose
    sequences the floor's path scores: `limit` of them drawn at random within each category, round-robin over the
    categories (quantgate.base.subsets), of which each context length gives at most FLOOR_CONTEXT (the first of its
    draw order); all when limit is None. Chosen from the prompts, not from what was sampled: the same before the
    sampling (the floor goes first) and after it."""
    pairs = [(x["id"], x["category"]) if isinstance(x, Mapping) else (x.id, x.category) for x in items]
    if limit is None:
        return {i for i, _ in pairs}
    per_length: dict[str, list[str]] = {}
    for i, c in order([p for p in pairs if p[1].startswith(CONTEXT_PREFIX)], lambda p: p[0], lambda p: p[1]):
        per_length.setdefault(c, []).append(i)
    capped = {i for group in per_length.values() for i in group[:FLOOR_CONTEXT]}
    rest = [{"id": i, "category": c} for i, c in pairs if not c.startswith(CONTEXT_PREFIX)]
    return {it["id"] for it in stratified(rest, max(0, limit - len(capped)))} | capped


__all__ = ["DRAW", "FLOOR_CONTEXT", "floor_ids", "stream_ids", "stream_order"]
