"""The scheme ladder (pure, no I/O): which schemes a release tries next, and what became of each.

With `ladder: true` a spec's `schemes` is a preference order: the first scheme is quantized, evaluated, judged and
gated; only when it is not promoted (REJECT or INCONCLUSIVE) is the next one tried, and the release stops at the
first PROMOTE. A rung whose candidate is REJECTed early by fidelity (`decide_early`) starts the next one at that
verdict, beside the baseline's remaining measurement. Without a ladder every scheme is one rung, tried at once (the
release's default).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

PROMOTE, REJECT, INCONCLUSIVE = "PROMOTE", "REJECT", "INCONCLUSIVE"


def next_rung(schemes: Sequence[str], decided: Mapping[str, str], ladder: bool) -> list[str]:
    """The schemes to try next, given the decisions so far (scheme -> PROMOTE | REJECT); [] when the release is done."""
    untried = [s for s in schemes if s not in decided]
    if not ladder:
        return [] if decided else untried
    if any(d == PROMOTE for d in decided.values()):
        return []
    return untried[:1]


def after(schemes: Sequence[str], name: str) -> str | None:
    """The rung after `name` in ladder order (None after the last): what starts as soon as `name` is REJECTed early."""
    order = list(schemes)
    i = order.index(name) + 1 if name in order else len(order)
    return order[i] if i < len(order) else None


def rungs(schemes: Sequence[str], decided: Mapping[str, str], reasons: Mapping[str, Sequence[str]] | None = None
          ) -> list[dict]:
    """One row per scheme in ladder order: its decision and the gate's reasons, or `not tried` with why."""
    promoted = next((s for s in schemes if decided.get(s) == PROMOTE), None)
    rows = []
    for s in schemes:
        if s in decided:
            rows.append({"scheme": s, "status": decided[s], "reasons": list((reasons or {}).get(s, []))})
        elif promoted is not None:
            rows.append({"scheme": s, "status": "not tried", "reasons": [f"{promoted} was promoted first"]})
        else:
            rows.append({"scheme": s, "status": "pending", "reasons": ["not reached yet"]})
    return rows


def describe(rows: Sequence[Mapping]) -> str:
    """One line for the summary's notes: `scheme ladder: a REJECT (first reason), b PROMOTE; not tried: c`."""
    done = (PROMOTE, REJECT, INCONCLUSIVE)
    tried = [f"{r['scheme']} {r['status']}" + (f" ({r['reasons'][0]})" if r["status"] != PROMOTE and r["reasons"] else "")
             for r in rows if r["status"] in done]
    rest = [r["scheme"] for r in rows if r["status"] not in done]
    return "scheme ladder: " + (", ".join(tried) or "nothing tried") + (f"; not tried: {', '.join(rest)}" if rest else "")
