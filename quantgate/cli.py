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
from quantgate.cli_report import report as _report, dashboard as _dash; app.command("report")(_report); app.command("dashboard")(_dash)  # noqa: E402,E702
from quantgate.cli_gate import gate as _gate; app.command("gate")(_gate)  # noqa: E402,E702
from quantgate.cli_perf import perf as _perf, perf_compare as _perf_cmp  # noqa: E402
app.command("perf")(_perf); app.command("perf-compare")(_perf_cmp)  # noqa: E702
from quantgate.cli_release import release as _release  # noqa: E402
app.command("release")(_release)
from quantgate.cli_judge import judge_cmd as _judge, review_app as _review  # noqa: E402
app.command("judge")(_judge); app.add_typer(_review, name="review")  # noqa: E702
from quantgate.cli_recall import recall as _recall; app.command("recall")(_recall)  # noqa: E402,E702
from quantgate.cli_eval import eval_cmd as _eval, compare_cmd as _compare  # noqa: E402
app.command("eval")(_eval); app.command("compare")(_compare)  # noqa: E702
from quantgate.cli_quant import schemes as _schemes, quantize as _quantize  # noqa: E402
app.command("schemes")(_schemes); app.command("quantize")(_quantize)  # noqa: E702
from quantgate.cli_plan import plan as _plan  # noqa: E402
app.command("plan")(_plan)
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
