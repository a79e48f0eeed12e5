"""The benchmark client's process (adapter): quantgate/serving/bench_driver.py in the serving environment, kept for
as many probes as its owner hands it (a speed window's), so vLLM's import is paid once, not per probe.

    with BenchClient() as client:
        crash = client.run(runs, out, api_key, python, timeout_s, watch)   # '' or what went wrong
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from quantgate.base.fileio import child_env
from quantgate.base.procs import guarded
from quantgate.serving.env import serve_python

DRIVER = Path(__file__).parents[1] / "serving" / "bench_driver.py"
POLL_S = 0.2  # how often a running probe is watched (results so far, the next run's go or skip)


class BenchClient:
    """The benchmark client's process (quantgate/serving/bench_driver.py --jobs), kept for many probes: vLLM's
    import, about 12 s of each probe's 15 s here, is paid once per window instead of once per probe. A probe hands it
    a job (its run list, log and done file; the server's key through the pipe) and watches it as it would its own
    process. A client that times out or dies is killed and the next job starts a fresh one. One process per serving
    environment (`python`), started where the first job is asked for: it inherits that thread's cores (a window's
    slot). Use it as a context manager; run_probe without one makes a client for its own probe only."""

    def __init__(self) -> None:
        self._procs: dict[str, subprocess.Popen] = {}

    def __enter__(self) -> BenchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for proc in self._procs.values():
            _stop(proc)
        self._procs.clear()

    def run(self, runs: list[dict], out: Path, api_key: str | None, python: Path | None, timeout_s: float,
            watch: Callable[[], None] | None = None) -> str:
        """Run one probe's benchmark runs, calling `watch` every POLL_S while they run; returns '' or what went wrong
        with the tail of the log."""
        spec, log, done = out / "raw" / "bench_spec.json", out / "bench.log", out / "raw" / "bench.done"
        spec.write_text(json.dumps({"runs": runs}, indent=1))
        log.write_bytes(b"")
        done.unlink(missing_ok=True)
        python_ = serve_python(python)
        proc = self._process(python_, log)
        job = {"spec": str(spec), "log": str(log), "done": str(done), "api_key": api_key}
        try:
            assert proc.stdin is not None
            proc.stdin.write((json.dumps(job) + "\n").encode())
            proc.stdin.flush()
        except OSError:  # it died between jobs: the check below says how
            pass
        deadline = time.monotonic() + timeout_s
        while not done.is_file() and proc.poll() is None:
            if time.monotonic() > deadline:
                self._drop(python_)
                return f"benchmark client timed out after {timeout_s:.0f} s (see {log})"
            if watch is not None:
                watch()
            time.sleep(POLL_S)
        if watch is not None:
            watch()
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-4:])
        if not done.is_file():
            self._drop(python_)
            return f"benchmark client exited with code {proc.returncode}: {tail}"
        said = done.read_text().strip()
        return "" if said == "0" else f"benchmark client failed: {said}: {tail}"

    def _process(self, python: Path, log: Path) -> subprocess.Popen:
        """The client for `python`, started if there is none (what it says before its first job goes to `log`)."""
        proc = self._procs.get(str(python))
        if proc is None or proc.poll() is not None:  # under the process guard: it dies with us, even if SIGKILLed
            with open(log, "ab") as fh:
                proc = subprocess.Popen(guarded([str(python), str(DRIVER), "--jobs"], python=python),
                                        stdin=subprocess.PIPE, stdout=fh, stderr=subprocess.STDOUT, env=child_env({}),
                                        start_new_session=True)
            self._procs[str(python)] = proc
        return proc

    def _drop(self, python: Path) -> None:
        proc = self._procs.pop(str(python), None)
        if proc is not None:
            proc.kill()
            proc.wait()


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """EOF on its stdin ends the client; one that does not end within `grace_s` is killed."""
    try:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=grace_s)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()
