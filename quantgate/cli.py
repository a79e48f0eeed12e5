"""The `quantgate` command line. Each capability registers its sub-commands here; logic lives in its module."""

from __future__ import annotations

import sys

import typer

from quantgate.errors import QuantgateError

app = typer.Typer(
    help="Quantize an LLM for its target hardware, validate it against the baseline, gate its release.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# --- sub-commands: each capability registers its own here (one line each) ---
# (registrations below)
from quantgate.cli_models import models_app as _models  # noqa: E402
app.add_typer(_models, name="models")


def main() -> None:
    """Console-script entry: user-fixable errors print as one clear message and exit 2, not a traceback."""
    try:
        app()
    except QuantgateError as exc:
        print(f"error: {exc.render()}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
