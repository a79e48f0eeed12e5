"""Shared fixtures: the real demo model and real vLLM servers (slow: seconds to minutes, CI runs them)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

# CPU serving arguments that give correct output for the demo model here (docs/design.md "Measured facts" + our own parity run:
# BF16 on this CPU's vLLM produced wrong text, FP32 eager matches transformers).
CPU_TEST_ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "2048"]
CPU_TEST_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """The demo checkpoint (SmolLM2-135M-Instruct, BF16 safetensors), materialized once and verified."""
    from quantgate.target.catalogue import ensure_demo_model

    return ensure_demo_model()


@pytest.fixture
def vllm_server(tmp_path):
    """Factory: `with vllm_server(model_dir, name=...) as srv:` starts a real vLLM server on loopback."""
    from quantgate.serving.server import ServerConfig, VLLMServer

    @contextlib.contextmanager
    def start(model: Path, name: str = "model", args: list[str] | None = None, env: dict | None = None):
        cfg = ServerConfig(model=model, name=name, args=CPU_TEST_ARGS if args is None else args, env={**CPU_TEST_ENV, **(env or {})})
        with VLLMServer(cfg, log_path=tmp_path / f"{name}.server.log") as srv:
            yield srv

    return start


@pytest.fixture(scope="session")
def demo_server(demo_model, tmp_path_factory):
    """One real vLLM server of the demo model (FP32 eager, served as "demo"), shared by the tests that only send it
    requests: its start-up is paid once per session. Tests that kill, break or inspect a server's lifetime start
    their own with `vllm_server`."""
    from quantgate.serving.server import ServerConfig, VLLMServer

    cfg = ServerConfig(model=demo_model, name="demo", args=CPU_TEST_ARGS, env=CPU_TEST_ENV)
    with VLLMServer(cfg, log_path=tmp_path_factory.mktemp("demo-server") / "server.log") as srv:
        yield srv
