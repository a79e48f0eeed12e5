"""What a release process does when it ends or is told to stop: take every process it started with it, Prefect's
temporary API server last.

- `run_flow(flow, **parameters)`: how `quantgate release` and `python flows/release.py` run the release flow. It
  runs the flow in a worker thread (below), under `on_stop_signals` and `prefect_api_server`.
- `prefect_api_server()`: Prefect's embedded engine starts a temporary API server (`python -m uvicorn ...` on
  127.0.0.1, prefect.server.api.server.SubprocessASGIServer) when no PREFECT_API_URL is set. Prefect starts it as a
  plain child, so a SIGKILLed release left it orphaned under pid 1, still listening. This context starts that server
  itself, before the flow, from the main thread, with Prefect's own command and settings but under the process guard
  (quantgate.base.procs.guarded: it dies with this process, even a SIGKILLed one) in a session of its own (a Ctrl-C in
  the terminal reaches only quantgate, which stops it last). It registers it as the instance Prefect's clients ask
  for (`SubprocessASGIServer()`, keyed by port None: what Prefect's own test harness does), so the engine uses it
  and never starts a second one. At the end the log and event workers are drained, then the server is stopped and
  checked gone (no process of its group, its port free). With PREFECT_API_URL set (a deployment, a server of the
  user's) nothing is started.
- `on_stop_signals()`: Python's default for SIGTERM ends the process at once, running no `finally` and no `atexit`.
  The handler here signals the whole process tree below this process (quantgate.base.proctree, read from /proc:
  children, grandchildren, in any session or process group), SIGTERM first and SIGKILL after a grace period,
  Prefect's API server after all the others (the flow's threads report to it while their servers stop), and then
  exits with 128 + the signal number. From the signal on, no new child starts (quantgate.base.procs
  .close_children): a step of the flow still running in its thread would otherwise start a server after the stop's
  last look at the tree. The release's files need no other care: every evidence file is written atomically, and
  the next run resumes from what is cached.

Why a worker thread: while a flow runs in the main thread, Prefect's engine replaces the SIGTERM handler with its own
(prefect.utilities.engine.capture_sigterm), which raises in the main thread; unwinding the flow then waits for every
running task (the thread-pool task runner shuts down with wait=True), and only then re-sends the signal to the
handler it replaced. A SIGTERMed release kept measuring for minutes. Prefect installs no handler outside the main
thread, so there the flow runs, and the main thread keeps quantgate's handlers and waits for it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import MethodType
from typing import Any, cast

from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import child_env
from quantgate.base.procs import close_children, guarded, verify_gone
from quantgate.base.proctree import descendants, stop_tree

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)  # SIGINT: Ctrl-C; the exit code is 130 then
PREFECT_STARTUP_S = 180.0  # a busy 2-core machine migrates the server's SQLite in more than Prefect's default 20 s
DRAIN_S = 10.0  # the flow's last logs and events reach the API server before it is stopped

_prefect: Any = None  # the Prefect API server this process owns (prefect_api_server), stopped after all the rest
_stopping = threading.Event()  # set by the first stop signal: a second one (Ctrl-C twice) changes nothing
_at_stop: list[Callable[[str], None]] = []  # called with the signal's name once the tree is stopped (on_stop)


def stopping() -> bool:
    """Whether a stop signal has begun stopping this release: a step failing now failed because its server or
    child was stopped, not on its own."""
    return _stopping.is_set()


def _quiet() -> None:
    """Silence this process for its last seconds: the flow's threads fail as their servers go (and then find the API
    server gone); those errors are what stopping means, not news."""
    logging.disable(logging.CRITICAL)
    threading.excepthook = lambda args: None
    sys.unraisablehook = lambda unraisable: None


def _on_signal(signum: int, frame: object) -> None:
    if _stopping.is_set():  # the first signal's stop is under way (Python runs a handler again inside a handler)
        return
    _stopping.set()
    close_children()  # a step still running starts no server or child after the tree's last look
    name = signal.Signals(signum).name
    last = _prefect_pids()
    os.write(2, f"quantgate: {name}: stopping every process of the release"
                f"{', Prefect API server last' if last else ''}\n".encode())
    _quiet()
    stop_tree(last=last)
    for record in list(_at_stop):  # e.g. the run's status.json: interrupted
        try:
            record(name)
        except Exception:  # noqa: BLE001 - the process is going; a record it could not write is not news now
            pass
    os._exit(128 + signum)  # now: threads still measuring must not keep a stopped release alive


@contextmanager
def on_stop(record: Callable[[str], None]) -> Iterator[None]:
    """While the block runs, a stop signal calls `record(signal name)` after the tree is stopped, before exiting."""
    _at_stop.append(record)
    try:
        yield
    finally:
        _at_stop.remove(record)


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


# --- Prefect's temporary API server, owned by this process ---------------------------------------------------------

def _prefect_pids() -> list[int]:
    proc = getattr(_prefect, "server_process", None)
    return [proc.pid] if proc is not None else []


def _guarded_uvicorn(server: Any) -> subprocess.Popen:
    """Prefect's own command for its temporary API server (SubprocessASGIServer._run_uvicorn_command in Prefect 3.9:
    uvicorn on 127.0.0.1, the UI off, ephemeral mode), run under the process guard in a session of its own."""
    import prefect
    from prefect.settings import get_current_settings

    command = [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
               "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(server.port),
               "--log-level", "error", "--lifespan", "on"]
    env = child_env({"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
                     **get_current_settings().to_environment_variables(exclude_unset=True)}, keep=("PREFECT_*",))
    return subprocess.Popen(guarded(command, grace_s=5.0), env=env, stdin=subprocess.DEVNULL, start_new_session=True)


def _drain_prefect() -> None:
    """The flow's queued logs and events sent to the API server (as Prefect's own test harness does before it stops
    its server), so that none is sent to a server that is gone."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=DRAIN_S)
        except Exception:  # noqa: BLE001 - a worker that never started, or a failed send: nothing to wait for
            pass


def _cpu_ticks(pids: list[int]) -> int:
    """User + system CPU time of `pids`, in clock ticks (/proc/<pid>/stat)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            continue
    return total


def _wait_idle(pid: int, window_s: float = 0.5, busy: float = 0.05, timeout_s: float = DRAIN_S) -> None:
    """Wait until the tree of `pid` used under `busy` of a core over the last `window_s` (at most `timeout_s`): the
    API server has written the events it was sent to its database. Stopped while writing, it logs the cancelled
    write with a traceback. An idle server is never quite at 0: its background loops take a clock tick about every
    0.7 s, so "no tick for a second" waited the whole timeout (10 s at the end of every release)."""
    deadline, allowed = time.monotonic() + timeout_s, busy * window_s * os.sysconf("SC_CLK_TCK")
    before = _cpu_ticks([pid, *descendants(pid)])
    while time.monotonic() < deadline:
        time.sleep(window_s)
        now = _cpu_ticks([pid, *descendants(pid)])
        if now - before <= allowed:
            return
        before = now


@contextmanager
def prefect_api_server() -> Iterator[str | None]:
    """Prefect's temporary API server for the block, started now under the process guard and stopped at the end,
    after the flow's logs and events were sent (module docstring). Yields its API URL; None (and starts nothing)
    when PREFECT_API_URL names a server already."""
    global _prefect
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    if PREFECT_API_URL.value():
        yield None
        return
    server = SubprocessASGIServer()  # the instance every Prefect client of this process asks for
    if server.running or not callable(getattr(server, "_run_uvicorn_command", None)):
        raise QuantgateError("cannot start Prefect's temporary API server under quantgate's process guard: "
                             + ("it runs already" if server.running else "this Prefect has no "
                                "SubprocessASGIServer._run_uvicorn_command"),
                             fix="run a Prefect server (prefect server start) and set PREFECT_API_URL, or install the "
                                 "Prefect version of requirements/pipeline.lock")
    # Prefect's restart on a taken port too; patches the method of this one instance (mypy types methods read-only)
    server._run_uvicorn_command = MethodType(_guarded_uvicorn, server)  # type: ignore[method-assign]
    try:
        server.start(timeout=max(PREFECT_STARTUP_S, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()))
    except BaseException:
        server.stop()  # Prefect leaves a server that did not answer in time running until exit
        raise
    _prefect = server
    try:
        yield server.api_url
    finally:
        _drain_prefect()
        pgid, port = _prefect_pids(), server.port
        if pgid:
            _wait_idle(pgid[0])
        _prefect = None
        server.stop()
        SubprocessASGIServer._instances[None] = server  # a late client (atexit) restarts this one: guarded too
        # the port is set once start() returned (Prefect picks one when none was given)
        warning = verify_gone(f"Prefect API server {server.address}", pgid[0] if pgid else None, None, [cast(int, port)])
        if warning:
            logging.getLogger(__name__).warning(warning)


def local_server_defaults() -> None:
    """Settings of Prefect's temporary API server that every entry point wants, unless the environment sets them:
    no telemetry (nothing outside the machine is reached), and time for its first SQLite migration on a busy
    2-core machine (Prefect's default 20 s is not enough there)."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


def run_flow(flow: Callable[..., Any], /, **parameters: Any) -> Any:
    """`flow(**parameters)` in a worker thread, with Prefect's API server owned (prefect_api_server) and the stop
    signals handled in the main thread (on_stop_signals, STOP_SIGNALS); returns what the flow returns or raises what
    it raised. Call it from the main thread."""
    value: list[Any] = []  # what the flow returned, once it has
    error: list[BaseException] = []  # what it raised
    local_server_defaults()

    def target() -> None:
        try:
            value.append(flow(**parameters))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            error.append(exc)

    with on_stop_signals(STOP_SIGNALS), prefect_api_server():
        worker = threading.Thread(target=target, name="release-flow", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(0.5)  # signal handlers run in this thread meanwhile
    if error:
        raise error[0]
    return value[0] if value else None
