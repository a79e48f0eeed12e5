"""The `quantgate` command line: the sub-commands of every command module, and the console-script entry point."""

from __future__ import annotations

import sys

import typer

import quantgate
from quantgate.base.errors import QuantgateError, SettingError, as_flag
from quantgate.cli import eval as eval_cmds
from quantgate.cli import check, export, gate, judge, models, perf, plan, pools, quant, recall, release, report, runs
from quantgate.cli import registry as registry_cmds

app = typer.Typer(
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

# One line per command; the commands' logic lives in their capability packages.
app.command("report")(report.report)
app.command("dashboard")(report.dashboard)
app.command("gate")(gate.gate)
app.command("sizing")(gate.sizing_cmd)
app.command("perf")(perf.perf)
app.command("perf-compare")(perf.perf_compare)
app.command("release")(release.release)
app.command("judge")(judge.judge_cmd)
app.add_typer(judge.review_app, name="review")
app.command("recall")(recall.recall)
app.command("eval")(eval_cmds.eval_cmd)
app.command("compare")(eval_cmds.compare_cmd)
app.command("schemes")(quant.schemes)
app.command("quantize")(quant.quantize)
app.command("plan")(plan.plan)
app.add_typer(models.models_app, name="models")
app.add_typer(registry_cmds.registry_app, name="registry")
app.add_typer(export.export_app, name="export")
app.add_typer(pools.pools_app, name="pools")
app.command("check")(check.check)
app.command("runs")(runs.runs)
app.command("show")(runs.show)


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
