"""`quantgate runs` (the run folders, newest first, filtered) and `quantgate show RUN` (one run: its decision per
candidate with the reasons, and where its report, summary and log are), read from the run folders themselves
(quantgate.report.runview), so a failed or interrupted run is listed too, with what it has."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from quantgate.base.runfiles import REPORT_HTML, SUMMARY
from quantgate.base.paths import results_dir
from quantgate.base.runstatus import owner_gone
from quantgate.report.page import lead_lines
from quantgate.report.runview import RunView, load_run, outcome_of, run_folders, shorten


def _status(view: RunView) -> str:
    """The run's decision, or how it ended without one (FAILED, INTERRUPTED: status.json, or for a run killed
    before it could write one the free lock of its dead release, base.runstatus.owner_gone), or "no decision"
    (still running, or a run of an older quantgate that stopped)."""
    return outcome_of(view) or ("INTERRUPTED" if owner_gone(view.folder) else "no decision")


def _views(results: Path) -> list[RunView]:
    return sorted((load_run(p) for p in run_folders(results)), key=lambda v: v.started, reverse=True)


def runs(
    results: Annotated[Path | None, typer.Option(help="results folder (default: $QUANTGATE_RESULTS or results/)")] = None,
    release: Annotated[str | None, typer.Option(help="only runs of this release (the spec's name)")] = None,
    decision: Annotated[str | None, typer.Option(help="only runs with this decision: PROMOTE, REJECT, INCONCLUSIVE, "
                                                      "FAILED, INTERRUPTED or 'no decision'")] = None,
    limit: Annotated[int, typer.Option(min=1, help="at most this many, newest first")] = 20,
) -> None:
    """List the release runs, newest first: run id, when, release, decision, candidates."""
    results = results or results_dir()
    root = results / "runs"
    shown = [v for v in _views(results) if (release is None or v.get("name", "release") == release)
             and (decision is None or _status(v).lower() == decision.lower())][:limit]
    if not shown:
        filters = ", ".join(f for f in (release and f"release {release}", decision and f"decision {decision}") if f)
        print(f"no runs in {root}" + (f" matching {filters}" if filters else ""))
        return
    for v in shown:
        names = ", ".join(v.candidates) or "-"
        how = f" ({gone})" if not outcome_of(v) and (gone := owner_gone(v.folder)) else ""
        print(f"{v.run_id}  {v.started[:19]}  {v.get('name', 'release', default='-')}  {_status(v)}{how}  {names}")


def show(
    run: Annotated[str, typer.Argument(help="run id (a folder of results/runs) or a run folder's path")],
    results: Annotated[Path | None, typer.Option(help="results folder (default: $QUANTGATE_RESULTS or results/)")] = None,
) -> None:
    """One run, decision first: each candidate's decision and the checks that decided it (value, bound, limit), what
    would change it, the steps skipped on purpose, what is missing, and where its files are."""
    folder = Path(run) if Path(run).is_dir() else (results or results_dir()) / "runs" / run
    if not folder.is_dir():
        print(f"error: no run folder {folder}: `quantgate runs` lists them", file=sys.stderr)
        raise typer.Exit(2)
    view = load_run(folder)
    lines = [f"{_status(view)}: run {view.run_id} ({view.started[:19]}), release "
             f"{view.get('name', 'release', default='-')}, model {view.get('model', default='-')}", *lead_lines(view)]
    st = view.status
    if st is not None and st.status != "completed":
        lines.append(f"  {st.ended()}" + (f" (log: {st.log})" if st.log else ""))
    elif st is None and (gone := owner_gone(folder)):
        lines.append(f"  interrupted: {gone}")
    lines += [f"  missing {gap.what}: {gap.reason}" + (f" ({gap.file})" if gap.file else "") for gap in view.gaps]
    files = [f"{p.name}" + ("" if p.exists() else " (not written)")
             for p in (folder / REPORT_HTML, folder / SUMMARY, folder / "decision.json")]
    print("\n".join(shorten(view, line) for line in lines))
    print(f"  files in {folder}: {', '.join(files)}")
