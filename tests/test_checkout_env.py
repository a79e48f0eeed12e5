"""Each checkout runs its own code (scripts/setup.sh setup_checkout_env): two clones of this repository at different
commits, `make setup` in both (the second after the first, then the first again), and each one's console script, its
Python from another directory, the Prefect console script's interpreter and `python flows/release.py`'s import all
find that clone's quantgate, whatever the shared pipeline environment had installed. Slow: real clones and setups
(seconds each: the shared environments exist already)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from quantgate.base.paths import REPO

pytestmark = pytest.mark.slow


def _clone(tmp_path: Path, name: str, version: str) -> Path:
    """A clone of this repository's HEAD whose quantgate says `version`, committed (a commit of its own)."""
    dest = tmp_path / name
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(dest)], check=True)
    init = dest / "quantgate" / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "0.1.0"', f'__version__ = "{version}"'))
    git = ["git", "-C", str(dest), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "commit", "--quiet", "-am", f"marker {version}"], check=True)
    return dest


def _setup(repo: Path) -> None:
    r = subprocess.run(["make", "setup"], cwd=repo, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def _runs_its_own(repo: Path, version: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a person's shell: no test runner's path
    said = subprocess.run([repo / ".venv/bin/quantgate", "--version"], capture_output=True, text=True, env=env,
                          cwd="/", timeout=120)
    assert said.stdout.strip() == f"quantgate {version}", said.stdout + said.stderr
    where = "import os, quantgate; print(os.path.dirname(os.path.dirname(quantgate.__file__)))"
    found = subprocess.run([repo / ".venv/bin/python", "-c", where], capture_output=True, text=True, env=env,
                           cwd="/", timeout=120)
    assert found.stdout.strip() == str(repo), found.stdout + found.stderr
    # the Prefect console script (a worker started as docs/prefect.md says) runs this checkout's interpreter
    assert (repo / ".venv/bin/prefect").read_text().splitlines()[0] == f"#!{repo}/.venv/bin/python"
    flow = subprocess.run([repo / ".venv/bin/python", "-c", "import runpy, quantgate; runpy.run_path('flows/release.py'"
                           ", run_name='x'); print(quantgate.__version__)"], capture_output=True, text=True, env=env,
                          cwd=repo, timeout=300)
    assert flow.stdout.strip().endswith(version), flow.stdout + flow.stderr


def test_two_checkouts_at_different_commits_each_run_their_own_code(tmp_path):
    first, second = _clone(tmp_path, "first", "0.1.0+first"), _clone(tmp_path, "second", "0.1.0+second")
    _setup(first)
    _setup(second)  # whatever the shared environment holds (an older setup installed a checkout into it) is not used
    _runs_its_own(first, "0.1.0+first")
    _runs_its_own(second, "0.1.0+second")
    _setup(first)  # again: up to date, and still its own
    _runs_its_own(first, "0.1.0+first")
    assert (first / ".venv").is_dir() and not (first / ".venv").is_symlink()
