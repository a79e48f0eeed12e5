"""Where things live: the repository's data folders and the cache outside git (environments, weights)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "quant_recipes"
EVAL_SETS = REPO / "eval_sets"
JUDGES = REPO / "judges"
RELEASES = REPO / "releases"


def home() -> Path:
    """Cache root for environments and model weights: $QUANTGATE_HOME, default ~/.cache/quantgate."""
    return Path(os.environ.get("QUANTGATE_HOME") or Path.home() / ".cache" / "quantgate").expanduser()


def models_dir() -> Path:
    return home() / "models"


def results_dir() -> Path:
    """Run outputs: $QUANTGATE_RESULTS, default <repo>/results."""
    return Path(os.environ.get("QUANTGATE_RESULTS") or REPO / "results")
