"""Find the serving environment: the Python interpreter that has vLLM installed.

The pipeline never imports vLLM; it starts it as a separate process from this interpreter. Where it lives is
configuration, so production can point at an existing install or a container's Python:
  1. $QUANTGATE_SERVE_PYTHON
  2. the release spec's `serving.python`
  3. <repo>/.venv-serve/bin/python (made by scripts/setup.sh)
"""

from __future__ import annotations

import os
import subprocess
from functools import lru_cache
from pathlib import Path

from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import child_env
from quantgate.base.paths import REPO

LAUNCHER = Path(__file__).with_name("vllm_launcher.py")
FIX = "run `scripts/setup.sh serve` (make demo and make test run it), or set QUANTGATE_SERVE_PYTHON to the python of an environment with vllm"


def serve_python(configured: str | Path | None = None) -> Path:
    """The serving interpreter, checked to exist. Nothing is started when it is missing."""
    source, value = next(
        ((s, v) for s, v in (("$QUANTGATE_SERVE_PYTHON", os.environ.get("QUANTGATE_SERVE_PYTHON")), ("serving.python", configured)) if v),
        ("default", REPO / ".venv-serve" / "bin" / "python"),
    )
    path = Path(value).expanduser()
    if not path.exists():
        raise QuantgateError(f"serving environment not found: {path} (from {source})", where=source, fix=FIX)
    return path


@lru_cache(maxsize=8)
def vllm_version(python: Path) -> str:
    """Version of vLLM in that environment, as vLLM reports it (e.g. '0.32.0+cpu'); checks that it imports."""
    proc = subprocess.run([str(python), str(LAUNCHER), "--version"], capture_output=True, text=True, timeout=600,
                          env=child_env())
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise QuantgateError(f"vLLM does not run from {python}: {tail}", where=str(python), fix=FIX)
    return lines[-1].strip()
