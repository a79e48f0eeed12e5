"""`quantgate export mlflow RUN --tracking-uri URL`: a finished release run into an MLflow tracking server
(quantgate.publishing.mlflow_export): a run per variant under a parent run, and a registered model version for each
PROMOTE candidate. The bearer token, when the server wants one, comes from MLFLOW_TRACKING_TOKEN.

Exit codes: 0 exported (or exported before: nothing new written), 1 the export failed at the server (unreachable
after retries, or a call refused; what was written stays, and exporting again finishes the job), 2 bad input
(not a finished run folder, a bad URL or model name).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from quantgate.base.paths import results_dir
from quantgate.publishing.mlflow_export import MlflowError, MlflowTarget, export_run

TOKEN_ENV = "MLFLOW_TRACKING_TOKEN"

export_app = typer.Typer(help="Export a finished run to a tracker: mlflow.", no_args_is_help=True)


@export_app.command("mlflow")
def mlflow_cmd(
    run: Annotated[str, typer.Argument(help="run id (a folder of results/runs) or a run folder's path")],
    tracking_uri: Annotated[str, typer.Option(envvar="MLFLOW_TRACKING_URI",
                                              help="the MLflow server's URL, e.g. http://127.0.0.1:5000 "
                                                   "(default: $MLFLOW_TRACKING_URI)")],
    experiment: Annotated[str | None, typer.Option(help="experiment name (default: quantgate-<release>)")] = None,
    model_name: Annotated[str | None, typer.Option(help="registered model name for PROMOTE candidates "
                                                        "(default: the release's name)")] = None,
) -> None:
    """Export a finished run to MLflow: params, metrics (every gated figure with its limit and bound), the report as
    an artifact, and on PROMOTE a registered model version tagged with the decision. Exporting again is a no-op."""
    folder = Path(run) if Path(run).is_dir() else results_dir() / "runs" / run
    if not folder.is_dir():
        print(f"error: no run folder {folder}: `quantgate runs` lists them", file=sys.stderr)
        raise typer.Exit(2)
    try:
        result = export_run(folder, MlflowTarget(tracking_uri, experiment=experiment, model_name=model_name,
                                                 token=os.environ.get(TOKEN_ENV) or None))
    except MlflowError as exc:
        print(f"error: {exc.render()}", file=sys.stderr)
        raise typer.Exit(1) from None
    for v in result.registered:
        print(f"registered {v.name} version {v.version}: {v.candidate} (run {v.run_id})")
    print(f"experiment {result.experiment} ({result.experiment_id}), parent run {result.parent_run_id}"
          + (" (exported before)" if result.reused else ""))
