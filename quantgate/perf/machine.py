"""The machine around a probe (adapter over /proc and psutil): the 1-minute load average, the cores' clock, how busy
the cores were and how much of that was someone else's work.

A speed ratio measured while other processes shared the cores measures them as much as the candidate: the speed
window (quantgate.release.perf_window) records a `Span` per probe in window.json, and the report shows it beside the
figures. Every reading is None where the machine does not give it (no /proc, no clock in /proc/cpuinfo as in many
VMs), never a guess.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def load1() -> float | None:
    """The 1-minute load average, rounded to 0.01."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def cpu_mhz(cores: list[int]) -> float | None:
    """The mean clock of `cores` from /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    mhz, cpu = {}, None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "processor":
            cpu = int(value)
        elif key.strip() == "cpu MHz" and cpu is not None:
            mhz[cpu] = float(value)
    got = [mhz[c] for c in cores if c in mhz]
    return round(sum(got) / len(got), 1) if got else None


def busy_jiffies(cores: list[int]) -> tuple[float, float] | None:
    """(busy jiffies, all jiffies) summed over `cores` (/proc/stat)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    busy = total = 0.0
    for line in lines:
        head, *vals = line.split()
        if head.startswith("cpu") and head[3:].isdigit() and int(head[3:]) in cores:
            v = [float(x) for x in vals]
            idle = v[3] + (v[4] if len(v) > 4 else 0.0)
            busy, total = busy + sum(v[:8]) - idle, total + sum(v[:8])
    return (busy, total) if total else None


def own_cpu() -> float | None:
    """CPU seconds used so far by this process and its children's trees (servers, probe clients)."""
    try:
        import psutil
    except ImportError:
        return None
    me = psutil.Process()
    own = me.cpu_times()
    total = own.children_user + own.children_system  # children that have ended (probe clients)
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


class Span:
    """The machine from construction to `end()` on `cores`: the load before and after, the clock at the start, the
    share of the cores that was busy and, of that, what processes outside this one's tree used."""

    def __init__(self, cores: list[int]):
        self.cores = cores
        self.load_before, self.cpu_mhz = load1(), cpu_mhz(cores)
        self._busy0, self._own0, self._t0 = busy_jiffies(cores), own_cpu(), time.perf_counter()
        self.seconds = 0.0
        self.load_after: float | None = None
        self.busy_share: float | None = None
        self.others_share: float | None = None

    def end(self) -> Span:
        self.seconds = round(time.perf_counter() - self._t0, 2)
        self.load_after = load1()
        busy1, own1 = busy_jiffies(self.cores), own_cpu()
        if self._busy0 is not None and busy1 is not None and self.cores and self.seconds > 0:
            busy = (busy1[0] - self._busy0[0]) / max(busy1[1] - self._busy0[1], 1e-9)
            self.busy_share = round(busy, 3)
            if self._own0 is not None and own1 is not None:
                own = (own1 - self._own0) / (self.seconds * len(self.cores))
                self.others_share = round(max(busy - own, 0.0), 3)
        return self
