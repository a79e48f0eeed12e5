"""The `quantgate` command line: the sub-commands of every command module, and the console-script entry point.

The commands are listed in COMMANDS, grouped into --help panels in the order a release team meets them, and each
module is imported only when its command runs (quantgate.cli.lazy): `quantgate --version` imports none of them.
"""

from __future__ import annotations

import sys

import typer

import quantgate
from quantgate.base.errors import QuantgateError, SettingError, as_flag
from quantgate.cli.lazy import LazyCommand, LazyGroup

RELEASE, INSPECT, QUANTIZE, MEASURE, SETUP = "Release", "Inspect results", "Quantize and plan", "Measure", "Setup"


def _table(panel: str, *rows: tuple[str, str, str]) -> dict[str, LazyCommand]:
    return {name: LazyCommand(f"quantgate.cli.{module}", attr, panel) for name, module, attr in rows}


# One line per command (name, module in quantgate/cli, attribute: a command function or a Typer of sub-commands);
# the commands' logic lives in their capability packages.
COMMANDS: dict[str, LazyCommand] = {
    **_table(RELEASE, ("check", "check", "check"), ("release", "release", "release"), ("gate", "gate", "gate"),
             ("sizing", "gate", "sizing_cmd"), ("registry", "registry", "registry_app")),
    **_table(INSPECT, ("runs", "runs", "runs"), ("show", "runs", "show"), ("report", "report", "report"),
             ("dashboard", "report", "dashboard"), ("export", "export", "export_app")),
    **_table(QUANTIZE, ("schemes", "quant", "schemes"), ("plan", "plan", "plan"), ("quantize", "quant", "quantize")),
    **_table(MEASURE, ("eval", "eval", "eval_cmd"), ("compare", "eval", "compare_cmd"), ("recall", "recall", "recall"),
             ("perf", "perf", "perf"), ("perf-compare", "perf", "perf_compare"), ("judge", "judge", "judge_cmd"),
             ("review", "judge", "review_app")),
    **_table(SETUP, ("models", "models", "models_app"), ("pools", "pools", "pools_app")),
}


class Quantgate(LazyGroup):
    lazy = COMMANDS


app = typer.Typer(
    cls=Quantgate,
    help="Quantize an LLM for its target hardware, validate it against the baseline, gate its release.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        print(f"quantgate {quantgate.__version__}")
        raise typer.Exit(0)


@app.callback()
def _options(version: bool = typer.Option(False, "--version", "-V", callback=_version, is_eager=True,
                                          help="print quantgate's version and exit")) -> None:
    """Quantize an LLM for its target hardware, validate it against the baseline, gate its release."""


def user_error(exc: QuantgateError) -> QuantgateError:
    """The error in the command line's terms: the library names a setting (`recall.lengths`), the user gave it as
    a flag (`--lengths`)."""
    return exc.in_terms(as_flag(exc.setting)) if isinstance(exc, SettingError) else exc


def main() -> None:
    """Console-script entry: user-fixable errors print as one clear message and exit 2, not a traceback."""
    try:
        app()
    except QuantgateError as exc:
        print(f"error: {user_error(exc).render()}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
