"""`quantgate release SPEC`: run the release flow locally (Prefect's embedded engine; no server needed)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer


def load_flow(name: str):
    """Import flows/<name>.py by path (flows/ is the deployments' source folder, not an installed package)."""
    import importlib.util

    from quantgate.paths import REPO

    path = REPO / "flows" / f"{name}.py"
    module_spec = importlib.util.spec_from_file_location(f"quantgate_flows_{name}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, name)


def release(
    spec: Path = typer.Argument(..., help="release spec YAML (e.g. releases/demo.yaml)"),
    run_id: Optional[str] = typer.Option(None, "--run-id", help="name of the run folder (default: <name>-<UTC time>)"),
) -> None:
    """Run a release: quantize, serve, check and evaluate every variant, compare with the baseline."""
    from quantgate.spec import load_spec

    load_spec(spec)  # refuse a bad spec before Prefect starts anything
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    summary = load_flow("release")(spec=str(spec), run_id=run_id)
    print(json.dumps({k: summary[k] for k in ("release", "run", "decision", "decision_note")}, indent=2))
