"""quantgate.base.proctree.stop_tree on real processes, as a stop signal runs it in `quantgate release`: the
children are stopped, but the release's own multiprocessing resource tracker is left to unlink the semaphores it
tracks when the release exits. (It ignores SIGTERM: stopped with the others, it held the stop for the whole grace
period and was then SIGKILLed, leaving a `/dev/shm/sem.mp-*` file behind at every stopped release.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from quantgate.base.paths import REPO

RELEASE = r"""
import multiprocessing as mp, os, subprocess, sys, time
from quantgate.base.proctree import stop_tree

lock = mp.get_context("spawn").Lock()  # a named semaphore, tracked by this process's resource tracker
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(lock._semlock.name, child.pid, flush=True)
t0 = time.monotonic()
stop_tree(grace_s=6.0)
print(f"{time.monotonic() - t0:.2f}", flush=True)
os._exit(143)
"""


def test_a_stopped_release_leaves_no_semaphore_and_does_not_wait_for_its_resource_tracker():
    proc = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 143, proc.stderr
    (name, child), (seconds,) = (line.split() for line in proc.stdout.splitlines())
    assert float(seconds) < 6.0, proc.stdout  # nothing deaf to SIGTERM held the stop for its grace period
    assert not psutil.pid_exists(int(child)) or psutil.Process(int(child)).status() == psutil.STATUS_ZOMBIE
    sem = Path("/dev/shm") / f"sem.{name.lstrip('/')}"
    deadline = time.monotonic() + 10
    while sem.exists() and time.monotonic() < deadline:  # the tracker unlinks it once the release has exited
        time.sleep(0.1)
    assert not sem.exists(), f"{sem} left behind"
