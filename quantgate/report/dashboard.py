"""The dashboard: every run under <results>/runs ingested into the store, a report per run, and one index page
(<results>/dashboard/index.html) with trends per model across releases, filters and links to the reports. The
trends lead with fidelity, the figure that decides most releases: per run its KL and top-1 with the 95% bound the
gate judged and the limit (from the stored checks). Built into another folder (`out`), the dashboard writes there
only: index.html, runs/<run>/report.html and its store, the run folders untouched.

Served (`serve`) on 127.0.0.1 only, from the results folder, so the index's relative links work the same from disk.
What is served is the dashboard page, each run's report (runs/<run>/report.html, report.md), charts, and the JSON
evidence files the reports link to (under runs/ and cache/): nothing else, so not quantgate.db, logs, checkpoints,
answer files (JSONL), the human review's answer key, lock files, hidden files or folder listings (`servable`). A
request whose Host header is not 127.0.0.1, localhost or the bound address (with the bound port, if a port is
given) is refused with 421, a request without one with 400: a page on another site cannot read the dashboard by
pointing its own host name at 127.0.0.1 (DNS rebinding).
"""

from __future__ import annotations

import functools
import os
from collections import defaultdict
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

from quantgate.base.runfiles import REPORT_HTML, REPORT_MD, REVIEW_KEY
from quantgate.base.runstatus import load_status
from quantgate.report import charts
from quantgate.report.page import TEMPLATES, _env, write_report
from quantgate.report.runview import ENDED, run_folders
from quantgate.report.sections import bound_of, num
from quantgate.report.store import Store, default_path

# PROMOTE, REJECT (harm detected), INCONCLUSIVE (too little evidence to decide: not promoted), then anything else
DECISION_ORDER = {"PROMOTE": 0, "REJECT": 1, "INCONCLUSIVE": 2, "FAILED": 3, "INTERRUPTED": 4, "UNKNOWN": 5}


def _ended(run_decision: str | None) -> str | None:
    """A run that ended without a decision shows how it ended (FAILED, INTERRUPTED) on each of its candidates."""
    return run_decision if run_decision in ENDED else None


def build(results: Path | str, db: Path | str | None = None, *, out: Path | str | None = None, log=print) -> Path:
    """Ingest every run, (re)write the reports of new or changed runs, write the index; returns its path. `out`: a
    folder to write everything to (the index, runs/<run>/report.html and the store) instead of the results folder."""
    results = Path(results)
    index = Path(out) / "index.html" if out else results / "dashboard" / "index.html"
    report_of = (lambda f: Path(out) / "runs" / f.name / REPORT_HTML) if out else (lambda f: f / REPORT_HTML)
    with Store(db or (Path(out) if out else results) / default_path().name) as store:
        for folder in run_folders(results):
            status = store.ingest(folder)
            if status != "unchanged" or not report_of(folder).is_file():
                write_report(folder, report_of(folder), link_root=results)
                log(f"{folder.name}: {status}, report written")
        html = render(store, index.parent, report_of)
    index.parent.mkdir(parents=True, exist_ok=True)
    index.write_text(html, encoding="utf-8")
    return index


def _series(rows: list[dict]) -> dict[str, list[tuple]]:
    out: dict[str, list[tuple]] = defaultdict(list)
    for r in rows:
        out[f"{r['eval_set']}/{r['metric']}"].append((r["run_id"], r["delta"], r["ci_low"], r["ci_high"]))
    return dict(out)


FIDELITY_CHECKS = ("fidelity:kl", "fidelity:top1")  # the pooled checks: the deciding figure over releases


def run_label(started: str | None, run_id: str) -> str:
    """A run on a trend's axis: when it started, month-day hour:minute (the run id when that is unknown)."""
    return started[5:16].replace("T", " ") if started and len(started) >= 16 else run_id


def _fidelity_points(store: Store, cands: list[dict]) -> list[dict]:
    """The pooled fidelity checks of these (run, candidate) pairs: mean, the bound its reason states, limit, outcome."""
    mine = {(c["run_id"], c["candidate"]) for c in cands}
    rows = store.query("SELECT c.run_id, c.candidate, c.name, c.measured, c.limit_value, c.outcome, c.reason FROM checks c "
                       "JOIN runs r USING (run_id) WHERE c.name IN (?, ?) ORDER BY r.started, r.run_id", *FIDELITY_CHECKS)
    return [{"run_id": r["run_id"], "measure": r["name"].split(":")[1], "mean": num(_float(r["measured"])),
             "bound": bound_of(r["reason"]), "limit": num(_float(r["limit_value"])), "outcome": r["outcome"]}
            for r in rows if (r["run_id"], r["candidate"]) in mine]


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def trends(store: Store) -> list[dict]:
    """One block per (model, hardware, scheme): fidelity, metric deltas and size/throughput ratios over the runs,
    oldest first (runs that ended without a decision are left out: they measured nothing to trend)."""
    blocks: list[dict] = []
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for c in store.candidates():
        if c["decision"] is None:  # a run that ended before its gate: nothing to trend
            continue
        groups[(c["model"], c["hardware"] or "?", c["scheme"] or c["candidate"])].append(c)
    for (raw_model, hardware, scheme), cands in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        runs, model = {c["run_id"] for c in cands}, raw_model or "?"
        labels = {c["run_id"]: run_label(c["started"], c["run_id"]) for c in cands}
        key = f"{len(blocks)}"  # the charts' id prefix: unique on the page
        rows = [r for r in store.metric_history(raw_model) if r["run_id"] in runs and (r["scheme"] or r["candidate"]) == scheme]
        fidelity = charts.fidelity_trend(_fidelity_points(store, cands), f"{model} / {scheme} on {hardware}: fidelity",
                                         labels, f"fidelity-trend-{key}")
        quality = charts.trend(_series(rows), f"{model} / {scheme} on {hardware}: quality delta", "candidate - baseline",
                               labels, f"quality-trend-{key}")
        cost = charts.trend({"size ratio": [(c["run_id"], c["size_ratio"], None, None) for c in cands],
                             "throughput ratio": [(c["run_id"], c["throughput_ratio"], None, None) for c in cands]},
                            f"{model} / {scheme} on {hardware}: cost and speed", "candidate / baseline", labels,
                            f"cost-trend-{key}")
        blocks.append({"model": model, "hardware": hardware, "scheme": scheme, "n": len(runs), "fidelity": fidelity,
                       "quality": quality, "cost": cost})
    return blocks


def render(store: Store, out_dir: Path, report_of=lambda folder: folder / REPORT_HTML) -> str:
    """The index page in `out_dir`, linking each run's report where `report_of(run folder)` puts it."""
    rows = []
    cands = store.candidates()
    with_cands = {c["run_id"] for c in cands}
    for r in store.runs():
        report = report_of(Path(r["folder"]))
        href = os.path.relpath(report, out_dir) if report.is_file() else None
        mine = [c for c in cands if c["run_id"] == r["run_id"]] if r["run_id"] in with_cands else [
            {"candidate": None, "scheme": None, "decision": r["decision"], "needs": None, "size_ratio": None,
             "throughput_ratio": None, "recall_delta": None, "judge_net": None}]
        st = load_status(Path(r["folder"])) if _ended(r["decision"]) else None
        ended = st.ended() if st is not None and st.status != "completed" else None
        for c in mine:
            rows.append({**r, **{k: c[k] for k in ("candidate", "scheme", "needs", "size_ratio", "throughput_ratio",
                                                   "recall_delta", "judge_net")},
                         "cand_decision": str(c["decision"] or _ended(r["decision"]) or "UNKNOWN"), "href": href,
                         "ended": ended})
    rows.reverse()  # newest first
    options = {k: sorted({str(r[k]) for r in rows if r[k]}) for k in ("model", "scheme", "hardware")}
    options["decision"] = sorted({r["cand_decision"] for r in rows}, key=lambda v: (DECISION_ORDER.get(v, 9), v))
    return _env(True).get_template("dashboard.html").render(
        css=(TEMPLATES / "style.css").read_text(encoding="utf-8"), rows=rows, options=options, blocks=trends(store),
        n_runs=len(store.runs()))


REPORT_FILES = frozenset({REPORT_HTML, REPORT_MD})
CHART_SUFFIXES = frozenset({".png", ".svg"})
EVIDENCE_SUFFIXES = frozenset({".json"})
NEVER_SERVED = frozenset({REVIEW_KEY})  # the blinded human review's answer key
LOCAL_NAMES = ("127.0.0.1", "localhost")


def _allowed_name(parts: list[str]) -> bool:
    """Whether a path (split into its parts under the results folder) names a report file by its place and kind."""
    name = parts[-1]
    suffix = PurePosixPath(name).suffix.lower()
    if name in NEVER_SERVED:
        return False
    if parts[0] == "dashboard":
        return len(parts) == 2 and (name == "index.html" or suffix in CHART_SUFFIXES)
    if parts[0] == "runs":
        return len(parts) >= 3 and ((len(parts) == 3 and name in REPORT_FILES) or suffix in CHART_SUFFIXES
                                    or suffix in EVIDENCE_SUFFIXES)
    return parts[0] == "cache" and suffix in EVIDENCE_SUFFIXES


def servable(results: Path | str, url_path: str) -> Path | None:
    """The file under `results` that a request for `url_path` may read, or None: report files only (module
    docstring), no hidden part, no '..', and a real path (symlinks followed) that stays inside its top folder."""
    parts = [p for p in unquote(urlsplit(url_path).path).split("/") if p]
    if not parts or any(p.startswith(".") or "\\" in p or "\0" in p for p in parts) or not _allowed_name(parts):
        return None
    top = Path(results).resolve() / parts[0]
    real = (top.parent / Path(*parts)).resolve()
    return real if top in real.parents and real.is_file() else None


def host_problem(host: str | None, allowed: set[str], port: int) -> tuple[int, str] | None:
    """(HTTP status, why) when a Host header is missing, malformed or names another host or port; None when it
    names this server ('127.0.0.1:8765', 'localhost', ...)."""
    if not host or not host.strip():
        return 400, "no Host header"
    h = host.strip().lower()
    if h.startswith("["):  # an IPv6 literal: [::1]:8765
        name, _, rest = h[1:].partition("]")
        name = f"[{name}]"
        given = rest[1:] if rest.startswith(":") else rest
    else:
        name, _, given = h.partition(":")
    if given and not given.isdigit():
        return 400, f"malformed Host header {host!r}"
    if name not in allowed or (given and int(given) != port):
        return 421, f"Host {host!r} is not this server (it answers to {', '.join(sorted(allowed))} on port {port})"
    return None


class _ReportHandler(SimpleHTTPRequestHandler):
    """GET/HEAD of report files only, for requests addressed to this server by name (module docstring)."""
    results: Path = Path(".")

    def log_message(self, format, *args):
        pass

    def send_head(self):
        host, port = self.server.server_address[:2]
        bad = host_problem(self.headers.get("Host"), {*LOCAL_NAMES, str(host)}, int(port))
        if bad is not None:
            self.send_error(*bad)
            return None
        if urlsplit(self.path).path in ("/", "/dashboard", "/dashboard/"):
            self.send_response(302)
            self.send_header("Location", "/dashboard/index.html")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        real = servable(self.results, self.path)
        if real is None:
            self.send_error(404, "not a report file")
            return None
        self.path = "/" + real.relative_to(Path(self.results).resolve()).as_posix()
        return super().send_head()


def serve(results: Path | str, port: int = 8765) -> ThreadingHTTPServer:
    """An HTTP server for the results folder's reports on 127.0.0.1 (call serve_forever(); port 0 picks a free one)."""
    root = Path(results).resolve()
    handler = type("ReportHandler", (_ReportHandler,), {"results": root})
    return ThreadingHTTPServer(("127.0.0.1", port), functools.partial(handler, directory=str(root)))
