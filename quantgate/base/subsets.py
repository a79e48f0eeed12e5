"""Every subset the gate judges is a seeded random draw within each slice (pure).

An eval set is often ordered: by date, by source, by difficulty. A subset made of the *first* ids of each category
proves closeness on those ids only, and says nothing about the rest: a category whose later ids carry the damage
is promoted on its early ones. So every subset a release takes (`eval.limit`, `fidelity.limit` and each look of an
adaptive plan, the noise floor's subset) is drawn here, the same way:

- within a category, items are ordered by sha256(f"{seed}:{id}"): a random order fixed by the seed and the id
  alone, not by the file's order nor by which other items exist, and fixed before any value is seen;
- the subset of size L is the first L items of a round-robin over the sorted categories, depth by depth (every
  category gets its share; a category that runs out leaves its turns to the others).

Nested by construction: the subset of L contains the subset of any L' < L, so look k of an adaptive plan holds
look k-1's samples and a later, larger release keeps the smaller one's answers.

The seed is the project's (`SEED`), not a setting: a release cannot be re-drawn until some subset promotes. The
rule and the seed are recorded with what was drawn (`DRAW`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")
SEED = 0
RULE = "sha256(seed:id) within each category, round-robin over sorted categories"
DRAW = {"rule": RULE, "seed": SEED}  # what a run records of how its subsets were drawn


def rank(item_id: str, seed: int = SEED) -> str:
    """An item's place within its category: the hex digest of sha256(f"{seed}:{id}")."""
    return hashlib.sha256(f"{seed}:{item_id}".encode()).hexdigest()


def order(items: Sequence[T], id_of: Callable[[T], str], category_of: Callable[[T], str], seed: int = SEED) -> list[T]:
    """Every item in draw order: round-robin over the sorted categories, each category in `rank` order."""
    by_cat: dict[str, list[T]] = {}
    for it in items:
        by_cat.setdefault(category_of(it), []).append(it)
    groups = [sorted(by_cat[c], key=lambda it: (rank(id_of(it), seed), id_of(it))) for c in sorted(by_cat)]
    return [g[depth] for depth in range(max((len(g) for g in groups), default=0)) for g in groups if depth < len(g)]


def draw(items: Sequence[T], limit: int | None, id_of: Callable[[T], str], category_of: Callable[[T], str],
         seed: int = SEED) -> list[T]:
    """The first `limit` items of the draw order (see `order`); every item, in its given order, when limit is None
    or covers them all."""
    if limit is None or limit >= len(items):
        return list(items)
    return order(items, id_of, category_of, seed)[:limit]


def interleave(items: Sequence[T], id_of: Callable[[T], str], category_of: Callable[[T], str],
               seed: int = SEED) -> list[T]:
    """Every item in stream order: each category in `rank` order, the categories merged in proportion to their
    sizes (the j-th of a category of N sits at (j + 0.5) / N of the stream; ties by category name). Every prefix
    of the stream is then a stratified random sample holding about the same fraction of each category, so its
    pooled mean estimates the whole set's and every slice fills at once (quantgate.gate.stream reads prefixes)."""
    by_cat: dict[str, list[T]] = {}
    for it in items:
        by_cat.setdefault(category_of(it), []).append(it)
    keyed = []
    for c in sorted(by_cat):
        group = sorted(by_cat[c], key=lambda it: (rank(id_of(it), seed), id_of(it)))
        keyed += [((j + 0.5) / len(group), c, j, it) for j, it in enumerate(group)]
    return [k[3] for k in sorted(keyed, key=lambda k: k[:3])]


__all__ = ["DRAW", "RULE", "SEED", "draw", "interleave", "order", "rank"]
