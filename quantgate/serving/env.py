"""Find the serving environment: the Python interpreter that has vLLM installed.

The pipeline never imports vLLM; it starts it as a separate process from this interpreter. Where it lives is
configuration, so production can point at an existing install or a container's Python:
  1. $QUANTGATE_SERVE_PYTHON
  2. the release spec's `serving.python`
  3. <repo>/.venv-serve/bin/python (made by scripts/setup.sh)
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from functools import lru_cache
from pathlib import Path

from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import child_env, write_text
from quantgate.base.paths import REPO, home

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


def version_file(python: Path) -> Path | None:
    """Where vLLM's version in a built serving environment is remembered: environments that scripts/setup.sh built
    never change once their `.complete` marker exists (a changed lock builds a new folder), so the version asked
    once holds until the environment is rebuilt. None for any other interpreter: it is asked every time."""
    env = Path(python).parent.parent.resolve()
    marker = env / ".complete"
    if not marker.is_file():
        return None
    key = hashlib.sha256(f"{env}:{marker.stat().st_mtime_ns}".encode()).hexdigest()[:16]
    return home() / "cache" / "vllm-version" / key


@lru_cache(maxsize=8)
def vllm_version(python: Path) -> str:
    """Version of vLLM in that environment, as vLLM reports it (e.g. '0.32.0+cpu'); checks that it imports. A
    built environment's answer is kept on disk (`version_file`): a re-run does not start vLLM to ask again."""
    remembered = version_file(python)
    if remembered is not None and remembered.is_file():
        return remembered.read_text(encoding="utf-8").strip()
    proc = subprocess.run([str(python), str(LAUNCHER), "--version"], capture_output=True, text=True, timeout=600,
                          env=child_env())
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise QuantgateError(f"vLLM does not run from {python}: {tail}", where=str(python), fix=FIX)
    if remembered is not None:
        write_text(remembered, lines[-1].strip() + "\n")
    return lines[-1].strip()
