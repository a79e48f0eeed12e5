"""The process tree below this process, read from /proc, and how it is stopped: SIGTERM, a grace period, SIGKILL.

`quantgate release` stops its whole tree this way when it is told to stop (quantgate.release.stopping): vLLM servers
and their engine processes, quantization children, benchmark clients, Prefect's API server last. The tree is read
from /proc (children, grandchildren, in any session or process group), not from this process's own bookkeeping: a
server's engine process is started by the server, not by quantgate.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from quantgate.base.procguard import TRACKER_WAIT_S, is_tracker

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


def descendants(pid: int, parents: dict[int, int] | None = None) -> list[int]:
    """Every process below `pid` (children first), from /proc (or from `parents`, one _parents() scan a caller
    shares between several lookups); [] where there is no /proc."""
    if parents is None and not os.path.isdir("/proc"):
        return []
    children: dict[int, list[int]] = {}
    for child, parent in (_parents() if parents is None else parents).items():
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


def _stop(pick: Callable[[], list[int]], grace_s: float) -> list[int]:
    """SIGTERM the processes `pick()` names, wait up to `grace_s`, SIGKILL what is left (and whatever `pick()` names
    by then), and wait a moment for those. Returns the pids that needed SIGKILL. A multiprocessing resource tracker
    ignores SIGTERM and unlinks the semaphores it tracks once the processes it serves are gone: the SIGKILL spares
    the trackers for TRACKER_WAIT_S first (killed at once, they leave their `/dev/shm/sem.mp-*` files behind)."""
    pids = pick()
    _signal(pids, signal.SIGTERM)
    _wait(pids, grace_s)
    left = [p for p in dict.fromkeys(pids + pick()) if _alive(p)]
    _signal([p for p in left if not is_tracker(p)], signal.SIGKILL)
    _wait(left, 5.0, lambda p: not is_tracker(p))
    _wait(left, TRACKER_WAIT_S)
    _signal([p for p in left if _alive(p)], signal.SIGKILL)
    _wait(left, 5.0)
    return left


def _wait(pids: list[int], wait_s: float, which: Callable[[int], bool] = lambda p: True) -> None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(_alive(p) and which(p) for p in pids):
        time.sleep(0.05)


def stop_tree(grace_s: float | None = None, last: Iterable[int] = ()) -> list[int]:
    """SIGTERM every descendant of this process, wait up to `grace_s` (default GRACE_S) for them to exit, SIGKILL
    what is left (and whatever was started meanwhile); the processes `last` and their trees only after all the
    others, the same way. This process's own multiprocessing resource tracker is not stopped: it exits after this
    process, unlinking the semaphores it tracks. Returns the pids that needed SIGKILL."""
    grace = GRACE_S if grace_s is None else grace_s
    roots = [p for p in last if _alive(p)]
    me = os.getpid()

    def spared(parents: dict[int, int] | None = None) -> set[int]:
        return {*roots, *(d for r in roots for d in descendants(r, parents))}

    def others() -> list[int]:
        # this process's own resource tracker is left alone: it unlinks what it tracks when this process exits
        parents = _parents()  # one /proc scan for the whole look
        keep = spared(parents)
        return [p for p in descendants(me, parents) if p not in keep and not (parents.get(p) == me and is_tracker(p))]

    killed = _stop(others, grace)
    return killed + _stop(lambda: sorted(p for p in spared() if _alive(p)), grace)
