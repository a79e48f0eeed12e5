"""Per-candidate sections of the release report built from the gate's and the comparison's files (adapter-free, but
every shape is checked): the gate's checks with their outcomes and power, the flips ledger, and fidelity.

Each function takes plain JSON values and returns plain values for the templates. A wrong container type raises
TypeError (quantgate.report.page turns it into a gap naming the section); a missing or odd scalar becomes None.
Decisions of schema 1 (checks with only `passed`) and schema 2 (`outcome`, `power`, `needs`, `operating`,
quantgate/gate/models.py) both read.
"""

from __future__ import annotations

import math
from typing import Any

from quantgate.base.stats import num
from quantgate.perf.payofffile import PayOff

MAX_REGRESSIONS = 40   # flips shown per kind (the counts cover them all)
MAX_GAINS = 40
MAX_WORST = 10         # worst fidelity samples shown
OUTCOMES = ("pass", "fail", "inconclusive", "skipped")
PASSED: dict[Any, str] = {True: "pass", False: "fail"}  # schema 1's `passed` -> the outcome
FIDELITY_MEASURES = (("kl", "KL", "KL(baseline || candidate), nats/token", "sig"),  # key, short, label, format
                     ("top1", "top-1", "top-1 agreement", "pct"),
                     ("dnll", "NLL increase", "NLL increase of the baseline's tokens, nats/token", "sig"))


def d(x: Any) -> dict:
    return x if isinstance(x, dict) else {}


def need(x: Any, kind: type, what: str) -> Any:
    """x when it has the expected JSON type; else a TypeError that the section turns into a gap."""
    if not isinstance(x, kind):
        raise TypeError(f"{what} should be a JSON {'object' if kind is dict else 'array'}, found {type(x).__name__}")
    return x


def _int(x: Any) -> int | None:
    return int(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and x == x else None


def _first(src: dict, *keys: str) -> float | None:
    return next((num(src[k]) for k in keys if num(src.get(k)) is not None), None)


# --- gate checks --------------------------------------------------------------------------------------------------

def outcome(check: dict) -> str:
    """pass / fail / inconclusive / skipped: schema 2's `outcome`, else schema 1's `passed` (True, False, None)."""
    o = check.get("outcome")
    if o in OUTCOMES:
        return o
    return PASSED.get(check.get("passed"), "skipped")


def power(p: Any) -> dict | None:
    """A check's `power` block (what a statistical check could see at its n), or None."""
    if not isinstance(p, dict):
        return None
    role = p.get("role")
    return {"n": _int(p.get("n")), "alpha": num(p.get("alpha")), "mdd": num(p.get("mdd")), "power": num(p.get("power")),
            "discordance": num(p.get("discordance")), "p_harm": num(p.get("p_harm")),
            "role": role if isinstance(role, str) else None, "limit_below_mdd": p.get("limit_below_mdd") is True,
            "needs_samples": _int(p.get("needs_samples"))}


def operating(o: Any) -> dict | None:
    if not isinstance(o, dict):
        return None
    note = o.get("note")
    return {"false_reject_bound": num(o.get("false_reject_bound")),
            "false_promote_at_limit": num(o.get("false_promote_at_limit")), "power": num(o.get("power")),
            "note": note if isinstance(note, str) else None}


def checks(decision: dict | None, link) -> dict | None:
    """The candidate's decision: verdict, reasons, what would decide it, operating characteristics and the checks."""
    if decision is None:
        return None
    rows = []
    for ch in need(decision.get("checks") or [], list, "checks"):
        ch = need(ch, dict, "a check")
        rows.append({"name": ch.get("name"), "measured": ch.get("measured"), "limit": ch.get("limit"),
                     "bound": ch.get("bound"), "required": ch.get("required"), "outcome": outcome(ch),
                     "power": power(ch.get("power")), "evidence": link(ch.get("evidence_file")), "reason": ch.get("reason")})
    counts = {o: sum(1 for r in rows if r["outcome"] == o) for o in OUTCOMES}
    needs = decision.get("needs")
    return {"decision": decision.get("decision"), "family": decision.get("family"),
            "schema": decision.get("schema_version", 1), "reasons": need(decision.get("reasons") or [], list, "reasons"),
            "needs": needs if isinstance(needs, str) else None, "operating": operating(decision.get("operating")),
            "checks": rows, "counts": counts}


# --- flips ledger -------------------------------------------------------------------------------------------------

def _flip(set_name: str, r: Any, kind: str) -> dict:
    r = need(r, dict, f"{set_name}: a {kind} row")
    refs = r.get("references")
    return {"set": set_name, "kind": kind, "id": r.get("id"), "category": r.get("category"), "metric": r.get("metric"),
            "references": [str(x) for x in refs] if isinstance(refs, list) else [],
            "base": r.get("base_output"), "cand": r.get("cand_output")}


def _pooled(set_name: str, p: Any) -> dict | None:
    if not isinstance(p, dict):
        return None
    return {"set": set_name, "n": _int(p.get("n")), "lost": _int(p.get("lost")), "gained": _int(p.get("gained")),
            **{k: num(p.get(k)) for k in ("base_mean", "cand_mean", "delta", "ci_low", "ci_high", "discordance",
                                           "p_harm")}}


def flips(compare: dict | None) -> dict | None:
    """Samples that went right -> wrong (regressions) and wrong -> right (gains), over every eval set: counts per
    category, and the rows worst first (the categories that lost most, net, come first), each kind capped."""
    if compare is None:
        return None
    regs, gains, pooled, gains_recorded = [], [], [], True
    for set_name, rep in compare.items():
        rep = need(rep, dict, set_name)
        regs += [_flip(set_name, r, "regression") for r in need(rep.get("regressions") or [], list, f"{set_name}: regressions")]
        if "gains" in rep:
            gains += [_flip(set_name, r, "gain") for r in need(rep.get("gains") or [], list, f"{set_name}: gains")]
        else:
            gains_recorded = False  # a comparison written before gains were listed
        if (p := _pooled(set_name, rep.get("pooled"))) is not None:
            pooled.append(p)
    cats: dict[tuple[str, str], dict] = {}
    for r in regs + gains:
        row = cats.setdefault((r["set"], str(r["category"])), {"set": r["set"], "category": str(r["category"]),
                                                               "lost": 0, "gained": 0})
        row["lost" if r["kind"] == "regression" else "gained"] += 1
    by_cat = sorted(cats.values(), key=lambda c: (c["gained"] - c["lost"], -c["lost"], c["set"], c["category"]))
    rank = {(c["set"], c["category"]): i for i, c in enumerate(by_cat)}

    def order(rows: list[dict]) -> list[dict]:
        return sorted(rows, key=lambda r: (rank[(r["set"], str(r["category"]))], str(r["id"])))

    return {"n_regressions": len(regs), "n_gains": len(gains), "gains_recorded": gains_recorded,
            "regressions": order(regs)[:MAX_REGRESSIONS], "gains": order(gains)[:MAX_GAINS],
            "by_category": [{**c, "net": c["gained"] - c["lost"]} for c in by_cat], "pooled": pooled}


# --- fidelity -----------------------------------------------------------------------------------------------------

def interval(x: Any) -> dict | None:
    """{"mean", "low", "high", "level"} from an interval object (or a bare number: the mean alone)."""
    if num(x) is not None:
        return {"mean": num(x), "low": None, "high": None, "level": None}
    if not isinstance(x, dict):
        return None
    mean = _first(x, "mean", "value", "estimate")
    if mean is None:
        return None
    return {"mean": mean, "low": _first(x, "low", "ci_low", "lower"), "high": _first(x, "high", "ci_high", "upper"),
            "level": _first(x, "level")}


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
    return [{"key": k, "short": short, "label": label, "fmt": fmt, "cand": interval(s.get(k)),
             "floor": interval(floor.get(k)) if floor else None} for k, short, label, fmt in FIDELITY_MEASURES
            if k in s or (floor and k in floor)]


def _categories(s: dict, floor: dict | None) -> list[dict]:
    fcats = d(d(floor).get("by_category"))
    out = []
    for cat, v in sorted(need(s.get("by_category") or {}, dict, "fidelity by_category").items()):
        v = d(v)
        out.append({"category": cat, "n_samples": _int(v.get("n_samples")), "n_tokens": _int(v.get("n_tokens")),
                    **{k: interval(v.get(k)) for k, *_ in FIDELITY_MEASURES},
                    "floor_kl": interval(d(fcats.get(cat)).get("kl"))})
    return out


def _worst(s: dict) -> list[dict]:
    rows = []
    for w in need(s.get("worst") or [], list, "fidelity worst")[:MAX_WORST]:
        w = d(w)
        rows.append({"id": w.get("id"), "category": w.get("category"), "kl": _first(w, "kl_mean", "kl"),
                     "top1": _first(w, "top1", "top1_mean", "top1_agreement"), "dnll": _first(w, "dnll_mean", "dnll"),
                     "n_tokens": _int(w.get("n_tokens"))})
    return rows


def fidelity(doc: dict | None, floor: dict | None) -> dict | None:
    """Teacher-forced fidelity against the baseline, with the noise floor (the baseline against itself) beside it."""
    s = fidelity_summary(doc)
    if s is None:
        return None
    levels = [iv["level"] for m in _measures(s, None) if (iv := m["cand"]) and iv["level"] is not None]
    return {"n_samples": _int(s.get("n_samples")), "n_tokens": _int(s.get("n_tokens")),
            "floor_n_samples": _int(d(floor).get("n_samples")), "has_floor": floor is not None,
            "level": levels[0] if levels else None, "measures": _measures(s, floor),
            "categories": _categories(s, floor), "worst": _worst(s)}


# --- serving performance: curves per variant and the workload profile's pay-off figures -----------------------------

PERF_CURVE_KEYS = ("output_tok_s", "goodput_rps", "slo_attainment", "ttft_p95_ms", "tpot_p95_ms", "itl_p95_ms")


def perf_curve(name: str, perf: dict | None) -> dict | None:
    """One variant's probe as plain values: per concurrency level the medians the charts draw, its SLO and cost."""
    if perf is None:
        return None
    levels = [{"concurrency": _int(m.get("concurrency")), **{k: num(m.get(k)) for k in PERF_CURVE_KEYS}}
              for m in need(perf.get("medians") or [], list, f"{name}: medians") if isinstance(m, dict)]
    w, sweep = d(perf.get("workload")), d(perf.get("sweep"))
    slo = d(w.get("slo"))
    return {"name": name, "levels": [lv for lv in levels if lv["concurrency"] is not None],
            "profile": w.get("profile") if isinstance(w.get("profile"), str) else None,
            "slo": {k: num(slo.get(k)) for k in ("ttft_ms", "tpot_ms", "attainment")} if slo else None,
            "seconds": num(perf.get("seconds")), "budget_s": num(sweep.get("budget_s")),
            "stopped": sweep.get("stopped") if isinstance(sweep.get("stopped"), str) else None,
            "skipped": len(sweep.get("skipped") or []) if isinstance(sweep.get("skipped"), list) else 0,
            "engine": {k: num(d(perf.get("engine_metrics")).get(k)) for k in ("kv_usage_max", "preemptions", "prefix_hit_rate")}}


def pay_off(doc: PayOff | dict | None) -> dict | None:
    """The workload profile's pay-off figures of a comparison (pay_off.json, or quantgate.perf.compare's output):
    ratio, interval and speed."""
    doc = PayOff.model_validate(doc) if isinstance(doc, dict) else doc
    if doc is None or not doc.has_figures:
        return None
    rows = []
    for r in doc.decide:
        ci = r.ratio
        lower = r.lower_is_better
        value, low, high = num(ci.value), num(ci.low), num(ci.high)

        def spd(x: float | None, lower: bool = lower) -> float | None:
            return None if x is None else (x if not lower else (math.inf if x == 0 else 1 / x))

        ends = sorted(v for v in (spd(low), spd(high)) if v is not None)
        rows.append({"figure": r.figure, "concurrency": r.concurrency, "baseline": num(r.baseline),
                     "candidate": num(r.candidate), "ratio": value, "low": low, "high": high,
                     "level": num(ci.level), "speed": spd(value), "speed_low": ends[0] if ends else None,
                     "speed_high": ends[-1] if ends else None})
    return {"workload": doc.workload, "rows": rows, "slo_concurrency": dict(doc.slo_concurrency)}
