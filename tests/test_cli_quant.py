"""`quantgate schemes` and `quantgate quantize` on the command line (synthetic checkpoint; no model load)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from quantgate.cli import main as cli

from _quant_fixtures import llama


def run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["quantgate", *args])
    monkeypatch.setenv("COLUMNS", "200")
    code = 0
    try:
        cli.main()
    except SystemExit as exc:
        code = exc.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def test_schemes_table_ranks_with_reasons(tmp_path, monkeypatch, capsys):
    model = llama(tmp_path / "m", hidden=576, inter=1536, layers=4)
    code, out, _ = run_cli(monkeypatch, capsys, "schemes", "--hardware", "A100", "--workload", "throughput", "--model", str(model))
    assert code == 0
    lines = [l for l in out.splitlines() if "│" in l and l.split("│")[1].strip().isdigit()]
    assert lines[0].split("│")[2].strip() == "int8-w8a8"
    assert "fp8-dynamic" in out and "no vLLM kernel" in out and "recommended: int8-w8a8" in out
    assert "vLLM 0." in out  # the table version the data reflects


def test_schemes_refuses_unknown_workload(tmp_path, monkeypatch, capsys):
    model = llama(tmp_path / "m", hidden=64, inter=128)
    code, _, err = run_cli(monkeypatch, capsys, "schemes", "--hardware", "h100", "--workload", "batch", "--model", str(model))
    assert code == 2 and "latency, throughput, fit" in err


def test_quantize_refuses_unsupported_scheme_with_alternatives(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("child started"))
    model = llama(tmp_path / "m", hidden=576, inter=1536)
    code, _, err = run_cli(monkeypatch, capsys, "quantize", "--model", str(model), "--scheme", "fp8-dynamic",
                           "--hardware", "x86-cpu", "--out", str(tmp_path / "o"))
    assert code == 2
    assert "error:" in err and "int8-w8a8" in err and "w4a16-gptq" in err and "l40s" in err
    assert not (tmp_path / "o").exists()


def test_quantize_refuses_bad_option_values(tmp_path, monkeypatch, capsys):
    model = llama(tmp_path / "m", hidden=576, inter=1536)
    code, _, err = run_cli(monkeypatch, capsys, "quantize", "--model", str(model), "--scheme", "int8-w8a8",
                           "--smoothing-strength", "2", "--out", str(tmp_path / "o"))
    assert code == 2 and "smoothing_strength" in err
