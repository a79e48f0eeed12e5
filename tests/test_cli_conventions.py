"""The command line's conventions: --version and -h everywhere, unknown values refused, empty lists said, and the
run folders listed and shown (`quantgate runs`, `quantgate show RUN`) from real gated run folders."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import typer
from _gate_fixtures import make_run
from typer.testing import CliRunner

from quantgate import __version__
from quantgate.base.paths import REPO
from quantgate.cli.main import COMMANDS, INSPECT, MEASURE, QUANTIZE, RELEASE, SETUP, app
from quantgate.gate.evidence import gate_run
from quantgate.gate.policy import DEFAULT_POLICY

run_cli = CliRunner().invoke


def test_version_and_short_help():
    for flag in ("--version", "-V"):
        res = run_cli(app, [flag])
        assert res.exit_code == 0 and res.output.strip() == f"quantgate {__version__}"
    assert run_cli(app, ["-h"]).exit_code == 0 and "release" in run_cli(app, ["-h"]).output
    res = run_cli(app, ["gate", "-h"])
    assert res.exit_code == 0 and "--junit-inconclusive" in res.output


def test_version_imports_no_command_module():
    """`quantgate --version` answers without importing a command module or what they import (1.7-2.1 s before, on
    a loaded 2-core machine): the modules Python reports importing, read from -X importtime."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "quantgate.cli.main", "--version"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"quantgate {__version__}", proc.stderr[-2000:]
    imported = {line.rpartition("|")[2].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "quantgate.cli.lazy" in imported  # what is read is really the import list
    assert not {e.module for e in COMMANDS.values()} & imported
    assert not {"numpy", "pydantic", "httpx", "yaml", "quantgate.spec.schema"} & imported


def _listed(output: str) -> list[tuple[str, str]]:
    """(command, its --help panel) in the order listed, from typer's boxes: `╭─ Panel ─...╮`, then `│ name  help │`
    rows (a wrapped help line starts with spaces: no name)."""
    found, panel = [], None
    for line in output.splitlines():
        if line.startswith("╭─"):
            panel = line.strip("╭─╮ ").rstrip("─").strip()
        elif line.startswith("│ ") and panel not in (None, "Options") and (name := line[2:].split(" ", 1)[0]):
            found.append((name, panel))
    return found


def test_help_lists_every_command_once_grouped_in_panels():
    res = run_cli(app, ["--help"], terminal_width=160)
    assert res.exit_code == 0, res.output
    assert _listed(res.output) == [(name, e.panel) for name, e in COMMANDS.items()] and len(COMMANDS) == 22
    order = [res.output.index(f"╭─ {panel} ") for panel in (RELEASE, INSPECT, QUANTIZE, MEASURE, SETUP)]
    assert order == sorted(order) and "╭─ Commands " not in res.output


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_loads_and_answers_help(name):
    target = COMMANDS[name].target()
    assert isinstance(target, typer.Typer) or callable(target)
    res = run_cli(app, [name, "-h"])
    assert res.exit_code == 0 and "Usage: " in res.output and name in res.output, res.output


def test_a_mistyped_command_is_named_with_a_suggestion():
    res = run_cli(app, ["relase"])
    assert res.exit_code == 2 and "No such command 'relase'" in res.output and "Did you mean 'release'" in res.output


def test_an_unknown_family_is_refused_naming_the_known_ones():
    res = run_cli(app, ["sizing", "--family", "foo"])
    assert res.exit_code == 2 and "'foo'" in res.output and "int8" in res.output and "w4a16" in res.output
    assert run_cli(app, ["sizing", "--family", "int8", "--n", "300"]).exit_code == 0


def test_an_empty_registry_and_no_runs_say_so(tmp_path):
    res = run_cli(app, ["registry", "list", "--root", str(tmp_path / "registry")])
    assert res.exit_code == 0 and "no promoted entries" in res.output
    res = run_cli(app, ["runs", "--results", str(tmp_path)])
    assert res.exit_code == 0 and f"no runs in {tmp_path / 'runs'}" in res.output


def test_runs_lists_and_filters_and_show_tells_one_run(tmp_path):
    results = tmp_path / "results"
    for name, kw in (("good", {}), ("bad", {"lose": {"proper_nouns": 10}})):
        run = make_run(tmp_path / name, "w4a16-gptq", **kw)
        gate_run(run, DEFAULT_POLICY)
        shutil.copytree(run, results / "runs" / f"r-{name}")
    shutil.copytree(tmp_path / "good" / "run", results / "runs" / "r-stopped")
    (results / "runs" / "r-stopped" / "decision.json").unlink()  # stopped before the gate
    res = run_cli(app, ["runs", "--results", str(results)])
    assert res.exit_code == 0, res.output
    lines = {ln.split()[0]: ln for ln in res.output.splitlines()}
    assert "PROMOTE" in lines["r-good"] and "REJECT" in lines["r-bad"] and "no decision" in lines["r-stopped"]
    assert all("w4a16-gptq" in ln for ln in lines.values())
    res = run_cli(app, ["runs", "--results", str(results), "--decision", "reject"])
    assert [ln.split()[0] for ln in res.output.splitlines()] == ["r-bad"]
    res = run_cli(app, ["show", "r-bad", "--results", str(results)])
    assert res.exit_code == 0 and res.output.startswith("REJECT: run r-bad") and "w4a16-gptq: REJECT (" in res.output
    assert "  FAIL  " in res.output  # the deciding checks, one a line
    assert "report.html (not written)" in res.output
    assert run_cli(app, ["show", "nope", "--results", str(results)]).exit_code == 2
