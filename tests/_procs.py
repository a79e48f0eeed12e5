"""Process helpers shared by the fault tests."""

from __future__ import annotations

import psutil


def live(pids: list[int]) -> list[int]:
    """Those of `pids` that still run (a zombie or a process that is gone does not)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            continue
    return out


def cmdline(proc: psutil.Process) -> str:
    """`proc`'s command line joined, or "" for a zombie or a process already gone (a child exiting mid-scan)."""
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""
