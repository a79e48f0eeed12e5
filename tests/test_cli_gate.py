"""`quantgate gate`: exit 0 on PROMOTE, 3 on REJECT, 4 on INCONCLUSIVE, 2 on bad input; decision.json written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import typer
from _gate_fixtures import make_run
from typer.testing import CliRunner

from quantgate.base.paths import RELEASES, REPO
from quantgate.cli.gate import gate

DEFAULT = RELEASES / "policies" / "default.yaml"
app = typer.Typer()
app.command("gate")(gate)
app.command("other")(lambda: None)  # two commands: typer then expects the sub-command name, like quantgate's app


def invoke(*args):
    return CliRunner().invoke(app, ["gate", *map(str, args)])


@pytest.mark.parametrize("run_kw, code, words", [
    ({}, 0, "decision: PROMOTE w4a16-gptq"),
    ({"lose": {"arithmetic_numbers": 10}}, 3, "[FAIL] category:default/arithmetic_numbers/numeric_match"),
    ({"lose": {"arithmetic_numbers": 6}}, 3, "[FAIL] pooled:default"),   # only the pooled test sees 6 of 250
    ({"parity": "fail"}, 3, "[FAIL] engine_parity"),
    ({"kl": 0.2}, 3, "[FAIL] fidelity:kl"),
    ({"kl": None}, 4, "[UNSURE] fidelity"),
    ({"throughput_ratio": None}, 4, "[UNSURE] pay_off:speed"),     # the default policy demands speed evidence
    ({"throughput_ratio": 0.5}, 3, "[FAIL] pay_off:latency/tpot_p50_ms"),
])
def test_exit_code_follows_the_decision(tmp_path, run_kw, code, words):
    run = make_run(tmp_path, **run_kw)
    r = invoke("--policy", DEFAULT, "--evidence", run)
    assert r.exit_code == code, r.output
    assert words in r.output
    doc = json.loads((run / "decision.json").read_text())
    assert doc["decision"] == {0: "PROMOTE", 3: "REJECT", 4: "INCONCLUSIVE"}[code]


def test_candidate_and_out(tmp_path):
    run = make_run(tmp_path)
    out = tmp_path / "elsewhere" / "d.json"
    r = invoke("--policy", DEFAULT, "--evidence", run, "--candidate", "int8-w8a8", "--out", out)
    assert r.exit_code == 4 and "missing evidence (required)" in r.output
    assert json.loads(out.read_text())["candidates"].keys() == {"int8-w8a8"}
    assert not (run / "decision.json").exists()


@pytest.mark.parametrize("setup, words", [
    (lambda t, run: (t / "p.yaml").write_text(DEFAULT.read_text().replace("min_samples: 10", "min_samples: 10\nbogus: 1")),
     "field 'bogus'"),
    (lambda t, run: (t / "p.yaml").write_text(DEFAULT.read_text().replace("max: 0.02", "max: 1.5")), "field 'error_rate.max'"),
    (lambda t, run: None, "file not found"),
])
def test_bad_policy_exits_2(tmp_path, setup, words):
    run = make_run(tmp_path)
    setup(tmp_path, run)
    r = invoke("--policy", tmp_path / "p.yaml", "--evidence", run)
    assert r.exit_code == 2 and words in r.output, r.output
    assert not (run / "decision.json").exists()


def test_bad_run_folder_exits_2(tmp_path):
    r = invoke("--policy", DEFAULT, "--evidence", tmp_path / "nowhere")
    assert r.exit_code == 2 and "run folder not found" in r.output
    (tmp_path / "empty").mkdir()
    r = invoke("--policy", DEFAULT, "--evidence", tmp_path / "empty")
    assert r.exit_code == 2 and "no candidate to gate" in r.output


def test_registered_in_the_quantgate_command(tmp_path):
    run = make_run(tmp_path, lose={"proper_nouns": 10})
    cmd = [sys.executable, "-m", "quantgate.cli", "gate", "--policy", str(DEFAULT), "--evidence", str(run)]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 3 and "decision: REJECT" in p.stdout, p.stdout + p.stderr
