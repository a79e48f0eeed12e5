"""The report's fidelity section (adapter-free, every shape checked): the candidate against the baseline and the
noise floor, pooled and per slice (category, context length), its worst samples, and the rows of the by-slice chart.

Each figure is shown with the bound the gate judged it by, at the level the gate judged it: a look of a sequential
design, a streaming look or a repair's share judges at its share of the policy's alpha (a "99% upper bound", a
"99.47% lower bound"), not at the fidelity file's own 95%. Those figures are the gate's own, read from its check of
the slice (`fidelity:<measure>[:<slice>]`, its `measured` and the bound its reason states). A figure the gate did
not judge (a slice it skipped, a decision file whose reasons state no bound) keeps the file's mean and 95% bound.
"""

from __future__ import annotations

from typing import Any

from quantgate.report.sections import BOUND, _first, _int, bound_of, d, need, num

MAX_WORST = 10         # worst fidelity samples shown
# key, short, label, format, the side the gate bounds (a larger KL or NLL increase is worse, a smaller top-1)
FIDELITY_MEASURES = (("kl", "KL", "KL(baseline || candidate), nats/token", "sig", "upper"),
                     ("top1", "top-1", "top-1 agreement", "pct", "lower"),
                     ("dnll", "NLL increase", "NLL increase of the baseline's tokens, nats/token", "sig", "upper"))
NON_NEGATIVE = ("kl",)  # a KL below zero is estimator noise: its interval is shown from 0
GATED = {"kl": "upper", "top1": "lower"}  # the measures the gate judges per slice, by the side it bounds


def interval(x: Any, key: str = "") -> dict | None:
    """{"mean", "low", "high", "level"} from an interval object (or a bare number: the mean alone); a measure that
    cannot be negative (NON_NEGATIVE, by `key`) has its ends clipped at 0."""
    if num(x) is not None:
        return {"mean": num(x), "low": None, "high": None, "level": None}
    if not isinstance(x, dict):
        return None
    mean = _first(x, "mean", "value", "estimate")
    if mean is None:
        return None
    low, high = _first(x, "low", "ci_low", "lower"), _first(x, "high", "ci_high", "upper")
    if key in NON_NEGATIVE:
        mean, low, high = (None if v is None else max(v, 0.0) for v in (mean, low, high))
    return {"mean": mean, "low": low, "high": high, "level": _first(x, "level")}


def one_sided(level: float | None) -> float | None:
    """The one-sided level of a two-sided interval's end: the gate judges the end of a 90% interval as a 95% bound."""
    return None if level is None else 1 - (1 - level) / 2


def fidelity_summary(doc: dict | None) -> dict | None:
    """The summary of a fidelity file: its "summary" object, or the file itself when it is the summary."""
    if doc is None:
        return None
    s = doc.get("summary")
    if isinstance(s, dict):
        return s
    if "kl" in doc:
        return doc
    raise TypeError("no \"summary\" object in the fidelity file")


def _measures(s: dict, floor: dict | None) -> list[dict]:
    return [{"key": k, "short": short, "label": label, "fmt": fmt, "side": side, "cand": interval(s.get(k), k),
             "floor": interval(floor.get(k), k) if floor else None} for k, short, label, fmt, side in FIDELITY_MEASURES
            if k in s or (floor and k in floor)]


def _categories(s: dict, floor: dict | None) -> list[dict]:
    fcats = d(d(floor).get("by_category"))
    out = []
    for cat, v in sorted(need(s.get("by_category") or {}, dict, "fidelity by_category").items(), key=_slice_order):
        v = d(v)
        out.append({"category": cat, "n_samples": _int(v.get("n_samples")), "n_tokens": _int(v.get("n_tokens")),
                    **{k: interval(v.get(k), k) for k, *_ in FIDELITY_MEASURES},
                    "floor_kl": interval(d(fcats.get(cat)).get("kl"), "kl")})
    return out


def _slice_order(item: tuple[str, Any]) -> tuple:
    """Task categories by name, then context lengths by length (context:512 before context:1024)."""
    name = item[0]
    length = name.partition(":")[2]
    return (1, int(length), name) if name.startswith("context:") and length.isdigit() else (0, 0, name)


def _worst(s: dict) -> list[dict]:
    rows = []
    for w in need(s.get("worst") or [], list, "fidelity worst")[:MAX_WORST]:
        w = d(w)
        rows.append({"id": w.get("id"), "category": w.get("category"), "kl": _first(w, "kl_mean", "kl"),
                     "top1": _first(w, "top1", "top1_mean", "top1_agreement"), "dnll": _first(w, "dnll_mean", "dnll"),
                     "n_tokens": _int(w.get("n_tokens"))})
    return rows


def judged(check: dict | None) -> tuple[float, float] | None:
    """(bound, its one-sided level) as the gate stated them in a check's reason ("... (99% upper bound 0.07212) ..."
    -> (0.07212, 0.99)); None where the reason states none."""
    reason = str((check or {}).get("reason") or "")
    m, value = BOUND.search(reason), bound_of(reason)  # BOUND's label starts with the level: "99.47% upper bound"
    return None if m is None or value is None else (value, float(m.group(1).partition("%")[0]) / 100)


def as_judged(iv: dict | None, check: dict | None, key: str) -> dict | None:
    """`iv`, an interval of measure `key`, with the gate's figures where its check of the slice states them: the
    mean it measured and the bound it judged, with that bound's one-sided level (`bound_level`); else unchanged."""
    j = judged(check)
    if iv is None or j is None:
        return iv
    mean = num((check or {}).get("measured"))
    mean = iv["mean"] if mean is None else max(mean, 0.0) if key in NON_NEGATIVE else mean
    return {**iv, "mean": mean, "high" if GATED[key] == "upper" else "low": j[0], "bound_level": j[1]}


def fidelity(doc: dict | None, floor: dict | None, checks_ctx: dict | None = None) -> dict | None:
    """Teacher-forced fidelity against the baseline, with the noise floor (the baseline against itself) beside it.
    `bound`: the one-sided level of the file's intervals (its "95% upper bound"); `look_levels`: the other levels
    at which the gate judged some of them (a look's share of alpha), as its checks (quantgate.report.sections.checks,
    `checks_ctx`) state them."""
    s = fidelity_summary(doc)
    if s is None:
        return None
    by_name = {r["name"]: r for r in (checks_ctx or {}).get("checks") or []}
    measures = _measures(s, floor)
    levels = [iv["level"] for m in measures if (iv := m["cand"]) and iv["level"] is not None]
    bound = one_sided(levels[0]) if levels else None
    measures = [{**m, "cand": as_judged(m["cand"], by_name.get(f"fidelity:{m['key']}"), m["key"])
                          if m["key"] in GATED else m["cand"]} for m in measures]
    categories = [{**k, **{key: as_judged(k[key], by_name.get(f"fidelity:{key}:{k['category']}"), key)
                           for key in GATED}} for k in _categories(s, floor)]
    judged = [m["cand"] for m in measures] + [k[key] for k in categories for key in GATED]
    return {"n_samples": _int(s.get("n_samples")), "n_tokens": _int(s.get("n_tokens")),
            "floor_n_samples": _int(d(floor).get("n_samples")), "has_floor": floor is not None, "bound": bound,
            "look_levels": sorted({lv for iv in judged if iv and (lv := iv.get("bound_level")) not in (None, bound)}),
            "measures": measures, "categories": categories, "worst": _worst(s)}


def slices(fid: dict | None, checks_ctx: dict | None) -> list[dict]:
    """The fidelity chart's rows: the pooled sample, then each category and context length, per measure (KL and
    top-1) its mean, the bound the gate judged (KL's upper, top-1's lower end) with its one-sided level and, from the
    gate's check of that slice (fidelity:<measure>[:<slice>]), its limit and outcome. A slice the gate did not judge
    has no limit, and the file's 95% bound."""
    if not fid:
        return []
    by_name = {r["name"]: r for r in (checks_ctx or {}).get("checks") or []}
    pooled = {"category": "all", **{m["key"]: m["cand"] for m in fid["measures"]}}
    out = []
    for row in [pooled, *fid["categories"]]:
        suffix = "" if row["category"] == "all" else f":{row['category']}"
        for key, side in GATED.items():
            iv, check = row.get(key), by_name.get(f"fidelity:{key}{suffix}", {})
            if iv is None:
                continue
            out.append({"slice": row["category"], "measure": key, "mean": iv["mean"],
                        "bound": iv["high" if side == "upper" else "low"], "level": iv.get("bound_level", fid["bound"]),
                        "limit": num(check.get("limit")), "outcome": check.get("outcome")})
    return out
