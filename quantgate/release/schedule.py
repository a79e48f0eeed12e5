"""Which variant runs where and when (adapter): the release's device slots, handed out one job at a time.

The flow submits every job at once (the baseline's serve-and-measure, each scheme's quantization, each candidate's
serve-and-measure) to Prefect's thread-pool task runner; each job then takes a slot from the release's SlotPool
for as long as it runs, so at most `width` jobs compute at once and never on the same devices or cores:
  - the width is quantgate.plan.slots.release_width: one slot per variant of the release up to the plan's
    replicas; on a CPU only when splitting its cores was measured to pay (quant_recipes/planner.yaml `slots`);
  - every slot of a release has the same size, so the results cache (keyed by slot size, not place) and the
    candidate/baseline speed ratios compare like with like;
  - on a CPU a quantization is pinned to its slot's cores (the child inherits the thread's affinity), so it runs
    beside the baseline's server instead of on top of it.
A candidate scores the baseline's answers for fidelity; it measures everything else first and then waits for
those answers (`wait_for_reference`).
A slot that falls free while no job waits for one, and none is announced (submitted, still to take its slot), is
lent to a variant being measured: it starts one more server of itself there and hands it some of its steps
(quantgate.release.replicas). So a lone candidate uses the whole machine, and the baseline, the longest job, takes
over the slot of a candidate that finished before it.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Set
from contextlib import contextmanager
from pathlib import Path
from typing import cast

from quantgate.base.errors import QuantgateError
from quantgate.evals.run import is_scored
from quantgate.plan.build import build_plan, load_planner_policy
from quantgate.plan.slots import Slot, release_width, slots
from quantgate.spec.schema import ReleaseSpec

Log = Callable[[str], None]
BASELINE, QUANTIZE, CANDIDATE = 0, 1, 2  # who gets a freed slot first: the baseline's answers are everyone's reference


class SlotPool:
    """Thread-safe: `with pool.take("baseline") as slot:` blocks until a slot is free. No slots (a plan whose
    replica spans nodes): one job at a time, each getting None (the plan's own placement)."""

    def __init__(self, free: list[Slot], log: Log = print, kind: str = "cpu"):
        self.slots = list(free)
        self.kind = kind
        self._free: list[Slot | None] = list(free) or [None]
        self._cond = threading.Condition()
        self._waiting: list[tuple[int, int]] = []
        self._tickets = itertools.count()
        self._log = log
        self._announced: set[str] = set()  # jobs submitted that have not taken their slot yet

    @property
    def width(self) -> int:
        return max(1, len(self.slots))

    @property
    def sample(self) -> Slot | None:
        """A slot of the release's size (for cache keys computed before any job runs)."""
        return self.slots[0] if self.slots else None

    def take_for(self, job: str, rank: int, endpoint: bool):
        """A slot for a variant's job; none for an endpoint's (it computes elsewhere: nothing to place here)."""
        return _no_slot() if endpoint else self.take(job, rank)

    @contextmanager
    def take_for_quantize(self, job: str, then: str | None = None) -> Iterator[Slot | None]:
        """A CPU slot for a quantization (it computes on the cores); on GPUs none: llmcompressor places itself, and
        a serving slot is not held for it. A free slot that nobody but `then` (the server waiting for this
        quantization) waits for or is announced to need is borrowed too: the slot handed out covers both's cores."""
        if self.kind != "cpu":
            yield None
            return
        with self.take(job, rank=QUANTIZE) as slot:
            extra = self.borrow(ignoring={then}) if slot is not None else None
            try:
                yield slot if extra is None else merged(cast(Slot, slot), extra)  # extra: borrowed only with a slot
            finally:
                if extra is not None:
                    self.give_back(extra)

    @contextmanager
    def take(self, job: str, rank: int = 0) -> Iterator[Slot | None]:
        """The first free slot, once no waiting job has a lower `rank` (then the earlier arrival) than this one."""
        with self._cond:
            me = (rank, next(self._tickets))
            self._waiting.append(me)
            while not self._free or min(self._waiting) != me:
                self._cond.wait()
            self._waiting.remove(me)
            self._announced.discard(job)
            slot = self._free.pop(0)
            self._cond.notify_all()  # the next in line may find another free slot
        self._log(f"{job}: running on {slot.label if slot else 'the planned devices'}")
        try:
            yield slot
        finally:
            self.give_back(slot)

    def announce(self, *jobs: str) -> None:
        """Jobs submitted that will `take` a slot later (a candidate waiting for its quantization): until they have
        taken one, no slot is lent to a variant's extra replica, which would hold it up."""
        with self._cond:
            self._announced.update(jobs)

    def withdraw(self, *jobs: str) -> None:
        """Announced jobs that will not come (their quantization failed)."""
        with self._cond:
            self._announced.difference_update(jobs)

    def borrow(self, ignoring: Set[str | None] = frozenset()) -> Slot | None:
        """A free slot for a running variant's extra replica (quantgate.release.replicas), only when no job is
        waiting for a slot or announced (but those `ignoring`); None otherwise. Return it with `give_back`."""
        with self._cond:
            if self._waiting or self._announced - set(ignoring) or not self.slots:
                return None
            free = [s for s in self._free if s is not None]
            if not free:
                return None
            self._free.remove(free[0])
            return free[0]

    def give_back(self, slot: Slot | None) -> None:
        with self._cond:
            self._free.append(slot)
            self._free.sort(key=lambda s: -1 if s is None else s.index)
            self._cond.notify_all()


def merged(slot: Slot, extra: Slot) -> Slot:
    """One CPU slot over the cores of both (a quantization that borrowed a free slot)."""
    return slot.model_copy(update={"devices": sorted({*slot.devices, *extra.devices}),
                                   "env": {**slot.env, "VLLM_CPU_OMP_THREADS_BIND": ",".join(
                                       str(c) for c in sorted({*slot.devices, *extra.devices}))}})


def variant_count(spec: ReleaseSpec) -> int:
    """Variants a release serves side by side: the baseline and every candidate (a ladder: one rung at a time).
    An endpoint takes no slot (quantgate serves nothing for it): it is not counted."""
    local = len(spec.schemes) + sum(1 for c in spec.candidates if c.checkpoint is not None)
    return max(1, (spec.baseline is None) + (min(1, local) if spec.ladder else local))


def release_pool(spec: ReleaseSpec, model_dir: Path, log: Log = print) -> SlotPool:
    """The release's slots, from the baseline's plan (the largest variant: it fits where every candidate does)."""
    s = spec.serving
    plan = build_plan(model_dir, spec.hardware, context=spec.context, concurrency=spec.concurrency, gpus=spec.gpus,
                      nodes=spec.nodes, replicas=s.replicas, nodes_share_host=s.local_nodes or None,
                      **s.plan_options(candidate=False))  # the baseline's knobs, as its server gets them
    rule = load_planner_policy().slots
    width = release_width(plan.kind, variant_count(spec), plan.replicas, rule)
    free = slots(plan, width)
    why = ("one slot per variant" if width > 1 else
           "one variant at a time on every core (splitting the cores was not measured to pay)" if plan.kind == "cpu"
           else "one variant at a time")
    log(f"slots: {', '.join(x.label for x in free) or 'none (multi-node replica)'}: {why}")
    return SlotPool(free, log, kind=plan.kind)


@contextmanager
def _no_slot() -> Iterator[None]:
    yield None


@contextmanager
def pinned(slot: Slot | None) -> Iterator[None]:
    """Pin the calling thread (and so the processes it starts) to a CPU slot's cores for the block."""
    if slot is None or slot.kind != "cpu" or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(slot.devices) & before or before)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def answers_final(folder: Path) -> bool:
    """An eval run's answers are final for this release: complete, or partial (a few failed requests, which the
    gate counts and the next release asks again; waiting for "complete" there would never end)."""
    return is_scored(folder)


def reference_final(reference: Mapping[str, Path], failed: Callable[[], bool],
                    final: Callable[[Path], bool] = answers_final) -> bool:
    """Whether every baseline folder in `reference` is final now; raises when the baseline's job failed first."""
    if all(final(d) for d in reference.values()):
        return True
    if failed():
        raise QuantgateError("the baseline's measurement failed, so there are no baseline answers to score",
                             where="release flow", fix="see the baseline's error above; fix it and re-run")
    return False


def wait_for_reference(reference: Mapping[str, Path], failed: Callable[[], bool], log: Log = print,
                       poll_s: float = 2.0, final: Callable[[Path], bool] = answers_final) -> None:
    """Block until every baseline folder in `reference` (what it is -> folder) is final; raise when the baseline's
    job failed."""
    said = False
    while not reference_final(reference, failed, final):
        if not said:
            log(f"waiting for the baseline's {', '.join(reference)} (fidelity scores them)")
            said = True
        time.sleep(poll_s)


def preload_libraries() -> None:
    """Import transformers and datasets in the calling thread before jobs run in threads. Their first import is
    not thread-safe: with the baseline's parity importing transformers while a candidate's eval loader imported
    datasets, datasets once found transformers half-initialised ("no attribute 'PreTrainedTokenizerBase'")."""
    import datasets  # noqa: F401  (heavy optional dependencies: imported here, once, on purpose)
    import transformers

    _ = transformers.PreTrainedTokenizerBase  # resolve the lazy attribute now, in this thread
