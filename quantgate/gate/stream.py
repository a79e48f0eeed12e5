"""Deciding a REJECT while the fidelity evidence streams in (pure).

The baseline samples its continuations in stream order (quantgate.base.subsets.interleave: every slice in a seeded
random order, the slices merged in proportion to their sizes, fixed before any value is seen), and a candidate scores
each one as it arrives. A streaming look reads the first n prompts of that order once every one of them is sampled
and scored: a stratified random sample of the whole, so its pooled and per-slice estimates estimate the full
sample's. The looks are planned before the first one: at the fractions `FRACTIONS` of the full sample (no look
below `MIN_PROMPTS`), and the full sample itself is the gate's own look.

Every check has looks of its own. The pooled checks look at prefixes of the whole stream (all slices at once: a
haystack's long continuation holds back every look behind it). Each slice's checks (a category, a context length)
look at prefixes of that slice's own order, at the same fractions of the slice (no look below the policy's
`min_category_samples`, where the slice could not be judged anyway): a slice of short prompts is decided while the
haystacks are still being sampled.

What a streaming look may decide, and why the gate's promise holds:
- only a REJECT (a failed fidelity check: the whole one-sided interval beyond a limit, the noise floor low enough
  to judge). A PROMOTE needs the full sample, judged at the policy's alpha as before. Stopping early for a REJECT
  can only remove promotions, so P(PROMOTE | a slice at its limit) stays at most alpha over all looks.
- look k of a check judges its bound at its share of alpha in linear spending over that check's planned looks and
  the full sample (quantgate.gate.looks.shares), so that the chance of a streaming REJECT by a check whose slice is
  exactly at its limit is at most the shares spent before the full sample (union bound, whatever the correlation
  between looks): a good candidate is rarely rejected early, and the budget of a wrong REJECT is in decision.json.
"""

from __future__ import annotations

import math
from collections.abc import Container, Mapping, Sequence

from quantgate.base.errors import QuantgateError
from quantgate.fidelity.record import POOLED, StreamLook
from quantgate.gate.looks import shares

FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
MIN_PROMPTS = 24  # fewer prompts than that say little per slice: no look


def planned(total: int, fractions: Sequence[float] = FRACTIONS, minimum: int = MIN_PROMPTS) -> list[int]:
    """The prompt counts of the streaming looks of a full sample of `total` prompts: distinct, growing, each at least
    `minimum` and below `total` (the full sample is the gate's own look)."""
    if total < 1:
        raise QuantgateError(f"a stream needs at least one prompt, got {total}", where="gate stream")
    sizes = sorted({math.ceil(f * total) for f in fractions if 0 < f < 1})
    return [n for n in sizes if minimum <= n < total]


def look(alpha: float, total: int, n: int, *, scope: str = POOLED, minimum: int = MIN_PROMPTS,
         by_category: Mapping[str, int] | None = None, elapsed_s: float | None = None,
         scored_tokens: int | None = None) -> StreamLook:
    """Streaming look at `n` prompts (a planned one, of `scope`: the pooled stream or one slice) with its share of
    `alpha`: linear spending over that scope's planned looks and its full sample."""
    sizes = planned(total, minimum=minimum)
    if n not in sizes:
        raise QuantgateError(f"{n} prompts is no planned streaming look of {total} ({sizes})", where="gate stream")
    parts = shares(alpha, [*sizes, total])
    k = sizes.index(n)
    return StreamLook(scope=scope, index=k + 1, of=len(sizes), n=n, total=total, alpha=round(parts[k], 10),
                      spent=round(sum(parts[: k + 1]), 10), by_category=dict(by_category or {}),
                      elapsed_s=elapsed_s, scored_tokens=scored_tokens)


def reached(order: Sequence[str], ready: Container[str], total: int, minimum: int = MIN_PROMPTS) -> int | None:
    """The largest planned look whose whole prefix of `order` is `ready` (sampled and scored), or None."""
    best = None
    sizes = planned(total, minimum=minimum)
    for i, pid in enumerate(order[: sizes[-1]] if sizes else []):
        if pid not in ready:
            break
        if i + 1 in sizes:
            best = i + 1
    return best


__all__ = ["FRACTIONS", "MIN_PROMPTS", "look", "planned", "reached"]
