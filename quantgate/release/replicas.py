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
    wanted: Callable[[], bool] | None = None  # False: the step will skip itself, so no extra server starts for it


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
        """Steps not handed out yet that will do work (those that will skip themselves not counted)."""
        with self.lock:
            return 0 if self.errors else sum(1 for s in self.todo if s.wanted is None or s.wanted())

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


@dataclass(frozen=True)
class Lending:
    """Extra servers of one variant on lent slots: `lender` lends free slots, `start` starts a server of the variant
    on one (a context manager), `pin` pins the replica's thread to it first; one more replica while at least
    `grow_at` steps wait, looked at every `poll_s` seconds."""
    lender: Lender
    start: Callable[[Slot], AbstractContextManager]
    pin: Callable[[Slot], AbstractContextManager] | None = None
    grow_at: int = 2
    poll_s: float = 2.0


class StepRunner:
    """`with StepRunner(steps, ...) as runner:` starts lending at once, so extra servers start beside the variant's
    own; `runner.work(srv)` (once its own server is up and checked) opens the hand-out, runs steps on `srv` until
    none is left, waits for the extra servers and raises the first step failure. Leaving the block early (a
    failure before `work`) stops the lending and lets the extra servers go. `servers`: how many took part."""

    def __init__(self, steps: list[Step], *, name: str, lending: Lending | None = None, log: Log = print):
        self.todo, self.name, self.lending, self.log = _Steps(steps), name, lending, log
        self.limit = len(steps)
        self.extras: list[threading.Thread] = []
        self.open, self.done = threading.Event(), threading.Event()
        self.grower = threading.Thread(target=self._grow, name=f"{name}-grow", daemon=True)

    @property
    def servers(self) -> int:
        return 1 + len(self.extras)

    def __enter__(self) -> StepRunner:
        if self.lending is not None:
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
        lend = self.lending
        assert lend is not None  # the grower runs only with lending (__enter__)
        while not self.done.is_set():
            if (self.todo.waiting() >= lend.grow_at and len(self.extras) < self.limit
                    and (slot := lend.lender.borrow()) is not None):
                self.log(f"{self.name}: {self.todo.waiting()} steps waiting; one more server on the free {slot.label}")
                t = threading.Thread(target=self._replica, args=(slot,), name=f"{self.name}-replica-{slot.index}",
                                     daemon=True)
                self.extras.append(t)
                t.start()
            self.done.wait(lend.poll_s)

    def _replica(self, slot: Slot) -> None:
        lend = self.lending
        assert lend is not None  # started by the grower only (_grow)
        try:
            with lend.pin(slot) if lend.pin else _nothing(), lend.start(slot) as srv:
                while not (self.open.wait(lend.poll_s) or self.done.is_set()):
                    pass  # the variant's own server is not checked yet: no step before it is
                if self.open.is_set():
                    self.todo.work(srv, f"{self.name} (replica on {slot.label})", self.log, extra=True)
        except BaseException as exc:  # noqa: BLE001 - an extra server that cannot start or stop: the others go on
            self.log(f"{self.name}: the extra server on {slot.label} failed ({exc}); the other servers take its steps")
        finally:
            lend.lender.give_back(slot)


def run_steps(steps: list[Step], first: Any, *, name: str, lending: Lending | None = None, log: Log = print) -> int:
    """`steps` on `first` (a running server) and on extra servers started on lent slots; returns how many servers
    took part (StepRunner, for a caller whose own server is already up)."""
    with StepRunner(steps, name=name, lending=lending, log=log) as runner:
        runner.work(first)
    return runner.servers


class _nothing(AbstractContextManager):
    def __exit__(self, *exc) -> None:
        return None
