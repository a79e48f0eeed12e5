"""Per-candidate sections of the release report built from the gate's and the comparison's files (adapter-free, but
every shape is checked): the gate's checks with their outcomes and power, the flips ledger and speed (fidelity:
quantgate.report.fidelitysection).

Each function takes plain JSON values and returns plain values for the templates. A wrong container type raises
TypeError (quantgate.report.page turns it into a gap naming the section); a missing or odd scalar becomes None.
Decisions of schema 1 (checks with only `passed`) and schema 2 (`outcome`, `power`, `needs`, `operating`,
quantgate/gate/models.py) both read.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from typing import Any

from quantgate.base.stats import num
from quantgate.gate.checks import DECIDED_EARLY
from quantgate.perf.payofffile import PayOff
from quantgate.perf.rounds import floor_speeds, speedup

MAX_REGRESSIONS = 40   # flips shown per kind (the counts cover them all)
MAX_GAINS = 40
OUTCOMES = ("pass", "fail", "inconclusive", "skipped")
PASSED: dict[Any, str] = {True: "pass", False: "fail"}  # schema 1's `passed` -> the outcome
EARLY = DECIDED_EARLY
MAX_LEAD = 8  # deciding checks on the first screen (the rest are in the checks table)
BOUND = re.compile(r"\((\d+(?:\.\d+)?% (?:upper|lower) bound) ([^)]+)\)")
_NEEDS = re.compile(r"needs about (\d+)")


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


def skipped_early(check: dict, why: Collection[str]) -> bool:
    """Whether a check lacks its evidence because the release skipped that step on purpose: its reason carries
    one of the recorded whys (the candidate's evidence.json `skipped` values, or its `decided` text, which the gate
    quotes in "not measured: <why>"), or the gate said so itself (gate.checks.decided_early). Such a check could not
    change the decision it was skipped for."""
    reason = str(check.get("reason") or "")
    return outcome(check) in ("inconclusive", "skipped") and (reason.startswith(EARLY)
                                                               or any(w and w in reason for w in why))


def checks(decision: dict | None, link, early: Collection[str] = ()) -> dict | None:
    """The candidate's decision: verdict, reasons, what would decide it, operating characteristics and the checks.
    A check skipped early (`skipped_early`) shows as skipped with one short reason, not the early decision's text
    again in each row (the deciding checks say it once)."""
    if decision is None:
        return None
    rows = []
    for ch in need(decision.get("checks") or [], list, "checks"):
        ch = need(ch, dict, "a check")
        early_row = skipped_early(ch, early)
        rows.append({"name": ch.get("name"), "measured": ch.get("measured"), "limit": ch.get("limit"),
                     "bound": ch.get("bound"), "required": ch.get("required"),
                     "outcome": "skipped" if early_row else outcome(ch), "early": early_row,
                     "power": power(ch.get("power")), "evidence": link(ch.get("evidence_file")),
                     "reason": EARLY if early_row else ch.get("reason"), "line": headline(ch)})
    counts = {o: sum(1 for r in rows if r["outcome"] == o) for o in OUTCOMES}
    needs = decision.get("needs")
    reasons = [r for r in need(decision.get("reasons") or [], list, "reasons")
               if not any(w and w in str(r) for w in early)]
    return {"decision": decision.get("decision"), "family": decision.get("family"),
            "schema": decision.get("schema_version", 1), "reasons": reasons,
            "needs": needs if isinstance(needs, str) else None, "operating": operating(decision.get("operating")),
            "checks": rows, "counts": counts, "early": sum(1 for r in rows if r["early"])}


def _fmt(x: Any, pct: bool) -> str:
    v = num(x)
    if v is None:
        return "—" if x is None else str(x)
    return f"{v + 0.0:.2%}" if pct else f"{v + 0.0:.4g}"


def headline(check: dict) -> dict:
    """A check in one line: its value, the bound the gate judged (as the gate words it: "95% upper bound 0.0289")
    and its limit, in the units of the gate's own reason (percent where the reason states the limit in percent),
    and the samples it would need to decide when the reason or its power says so."""
    reason = str(check.get("reason") or "")
    m = BOUND.search(reason)
    pct = num(check.get("limit")) is not None and f"{num(check.get('limit')):.2%}" in reason
    p, wanted = power(check.get("power")), _NEEDS.search(reason)
    needs = (p or {}).get("needs_samples") or (int(wanted.group(1)) if wanted else None)
    return {"value": _fmt(check.get("measured"), pct), "bound_label": m.group(1) if m else None,
            "bound": m.group(2).strip() if m else None, "limit": _fmt(check.get("limit"), pct),
            "needs": needs if outcome(check) != "pass" else None}


def bound_of(reason: Any) -> float | None:
    """The number of the bound a check's reason states ("95% upper bound 0.0289" -> 0.0289, "... 89.61%" -> 0.8961)."""
    m = BOUND.search(str(reason or ""))
    text = m.group(2).strip() if m else ""
    value = num(_float(text.rstrip("%")))
    return None if value is None else (value / 100 if text.endswith("%") else value)


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _headroom(row: dict) -> float:
    """How far a passed check sits inside its limit, relative to it (the smallest first on the first screen)."""
    value, limit = num(row["measured"]), num(row["limit"])
    return abs(limit - value) / abs(limit) if value is not None and limit else math.inf


def deciding(checks_ctx: dict | None) -> dict:
    """The checks that decided: a REJECT's failed ones, an INCONCLUSIVE's undecided ones (not those skipped early),
    a PROMOTE's required statistical ones closest to their limits; at most MAX_LEAD, with how many more."""
    if not checks_ctx:
        return {"rows": [], "more": 0}
    rows, verdict = checks_ctx["checks"], checks_ctx.get("decision")
    if verdict == "REJECT":
        picked = [r for r in rows if r["outcome"] == "fail"]
    elif verdict == "PROMOTE":
        picked = sorted((r for r in rows if r["required"] and r["bound"] and r["outcome"] == "pass"), key=_headroom)
    else:
        picked = [r for r in rows if r["outcome"] == "inconclusive"]
    return {"rows": picked[:MAX_LEAD], "more": max(0, len(picked) - MAX_LEAD)}


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
    category, and the rows worst first (the categories that lost most, net, come first), each kind capped. None
    without a comparison, or with one of no eval set (both skipped once the REJECT was decided): nothing was compared,
    so no "0 regressions"."""
    if not compare:
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
        ci, floor = r.ratio, doc.floor_of(r)
        lower = r.lower_is_better
        value, low, high = num(ci.value), num(ci.low), num(ci.high)

        def spd(x: float | None, lower: bool = lower) -> float | None:
            return None if x is None else speedup(x, lower)

        ends = sorted(v for v in (spd(low), spd(high)) if v is not None)
        aa = floor_speeds(floor, lower)
        rows.append({"figure": r.figure, "concurrency": r.concurrency, "baseline": num(r.baseline),
                     "candidate": num(r.candidate), "ratio": value, "low": low, "high": high,
                     "level": num(ci.level), "speed": spd(value), "speed_low": ends[0] if ends else None,
                     "speed_high": ends[-1] if ends else None, "floor_low": aa[0] if aa else None,
                     "floor_high": aa[1] if aa else None, "n": ci.n_cand, "method": ci.method})
    return {"workload": doc.workload, "rows": rows, "slo_concurrency": dict(doc.slo_concurrency),
            "measured": measured_how(doc)}


def measured_how(doc: PayOff) -> str:
    """Under what conditions the speed figures were measured, in one sentence (the card's and the report's)."""
    w = doc.window
    if w is None:
        return ("Probes taken apart: each variant was probed on its own server when it was measured (the baseline's "
                "probe may come from an earlier release's cache), so the ratios are unpaired and carry whatever load "
                "each probe met.")
    load = w.load
    lo, hi, others = load.get("load1_min"), load.get("load1_max"), load.get("others_share_max")
    return (f"Side by side in one window: {w.rounds} rounds of baseline, candidates, baseline again on cores "
            f"{', '.join(map(str, w.cores)) or 'all'}, {w.started} to {w.ended}"
            + (f" ({w.seconds:.0f} s)" if w.seconds else "")
            + (f"; 1-minute load {lo:.2f}-{hi:.2f}" if lo is not None and hi is not None else "")
            + (f", other processes at most {others:.0%} of those cores" if others is not None else "")
            + ". Intervals are paired by round; the A/A floor is the baseline against itself in the same rounds.")
