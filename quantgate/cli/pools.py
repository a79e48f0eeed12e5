"""`quantgate pools setup POOL...`: the Prefect work pools a release on several hosts submits its variants to
(quantgate.pools.executor), each with its `measure-variant/<pool>` deployment. Needs PREFECT_API_URL (the server the
workers poll). Then on each host: `QUANTGATE_REPO=<checkout> prefect worker start --pool POOL --type process`."""

from __future__ import annotations

import importlib
import os
from typing import Annotated

import typer

from quantgate.base.errors import ConfigError

pools_app = typer.Typer(help="Prefect work pools for releases across hosts.", no_args_is_help=True)


@pools_app.command("setup")
def setup(pools: Annotated[list[str], typer.Argument(help="work pool names, e.g. one per kind of host: cpu-a gpu-h100")]
          ) -> None:
    """Create each work pool (process type) when missing and (re)create its measure-variant deployment."""
    if not os.environ.get("PREFECT_API_URL"):
        raise ConfigError("work pools live on a Prefect server: PREFECT_API_URL is not set", where="environment",
                           fix="start one (`prefect server start`) and export PREFECT_API_URL=http://<host>:4200/api")
    # Prefect loads only now (as for `quantgate release`), so the other commands start quickly
    for name in importlib.import_module("quantgate.pools.executor").setup_pools(pools, log=print):
        print(f"ready: {name}")
