"""Run folders and step manifests: what ran, on which inputs, with which code and libraries, for how long.

results/runs/<run-id>/
    run.json                 spec (as loaded), git commit + dirty flag, package versions, start/end
    <step>/manifest.json     inputs' hashes, outputs, seconds (one per step)
    timings.json             wall seconds of every flow step, in order (`timed`)
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import time
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

from quantgate.base.fileio import write_json
from quantgate.base.paths import REPO, results_dir

PACKAGES = ("quantgate", "llmcompressor", "compressed-tensors", "transformers", "torch", "prefect", "datasets", "evaluate")


def new_run_id(name: str) -> str:
    return f"{name}-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}"


def run_dir(run_id: str) -> Path:
    path = results_dir() / "runs" / run_id
    path.mkdir(parents=True, exist_ok=True)
    return path


def git_state(repo: Path = REPO) -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


@contextmanager
def step(run: Path, name: str, inputs: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Record one step: yields a dict for its outputs; writes <run>/<name>/manifest.json with timing and status."""
    record: dict[str, Any] = {"step": name, "inputs": inputs, "outputs": {}, "started": dt.datetime.now(dt.timezone.utc).isoformat()}
    start = time.monotonic()
    try:
        yield record["outputs"]
        record["status"] = "ok"
    except BaseException as exc:
        record["status"] = "failed"
        record["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        record["seconds"] = round(time.monotonic() - start, 2)
        write_json(run / name / "manifest.json", record)


@contextmanager
def timed(run: Path, name: str) -> Iterator[None]:
    """Append {step, seconds, status} to <run>/timings.json when the block ends (also when it fails)."""
    start, status = time.monotonic(), "ok"
    try:
        yield
    except BaseException:
        status = "failed"
        raise
    finally:
        rows = timings(run)
        rows.append({"step": name, "seconds": round(time.monotonic() - start, 1), "status": status})
        write_json(run / "timings.json", rows)


def timings(run: Path) -> list[dict[str, Any]]:
    try:
        return json.loads((run / "timings.json").read_text())
    except (OSError, ValueError):
        return []
