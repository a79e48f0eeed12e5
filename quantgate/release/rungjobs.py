"""The jobs of one rung of a release (the flow's helpers): which slots its variants will take, whether the
baseline's job failed, and the ladder's next rung once a candidate is REJECTed early by fidelity."""

from __future__ import annotations

from collections.abc import Callable

from prefect.futures import PrefectFuture

from quantgate.release import ladder, schedule
from quantgate.release.variants import RepairRung, Variant
from quantgate.spec.external import candidate_names
from quantgate.spec.schema import ReleaseSpec


def slot_jobs(pool: schedule.SlotPool, base: Variant | None, candidates: list) -> list[str]:
    """The pool jobs (names as they take their slots) that measuring these variants will start."""
    jobs = [base.name] if base is not None and base.endpoint is None else []
    for c in candidates:
        if isinstance(c, (str, RepairRung)):  # a scheme: its quantization (on a CPU slot only), then its server
            name = c if isinstance(c, str) else c.name
            jobs += [f"quantize {name}", name] if pool.kind == "cpu" else [name]
        elif c.endpoint is None:
            jobs.append(c.name)
    return jobs


def failed(job: PrefectFuture | None) -> Callable[[], bool]:
    """Whether a job ended without success, asked later (a future passed as a task argument would be waited for)."""
    return lambda: job is not None and job.state.is_final() and not job.state.is_completed()


def next_at_verdict(s: ReleaseSpec, job: PrefectFuture) -> str | None:
    """The rung after `job`'s candidate once it ended REJECTed early by fidelity; None otherwise (it failed, or its
    gate decides after the measurement: the ladder then goes on from the gate's decisions)."""
    job.wait()
    if not job.state.is_completed() or not (ev := job.result()).decided:
        return None
    return ladder.after(candidate_names(s), ev.variant.name)
