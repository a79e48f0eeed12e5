"""Progress of long loops (eval, recall, judge, fidelity, perf): counts, rate and ETA, one reporter for all.

The caller names the work; the loop counts it:

    with progress.reporting("baseline: eval default", log=logger.info):   # e.g. a release step
        ... http.for_each(items, handle, ...)                             # counts every finished item

Inside a `reporting` block every loop that reports (quantgate.base.http.for_each, and `watch` for work done by
another process) shows "LABEL: 120/300 (40%), 3.1/s, ETA 58 s":
  - as a line through `log` at most every `every_s` seconds and once at the end (Prefect's run log, CI logs);
  - as a rich progress bar when stderr is a terminal (several loops at once share one display).
Outside a `reporting` block nothing is shown, so commands with their own display keep it. The block is a context
variable: it follows the code into asyncio tasks, and each thread (each concurrent variant) has its own.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

Log = Callable[[str], None]


class Advance(Protocol):
    """What `loop` yields: advance(n=1) counts n more finished items."""
    def __call__(self, n: int = 1) -> None: ...


@dataclass
class _Sink:
    label: str
    log: Log | None
    every_s: float


_SINK: ContextVar[_Sink | None] = ContextVar("quantgate_progress", default=None)
_BAR_LOCK = threading.Lock()
_BAR: dict[str, Any] = {"progress": None, "tasks": 0}


def line(label: str, done: int, total: int, elapsed_s: float, unit: str = "") -> str:
    """'LABEL: 120/300 (40%), 3.1/s, ETA 58 s' (pure: the text every display shows); with a unit (work counted in
    tokens, say) 'LABEL: 41200/87300 tokens (47%), 152.30 tokens/s, ETA 5.0 min'."""
    rate = done / elapsed_s if elapsed_s > 0 and done else 0.0
    share = f" ({100 * done / total:.0f}%)" if total else ""
    if rate and total > done:
        eta = f", ETA {_duration((total - done) / rate)}"
    else:
        eta = ", done" if total and done >= total else ""
    of = f" {unit}" if unit else ""
    return f"{label}: {done}/{total}{of}{share}, {rate:.2f}{of}/s{eta}"


def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


@dataclass
class Counter:
    """One loop's count under a sink; `advance` is safe from several threads and asyncio tasks."""
    sink: _Sink
    total: int
    unit: str = ""
    start: float = field(default_factory=time.monotonic)
    done: int = 0
    last_said: float = field(default_factory=time.monotonic)
    task: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def advance(self, n: int = 1) -> None:
        with self.lock:
            self.done += n
            now = time.monotonic()
            say = self.sink.log is not None and now - self.last_said >= self.sink.every_s and self.done < self.total
            if say:
                self.last_said = now
        if say:
            assert self.sink.log is not None  # `say` holds only with a log
            self.sink.log(line(self.sink.label, self.done, self.total, now - self.start, self.unit))
        if self.task is not None:
            elapsed = now - self.start
            _BAR["progress"].update(self.task, completed=self.done, rate=f"{self.done / elapsed:.2f}/s" if elapsed else "")


@contextmanager
def reporting(label: str, log: Log | None = None, every_s: float = 30.0) -> Iterator[None]:
    """Within the block, loops report their progress under `label`: lines through `log`, a bar on a terminal."""
    token = _SINK.set(_Sink(label, log, every_s))
    try:
        yield
    finally:
        _SINK.reset(token)


def _bar_add(label: str, total: int) -> int | None:
    if not sys.stderr.isatty():
        return None
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn,
                               TimeRemainingColumn)  # rich: only for a terminal
    with _BAR_LOCK:
        if _BAR["progress"] is None:
            bar = _BAR["progress"] = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                              TaskProgressColumn(), TextColumn("{task.fields[rate]}"),
                                              TextColumn("ETA"), TimeRemainingColumn(), transient=True)
            bar.start()
        _BAR["tasks"] += 1
        return _BAR["progress"].add_task(label, total=total, rate="")


def _bar_remove(task: int) -> None:
    with _BAR_LOCK:
        _BAR["progress"].remove_task(task)
        _BAR["tasks"] -= 1
        if _BAR["tasks"] == 0:
            _BAR["progress"].stop()
            _BAR["progress"] = None


@contextmanager
def loop(total: int, unit: str = "") -> Iterator[Advance]:
    """A loop of `total` items (or units of work, named by `unit`): yields advance(n=1). A no-op outside a
    `reporting` block or for an empty loop."""
    sink = _SINK.get()
    if sink is None or total <= 0:
        yield lambda n=1: None
        return
    counter = Counter(sink, total, unit)
    counter.task = _bar_add(sink.label, total)
    try:
        yield counter.advance
    finally:
        if counter.task is not None:
            _bar_remove(counter.task)
        if sink.log is not None:
            sink.log(line(sink.label, counter.done, total, time.monotonic() - counter.start, unit))


@contextmanager
def watch(total: int, count: Callable[[], int], poll_s: float = 5.0) -> Iterator[None]:
    """Progress of work another process does (e.g. `vllm bench serve` runs): `count()` finished items, polled."""
    stop = threading.Event()
    with loop(total) as advance:
        counter_done = [0]

        def poll() -> None:
            while not stop.wait(poll_s):
                n = min(total, count())
                if n > counter_done[0]:
                    advance(n - counter_done[0])
                    counter_done[0] = n

        t = threading.Thread(target=poll, daemon=True, name="progress-watch")
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join()
            n = min(total, count())
            if n > counter_done[0]:
                advance(n - counter_done[0])
