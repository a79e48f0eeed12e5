"""Deciding a candidate early (adapter): fidelity is measured first, and a candidate whose fidelity already fails
its limit skips the expensive steps that cannot change its decision.

Why it is safe: the gate rejects on any failed check, and a failed fidelity check (the whole one-sided interval
beyond the limit, with the noise floor low enough to judge) stays failed whatever the recall grid, the perf probe or
the judge would show. The check is the gate's own (quantgate.gate.early.early_fidelity_checks) on the same
files the final gate reads, at the first look's share of alpha, so the final decision is the REJECT decided here.
Widened rounds (`adaptive`) measure in full: their candidates were INCONCLUSIVE, not rejected.

    early = EarlyDecision(spec, run, variant, reference, wait=...)   # per candidate, in its measurement
    early.judge(cand_dump)        # after its fidelity dump: waits for the baseline's dumps, then the gate's checks
    early.skips("recall")         # True (logged, recorded) when the REJECT is decided; the step does not run

A dump scored in parts on several servers (quantgate.fidelity.parts) is judged by the part that completes it. A
server that finished its own part while others still score theirs would take the recall grid next: `skips` waits
until no part is in flight (`with early.scoring():` around each), so the decision comes first there too.

What was skipped and why goes into the candidate's evidence.json (`skipped`), the summary's notes and the report.
`decide_early: false` in the spec measures everything.

The baseline beside them (`Verdicts`): its own eval sets, recall grid and perf probe are only ever compared with a
candidate's. When every candidate of the release has its REJECT decided before the baseline reaches them, they
can change no decision of this release, and the baseline skips them too (its evidence.json says why; the next
release that needs them measures them). In a ladder the rungs still to come count as candidates: the baseline skips
them only once the last rung is decided too (quantgate.release.flow starts each rung at its predecessor's REJECT).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from quantgate.base.errors import QuantgateError
from quantgate.fidelity.run import is_complete
from quantgate.fidelity.record import StreamLook
from quantgate.gate.early import early_fidelity_checks
from quantgate.gate.models import Check
from quantgate.release import fidelity_step
from quantgate.spec.adaptive import fidelity_looks, fidelity_size
from quantgate.spec.schema import ReleaseSpec, policy_path
from quantgate.release.variants import Log, Variant

SKIPPABLE = ("evals", "recall", "perf", "judge")  # the steps a decided REJECT makes pointless
# Skipped once the REJECT is decided, but never waited for: a baseline with only its eval sets left serves them at
# once, as every candidate not yet decided is gated on them (the others are compared with a candidate only).
UNWAITED = ("evals",)
_skippable = set(SKIPPABLE)  # and the kinds added as one module each (quantgate.release.measurements.register)


def waited_for() -> set[str]:
    """The skippable steps a baseline with nothing else left waits for the candidates' verdicts before serving."""
    return _skippable - set(UNWAITED)


def skippable_too(step: str) -> None:
    _skippable.add(step)


class Verdicts:
    """One release's early verdicts, shared by its candidates (who report a decided REJECT) and its baseline (who
    asks `skips(step)` before its recall grid and perf probe). Thread-safe: the jobs run in threads of one flow."""

    def __init__(self, candidates: list[str]) -> None:
        self.candidates = set(candidates)
        self.rejected: set[str] = set()
        self.settled: set[str] = set()  # judged early (rejected or not), or ended without deciding
        self.skipped: dict[str, str] = {}  # the baseline's steps not run, and why
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)

    def reject(self, candidate: str) -> None:
        with self._lock:
            self.rejected.add(candidate)
            self.settled.add(candidate)
            self._changed.notify_all()

    def settle(self, candidate: str) -> None:
        """The candidate will decide nothing early from now on (judged, or its job ended or failed)."""
        with self._lock:
            self.settled.add(candidate)
            self._changed.notify_all()

    def wait_settled(self) -> None:
        """Until every candidate is settled: a baseline left with nothing but skippable steps (its answers
        cached, as in an unchanged re-run) asks this before it starts a server for them. The flow settles a
        candidate whose quantization failed; each candidate's job settles itself when it ends."""
        with self._lock:
            self._changed.wait_for(lambda: self.candidates <= self.settled)

    def all_rejected(self) -> bool:
        with self._lock:
            return bool(self.candidates) and self.candidates <= self.rejected

    def drop_skippable(self, todo: dict[str, list[str]]) -> None:
        """A baseline left with only steps that every candidate's decided REJECT would skip (an unchanged re-run of
        a release whose baseline skipped them): wait for the candidates' verdicts before a server is started for
        them, and drop them from `todo` (kind -> pending keys) when every REJECT is decided."""
        pending = {kind for kind, keys in todo.items() if keys}
        if not pending or not pending <= waited_for():
            return
        self.wait_settled()
        for kind in pending:
            if self.skips(kind):
                todo[kind] = []

    def stopped_sampling(self) -> None:
        """The baseline's fidelity sampling was stopped (every candidate decided at a streaming look): recorded."""
        with self._lock:
            self.skipped["fidelity"] = (f"sampling stopped once every candidate's REJECT was decided at a streaming "
                                        f"look ({', '.join(sorted(self.rejected))}); the samples so far are kept for "
                                        "the next release")

    def skips(self, step: str) -> bool:
        """Whether the baseline skips `step` (recorded): a skippable step, every candidate's REJECT decided."""
        if step not in _skippable or not self.all_rejected():
            return False
        with self._lock:
            self.skipped[step] = ("every candidate's REJECT was decided by fidelity first "
                                  f"({', '.join(sorted(self.rejected))}): no decision of this release compares with it")
        return True


class EarlyDecision:
    """One candidate's early decision: judged once, after its fidelity dump, read by the steps that may skip."""

    def __init__(self, spec: ReleaseSpec, run: Path, variant: Variant, reference: Mapping[str, Path], *,
                 wait: Callable[[], object] | None, log: Log) -> None:
        self.spec, self.run, self.variant, self.reference = spec, run, variant, reference
        self.wait, self.log = wait, log
        plan = fidelity_looks(spec)  # the planned looks: this one spends its share of alpha
        self.looks = (plan, fidelity_size(spec)) if plan else None
        self.reason: str | None = None   # why the REJECT is decided (the failed checks), None while it is not
        self.verdicts: Verdicts | None = None  # the release's, told of a decided REJECT (set by the caller)
        self.skipped: dict[str, str] = {}  # step -> why it did not run
        self.stream: StreamLook | None = None  # the streaming look that decided the REJECT (quantgate.release.streaming)
        self._lock = threading.Lock()
        self._in_flight = 0  # fidelity parts being scored now (scoring())
        self._idle = threading.Condition(self._lock)

    def judge(self, cand_dump: Path) -> None:
        """The gate's fidelity checks on this candidate's dump against the baseline's (waiting for those); a failed
        one decides the REJECT. A baseline that never finishes its dumps leaves the decision to the final gate.
        The release's verdicts hear of it either way."""
        try:
            self._judge(cand_dump)
        finally:
            if self.verdicts is not None:
                self.verdicts.settle(self.variant.name)

    def _judge(self, cand_dump: Path) -> None:
        try:
            if self.wait is not None:
                self.wait()
        except QuantgateError as exc:
            self.log(f"{self.variant.name}: not deciding early ({exc.message})")
            return
        base = fidelity_step.baseline_dumps(self.spec, self.reference)
        if not all(is_complete(d, None) for d in (*base.values(), cand_dump)):  # nothing to decide on yet
            self.log(f"{self.variant.name}: not deciding early (the baseline's fidelity dumps are not complete)")
            return
        try:
            fidelity_step.compare(self.run, base, self.variant.name, {"main": cand_dump})  # what the gate reads
            checks = early_fidelity_checks(self.run, policy_path(self.spec), self.variant.name, self.variant.scheme,
                                           self.looks)
        except QuantgateError as exc:  # the final gate reads the same files and reports what is wrong with them
            self.log(f"{self.variant.name}: not deciding early ({exc.message})")
            return
        failed = [c for c in checks if c.outcome == "fail"]
        if failed:
            self._reject(failed, f"({len(failed)} failed check(s)); skipping {', '.join(SKIPPABLE)} (decide_early: "
                                 "false measures them)")

    def decide_at_look(self, failed: list[Check], look: StreamLook) -> None:
        """The REJECT decided at a streaming look (its record written by the caller): the rest of the candidate's
        fidelity and the skippable steps are skipped, and the release's verdicts hear of it."""
        self.stream = look
        self._reject(failed, f"at streaming look {look.index} of {look.of} of {look.scope} ({look.n} of {look.total} "
                             f"prompts, {look.elapsed_s:g} s in); skipping the rest of its fidelity and "
                             f"{', '.join(SKIPPABLE)}")

    def _reject(self, failed: list[Check], how: str) -> None:
        """The REJECT decided by the failed checks: said, and told to the release's verdicts."""
        self.reason = "; ".join(f"{c.name}: {c.reason}" for c in failed[:3]) + \
            (f" (and {len(failed) - 3} more)" if len(failed) > 3 else "")
        self.log(f"{self.variant.name}: REJECT decided by fidelity {how}: {self.reason}")
        if self.verdicts is not None:
            self.verdicts.reject(self.variant.name)

    @contextmanager
    def scoring(self) -> Iterator[None]:
        """Around a part of the candidate's fidelity scoring: `skips` waits while any part is in flight."""
        with self._lock:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1
                self._idle.notify_all()

    def skips(self, step: str) -> bool:
        """Whether `step` is skipped because the REJECT is decided (recorded once per step); decided once no part of
        the fidelity scoring is in flight (a step is handed out only after every part was)."""
        if step not in _skippable:
            return False
        with self._lock:
            self._idle.wait_for(lambda: self._in_flight == 0)
            if self.reason is None:
                return False
            self.skipped[step] = f"decided early: REJECT by fidelity ({self.reason})"
        return True


def early_decision(spec: ReleaseSpec, run: Path, variant: Variant, reference: Mapping[str, Path] | None,
                   wait: Callable[[], object] | None, log: Log) -> EarlyDecision | None:
    """The candidate's EarlyDecision, or None: the baseline itself, `decide_early: false` (the flow sets it for
    widened rounds), or no fidelity to decide on."""
    if reference is None or not spec.decide_early or spec.fidelity is None:
        return None
    if not fidelity_looks(spec):
        return None
    return EarlyDecision(spec, run, variant, reference, wait=wait, log=log)


__all__ = ["SKIPPABLE", "EarlyDecision", "Verdicts", "early_decision", "skippable_too", "waited_for"]
