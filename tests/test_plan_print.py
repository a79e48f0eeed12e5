"""`quantgate plan` prints per-node commands to paste into a shell: only the known placeholders ($HEAD_IP, ...)
expand there; `$(...)`, backticks and any other `$` in a path stay literal text."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from quantgate.cli.main import app
from quantgate.cli.plan import _env, _sh

MOE = Path(__file__).parent / "data" / "model_shapes" / "moe-671b-fp8.yaml"


def _words_in_bash(line: str, env: dict[str, str], cwd: Path) -> list[str]:
    """The words bash makes of `line` (as if pasted as a command's arguments), NUL-separated to keep them exact."""
    out = subprocess.run(["bash", "-c", f"set -- {line}\nprintf '%s\\0' \"$@\""], capture_output=True, cwd=cwd,
                         env={"PATH": os.environ["PATH"], **env}, timeout=30, check=True)
    return out.stdout.decode().split("\0")[:-1]


@pytest.mark.parametrize("tokens, want", [
    (["vllm", "serve", "/m/$(touch pwned)"], ["vllm", "serve", "/m/$(touch pwned)"]),
    (["/m/`touch pwned`", "it's", 'a "b"', "x\\y", "", "a b"], ["/m/`touch pwned`", "it's", 'a "b"', "x\\y", "", "a b"]),
    (["$HOME/x", "${PATH}", "$HEAD_IPX", "$1", "~", "*"], ["$HOME/x", "${PATH}", "$HEAD_IPX", "$1", "~", "*"]),
    (["--master-addr", "$HEAD_IP", "--address=$HEAD_IP:6379", "${MASTER_ADDR}-x", "$MASTER_PORT"],
     ["--master-addr", "10.0.0.9", "--address=10.0.0.9:6379", "10.0.0.8-x", "29501"]),
])
def test_printed_words_reach_the_command_literally_except_placeholders(tmp_path, tokens, want):
    got = _words_in_bash(_sh(tokens), {"HEAD_IP": "10.0.0.9", "MASTER_ADDR": "10.0.0.8", "MASTER_PORT": "29501",
                                       "HOME": "/home/u"}, tmp_path)
    assert got == want
    assert not (tmp_path / "pwned").exists()


def test_env_assignments_stay_assignments_and_values_are_quoted(tmp_path):
    line = _env({"VLLM_CPU_OMP_THREADS_BIND": "0|1", "X": "$(touch pwned)", "ADDR": "$HEAD_IP"})
    assert line.startswith("VLLM_CPU_OMP_THREADS_BIND=")  # a quoted name would be a command, not an assignment
    out = subprocess.run(["bash", "-c", f"{line} env"], capture_output=True, text=True, cwd=tmp_path, timeout=30,
                         env={"PATH": os.environ["PATH"], "HEAD_IP": "10.0.0.9"}, check=True).stdout.splitlines()
    assert {"VLLM_CPU_OMP_THREADS_BIND=0|1", "X=$(touch pwned)", "ADDR=10.0.0.9"} <= set(out)
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(ValueError):
        _env({"A B": "1"})


def test_quantgate_plan_prints_hostile_names_quoted(tmp_path):
    hostile = "m $(touch pwned) `touch pwned2`"
    model = tmp_path / "moe.yaml"
    model.write_text(MOE.read_text().replace("name: moe-671b-fp8", f"name: '{hostile}'"))
    out = CliRunner().invoke(app, ["plan", "--model", str(model), "--hardware", "h200", "--nodes", "2", "--context",
                                   "32768", "--concurrency", "128"], terminal_width=10_000)
    assert out.exit_code == 0, out.output
    lines = [m.group(1) for line in out.output.splitlines()
             if (m := re.match(r"\s*\[(?:native|ray)\] node \d \((?:head|worker)\): (.*)", line))]
    assert lines
    served = 0
    for line in lines:
        words = _words_in_bash(line, {"HEAD_IP": "10.1.1.1"}, tmp_path)
        assert "$HEAD_IP" not in " ".join(words)  # the default master address placeholder expanded
        if "serve" in words:
            assert words[words.index("serve") + 1] == hostile
            served += 1
    assert served >= 2 and "10.1.1.1" in " ".join(_words_in_bash(lines[0], {"HEAD_IP": "10.1.1.1"}, tmp_path))
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()
    # an address given on the command line is text, never code
    out = CliRunner().invoke(app, ["plan", "--model", str(MOE), "--hardware", "h200", "--nodes", "2", "--context",
                                   "32768", "--concurrency", "128", "--master-addr", "$(touch pwned)"],
                             terminal_width=10_000)
    assert out.exit_code == 0, out.output
    line = next(m.group(1) for line in out.output.splitlines()
                if (m := re.match(r"\s*\[native\] node 1 \(worker\): (.*)", line)))
    assert "$(touch pwned)" in _words_in_bash(line, {}, tmp_path) and not (tmp_path / "pwned").exists()
