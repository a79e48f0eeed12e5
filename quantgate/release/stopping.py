"""What a release process does when it is told to stop (SIGTERM, SIGHUP): take every process it started with it.

Python's default for SIGTERM ends the process at once, running no `finally` and no `atexit`. The children that
watch their parent (vLLM servers and the quantization child run under a parent-death guard) then go too, but the
ones that do not are left running: Prefect's local API server (a uvicorn subprocess of the embedded engine) was
found orphaned under pid 1 after `quantgate release` was SIGTERMed. `on_stop_signals()` replaces that default with a
handler that signals the whole process tree below this process (read from /proc: children, grandchildren, in any
session or process group), SIGTERM first and SIGKILL after a grace period, and then exits with 128 + the signal
number. The release's files need no other care: every evidence file is written atomically, and the next run
resumes from what is cached.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

GRACE_S = 10.0  # vLLM needs a few seconds to stop its engine process cleanly


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process visible in /proc."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_bytes()
            out[int(name)] = int(stat.rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return out


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children first), from /proc; [] where there is no /proc."""
    if not os.path.isdir("/proc"):
        return []
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    out, todo = [], [pid]
    while todo:
        for child in sorted(children.get(todo.pop(0), [])):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != b"Z"  # a zombie has exited; its parent (us) is about to go


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_tree(grace_s: float | None = None) -> list[int]:
    """SIGTERM every descendant of this process, wait up to `grace_s` (default GRACE_S) for them to exit, SIGKILL
    what is left (and whatever was started meanwhile). Returns the pids that needed SIGKILL."""
    pids = descendants(os.getpid())
    _signal(pids, signal.SIGTERM)
    deadline = time.monotonic() + (GRACE_S if grace_s is None else grace_s)
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in dict.fromkeys(pids + descendants(os.getpid())) if _alive(p)]
    _signal(left, signal.SIGKILL)
    return left


def _on_signal(signum: int, frame: object) -> None:
    stop_tree()
    os._exit(128 + signum)  # now: threads still measuring must not keep a stopped release alive


@contextmanager
def on_stop_signals(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGHUP)) -> Iterator[bool]:
    """While the block runs, `signals` stop this process and every process below it (module docstring); the
    previous handlers come back after it. Yields False (and changes nothing) outside the main thread, where Python
    cannot set handlers."""
    try:
        previous = {sig: signal.signal(sig, _on_signal) for sig in signals}
    except ValueError:  # not the main thread
        yield False
        return
    try:
        yield True
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
