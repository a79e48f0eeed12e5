"""Recall scoring (pure): exact recall of the needle value(s) after normalization, per (length, depth, kind).

Normalization: NFKC, case-folded, punctuation and symbols read as spaces, runs of spaces collapsed.
Diacritics are kept (dropping them is a recall error). A value matches as a whole word (no letter or digit
touching it); values written in CJK characters match as a substring. A numeric value also matches when
written with single separators between digits ("4 821 337", "4,821,337").

Per needle (one paired observation, whatever request asked it): `recall` = share of its expected values found,
`exact` = all of them found; `others_found` counts values of facts not asked about (the haystack's other needles,
unasked multi facts) in the answer, reported, not penalized. Failed requests (error) are counted per cell and left
out of the means.

Needles that share a haystack are not fully independent observations. `cluster_effect` measures how much they
move together (the intra-haystack correlation of a per-needle value, one-way ANOVA estimator), the design effect
1 + (m - 1) x ICC for m needles per haystack, and the effective number of independent observations n / deff:
`cells` reports it for the recall outcomes, `compare` for the paired differences the gate tests. Values are
centred on their (length, kind) mean first: a kind or length that is hard for every haystack is a property of the
grid's cells, there in any layout, not a dependence that sharing a haystack adds.
"""

from __future__ import annotations

import re
import unicodedata
from collections import defaultdict
from collections.abc import Iterable, Sequence

from quantgate.base.errors import SettingError

_SEP = r"[\s,.'’_\u00a0\u202f-]?"


def normalize(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).casefold()
    text = "".join(" " if unicodedata.category(c)[0] in "PSZC" else c for c in text)
    return " ".join(text.split())


def _is_cjk(value: str) -> bool:
    return all(unicodedata.name(c, "").startswith(("CJK", "HIRAGANA", "KATAKANA", "HANGUL")) for c in value if not c.isspace())


def found(value: str, output: str) -> bool:
    if value.isdigit():
        pattern = r"(?<!\d)" + _SEP.join(value) + r"(?!\d)"
        return re.search(pattern, unicodedata.normalize("NFKC", output)) is not None
    v, out = normalize(value), normalize(output)
    if not v:
        return False
    if _is_cjk(v):
        return v in out.replace(" ", "")
    return re.search(r"(?<!\w)" + re.escape(v) + r"(?!\w)", out) is not None


def score(output: str, expected: Sequence[str], others: Sequence[str] = ()) -> dict:
    hits = [found(v, output) for v in expected]
    return {"found": hits, "recall": sum(hits) / len(hits), "exact": all(hits),
            "others_found": sum(found(v, output) for v in others)}


def cluster_effect(groups: Iterable[Sequence[float]]) -> dict:
    """ICC of values grouped by cluster, the design effect and the effective n (None where nothing varies)."""
    gs = [list(g) for g in groups if len(g)]
    n, k = sum(len(g) for g in gs), len(gs)
    none = {"n": n, "clusters": k, "icc": None, "design_effect": None, "n_effective": None}
    if k < 2 or n <= k:
        return none
    grand = sum(map(sum, gs)) / n
    means = [sum(g) / len(g) for g in gs]
    msb = sum(len(g) * (m - grand) ** 2 for g, m in zip(gs, means)) / (k - 1)
    msw = sum((x - m) ** 2 for g, m in zip(gs, means) for x in g) / (n - k)
    m0 = (n - sum(len(g) ** 2 for g in gs) / n) / (k - 1)
    if msb + (m0 - 1) * msw <= 0:
        return none
    icc = max(0.0, (msb - msw) / (msb + (m0 - 1) * msw))
    deff = 1 + (n / k - 1) * icc
    return {**none, "icc": round(icc, 4), "design_effect": round(deff, 4), "n_effective": round(n / deff, 1)}


def _by(records: Iterable[dict], key: str, value: str) -> list[list[float]]:
    """`value` of each record, centred on its (length, kind) mean, grouped by `key` (the haystack)."""
    records = list(records)
    strata: dict[tuple, list[float]] = defaultdict(list)
    for r in records:
        strata[(r.get("length"), r.get("kind"))].append(float(r[value]))
    mean = {k: sum(v) / len(v) for k, v in strata.items()}
    groups: dict[str, list[float]] = defaultdict(list)
    for r in records:
        groups[r.get(key) or r["id"]].append(float(r[value]) - mean[(r.get("length"), r.get("kind"))])
    return list(groups.values())


def _summary(recs: Sequence[dict]) -> dict:
    ok = [r for r in recs if r.get("error") is None]
    n = len(ok)
    return {"n": n, "n_error": len(recs) - n,
            "recall": sum(r["recall"] for r in ok) / n if n else None,
            "exact": sum(bool(r["exact"]) for r in ok) / n if n else None}


def cells(records: Iterable[dict]) -> dict:
    """Scored per-request records -> overall, by kind, by language and per (length, depth, kind) cell."""
    records = list(records)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    by_kind: dict[str, list[dict]] = defaultdict(list)
    by_lang: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["length"], r["depth"], r["kind"])].append(r)
        by_kind[r["kind"]].append(r)
        by_lang[r["lang"]].append(r)
    ok = [r for r in records if r.get("error") is None]
    return {
        "overall": _summary(records),
        "observations": {"needles": len(records), "requests": len({r.get("request") or r["id"] for r in records}),
                         "haystacks": len({r.get("haystack") or r["id"] for r in records}),
                         "recall_within_haystack": cluster_effect(_by(ok, "haystack", "recall"))},
        "by_kind": {k: _summary(v) for k, v in sorted(by_kind.items())},
        "by_language": {k: _summary(v) for k, v in sorted(by_lang.items())},
        "cells": [{"length": n, "depth": d, "kind": k, **_summary(v)} for (n, d, k), v in sorted(groups.items())],
    }


def _delta(b: float | None, c: float | None) -> float | None:
    return None if b is None or c is None else c - b


def compare(base: Iterable[dict], cand: Iterable[dict]) -> dict:
    """Paired by request id (the id carries the prompt's hash): candidate minus baseline, per cell and overall."""
    b = {r["id"]: r for r in base}
    c = {r["id"]: r for r in cand}
    common = sorted(set(b) & set(c))
    if not common:
        raise SettingError("the baseline and candidate runs share no prompt (different grid, seed or tokenizer?)",
                             setting="baseline", fix="run both with the same grid (lengths, depths, kinds, samples, seed) and tokenizer")
    both = [i for i in common if b[i].get("error") is None and c[i].get("error") is None]
    bc, cc = cells(b[i] for i in both), cells(c[i] for i in both)
    out_cells = []
    for x, y in zip(bc["cells"], cc["cells"]):
        out_cells.append({"length": x["length"], "depth": x["depth"], "kind": x["kind"], "n": x["n"],
                          "base": x["recall"], "cand": y["recall"], "delta": _delta(x["recall"], y["recall"]),
                          "base_exact": x["exact"], "cand_exact": y["exact"], "delta_exact": _delta(x["exact"], y["exact"])})
    ob, oc = bc["overall"], cc["overall"]
    diffs = [{**c[i], "diff": float(c[i]["recall"]) - float(b[i]["recall"])} for i in both]
    return {
        "n_paired": len(both), "n_base_only": len(set(b) - set(c)), "n_cand_only": len(set(c) - set(b)),
        "n_requests": len({c[i].get("request") or i for i in both}), "n_haystacks": len({c[i].get("haystack") or i for i in both}),
        "paired_within_haystack": cluster_effect(_by(diffs, "haystack", "diff")),
        "n_error_excluded": len(common) - len(both),
        "overall": {"base": ob["recall"], "cand": oc["recall"], "delta": _delta(ob["recall"], oc["recall"]),
                    "base_exact": ob["exact"], "cand_exact": oc["exact"], "delta_exact": _delta(ob["exact"], oc["exact"])},
        "by_kind": {k: {"base": bc["by_kind"][k]["recall"], "cand": cc["by_kind"][k]["recall"],
                        "delta": _delta(bc["by_kind"][k]["recall"], cc["by_kind"][k]["recall"])} for k in bc["by_kind"]},
        "cells": out_cells,
        "regressions": [i for i in both if b[i]["recall"] > c[i]["recall"]],
        "improvements": [i for i in both if c[i]["recall"] > b[i]["recall"]],
    }
