"""quantgate.base.proctree.stop_tree on real processes, as a stop signal runs it in `quantgate release`: the
children are stopped, but the release's own multiprocessing resource tracker is left to unlink the semaphores it
tracks when the release exits. (It ignores SIGTERM: stopped with the others, it held the stop for the whole grace
period and was then SIGKILLed, leaving a `/dev/shm/sem.mp-*` file behind at every stopped release.)"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from quantgate.base.paths import REPO
from quantgate.base.procs import TAG_VAR, tagged

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


SPAWNING = r"""
import subprocess, sys, threading, time
from quantgate.base import procs, proctree
from quantgate.release import stopping

proctree.GRACE_S = 1.0


def spawn_forever():  # a flow step that keeps starting children (servers) while the stop signal arrives
    while True:
        try:
            # deaf to SIGTERM, as a server that takes seconds to stop: its guard's sweep SIGKILLs it after 5 s
            subprocess.Popen(procs.guarded(["sh", "-c", "trap '' TERM; exec sleep 300"], grace_s=5.0),
                             start_new_session=True)
        except Exception as exc:
            print("refused:", exc, file=sys.stderr, flush=True)
            return
        time.sleep(0.02)  # about 30 guarded children a second: enough to be starting one when the signal comes


with stopping.on_stop_signals(stopping.STOP_SIGNALS):
    worker = threading.Thread(target=spawn_forever, daemon=True)
    worker.start()
    print("ready", flush=True)
    while worker.is_alive():  # as run_flow waits for the flow's thread: the handler runs in this thread meanwhile
        worker.join(0.5)
"""


def test_no_child_starts_after_a_stop_signal_so_none_outlives_the_process():
    """A thread that keeps starting guarded children while SIGTERM arrives (as a flow step starting a
    server does): every child is gone the moment the process has exited. Before, a child started after the stop's
    last look at the tree lived on for its guard's grace period (5 s here), and a release's SIGTERM test once found
    a vLLM server and its guards alive after the exit."""
    tag = secrets.token_hex(6)
    proc = subprocess.Popen([sys.executable, "-c", SPAWNING], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), TAG_VAR: tag})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # children starting all along (about 30)
        started = len(tagged(tag))
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        left = tagged(tag)  # at once: not after the guards' grace period
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert started > 0 and left == [], f"of {started} children started, alive after the process exited: {left}"
    assert "not started: sh" in err and "Traceback" not in err, err[-2000:]  # refused, quietly
