"""The probe's run plan and when to stop it (pure: no I/O): saturation, a broken SLO, the time budget.

Runs go repeat by repeat, each repeat over the levels in ascending order: repeat 0 sweeps the levels first, so
saturation is seen early, and a budget that runs out leaves every measured level with its first repeat.
With `sweep`, the first repeat of each level is compared with the level below: the sweep stops after a level
- whose SLO attainment is below the SLO's (latency broke the SLO), or
- whose output tokens/s rose by less than `saturation_gain` over the level below (throughput stopped rising),
and every run of a higher level is skipped. That level itself stays measured: it shows where the load breaks.
Independently, a run does not start once `budget_s` has passed since the probe started (the driver's start and
the warm-up included), nor when a run of its level took longer than the time left. The first two runs of the
lowest level always start, so that a probe gives at least one ratio with an interval (it may then end over budget,
which it records). The caller releases one run at a time (quantgate.perf.probe), so every decision is made before
the run it concerns starts.
"""

from __future__ import annotations

from quantgate.perf.models import SLO, RunResult

Key = tuple[int, int]  # (repeat, concurrency)
MIN_REPEATS = 2        # runs of the lowest level the budget never skips: one interval at least


def plan(levels: list[int], repeats: int) -> list[Key]:
    return [(r, c) for r in range(repeats) for c in sorted(set(levels))]


def meets_slo(run: RunResult, slo: SLO | None) -> bool | None:
    """True/False when the run was scored against an SLO; None without one."""
    if slo is None or run.slo_attainment is None:
        return None
    return run.slo_attainment >= slo.attainment


def stop_reason(prev: RunResult | None, cur: RunResult, slo: SLO | None, gain: float) -> str | None:
    """Why a sweep stops after `cur` (the first repeat of its level), given the level below; None: go on."""
    c = cur.concurrency
    if cur.error_rate > 0:
        return f"requests failed at concurrency {c} ({cur.error_rate:.0%})"
    if meets_slo(cur, slo) is False:
        return (f"the SLO broke at concurrency {c}: {cur.slo_attainment:.0%} of requests met it, "
                f"{slo.attainment:.0%} needed")  # type: ignore[union-attr]
    if prev is not None and prev.output_tok_s and cur.output_tok_s is not None \
            and cur.output_tok_s < gain * prev.output_tok_s:
        return (f"saturated at concurrency {c}: {cur.output_tok_s:.1f} output tokens/s, less than {gain:g}x the "
                f"{prev.output_tok_s:.1f} at concurrency {prev.concurrency}")
    return None


def sweep_stop(levels: list[int], done: dict[Key, RunResult], slo: SLO | None, gain: float) -> tuple[int, str] | None:
    """(level, reason) where the sweep stops, from the first repeat's results so far; None: not (yet)."""
    prev = None
    for c in sorted(set(levels)):
        cur = done.get((0, c))
        if cur is None:
            return None
        why = stop_reason(prev, cur, slo, gain)
        if why:
            return c, why
        prev = cur
    return None


def expected_seconds(done: dict[Key, RunResult]) -> dict[int, float]:
    """Per level, the longest run measured so far: what the next run of that level is expected to take."""
    out: dict[int, float] = {}
    for (_, c), r in done.items():
        if r.duration_s:
            out[c] = max(out.get(c, 0.0), r.duration_s)
    return out


def to_skip(order: list[Key], done: dict[Key, RunResult], *, sweep: bool, slo: SLO | None, gain: float,
            elapsed_s: float, budget_s: float | None) -> tuple[dict[Key, str], str | None]:
    """Runs of `order` not done that should not start, with the reason; and why the sweep stopped, if it did.
    A run is over budget when the budget is spent, or when a run of its level took longer than what is left."""
    stop = sweep_stop([c for _, c in order], done, slo, gain) if sweep else None
    expected = expected_seconds(done)
    lowest = min((c for _, c in order), default=0)
    protected = {(r, lowest) for r in range(MIN_REPEATS)}  # the least a ratio needs for an interval
    skip: dict[Key, str] = {}
    for key in order:
        if key in done:
            continue
        if stop is not None and key[1] > stop[0]:
            skip[key] = stop[1]
        elif budget_s is not None and key not in protected and elapsed_s + expected.get(key[1], 0.0) >= budget_s:
            skip[key] = (f"the probe's time budget of {budget_s:g} s was spent" if elapsed_s >= budget_s else
                         f"a run at concurrency {key[1]} takes {expected[key[1]]:.0f} s, more than the "
                         f"{budget_s - elapsed_s:.0f} s left of the {budget_s:g} s budget")
    return skip, stop[1] if stop else None


def overrun(seconds: float, budget_s: float | None, warmup_s: float | None, runs: int) -> str | None:
    """Why a probe that took `seconds` ran past its budget, or None when it kept it: the warm-up and the lowest
    level's MIN_REPEATS runs always happen, so a budget shorter than they take is overrun by design."""
    if budget_s is None or seconds <= budget_s:
        return None
    warm = f"its warm-up took {warmup_s:.0f} s, " if warmup_s else ""
    return (f"{seconds:.0f} s, over its budget of {budget_s:g} s: {warm}and {runs} run(s) were measured; the lowest "
            f"level's first {MIN_REPEATS} runs start whatever the budget (one ratio with an interval at least), and a "
            "run that has started is not cut short")
