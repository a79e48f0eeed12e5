"""Progress of long loops (eval, recall, judge, fidelity, perf): counts, rate and ETA, one reporter for all.

The caller names the work; the loop counts it:

    with progress.reporting("baseline: eval default", log=logger.info):   # e.g. a release step
        ... http.for_each(items, handle, ...)                             # counts every finished item

Inside a `reporting` block every loop that reports (quantgate.base.http.for_each, and `watch` for work done by
another process) shows "LABEL: 120/300 (40%), 3.1/s, ETA 58 s":
  - as a line through `log` at most every `every_s` seconds and once at the end (Prefect's run log, CI logs);
  - as a rich progress bar when stderr is a terminal (several loops at once share one display).
A request loop counts each item from when it is sent (`begin`) to its answer (`end`), in the unit of its cost
(prompt + sampled tokens, say), and its rate and ETA count half of the work in flight as done (Counter).
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
from typing import TYPE_CHECKING, Protocol, cast

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

Log = Callable[[str], None]


class Advance(Protocol):
    """What `loop` yields: advance(n=1) counts n more finished items; begin(cost) -> handle and end(handle) count
    an item from when it is sent to when it is finished, so that work in flight counts towards the rate and ETA."""
    def __call__(self, n: int = 1) -> None: ...

    def begin(self, cost: int) -> int: ...

    def end(self, handle: int) -> None: ...


@dataclass
class _Sink:
    label: str
    log: Log | None
    every_s: float


_SINK: ContextVar[_Sink | None] = ContextVar("quantgate_progress", default=None)
_BAR_LOCK = threading.Lock()


@dataclass
class _Bar:
    """The terminal's one progress bar (rich's, while any task shows) and how many tasks it shows."""
    progress: Progress | None = None
    tasks: int = 0


_BAR = _Bar()


def line(label: str, done: int, total: int, elapsed_s: float, unit: str = "", in_flight: float = 0.0,
         rate: float | None = None) -> str:
    """'LABEL: 120/300 (40%), 3.1/s, ETA 58 s' (pure: the text every display shows); with a unit (work counted in
    tokens, say) 'LABEL: 41200/87300 tokens (47%), 152.30 tokens/s, ETA 5.0 min'. `in_flight`: the work credited to
    items not finished yet (requests sent, not answered), said and counted as done for the ETA; `rate`: the rate
    to show and divide by (default: finished work over elapsed time)."""
    if rate is None:
        rate = done / elapsed_s if elapsed_s > 0 and done else 0.0
    ahead = min(total, done + in_flight) if total else done
    share = f" ({100 * done / total:.0f}%)" if total else ""
    of = f" {unit}" if unit else ""
    flight = f", ~{in_flight:.0f} more in flight" if in_flight >= 1 and done < total else ""
    if rate and total > ahead:
        eta = f", ETA {_duration((total - ahead) / rate)}"
    else:
        eta = ", done" if total and done >= total else ""
    return f"{label}: {done}/{total}{of}{share}{flight}, {rate:.2f}{of}/s{eta}"


def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


@dataclass
class Counter:
    """One loop's count under a sink; `advance`, `begin` and `end` are safe from several threads and asyncio tasks.

    Items counted with `begin` and `end` (the shared request loop, quantgate.base.http.for_each) are work in flight
    between the two, and the rate and ETA count half of it as done: a request in flight is on average half served.
    Finished work alone gave "ETA 1607.4 min" for a job done 10 minutes later, when 64 haystack prompts were in
    flight and one short answer was back. tests/test_progress.py checks the first ETA against a simulated server
    that prefills long prompts first and decodes every sequence a token a step."""
    sink: _Sink
    total: int
    unit: str = ""
    clock: Callable[[], float] = time.monotonic
    done: int = 0
    task: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    flight: dict[int, int] = field(default_factory=dict)  # handle -> cost of an item in flight
    handles: int = 0

    def __post_init__(self) -> None:
        self.start = self.last_said = self.clock()

    def advance(self, n: int = 1) -> None:
        """`n` more units finished (of items not counted with begin and end)."""
        with self.lock:
            self.done += n
        self._show()

    __call__ = advance

    def begin(self, cost: int) -> int:
        """An item of `cost` units is in flight from now: its handle for `end`."""
        with self.lock:
            self.handles += 1
            self.flight[self.handles] = cost
            return self.handles

    def end(self, handle: int) -> None:
        """The item is finished: its cost counts as done."""
        with self.lock:
            self.done += self.flight.pop(handle)
        self._show()

    def text(self) -> str:
        """The progress line now, half of the work in flight counted as done for the rate and ETA."""
        now = self.clock()
        with self.lock:
            credit, done = sum(self.flight.values()) / 2, self.done
        elapsed = now - self.start
        rate = (done + credit) / elapsed if elapsed > 0 else 0.0
        return line(self.sink.label, done, self.total, elapsed, self.unit, credit, rate)

    def _show(self) -> None:
        now = self.clock()
        with self.lock:
            say = self.sink.log is not None and now - self.last_said >= self.sink.every_s and self.done < self.total
            if say:
                self.last_said = now
        if say:
            assert self.sink.log is not None  # `say` holds only with a log
            self.sink.log(self.text())
        if self.task is not None:
            elapsed = now - self.start
            assert _BAR.progress is not None  # a task is shown on the bar
            _BAR.progress.update(cast("TaskID", self.task), completed=self.done,
                                 rate=f"{self.done / elapsed:.2f}/s" if elapsed else "")


class _Quiet:
    """What `loop` yields outside a `reporting` block: counts nothing."""
    def __call__(self, n: int = 1) -> None:
        return None

    def begin(self, cost: int) -> int:
        return 0

    def end(self, handle: int) -> None:
        return None


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
        if _BAR.progress is None:
            bar = _BAR.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                              TaskProgressColumn(), TextColumn("{task.fields[rate]}"),
                                              TextColumn("ETA"), TimeRemainingColumn(), transient=True)
            bar.start()
        _BAR.tasks += 1
        return _BAR.progress.add_task(label, total=total, rate="")


def _bar_remove(task: int) -> None:
    with _BAR_LOCK:
        assert _BAR.progress is not None  # the task was added to it
        _BAR.progress.remove_task(cast("TaskID", task))
        _BAR.tasks -= 1
        if _BAR.tasks == 0:
            _BAR.progress.stop()
            _BAR.progress = None


@contextmanager
def loop(total: int, unit: str = "") -> Iterator[Advance]:
    """A loop of `total` items (or units of work, named by `unit`): yields advance(n=1). A no-op outside a
    `reporting` block or for an empty loop."""
    sink = _SINK.get()
    if sink is None or total <= 0:
        yield _Quiet()
        return
    counter = Counter(sink, total, unit)
    counter.task = _bar_add(sink.label, total)
    try:
        yield counter
    finally:
        if counter.task is not None:
            _bar_remove(counter.task)
        if sink.log is not None:
            sink.log(counter.text())


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
