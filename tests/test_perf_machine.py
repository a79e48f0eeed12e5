"""The machine around a probe (quantgate.perf.machine), read from this machine's real /proc: a span in which this
process keeps one core busy reads that core as busy and the work as its own, and a span in which a process
outside this process's tree does the work reads it as someone else's."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from quantgate.perf.machine import Span, busy_jiffies, cpu_mhz, load1

# slow: not slow to run (6 s), but it reads how busy a core is, so it runs in the serial pass, with no other test's
# process on the core beside it
LINUX = os.path.isfile("/proc/stat") and hasattr(os, "sched_getaffinity")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not LINUX, reason="reads Linux's /proc")]


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.fixture
def one_core():
    """This process pinned to one of its cores for the test (the speed window pins itself to its slot the same way)."""
    before = os.sched_getaffinity(0)
    core = min(before)
    os.sched_setaffinity(0, {core})
    yield core
    os.sched_setaffinity(0, before)


def test_own_work_on_the_core_is_busy_and_not_someone_elses(one_core):
    span = Span([one_core])
    _spin(0.6)
    span.end()
    assert span.seconds >= 0.6 and span.load_before is not None and span.load_after is not None
    assert span.busy_share is not None and span.busy_share > 0.7, span.busy_share  # the spin kept the core busy
    assert span.others_share is not None and span.others_share < 0.3, span.others_share  # and it was ours


def test_work_outside_this_process_tree_is_someone_elses(one_core):
    """A spinning process on the core that is not below the measuring one (its parent exited: it was handed to init),
    as another job on a shared CI machine is; a child's work would count as the measuring process's own (the servers
    and the probe clients are its children). The span is read in a fresh process: this test process may hold servers
    of other tests' session fixtures, whose idle threads are its own work on the other cores."""
    spin = (f"import os, time\nos.sched_setaffinity(0, {{{one_core}}})\n"
            "end = time.time() + 3\nwhile time.time() < end: pass")
    hand_off = ("import subprocess, sys\nquiet = subprocess.DEVNULL\n"
                f"print(subprocess.Popen([sys.executable, '-c', {spin!r}], stdout=quiet, stderr=quiet).pid)")
    measure = (f"import os, time\nfrom quantgate.perf.machine import Span\nos.sched_setaffinity(0, {{{one_core}}})\n"
               f"span = Span([{one_core}])\ntime.sleep(0.8)\nspan.end()\nprint(span.busy_share, span.others_share)")
    pid = int(subprocess.run([sys.executable, "-c", hand_off], capture_output=True, text=True, check=True).stdout)
    try:
        time.sleep(0.3)  # spinning by now
        out = subprocess.run([sys.executable, "-c", measure], capture_output=True, text=True, check=True).stdout
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    busy, others = (float(x) for x in out.split())
    assert busy > 0.6, out
    assert others > 0.5, out


def test_readings_are_none_where_the_machine_has_none():
    assert busy_jiffies([10_000]) is None and cpu_mhz([10_000]) is None
    assert isinstance(load1(), float)
