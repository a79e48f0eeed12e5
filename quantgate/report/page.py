"""The release report of one run: a self-contained HTML page and a Markdown summary (the Prefect artifact).

`context(view)` turns a run's evidence (quantgate.report.runview) into plain values (the sections come from
quantgate.report.sections and .fidelitysection); templates/report.html and templates/report.md.j2 lay them out. The page leads with the decision: per candidate the checks that decided it, each in one line
(sections.deciding), and what would change it; steps the release skipped on purpose (decided early by fidelity)
are named once, in grey, and are no gap. A section whose evidence is missing or malformed shows the gap instead of
failing: every section is built on its own, and an unexpected shape becomes a gap naming the file. Paths are
relative to the run folder (runview.shorten over the rendered text): a report is published, the machine is not.
Links point only at files that exist and lie under `link_root` (the results folder), so they resolve both from
disk and when the results folder is served. The Markdown goes into a Prefect artifact, where inline HTML would
render: every value read from a file passes through `mdcell` (HTML and link syntax escaped) or `mdcode`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from quantgate.gate import kinds
from quantgate.base.runfiles import REPAIR, REPORT_HTML
from quantgate.gate.repairfile import load_repair
from quantgate.report import charts, fidelitysection, sections
from quantgate.report.runview import (BASELINE, Candidate, ReportGap, RunView, load_run, outcome_of, shorten,
                                      size_ratio, skipped_steps)
from quantgate.report.sections import d as _d, need as _need, num as _num

TEMPLATES = Path(__file__).with_name("templates")
MD_FLIPS = 10            # flips listed in the Markdown summary (the HTML report lists up to sections.MAX_REGRESSIONS)
MD_OUTPUT_CHARS = 160    # model outputs are cut to this in the Markdown summary
BADGES = {"pass": "pass", "fail": "FAIL", "inconclusive": "INCONCLUSIVE", "skipped": "skip"}
WORDS = {"pass": "passed", "fail": "failed"}  # the outcome counts as the report words them
# evidence.json `skipped` keys, in words
STEPS = {"evals": "eval sets", "recall": "recall grid", "perf": "perf probe", "judge": "judge"}


class Links:
    """Relative hrefs from the report's folder to evidence files under `root`; None for anything else. A file
    outside `root` is named by its file name alone (its place on the machine that ran the release means nothing
    to a reader of the report)."""
    def __init__(self, out_dir: Path, root: Path):
        self.out_dir, self.root = out_dir.resolve(), root.resolve()

    def __call__(self, path: str | Path | None) -> dict:
        if not path:
            return {"href": None, "text": ""}
        p = Path(path).resolve()
        inside = p == self.root or self.root in p.parents
        return {"href": os.path.relpath(p, self.out_dir) if inside and p.is_file() else None,
                "text": str(path) if inside else p.name}


def _section(view: RunView, name: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as exc:
        view.gaps.append(ReportGap(name, None, f"unexpected content, section left out: {type(exc).__name__}: {exc}"))
        return None


def _stat_row(set_name: str, metric: str, category: str, s: dict) -> dict:
    return {"set": set_name, "metric": metric, "category": category, "n": s.get("n"),
            **{k: _num(s.get(k)) for k in ("base_mean", "cand_mean", "delta", "ci_low", "ci_high", "mcnemar_p")}}


def _deltas(c: Candidate) -> list[dict]:
    rows = []
    for set_name, rep in _d(c.compare).items():
        for metric, m in _need(_need(rep, dict, set_name).get("metrics"), dict, f"{set_name}: metrics").items():
            rows.append(_stat_row(set_name, metric, "all", _need(_need(m, dict, metric).get("overall"), dict,
                                                                 f"{set_name}/{metric}: overall")))
            rows += [_stat_row(set_name, metric, cat, _d(s)) for cat, s in sorted(_d(m.get("by_category")).items())]
    return rows


def _judge(c: Candidate) -> dict | None:
    r = c.judge  # a JudgeReport (quantgate.judge.reportfile); the template reads plain dicts of what the file holds
    if r is None:
        return None
    cal, cmp_, overall = r.calibration, r.comparison, r.comparison.overall
    rates = {k: getattr(overall, k).model_dump(exclude_unset=True) for k in ("win", "tie", "loss")
             if k in overall.model_fields_set}
    return {"counts": r.counts_as_evidence, "not_stronger": r.judge_not_stronger,
            "calibration": {"accuracy": _num(cal.accuracy), "bar": _num(cal.bar), "reliable": cal.reliable,
                            "reason": cal.reason, "ci_low": _num(cal.ci_low), "ci_high": _num(cal.ci_high),
                            "by_type": {t: a.model_dump(exclude_unset=True) for t, a in cal.by_type.items()}},
            "ni": overall.non_inferiority.model_dump(exclude_unset=True), "rates": rates,
            "position_consistency": _num(cmp_.position_consistency),
            "worst": [w.model_dump(exclude_unset=True) for w in cmp_.worst_losses[:5]]}


def _human(c: Candidate) -> dict:
    """Review status: none (no judge), not exported, exported and awaiting the filled CSV, or imported."""
    h = c.human or (c.judge.human if c.judge else None)
    if h:
        agree = _d(h.get("agreement"))
        return {"status": "imported", "text": f"{h.get('n_reviewed')} of {h.get('n_exported')} exported pairs reviewed "
                f"({h.get('n_blank')} blank); human-judge agreement {_pct(agree.get('rate'))} over {agree.get('n')} pairs",
                "rates": {k: _d(v) for k, v in _d(h.get("rates")).items()}}
    if c.review_key:
        n = len(c.review_key.get("items") or [])
        return {"status": "awaiting", "text": f"{n} pairs exported for review; the filled CSV is not imported yet "
                f"(quantgate review import)", "rates": {}}
    if c.judge_dir is None:
        return {"status": "none", "text": "no judge run for this candidate, so nothing to review", "rates": {}}
    return {"status": "not_exported", "text": "no pairs exported for human review (quantgate review export)", "rates": {}}


def _pct(x: Any) -> str:
    return "—" if _num(x) is None else f"{x:.1%}"


def _recall(c: Candidate) -> dict | None:
    if c.recall_delta is None and c.recall_cells is None and not c.heatmaps:
        return None
    d = c.recall_delta  # a RecallDelta (quantgate.recall.resultfile)
    return {"overall": {k: _num(getattr(d.overall, k)) if d else None
                        for k in ("base", "cand", "delta", "base_exact", "cand_exact", "delta_exact")},
            "n": d.n_paired if d else None, "errors": d.n_error_excluded if d else None,
            "images": {k: charts.png_uri(p) for k, p in c.heatmaps.items()}}


def _perf(view: RunView, c: Candidate) -> dict:
    q = view.variants[c.name].quantization if c.name in view.variants else None
    p = c.pay_off  # a PayOff (quantgate.perf.payofffile)
    return {"size_ratio": size_ratio(view, c.name),
            "ratios": {k: _num(getattr(p, k)) for k in ("throughput_ratio", "request_throughput_ratio", "ttft_ratio",
                                                        "itl_ratio", "kv_tokens_ratio") if p and k in p.model_fields_set},
            "ci": {k: _ends(p.ci.get(k)) for k in ("throughput_ratio", "request_throughput_ratio", "ttft_ratio",
                                                   "itl_ratio") if p and isinstance(p.ci.get(k), dict)},
            "concurrency": p.concurrency if p else None, "pay_off": sections.pay_off(p),
            "quant": None if q is None else {"wall_s": _num(_d(q.get("timings_s")).get("wall")), "reused": q.get("reused"),
                                             "weights_bytes": q.get("weights_bytes"), "compression": _num(q.get("compression_ratio"))}}


def _ends(ci: Any) -> list[float | None]:
    """A ratio's interval ends as the report prints them beside the ratio (quantgate.perf.intervals.RatioCI)."""
    ci = _d(ci)
    return [_num(ci.get("low")), _num(ci.get("high"))]


def _checks_of(view: RunView, c: Candidate, link: Callable[[Any], dict]) -> dict | None:
    """The candidate's checks (sections.checks), those skipped for its early decision known by the recorded whys."""
    early = {*c.skipped.values(), *([c.decided] if c.decided else [])}
    return _section(view, f"{c.name}: checks", lambda: sections.checks(c.decision, link, early))


def _candidate(view: RunView, c: Candidate, link: Links, floor: dict | None) -> dict:
    out: dict[str, Any] = {"name": c.name, "scheme": _d(c.summary).get("scheme") or c.name}
    out["checks"] = _checks_of(view, c, link)
    out["lead"] = sections.deciding(out["checks"])
    out["deltas"] = _section(view, f"{c.name}: comparison", lambda: _deltas(c)) or []
    out["forest"] = _section(view, f"{c.name}: chart", lambda: charts.forest(
        [{**r, "label": f"{r['set']}/{r['metric']}/{r['category']}"} for r in out["deltas"]], f"{c.name} vs baseline",
        f"forest-{c.name}"))
    out["flips"] = _section(view, f"{c.name}: flips", lambda: sections.flips(c.compare))
    out["evals_skipped"] = "evals" in c.skipped  # its eval sets not run: decided early (quantgate.release.early)
    fid = fidelitysection
    out["fidelity"] = _section(view, f"{c.name}: fidelity", lambda: fid.fidelity(c.fidelity, floor, out["checks"]))
    out["slices"] = _section(view, f"{c.name}: fidelity chart", lambda: charts.fidelity_slices(
        fid.slices(out["fidelity"], out["checks"]), f"fidelity-{c.name}"))
    out["judge"] = _section(view, f"{c.name}: judge", lambda: _judge(c))
    out["human"] = _section(view, f"{c.name}: human review", lambda: _human(c))
    out["recall"] = _section(view, f"{c.name}: recall", lambda: _recall(c))
    out["kinds"] = _section(view, f"{c.name}: measurements", lambda: _kinds(view, c.name)) or []
    out["repair"] = _section(view, f"{c.name}: repair", lambda: _repair(view, c.name))
    out["perf"] = _section(view, f"{c.name}: performance", lambda: _perf(view, c)) or \
        {"size_ratio": None, "ratios": {}, "concurrency": None, "quant": None}
    out["skipped"] = list(c.skipped)
    out["decision"] = (out["checks"] or {}).get("decision") or _d(c.summary).get("decision")
    out["gaps"] = [g for g in view.gaps if g.what.startswith(f"{c.name}:")]  # the sections' own gaps included
    return out


def _kinds(view: RunView, name: str) -> list[dict]:
    """The comparisons of the kinds added as modules of their own (quantgate.gate.kinds: every installed one)."""
    rows = []
    for kind, comp in kinds.read(view.folder, name).items():
        view.files.append(kinds.comparison_file(view.folder, name, kind))
        s = comp.stat
        rows.append({"kind": kind, "quantity": comp.quantity, "unit": comp.unit, "n": s.n, "base": s.base_mean,
                     "cand": s.cand_mean, "delta": s.delta, "ci_low": s.ci_low, "ci_high": s.ci_high,
                     "level": comp.level, "figures": comp.figures})
    return rows


def _repair(view: RunView, name: str) -> dict | None:
    """A repaired candidate's repair.json (quantgate.gate.repairfile): what it keeps and why, the ranking's head, and
    each set of layers tried together; None for any other candidate."""
    path = view.folder / name / REPAIR
    if not path.is_file():
        return None
    view.files.append(path)
    r = load_repair(path)
    slices = list(r.failing)
    head = r.ranking.order[:len(r.kept) + 6]  # the kept layers and the next ones the ranking names
    kept = {k.layer for k in r.kept}
    return {"repairs": r.repairs, "kept": [k.model_dump() for k in r.kept], "slices": slices, "limits": r.failing,
            "added_size": r.added_size, "margin": r.margin, "passes": r.passes, "alpha": r.alpha,
            "prompts": len(r.ranking.prompts), "per_slice": r.ranking.per_slice, "sequences": r.ranking.sequences,
            "tokens": r.ranking.scored_tokens, "seconds": r.ranking.truth_s + r.ranking.sets_s,
            "before": r.ranking.before, "before_top1": r.ranking.before_top1, "min_top1": r.min_top1,
            "measured": r.measured,
            "ranking": [{"layer": i, "kept": i in kept, "gains": {s: r.ranking.gains[s][i] for s in slices}}
                        for i in head],
            "tried": [{"k": k, "kl": kl, "top1": r.ranking.tried_top1.get(k, {}), "chosen": k == len(r.kept)}
                      for k, kl in sorted(r.ranking.tried.items())]}


def _list(x: Any) -> list:
    return x if isinstance(x, list) else []


def _evidence_files(view: RunView, link: Links) -> list[dict]:
    return [link(p) for p in sorted(set(view.files))]


def _said(note: str, decided: list[str]) -> str:
    """A note with an early decision's text (its failed checks) replaced by a pointer to the deciding checks."""
    for text in decided:
        note = note.replace(text, "the deciding checks above")
    return note


def _skipped(view: RunView) -> list[dict]:
    """Each variant's steps skipped on purpose (evidence.json `skipped`), in words: not gaps, nothing to fetch."""
    out = []
    for name, v in view.variants.items():
        steps = skipped_steps(v.evidence)
        if steps:
            out.append({"variant": name, "steps": [STEPS.get(k, k) for k in steps]})
    return out


def context(view: RunView, out_dir: Path, link_root: Path) -> dict:
    """Everything the templates show, as plain values."""
    link = Links(out_dir, link_root)
    dec = view.decision or {}
    floor = _section(view, "fidelity noise floor", lambda: fidelitysection.fidelity_summary(view.floor))
    cands = [_candidate(view, c, link, floor) for c in view.candidates.values()]
    points = [{"name": c["name"], "size_ratio": c["perf"].get("size_ratio"),
               "throughput_ratio": c["perf"].get("ratios", {}).get("throughput_ratio"),
               "deltas": [(f"{r['set']}/{r['metric']}", r["delta"], r["ci_low"], r["ci_high"])
                          for r in c["deltas"] if r["category"] == "all"]} for c in cands]
    trade = _section(view, "chart: quality vs size vs speed", lambda: charts.trade_off(points))
    curves = _section(view, "chart: goodput and latency vs concurrency", lambda: charts.perf_curves(
        [sections.perf_curve(n, v.perf) for n, v in view.variants.items()]))
    policy = _d(dec.get("policy") or _d(view.summary).get("policy"))
    parity = _d(_d(view.variants[BASELINE].evidence).get("parity"))
    decided = [c.decided for c in view.candidates.values() if c.decided]  # said once, by the deciding checks
    notes = [_said(str(n), decided) for n in _d(view.summary).get("notes") or []] \
        if isinstance(_d(view.summary).get("notes"), list) else []
    return {
        "run_id": view.run_id, "started": view.started, "release": view.get("release", "name") or "?",
        "model": view.get("model") or "?", "hardware": view.get("hardware") or "?",
        "decision": outcome_of(view) or "UNKNOWN",
        "status": view.status.model_dump() if view.status is not None else None,
        "promoted": dec.get("promoted") or next(iter(_list(_d(view.summary).get("promoted"))), None),
        "policy": policy, "git": view.run.git.model_dump() if view.run else {},
        "packages": dict(view.run.packages) if view.run else {},
        "parity": {"verdict": parity.get("verdict"), "reason": parity.get("reason")} if parity else None,
        "notes": notes,
        "candidates": cands, "trade_off": trade, "perf_curves": curves, "gaps": list(view.gaps),
        "skipped": _skipped(view), "early": sections.EARLY, "files": _evidence_files(view, link),
    }


def _env(autoescape: bool):
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=autoescape,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(num=_fmt_num, pct=_pct, signed=_fmt_signed, sig=_fmt_sig, interval=_fmt_interval,
                       bounded=_fmt_bounded, mdcell=_mdcell, mdcode=_mdcode, cut=_cut, mark=_mark)
    return env


def _fmt_num(x: Any, digits: int = 3) -> str:
    if isinstance(x, str):
        return x
    return "—" if _num(x) is None else f"{x:.{digits}f}"


def _fmt_signed(x: Any, digits: int = 3) -> str:
    return "—" if _num(x) is None else f"{x:+.{digits}f}"


def _fmt_sig(x: Any, digits: int = 3) -> str:
    return "—" if _num(x) is None else f"{x:.{digits}g}"


def _fmt_interval(iv: Any, fmt: str = "sig") -> str:
    """"mean [low, high]" of a fidelitysection.interval (either end may be missing); "—" without one."""
    if not isinstance(iv, dict) or _num(iv.get("mean")) is None:
        return "—"
    f = _pct if fmt == "pct" else _fmt_sig
    ends = f" [{f(iv.get('low'))}, {f(iv.get('high'))}]" if iv.get("low") is not None or iv.get("high") is not None else ""
    return f"{f(iv['mean'])}{ends}"


def _fmt_bounded(iv: Any, fmt: str, side: str, level: float | None) -> str:
    """"mean (99% upper bound high)" of a fidelitysection.interval: the bound on `side` at the level the gate judged
    it (its `bound_level`, else `level`), in the gate's words. Without a level, "mean [low, high]"."""
    level = iv.get("bound_level", level) if isinstance(iv, dict) else level
    if level is None or not isinstance(iv, dict) or iv.get("low" if side == "lower" else "high") is None:
        return _fmt_interval(iv, fmt)
    f = _pct if fmt == "pct" else _fmt_sig
    return f"{f(iv['mean'])} ({level * 100:.4g}% {side} bound {f(iv['low' if side == 'lower' else 'high'])})"


def _mark(outcome: Any) -> str:
    """A check's badge (also its CSS class): pass / FAIL / INCONCLUSIVE / skip. Schema 1's `passed` still maps."""
    if isinstance(outcome, bool) or outcome is None:
        outcome = sections.PASSED.get(outcome, "skipped")
    return BADGES.get(str(outcome), str(outcome))


_MD_ESCAPES = str.maketrans({"\\": "\\\\", "&": "&amp;", "<": "&lt;", ">": "&gt;", "|": "\\|", "[": "\\[", "]": "\\]",
                             "`": "\\`"})


def _mdcell(x: Any) -> str:
    """Untrusted text for one line or table cell of the Markdown summary: whitespace folded; HTML (<, >, &) turned
    into entities so no tag or entity from a model output passes into the artifact; | [ ] ` backslash-escaped so it
    cannot split a cell, open a link or image, or start a code span."""
    return " ".join(str("" if x is None else x).split()).translate(_MD_ESCAPES)


def _mdcode(x: Any) -> str:
    """Text for inside a Markdown code span (`...`): one line, no backtick to close the span early."""
    return " ".join(str("" if x is None else x).split()).replace("`", "'")


def _cut(x: Any, n: int = MD_OUTPUT_CHARS) -> str:
    text = "" if x is None else str(x)
    return text if len(text) <= n else text[: n - 1] + "…"


def render_html(ctx: dict) -> str:
    return _env(True).get_template("report.html").render(css=(TEMPLATES / "style.css").read_text(encoding="utf-8"), **ctx)


def render_markdown(ctx: dict, html_name: str | None = None) -> str:
    return _env(False).get_template("report.md.j2").render(html_name=html_name, md_flips=MD_FLIPS, **ctx)


def default_root(run: Path) -> Path:
    """The results folder when the run sits at <results>/runs/<id>, else the run folder itself."""
    run = run.resolve()
    return run.parent.parent if run.parent.name == "runs" else run


def write_report(run: Path | str, out: Path | str | None = None, *, link_root: Path | None = None) -> tuple[Path, Path]:
    """Write <run>/report.html and report.md (or `out` and out with .md); returns both paths."""
    run = Path(run)
    html = Path(out) if out else run / REPORT_HTML
    md = html.with_suffix(".md")
    html.parent.mkdir(parents=True, exist_ok=True)
    results = default_root(run)
    # under the results folder: links stay inside it (they must resolve when it is served); elsewhere: any file
    root = link_root or (results if results in html.resolve().parents else Path(html.resolve().anchor))
    view = load_run(run)
    ctx = context(view, html.parent, root)
    html.write_text(shorten(view, render_html(ctx)), encoding="utf-8")
    md.write_text(shorten(view, render_markdown(ctx, html.name)), encoding="utf-8")
    return html, md


def markdown_summary(run: Path | str) -> str:
    """The Markdown summary alone (for a Prefect artifact): no files written."""
    view = load_run(Path(run))
    return shorten(view, render_markdown(context(view, Path(run), default_root(Path(run)))))


def lead_lines(view: RunView) -> list[str]:
    """The report's first screen as text, for `quantgate show`: per candidate its decision, its deciding checks one
    a line (value, bound, limit, the samples it would need) and what would change it; the steps skipped on purpose
    once. Paths are the caller's to shorten (runview.shorten)."""
    out = []
    for c in view.candidates.values():
        ctx = _checks_of(view, c, lambda _p: {})
        verdict = (ctx or {}).get("decision") or _d(c.summary).get("decision") or "no decision"
        counts = ", ".join(f"{n} {WORDS.get(o, o)}" for o, n in (ctx or {}).get("counts", {}).items())
        out.append(f"  {c.name}: {verdict}" + (f" ({counts})" if counts else ""))
        lead = sections.deciding(ctx)
        for r in lead["rows"]:
            ln = r["line"]
            out.append(f"    {r['name']}  {_mark(r['outcome'])}  {ln['value']}"
                       + (f", {ln['bound_label']} {ln['bound']}" if ln["bound"] else "") + f", limit {ln['limit']}"
                       + (f"; needs about {ln['needs']} samples" if ln["needs"] else ""))
        if lead["more"]:
            out.append(f"    and {lead['more']} more (the report lists every check)")
        if verdict == "REJECT":
            out.append("    what would change it: nothing more samples can show (each failed check lies beyond its limit)")
        elif ctx and ctx.get("needs"):
            out.append(f"    what would change it: {ctx['needs']}")
    for s in _skipped(view):
        out.append(f"  {s['variant']}: {', '.join(s['steps'])}: {sections.EARLY}")
    return out
