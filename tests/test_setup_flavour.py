"""scripts/setup.sh's flavours: which pipeline and serving environments a machine gets (CPU or CUDA builds).

The shell functions run for real (`source scripts/setup.sh` defines them without building anything). An NVIDIA
GPU is faked by an `nvidia-smi` script on PATH, because this machine has none; nothing here builds an environment.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SETUP = REPO / "scripts" / "setup.sh"
BASH = shutil.which("bash")


def _bin(tmp: Path, nvidia_smi: str | None) -> Path:
    """A PATH folder with the few tools the sourced script needs, plus an `nvidia-smi` script when asked."""
    b = tmp / "bin"
    b.mkdir(exist_ok=True)
    for tool in ("dirname", "sha256sum", "cut", "cat", "date"):
        (b / tool).unlink(missing_ok=True)
        (b / tool).symlink_to(shutil.which(tool))
    if nvidia_smi is not None:
        (b / "nvidia-smi").write_text(f"#!{BASH}\n{nvidia_smi}\n")
        (b / "nvidia-smi").chmod(0o755)
    return b


def _call(tmp: Path, function: str, nvidia_smi: str | None = None, env: dict[str, str] | None = None,
          before: str = "") -> subprocess.CompletedProcess:
    bindir = _bin(tmp, nvidia_smi)
    script = f'source "{SETUP}"; {before}\n{function}'
    clean = {"PATH": str(bindir), "HOME": str(tmp), **(env or {})}
    return subprocess.run([BASH, "-c", script], env=clean, capture_output=True, text=True, timeout=30)


GPU = 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"; exit 0'
DRIVER_GONE = 'echo "NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver" >&2; exit 9'


@pytest.mark.parametrize("nvidia_smi, env, expected", [
    (None, {}, "cpu"),                                                  # no nvidia-smi at all
    (GPU, {}, "gpu"),                                                   # nvidia-smi lists a GPU
    (DRIVER_GONE, {}, "cpu"),                                           # nvidia-smi installed, no usable GPU
    (GPU, {"QUANTGATE_PIPELINE_FLAVOR": "cpu"}, "cpu"),                 # override wins over detection
    (None, {"QUANTGATE_PIPELINE_FLAVOR": "gpu"}, "gpu"),
    (GPU, {"QUANTGATE_PIPELINE_FLAVOR": "auto"}, "gpu"),
    (GPU, {"QUANTGATE_SERVE_FLAVOR": "cpu"}, "gpu"),                    # the other variable does not steer it
])
def test_pipeline_flavor(tmp_path, nvidia_smi, env, expected):
    r = _call(tmp_path, "pipeline_flavor", nvidia_smi, env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == expected


@pytest.mark.parametrize("nvidia_smi, env, expected", [
    (None, {}, "cpu"), (GPU, {}, "gpu"), (DRIVER_GONE, {}, "cpu"),
    (GPU, {"QUANTGATE_SERVE_FLAVOR": "cpu"}, "cpu"), (None, {"QUANTGATE_SERVE_FLAVOR": "gpu"}, "gpu"),
])
def test_serve_flavor_detects_the_same_way(tmp_path, nvidia_smi, env, expected):
    r = _call(tmp_path, "serve_flavor", nvidia_smi, env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == expected


@pytest.mark.parametrize("var, function", [("QUANTGATE_PIPELINE_FLAVOR", "pipeline_flavor"),
                                           ("QUANTGATE_SERVE_FLAVOR", "serve_flavor")])
def test_bad_override_is_refused_naming_the_variable(tmp_path, var, function):
    r = _call(tmp_path, f'x=$({function}) || exit 7; echo "$x"', GPU, {var: "cuda"})
    assert r.returncode == 7
    assert var in r.stderr and "cpu, gpu or auto" in r.stderr and "'cuda'" in r.stderr


def _setup_pipeline(tmp_path: Path, nvidia_smi: str | None, env: dict[str, str] | None = None) -> tuple[str, Path]:
    """Run the real setup_pipeline in a scratch checkout, with build_env replaced by a recorder: which environment
    (name, requirements file, post-install step) would it build, and which shared environment is the checkout's own
    .venv layered on (setup_checkout_env, replaced by a recorder too; tests/test_checkout_env.py runs the real one)?"""
    fake_repo = tmp_path / "repo"
    fake_env = tmp_path / "env"
    shutil.rmtree(fake_repo, ignore_errors=True)
    shutil.rmtree(fake_env, ignore_errors=True)
    (tmp_path / "bin" / "ln").unlink(missing_ok=True)
    (fake_env / "bin").mkdir(parents=True)
    (fake_env / "bin" / "python").write_text(f"#!{BASH}\nexit 0\n")  # the editable install: a no-op here
    (fake_env / "bin" / "python").chmod(0o755)
    fake_repo.mkdir()
    (fake_repo / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (_bin(tmp_path, nvidia_smi) / "ln").symlink_to(shutil.which("ln"))
    before = (f'repo="{fake_repo}"; build_env() {{ echo "$*" > "{tmp_path}/built"; echo "{fake_env}"; }}; '
              f'setup_checkout_env() {{ echo "$1" > "{tmp_path}/layered"; }}')
    r = _call(tmp_path, "setup_pipeline", nvidia_smi, env, before=before)
    assert r.returncode == 0, r.stderr
    return (tmp_path / "built").read_text().strip(), Path((tmp_path / "layered").read_text().strip())


def test_cpu_machine_builds_the_cpu_lock_as_before(tmp_path):
    built, layered = _setup_pipeline(tmp_path, None)
    assert built == f"pipeline {tmp_path}/repo/requirements/pipeline.lock"   # same name, same lock, no post step
    assert layered == tmp_path / "env"


def test_gpu_machine_builds_the_cuda_flavour(tmp_path):
    built, layered = _setup_pipeline(tmp_path, GPU)
    assert built == f"pipeline-gpu {tmp_path}/repo/requirements/pipeline-gpu.in post_pipeline_gpu"
    assert layered == tmp_path / "env"
    built, _ = _setup_pipeline(tmp_path, GPU, {"QUANTGATE_PIPELINE_FLAVOR": "cpu"})
    assert built.startswith("pipeline ") and built.endswith("pipeline.lock")


def _pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", line)
        if m:
            out[m.group(1).lower()] = m.group(2)
    return out


def test_gpu_requirements_keep_the_pipeline_pins():
    """pipeline-gpu.in = pipeline.in's pins (torch's public version: the CUDA build from PyPI) + compressed-tensors as
    locked, since llmcompressor pins it exactly and the two flavours must quantize with the same code."""
    cpu_in, gpu_in = _pins(REPO / "requirements/pipeline.in"), _pins(REPO / "requirements/pipeline-gpu.in")
    lock = _pins(REPO / "requirements/pipeline.lock")
    assert gpu_in == cpu_in | {"compressed-tensors": lock["compressed-tensors"]}
    assert lock["torch"].split("+")[0] == gpu_in["torch"] and "+" not in gpu_in["torch"]
    for name in ("llmcompressor", "transformers"):
        assert gpu_in[name] == lock[name]


FAKE_TORCH = """
import types
__version__ = {version!r}
version = types.SimpleNamespace(cuda={cuda!r})
class cuda:
    is_available = staticmethod(lambda: {n} > 0)
    device_count = staticmethod(lambda: {n})
    get_device_name = staticmethod(lambda i: "NVIDIA H100 80GB HBM3")
"""


def _post_install(tmp_path: Path, version: str, cuda: str | None, n: int) -> subprocess.CompletedProcess:
    """post_pipeline_gpu on a scratch environment whose python is this one with a stand-in `torch` module (torch's
    CUDA build cannot run here) and whose `pip freeze` prints two fixed lines."""
    env = tmp_path / f"env-{version}"
    (env / "bin").mkdir(parents=True)
    (env / "torch").mkdir()
    (env / "torch" / "__init__.py").write_text(FAKE_TORCH.format(version=version, cuda=cuda, n=n))
    (env / "bin" / "python").write_text(
        f"#!{BASH}\n"
        'if [ "$1 $2 $3" = "-m pip freeze" ]; then echo "torch==' + version + '"; echo "llmcompressor==0.14.0.1"; exit 0; fi\n'
        f'PYTHONPATH="{env}" exec "{sys.executable}" "$@"\n')
    (env / "bin" / "python").chmod(0o755)
    return _call(tmp_path, f'post_pipeline_gpu "{env}"')


def test_post_install_records_what_was_resolved(tmp_path):
    r = _post_install(tmp_path, "2.13.0", "12.8", 2)
    assert r.returncode == 0, r.stderr
    env = tmp_path / "env-2.13.0"
    assert (env / "resolved.txt").read_text().splitlines() == ["torch==2.13.0", "llmcompressor==0.14.0.1"]
    info = json.loads((env / "torch.json").read_text())
    assert info == {"torch": "2.13.0", "cuda": "12.8", "cuda_available": True,
                    "devices": ["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"]}
    assert "CUDA 12.8" in r.stderr


def test_post_install_refuses_a_cpu_torch(tmp_path):
    """A find-links folder with +cpu wheels (as on this machine) satisfies torch==2.13.0 before PyPI's CUDA wheel."""
    r = _post_install(tmp_path, "2.13.0+cpu", None, 0)
    assert r.returncode != 0
    assert "CPU build of torch (2.13.0+cpu)" in r.stderr and "QUANTGATE_PIPELINE_FLAVOR=cpu" in r.stderr
