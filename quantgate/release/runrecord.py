"""Run folders and step manifests: what ran, on which inputs, with which code and libraries, for how long.

results/runs/<run-id>/
    run.json                 spec (as loaded), git commit + dirty flag, package versions, start/end
    <step>/manifest.json     inputs' hashes, outputs, seconds (one per step)
    timings.json             wall seconds of every flow step, in order (`timed`; timings.json.lock guards it)
    status.json              completed, failed or interrupted, with the failing step and its root cause
                             (`recording_status`; the model is quantgate.base.runstatus)
    status.json.lock         held by the release's process until status.json is written: a run with neither
                             status.json nor a live holder of this lock was killed (base.runstatus.owner_gone)
"""

from __future__ import annotations

import datetime as dt
import re
import secrets
import subprocess
import threading
import time
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any, Literal, TypedDict
from collections.abc import Iterator, Mapping

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from quantgate.base.runfiles import MANIFEST, STATUS, TIMINGS
from quantgate.base.errors import QuantgateError, SettingError
from quantgate.base.fileio import lock, write_json
from quantgate.base.paths import REPO, results_dir
from quantgate.base.runinfo import GitState, RunRecord
from quantgate.base.runstatus import RunStatus, root_cause_in_log, root_cause_in_text
from quantgate.spec.schema import ReleaseSpec
from quantgate.release.stopping import on_stop, stopping
from quantgate.serving.env import serve_python, vllm_version

PACKAGES = ("quantgate", "llmcompressor", "compressed-tensors", "transformers", "torch", "prefect", "datasets", "evaluate")


RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
RUN_ID_MAX = 128


def check_run_id(run_id: str) -> str:
    """`run_id` when it is a plain folder name (letters, digits, '_', '.', '-'; first a letter or digit; at most
    128 characters); otherwise a SettingError of `run_id`. A run id never leaves results/runs: no '/', no '..', not absolute."""
    if not isinstance(run_id, str) or len(run_id) > RUN_ID_MAX or not RUN_ID.fullmatch(run_id):
        shown = repr(run_id) if not isinstance(run_id, str) or len(run_id) <= 80 else repr(run_id[:80] + "...")
        why = (f"longer than {RUN_ID_MAX} characters" if isinstance(run_id, str) and len(run_id) > RUN_ID_MAX
               else "not a plain folder name")
        raise SettingError(f"run id {shown} is {why}", setting="run_id",
                             fix="use letters, digits, '_', '.' and '-' only, starting with a letter or digit, at most "
                                 f"{RUN_ID_MAX} characters (e.g. demo-2024-06-01-a); or leave it out for a fresh one")
    return run_id


def new_run_id(name: str) -> str:
    """<name>-<UTC time to the second>Z-<8 random hex digits>: unique for releases started in the same second (two
    of 200 started in one second share an id with probability 5e-6; with the 6 digits of before, 1e-3)."""
    return f"{name}-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}-{secrets.token_hex(4)}"


def _taken(path: Path) -> QuantgateError:
    return QuantgateError("run folder exists already: it belongs to an earlier release and is not reused",
                          where=str(path), fix="choose another run id (`run_id`), or leave it out for a "
                                               "fresh <name>-<time>-<random> id")


def check_new_run_id(run_id: str | None) -> None:
    """Refuse, before any work, a run id that is no plain folder name or whose run folder exists already."""
    if run_id is not None and (results_dir() / "runs" / check_run_id(run_id)).exists():
        raise _taken(results_dir() / "runs" / run_id)


def run_dir(run_id: str) -> Path:
    """Create the run folder results/runs/<run_id> and return it. A run folder is never reused: one that exists
    already is refused (its files belong to another release)."""
    check_run_id(run_id)
    runs = results_dir() / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    path = runs / run_id
    try:
        path.mkdir()  # atomic: of two releases asking for one id, exactly one gets it
    except FileExistsError:
        raise _taken(path) from None
    return path


def git_state(repo: Path = REPO) -> GitState:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        return GitState(commit=git("rev-parse", "HEAD") or None,
                        dirty=bool(git("status", "--porcelain", "--untracked-files=no")))
    except (OSError, subprocess.SubprocessError):
        return GitState(commit=None, dirty=None)


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def run_record(spec: ReleaseSpec, spec_path: str | Path) -> RunRecord:
    """What <run>/run.json holds: the spec as loaded and its file, the code and package versions (the serving side's
    vLLM among them) and the ResolvedRelease."""
    python, vllm = _serving_side(spec)
    return RunRecord(spec_file=str(spec_path), spec=spec.model_dump(mode="json"), git=git_state(),
                     packages={**package_versions(), "vllm": vllm}, resolved=spec.resolved(python))


def _serving_side(spec: ReleaseSpec) -> tuple[Path | None, str | None]:
    """The serving interpreter and its vLLM version (a separate environment: not among this process's packages);
    None for what there is none of (a release of endpoints only may run without one)."""
    try:
        python = serve_python(spec.serving.python)
    except QuantgateError:
        return None, None
    try:
        return python, vllm_version(python)
    except QuantgateError:
        return python, None


@contextmanager
def step(run: Path, name: str, inputs: Mapping[str, object]) -> Iterator[dict[str, object]]:
    """Record one step: yields a dict for its outputs; writes <run>/<name>/manifest.json with timing and status."""
    outputs: dict[str, object] = {}
    record: dict[str, object] = {"step": name, "inputs": inputs, "outputs": outputs,
                                 "started": dt.datetime.now(dt.UTC).isoformat()}
    start = time.monotonic()
    try:
        yield outputs
        record["status"] = "ok"
    except BaseException as exc:
        record["status"] = "failed"
        record["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        record["seconds"] = round(time.monotonic() - start, 2)
        write_json(run / name / MANIFEST, record)


class Timing(BaseModel):
    """One flow step's row in <run>/timings.json. start/end are Unix times: steps run side by side on slots, so the
    overlaps and the critical path show. A key this version does not know (a newer writer's) is kept when a row is
    appended."""
    model_config = ConfigDict(extra="allow")

    step: str
    seconds: float
    status: Literal["ok", "failed", "stopped"]
    start: float
    end: float
    served: bool | None = None  # serve and measure: a server was started (False: every figure came from the cache)
    slot: str | None = None     # serve and measure: the device slot it was served on


class StepNotes(BaseModel):
    """What a step adds to its timing row while it runs (`timed` yields it): the fields it sets, None included, are
    written; a step that sets none has none in its row."""
    served: bool | None = None
    slot: str | None = None


_ROWS = TypeAdapter(list[Timing])


# run -> the steps in flight and when each began: a stop signal ends the process before their rows are written, so
# status.json names the step it cut short from here
_RUNNING: dict[Path, dict[str, float]] = {}
_RUNNING_LOCK = threading.Lock()


def running_steps(run: Path) -> list[str]:
    """The run's steps in flight in this process, the first begun first."""
    with _RUNNING_LOCK:
        steps = _RUNNING.get(run, {})
        return sorted(steps, key=steps.__getitem__)


@contextmanager
def timed(run: Path, name: str) -> Iterator[StepNotes]:
    """Append the step's Timing to <run>/timings.json when the block ends (also when it fails: status "failed", or
    "stopped" when a stop signal is stopping the release); while it runs it is one of `running_steps(run)`."""
    start, wall, notes = time.monotonic(), time.time(), StepNotes()
    status: Literal["ok", "failed", "stopped"] = "ok"
    with _RUNNING_LOCK:
        _RUNNING.setdefault(run, {})[name] = start
    try:
        yield notes
    except BaseException:
        status = "stopped" if stopping() else "failed"  # a stop signal took its server away: not its own failure
        raise
    finally:
        with _RUNNING_LOCK:
            _RUNNING.get(run, {}).pop(name, None)
        with lock(run / TIMINGS, what=f"timing {name}"):  # read, append, write: steps in parallel lose none
            rows = timings(run)
            rows.append(Timing(step=name, seconds=round(time.monotonic() - start, 1), status=status,
                               start=round(wall, 2), end=round(time.time(), 2), **notes.model_dump(exclude_unset=True)))
            write_json(run / TIMINGS, [r.model_dump(mode="json", exclude_unset=True) for r in rows])


def timings(run: Path) -> list[Timing]:
    """The run's step timings, in the order the steps ended; none when the file is missing or unreadable (a run
    stopped before its first step ended)."""
    try:
        return _ROWS.validate_json((run / TIMINGS).read_bytes())
    except (OSError, ValidationError):
        return []


def release_started(run: Path) -> float:
    """When the release began (Unix time): its first step's start (the model step ends in a second); now when no
    step has ended yet."""
    starts = [t.start for t in timings(run)]
    return min(starts) if starts else time.time()


_INTERRUPTS = ("KeyboardInterrupt", "SystemExit", "TerminationSignal", "Abort", "CancelledError", "Cancelled")


def write_status(run: Path, status: str, /, **fields: Any) -> RunStatus:
    """<run>/status.json (quantgate.base.runstatus.RunStatus)."""
    record = RunStatus(status=status, finished=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), **fields)
    write_json(run / STATUS, record.model_dump(mode="json", exclude_none=True))
    return record


class FailureFields(TypedDict, total=False):
    """status.json's fields of a release that raised (quantgate.base.runstatus.RunStatus)."""
    status: str
    step: str | None
    error: str
    root_cause: str | None
    log: str | None


def failure_fields(run: Path, exc: BaseException) -> FailureFields:
    """What status.json says of a release that raised `exc`: interrupted, or failed with the step (the first that
    failed in timings.json), the error, its root cause (the first exception in the failing server's log, else in
    the error's own text, else the exception it came from) and that log."""
    failed = sorted((r for r in timings(run) if r.status in ("failed", "stopped")), key=lambda r: r.start)
    if stopping() or any(t.__name__ in _INTERRUPTS for t in type(exc).__mro__):
        said = str(exc).strip()
        return {"status": "interrupted", "step": _cut_short(run),
                "error": f"{type(exc).__name__}: {said}" if said else type(exc).__name__}
    failed = [r for r in failed if r.status == "failed"]
    message = exc.message if isinstance(exc, QuantgateError) else str(exc)
    log = getattr(exc, "log_path", None)
    cause = root_cause_in_log(log) if log else None
    inner = exc.__cause__ or exc.__context__
    cause = cause or root_cause_in_text(message) or (f"{type(inner).__name__}: {inner}" if inner else None)
    return {"status": "failed", "step": failed[0].step if failed else None, "error": f"{type(exc).__name__}: "
            f"{message.splitlines()[0] if message else ''}", "root_cause": cause, "log": str(log) if log else None}


def _cut_short(run: Path) -> str | None:
    """The step(s) an interrupt cut short: those still in flight, else the first whose row says it stopped or
    failed (its block ended before the interrupt reached the release)."""
    if running := running_steps(run):
        return ", ".join(running)
    ended = sorted((r for r in timings(run) if r.status in ("failed", "stopped")), key=lambda r: r.start)
    return ended[0].step if ended else None


@contextmanager
def recording_status(run: Path) -> Iterator[dict[str, object]]:
    """<run>/status.json when the block ends: completed (with what the block put in the yielded dict, e.g. the
    decision), failed (failure_fields) or interrupted (with the step it cut short), also by a stop signal that ends
    the process before the block can (quantgate.release.stopping.on_stop). The block holds status.json's lock: a
    SIGKILL leaves no status, and the lock's free holder tells `quantgate runs` the run was interrupted."""
    done: dict[str, object] = {}

    def interrupted(sig: str) -> None:
        write_status(run, "interrupted", signal=sig, step=_cut_short(run))

    with lock(run / STATUS, timeout=None, what=f"the release of run {run.name}"):  # released once it is written
        with on_stop(interrupted):
            try:
                yield done
            except BaseException as exc:
                fields = failure_fields(run, exc)
                write_status(run, fields.pop("status"), **fields)
                raise
        write_status(run, "completed", **done)
