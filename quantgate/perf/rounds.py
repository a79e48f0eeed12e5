"""Speed compared side by side (pure): the order of a perf window's rounds, and paired ratios with an A/A floor.

A release probes speed in one window after its other measurements, the baseline and every candidate on the same
slot (quantgate.release.perf_window). Each round runs the baseline, the candidates, and the baseline again:

    round 1: A B C A'      round 2: A C B A'      round 3: A B C A' ...

(the candidates' order reversed every other round, so no candidate always runs next to the same baseline run).
Per round and figure, with a and a' the baseline's two runs and c a candidate's:
- the candidate against the baseline: log c - (log a + log a') / 2, so a drift linear in time over the round hits
  both sides alike and cancels;
- the A/A floor: log a' - log a, the baseline against itself on the same machine in the same window.
Over the rounds each gives a paired t interval (quantgate.perf.intervals, `paired-log`): `geometric_baseline` builds
the baseline side of the first, and the floor is the ratio of the baseline's second runs to its first.

How the gate reads them (quantgate.gate.payoff): a candidate claiming a speed-up (a demand of 1x or more) must
show it beyond the floor: the worst end of its interval at or above the demand and outside the floor's interval; a
slow-down fails only where even its best end lies below the floor's interval.
A floor that excludes 1 says the load changed between the two halves of a round: no speed figure of that window
can be trusted, and every speed check there is INCONCLUSIVE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from quantgate.perf.intervals import RatioCI, t_quantile
from quantgate.perf.models import Figures, PerfResult

FIRST, SECOND = "a", "b"  # the baseline's two runs of a round


@dataclass(frozen=True)
class PlannedProbe:
    """One probe of a window: round `round` (from 0), position `index` in it, the variant and, for the baseline,
    which of its two runs (FIRST or SECOND; None for a candidate)."""
    round: int
    index: int
    variant: str
    half: str | None = None


def plan(baseline: str, candidates: list[str], rounds: int) -> list[PlannedProbe]:
    """The window's probes in order (see the module doc)."""
    if rounds < 1:
        raise ValueError(f"a window needs at least one round, got {rounds}")
    out = []
    for r in range(rounds):
        middle = candidates if r % 2 == 0 else candidates[::-1]
        names = [(baseline, FIRST), *((c, None) for c in middle), (baseline, SECOND)]
        out += [PlannedProbe(r, i, name, half) for i, (name, half) in enumerate(names)]
    return out


def as_rounds(parts: list[PerfResult]) -> PerfResult:
    """One result from a variant's probes of a window, in round order: each probe's runs take its round's index as
    their repeat, so that paired intervals pair runs of the same round."""
    first = parts[0]
    runs = [r.model_copy(update={"repeat": k}) for k, p in enumerate(parts) for r in p.runs]
    return first.model_copy(update={"runs": runs, "medians": [], "repeats": len(parts),
                                    "seconds": sum(p.seconds for p in parts)})


def _geo(x: float | None, y: float | None) -> float | None:
    if x is None or y is None or x < 0 or y < 0:
        return None
    return math.sqrt(x * y)


def geometric_baseline(first: PerfResult, second: PerfResult) -> PerfResult:
    """The baseline side of a candidate's paired ratio: per round and level, the geometric mean of the baseline's
    two runs (each figure; a figure missing from either run is missing). `first` and `second` come from
    `as_rounds`, so their repeats are round indices."""
    by_key = {(r.repeat, r.concurrency): r for r in second.runs}
    runs = []
    for r in first.runs:
        other = by_key.get((r.repeat, r.concurrency))
        if other is None:
            continue
        figures = {k: _geo(getattr(r, k), getattr(other, k)) for k in Figures.model_fields}
        runs.append(r.model_copy(update=figures))
    return first.model_copy(update={"runs": runs, "medians": [], "seconds": first.seconds + second.seconds})


def floor_speeds(floor: RatioCI | None, lower_is_better: bool) -> tuple[float, float] | None:
    """The A/A floor's interval as speed-ups (slowest, fastest); None without a floor or its interval."""
    if floor is None or floor.low is None or floor.high is None:
        return None
    ends = sorted((speedup(floor.low, lower_is_better), speedup(floor.high, lower_is_better)))
    return ends[0], ends[1]


def floor_clears(worst: float, floor: RatioCI | None, lower_is_better: bool) -> tuple[bool, str]:
    """Whether a candidate's worst-end speed-up `worst` (how many times as fast as the baseline) lies beyond the
    A/A floor's interval, and the floor in words. No floor (or no interval): True, said."""
    ends = floor_speeds(floor, lower_is_better)
    if ends is None:
        return True, "no A/A floor"
    assert floor is not None
    return worst > ends[1], f"A/A floor {ends[0]:.2f}x-{ends[1]:.2f}x over {floor.n_cand} rounds"


def floor_drifted(floor: RatioCI | None) -> bool:
    """The baseline against itself is significantly off 1: the load changed within the rounds."""
    return floor is not None and floor.low is not None and floor.high is not None and \
        (floor.low > 1.0 or floor.high < 1.0)


def speedup(ratio: float, lower_is_better: bool) -> float:
    """How many times as fast as the baseline a candidate/baseline ratio makes the candidate."""
    if not lower_is_better:
        return ratio
    return math.inf if ratio == 0 else 1.0 / ratio


def rounds_needed(point: float, worst: float, target: float, rounds: int) -> int | None:
    """About how many rounds bring the worst end of an interval (now `worst`, around `point`, at `rounds`) up to
    `target`, its half-width shrinking as t_{n-1} / sqrt(n); None when the point itself is not beyond the target."""
    if point <= target or worst <= 0 or rounds < 2:
        return None
    width = math.log(point / worst) / (t_quantile(0.95, rounds - 1) / math.sqrt(rounds))
    need = math.log(point / target)
    n = rounds
    while n < 1000 and width * t_quantile(0.95, n - 1) / math.sqrt(n) > need:
        n += 1
    return n
