"""The dashboard: every run under <results>/runs ingested into the store, a report per run, and one index page
(<results>/dashboard/index.html) with trends per model across releases, filters and links to the reports.

Served (`serve`) on 127.0.0.1 only, from the results folder, so the index's relative links work the same from disk.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

from quantgate.report import charts
from quantgate.report.page import TEMPLATES, _env, write_report
from quantgate.report.runview import run_folders
from quantgate.report.store import Store, default_path

# PROMOTE, REJECT (harm detected), INCONCLUSIVE (too little evidence to decide: not promoted), then anything else
DECISION_ORDER = {"PROMOTE": 0, "REJECT": 1, "INCONCLUSIVE": 2, "UNKNOWN": 3}


def build(results: Path | str, db: Path | str | None = None, *, log=print) -> Path:
    """Ingest every run, (re)write the reports of new or changed runs, write the index; returns its path."""
    results = Path(results)
    out = results / "dashboard" / "index.html"
    with Store(db or results / default_path().name) as store:
        for folder in run_folders(results):
            status = store.ingest(folder)
            if status != "unchanged" or not (folder / "report.html").is_file():
                write_report(folder, link_root=results)
                log(f"{folder.name}: {status}, report written")
        html = render(store, results, out.parent)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(html, encoding="utf-8")
    return out


def _series(rows: list[dict]) -> dict[str, list[tuple]]:
    out: dict[str, list[tuple]] = defaultdict(list)
    for r in rows:
        out[f"{r['eval_set']}/{r['metric']}"].append((r["run_id"], r["delta"], r["ci_low"], r["ci_high"]))
    return dict(out)


def trends(store: Store) -> list[dict]:
    """One block per (model, hardware, scheme): metric deltas and size/throughput ratios over the runs, oldest first."""
    blocks = []
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for c in store.candidates():
        groups[(c["model"], c["hardware"] or "?", c["scheme"] or c["candidate"])].append(c)
    for (raw_model, hardware, scheme), cands in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        runs, model = {c["run_id"] for c in cands}, raw_model or "?"
        rows = [r for r in store.metric_history(raw_model) if r["run_id"] in runs and (r["scheme"] or r["candidate"]) == scheme]
        quality = charts.trend(_series(rows), f"{model} / {scheme} on {hardware}: quality delta", "candidate - baseline")
        cost = charts.trend({"size ratio": [(c["run_id"], c["size_ratio"], None, None) for c in cands],
                             "throughput ratio": [(c["run_id"], c["throughput_ratio"], None, None) for c in cands]},
                            f"{model} / {scheme} on {hardware}: cost and speed", "candidate / baseline")
        blocks.append({"model": model, "hardware": hardware, "scheme": scheme, "n": len(runs), "quality": quality,
                       "cost": cost})
    return blocks


def render(store: Store, results: Path, out_dir: Path) -> str:
    rows = []
    cands = store.candidates()
    with_cands = {c["run_id"] for c in cands}
    for r in store.runs():
        report = Path(r["folder"]) / "report.html"
        href = os.path.relpath(report, out_dir) if report.is_file() else None
        mine = [c for c in cands if c["run_id"] == r["run_id"]] if r["run_id"] in with_cands else [
            {"candidate": None, "scheme": None, "decision": r["decision"], "needs": None, "size_ratio": None,
             "throughput_ratio": None, "recall_delta": None, "judge_net": None}]
        for c in mine:
            rows.append({**r, **{k: c[k] for k in ("candidate", "scheme", "needs", "size_ratio", "throughput_ratio",
                                                   "recall_delta", "judge_net")},
                         "cand_decision": str(c["decision"] or "UNKNOWN"), "href": href})
    rows.reverse()  # newest first
    options = {k: sorted({str(r[k]) for r in rows if r[k]}) for k in ("model", "scheme", "hardware")}
    options["decision"] = sorted({r["cand_decision"] for r in rows}, key=lambda v: (DECISION_ORDER.get(v, 9), v))
    return _env(True).get_template("dashboard.html").render(
        css=(TEMPLATES / "style.css").read_text(encoding="utf-8"), rows=rows, options=options, blocks=trends(store),
        results=str(results), n_runs=len(store.runs()))


def serve(results: Path | str, port: int = 8765):
    """An HTTP server for the results folder on 127.0.0.1 (call serve_forever(); port 0 picks a free one)."""
    import functools
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, format, *args):  # noqa: A002  (the base class's signature)
            pass

    handler = functools.partial(Quiet, directory=str(results))
    return ThreadingHTTPServer(("127.0.0.1", port), handler)
