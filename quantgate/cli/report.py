"""`quantgate report RUN_DIR [--out FILE]` and `quantgate dashboard [--serve] [--port P] [--results DIR] [--out DIR]`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from quantgate.base.errors import QuantgateError
from quantgate.base.paths import results_dir
from quantgate.report.dashboard import build, serve as make_server
from quantgate.report.page import write_report
from quantgate.report.runview import is_run


def report(
    run_dir: Annotated[Path, typer.Argument(help="run folder of a release (results/runs/<run-id>)")],
    out: Annotated[Path | None, typer.Option(help="HTML file to write (default <run>/report.html); the Markdown "
                                                     "summary goes beside it with .md")] = None,
) -> None:
    """Write the release report of one run: self-contained HTML and a Markdown summary. Missing evidence is shown
    as a gap in the report, not an error."""

    if not is_run(run_dir):
        raise QuantgateError("not a run folder (no run.json)", where=str(run_dir),
                             fix="give a results/runs/<run-id> folder written by `quantgate release`")
    html, md = write_report(run_dir, out)
    print(f"report: {html}\nsummary: {md}")


def dashboard(
    results: Annotated[Path | None, typer.Option(help="results folder (default $QUANTGATE_RESULTS or <repo>/results)")] = None,
    serve: Annotated[bool, typer.Option("--serve", help="serve the results folder on 127.0.0.1 after building")] = False,
    port: Annotated[int, typer.Option(help="port for --serve (0: any free port)")] = 8765,
    out: Annotated[Path | None, typer.Option(help="write the dashboard here instead (index.html, runs/<run>/report.html "
                                                  "and its quantgate.db), leaving the results folder untouched")] = None,
) -> None:
    """Ingest every run into results/quantgate.db, write each run's report and results/dashboard/index.html (with
    --out: all of it into that folder)."""
    root = results or results_dir()
    if not root.is_dir():
        raise QuantgateError("results folder not found", where=str(root), fix="run a release first, or pass --results DIR")
    if serve and out is not None:
        raise QuantgateError("--serve serves the results folder; a dashboard written elsewhere (--out) is opened from "
                             "disk", where="--out", fix="drop --out to serve, or open <out>/index.html")
    index = build(root, out=out)
    print(f"dashboard: {index}")
    if serve:
        try:
            server = make_server(root, port)
        except OSError as exc:
            raise QuantgateError(f"cannot listen on 127.0.0.1:{port}: {exc.strerror}", where="--port",
                                 fix="pick another port, or --port 0 for any free one") from None
        print(f"serving {root} at http://127.0.0.1:{server.server_address[1]}/dashboard/index.html (Ctrl-C stops)",
              flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
