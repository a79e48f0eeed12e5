"""One variant's measurement spread over its replicas (adapter): its steps run on whichever of its servers is free.

A variant's measurement is a list of independent steps (each eval set, the recall grid, the perf probe, each
fidelity path; engine parity runs first, on its own). The variant starts on its own slot with one server. While at
least `grow_at` steps wait for a server and the release's pool lends a slot (a free one that no job of the release is
waiting for or has been announced to need: quantgate.release.schedule.SlotPool.borrow), it starts one more server of
the same variant there. Slots of a release are all the same size, so every replica computes what the first would
have, and results land in the same cache folders. A replica leaves when no step is left for it, and its slot goes back
to the pool at once. So a lone candidate uses every slot of the machine, and the baseline, the longest job of a
release, takes over the slot of a candidate that finished before it.

Each step runs in the thread of the server it was given; a replica's thread is pinned to its slot before its server
starts (quantgate.release.schedule.pinned), so the server's processes and the step's client work stay on that slot.
Extra servers start at once, beside the variant's own, and take steps only once the variant's own server is up
and its engine checked (StepRunner.work). The first failure stops the hand-out of steps; the others finish what they
run, and the failure is raised.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from quantgate.plan.slots import Slot

Log = Callable[[str], None]


class StepRun(Protocol):
    """A step's work, given a running server of the variant (what it returns is not used)."""
    def __call__(self, srv: Any, /) -> object: ...


@dataclass(frozen=True)
class Step:
    name: str
    run: StepRun   # given a running server of the variant


class Lender(Protocol):
    def borrow(self) -> Slot | None: ...
    def give_back(self, slot: Slot) -> None: ...


class _Steps:
    """The steps not handed out yet, and the first failure (thread-safe)."""

    def __init__(self, steps: list[Step]):
        self.todo = deque(steps)
        self.lock = threading.Lock()
        self.errors: list[BaseException] = []

    def next(self) -> Step | None:
        with self.lock:
            return None if self.errors or not self.todo else self.todo.popleft()

    def waiting(self) -> int:
        with self.lock:
            return 0 if self.errors else len(self.todo)

    def work(self, srv: Any, label: str, log: Log, extra: bool = False) -> None:
        """Run steps on `srv` until none is left (or one failed anywhere). On an extra replica whose server died,
        the step goes back to the others (the variant's own server is what the measurement stands or falls with)."""
        while (step := self.next()) is not None:
            log(f"{label}: {step.name}")
            try:
                step.run(srv)
            except BaseException as exc:  # noqa: BLE001 - raised by run_steps once every replica has stopped
                with self.lock:
                    if extra and not srv.alive():
                        self.todo.appendleft(step)
                        log(f"{label}: its server died during {step.name}; the step goes back to the others")
                    else:
                        self.errors.append(exc)
                return


class StepRunner:
    """`with StepRunner(steps, ...) as runner:` starts lending at once, so extra servers start beside the variant's
    own; `runner.work(srv)` (once its own server is up and checked) opens the hand-out, runs steps on `srv` until
    none is left, waits for the extra servers and raises the first step failure. Leaving the block early (a
    failure before `work`) stops the lending and lets the extra servers go. `servers`: how many took part."""

    def __init__(self, steps: list[Step], *, name: str, lender: Lender | None = None,
                 start: Callable[[Slot], AbstractContextManager] | None = None,
                 pin: Callable[[Slot], AbstractContextManager] | None = None, log: Log = print,
                 grow_at: int = 2, poll_s: float = 2.0):
        self.todo, self.name, self.lender, self.start, self.pin, self.log = _Steps(steps), name, lender, start, pin, log
        self.grow_at, self.poll_s, self.limit = grow_at, poll_s, len(steps)
        self.extras: list[threading.Thread] = []
        self.open, self.done = threading.Event(), threading.Event()
        self.grower = threading.Thread(target=self._grow, name=f"{name}-grow", daemon=True)

    @property
    def servers(self) -> int:
        return 1 + len(self.extras)

    def __enter__(self) -> StepRunner:
        if self.lender is not None and self.start is not None:
            self.grower.start()
        return self

    def work(self, first: Any) -> None:
        """Open the hand-out, run steps on `first` until none is left, wait for the extra servers' steps; raise the
        first step failure."""
        self.open.set()
        self.todo.work(first, self.name, self.log)
        self._finish()
        if self.todo.errors:
            raise self.todo.errors[0]

    def __exit__(self, *exc) -> None:
        self._finish()

    def _finish(self) -> None:
        self.done.set()
        if self.grower.is_alive():
            self.grower.join()
        for t in self.extras:
            t.join()

    def _grow(self) -> None:
        assert self.lender is not None  # the grower runs only with a lender and a start (__enter__)
        while not self.done.is_set():
            if (self.todo.waiting() >= self.grow_at and len(self.extras) < self.limit
                    and (slot := self.lender.borrow()) is not None):
                self.log(f"{self.name}: {self.todo.waiting()} steps waiting; one more server on the free {slot.label}")
                t = threading.Thread(target=self._replica, args=(slot,), name=f"{self.name}-replica-{slot.index}",
                                     daemon=True)
                self.extras.append(t)
                t.start()
            self.done.wait(self.poll_s)

    def _replica(self, slot: Slot) -> None:
        assert self.lender is not None and self.start is not None  # started by the grower only (_grow)
        try:
            with self.pin(slot) if self.pin else _nothing(), self.start(slot) as srv:
                while not (self.open.wait(self.poll_s) or self.done.is_set()):
                    pass  # the variant's own server is not checked yet: no step before it is
                if self.open.is_set():
                    self.todo.work(srv, f"{self.name} (replica on {slot.label})", self.log, extra=True)
        except BaseException as exc:  # noqa: BLE001 - an extra server that cannot start or stop: the others go on
            self.log(f"{self.name}: the extra server on {slot.label} failed ({exc}); the other servers take its steps")
        finally:
            self.lender.give_back(slot)


def run_steps(steps: list[Step], first: Any, *, name: str, lender: Lender | None = None,
              start: Callable[[Slot], AbstractContextManager] | None = None,
              pin: Callable[[Slot], AbstractContextManager] | None = None, log: Log = print,
              grow_at: int = 2, poll_s: float = 2.0) -> int:
    """`steps` on `first` (a running server) and on extra servers started on lent slots; returns how many servers
    took part (StepRunner, for a caller whose own server is already up)."""
    with StepRunner(steps, name=name, lender=lender, start=start, pin=pin, log=log, grow_at=grow_at,
                    poll_s=poll_s) as runner:
        runner.work(first)
    return runner.servers


class _nothing(AbstractContextManager):
    def __exit__(self, *exc) -> None:
        return None
