"""A run's status (`<run>/status.json`): whether the release completed, failed or was interrupted, and for a
failure the step, the root cause and the log to read. Written by the release (quantgate.release.runrecord), read by
the report, the dashboard and `quantgate runs` / `show`, so a run that ended without a decision explains itself; a run
killed before it could write one is known by its lock (`owner_gone`).

The root cause is the first error a child wrote, not the last: vLLM's API server ends a failed start with "Engine
core initialization failed. See root cause above", and the cause (a truncated safetensors file, a kernel that does
not exist) is the engine core's exception earlier in the same log. `root_cause_in_log` returns that first one.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from quantgate.base.fileio import is_locked, lock_holder, lock_path
from quantgate.base.runfiles import STATUS
from quantgate.base.typedfile import read_model

SCHEMA = 1
# an exception line as Python prints it: "SafetensorError: ...", "torch.OutOfMemoryError: ...", after vLLM's
# "(EngineCore pid=12) " prefix; the closing lines that point elsewhere are not causes
_EXC = re.compile(r"^(?:\([^)]*\)\s*)?(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*(?:Error|Exception|Interrupt|Exit))(?::\s*(.*))?$")
_NOT_CAUSES = ("root cause above", "see stack trace", "see the log", "see its log")


class RunStatus(BaseModel):
    model_config = ConfigDict(extra="allow")

    schema_version: int = SCHEMA
    status: Literal["completed", "failed", "interrupted"]
    finished: str                      # ISO time the status was written
    decision: str | None = None        # completed: the release's decision
    step: str | None = None            # failed: the step that failed (timings.json's name), when one did;
                                       # interrupted: the step it cut short
    error: str | None = None           # the error as raised
    root_cause: str | None = None      # the first error in the failing child's or server's log, else the error's cause
    log: str | None = None             # the log that holds it
    signal: str | None = None          # interrupted: the signal that stopped it

    def ended(self) -> str:
        """How the run ended, in one line: "failed in step X by SIGTERM: <root cause, else the error>"."""
        why = self.root_cause or self.error
        return (self.status + (f" in step {self.step}" if self.step else "")
                + (f" by {self.signal}" if self.signal else "") + (f": {why}" if why else ""))


def root_cause_in_text(text: str) -> str | None:
    """The first exception line in a log or an error message ("Type: message"), skipping lines that only point to
    an earlier cause; None when there is none."""
    for line in text.splitlines():
        m = _EXC.match(line.strip())
        if m and not any(p in line.lower() for p in _NOT_CAUSES):
            return f"{m.group(1)}: {m.group(2)}" if m.group(2) else m.group(1)
    return None


def root_cause_in_log(path: Path | str, max_bytes: int = 2_000_000) -> str | None:
    """root_cause_in_text of a log file's first `max_bytes`; None when it has none or cannot be read."""
    try:
        with open(path, "rb") as f:
            return root_cause_in_text(f.read(max_bytes).decode(errors="replace"))
    except OSError:
        return None


def owner_gone(run: Path) -> str | None:
    """How a run with no status.json is known to be interrupted: the release holds status.json's lock until it has
    written the file, so a lock file that no live process holds means its process died without a word (SIGKILL, a
    lost host). None when the run has its status, its release still runs, or it never took the lock (a run of an
    older quantgate, or one that had not started)."""
    at = Path(run) / STATUS
    if at.is_file() or not lock_path(at).is_file() or is_locked(at):
        return None
    h = lock_holder(at) or {}
    who = f"pid {h.get('pid')} on host {h.get('host')}, since {h.get('since')}" if h else "its holder"
    return f"no status.json, and no live process holds {lock_path(at).name} ({who}): its release process is gone"


def load_status(run: Path) -> RunStatus | None:
    """The run's status.json, or None when it has none (a run of an older quantgate, or one still running)."""
    path = Path(run) / STATUS
    return read_model(path, RunStatus, "run status", "a run of this quantgate writes it at its end; delete a damaged "
                      "one (the report then shows the run as it has no status)") if path.is_file() else None


__all__ = ["RunStatus", "load_status", "owner_gone", "root_cause_in_log", "root_cause_in_text"]
