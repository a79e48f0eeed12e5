"""The kinds of measurement a release makes of every variant, one object each, and the job they share (adapter).

A kind is everything the release needs to know about one measurement (`Measurement`):
- `folders(job)`: where its results live in the variant's cache, keyed before anything runs ({}: the spec asks
  for none of it);
- `pending(job, folders)`: which of those folders are not done yet (each kind's own "done" test);
- `steps(job, folders, pending, early)`: the work, as steps any running server of the variant can take
  (quantgate.release.replicas hands them out), and `phase(job, early)`: where its steps go in the variant's order;
- `record(folders, skipped)`: its fields of the variant's evidence (`Evidence`, written as evidence.json);
- `compare(run, baseline, candidate)`: its comparison files in the run folder, which the gate reads.

`KINDS` is the registry: the release's measure step (quantgate.release.steps) iterates it to decide what is left
to measure, to build the steps and the evidence, and to compare a candidate with the baseline. Adding a kind is
one class with its tests, registered in KINDS (docs/design.md, "Adding a measurement kind").

    job = VariantJob(spec, variant, run, folder, cache, ...)   # once per variant, when its slot is known
    folders = {k.name: k.folders(job) for k in KINDS}
    todo = {k.name: k.pending(job, folders[k.name]) for k in KINDS}
    steps = ordered_steps(job, folders, todo, early)

The order of the steps on the variant's servers: the baseline samples and scores its fidelity continuations first
(the candidates beside it wait for them); a candidate deciding early (quantgate.release.early) scores its fidelity
first, as the samples come (a streaming look may decide its REJECT: quantgate.release.streaming), then its eval sets,
the recall grid and the perf probe, which a decided REJECT skips (and the baseline's too, once every candidate's
REJECT is decided); otherwise fidelity comes last.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from quantgate.base.fileio import write_json
from quantgate.base.plugins import load_kinds
from quantgate.base.runfiles import COMPARE_DIR, PAY_OFF, PERF
from quantgate.base import progress
from quantgate.evals.compare import SetReport
from quantgate.evals.run import compare_dirs
from quantgate.fidelity import sampling
from quantgate.perf.compare import compare as perf_compare
from quantgate.perf.probe import load_result
from quantgate.perf.sweep import overrun
from quantgate.recall import run as recall
from quantgate.release import fidelity_step
from quantgate.release.cachelayout import (eval_complete, eval_dirs, perf_dir, perf_ok, perf_runs_done, perf_settings,
                                           recall_dir)
from quantgate.release.early import EarlyDecision, Verdicts, skippable_too
from quantgate.release.measure import measure_eval, measure_perf, measure_recall
from quantgate.release.replicas import Step
from quantgate.release.runrecord import release_started
from quantgate.release.streaming import StreamJudge
from quantgate.spec.schema import ReleaseSpec
from quantgate.release.variants import Evidence, Log, Variant


@dataclass(frozen=True)
class MeasureRequest:
    """One variant to serve and measure in one run, as the flow asks for it before a slot is known
    (quantgate.release.steps.serve_and_evaluate turns it into a VariantJob once the slot and the cache are)."""
    spec: ReleaseSpec
    variant: Variant
    run: Path
    parity: bool                             # check the engine against the reference implementation (the baseline)
    tokenizer: Path | None = None            # default the variant's; pass the baseline's (same perf/fidelity inputs)
    reference: Mapping[str, Path] | None = None  # the baseline's eval folders; None: this variant's own (a baseline)
    verdicts: Verdicts | None = None         # the release's early verdicts, shared by its baseline and candidates


@dataclass(frozen=True)
class VariantJob:
    """What measuring one variant needs, built once when its slot is known and passed whole."""
    spec: ReleaseSpec
    variant: Variant
    run: Path                       # <run>
    folder: Path                    # <run>/<variant>: its plan, server log and evidence.json
    cache: Path                     # its cached results (quantgate.release.cachelayout.variant_cache)
    tokenizer: Path                 # the baseline's: the same perf requests and fidelity sequences for every variant
    reference: Mapping[str, Path]   # the baseline's eval folders (the baseline's own for the baseline)
    baseline: bool                  # it is the baseline: it samples the fidelity continuations and scores the floor
    log: Log
    # blocks until the baseline's samples (or dumps=True) exist; with block=False, says whether they do now (raises
    # when the baseline's job failed)
    reference_ready: Callable[..., object] | None = None
    parts: int = 1                  # a candidate's fidelity scoring in this many steps, for replicas to share
    verdicts: Verdicts | None = None  # the release's early verdicts (quantgate.release.early)

    def drop_skippable(self, todo: dict[str, list[str]], need_parity: bool) -> None:
        """The baseline's pending steps that every candidate's decided REJECT makes pointless, dropped before a
        server is started for them alone (quantgate.release.early.Verdicts.drop_skippable)."""
        if self.baseline and self.verdicts is not None and not need_parity:
            self.verdicts.drop_skippable(todo)

    def skips(self, step: str, early: EarlyDecision | None) -> bool:
        """Whether this variant skips `step`: a candidate's decided REJECT, or (the baseline) every candidate's."""
        if early is not None:
            return early.skips(step)
        return self.baseline and self.verdicts is not None and self.verdicts.skips(step)


# Evidence fields as a kind records them: its folders by key, its one folder, or None (skipped or not measured)
Recorded = dict[str, dict[str, Path] | Path | None]


class Measurement(Protocol):
    name: str

    def folders(self, job: VariantJob) -> dict[str, Path]: ...
    def pending(self, job: VariantJob, folders: dict[str, Path]) -> list[str]: ...
    def steps(self, job: VariantJob, folders: dict[str, Path], pending: list[str],
              early: EarlyDecision | None) -> list[Step]: ...
    def phase(self, job: VariantJob, early: EarlyDecision | None) -> float: ...
    def record(self, folders: dict[str, Path], skipped: Mapping[str, str]) -> Recorded: ...
    def compare(self, run: Path, base: Evidence, cand: Evidence) -> dict[str, SetReport] | None: ...


def _wanted(job: VariantJob) -> Callable[[], bool] | None:
    """Whether a skippable step of the baseline still wants an extra server (quantgate.release.replicas): not once
    every candidate's REJECT is decided, as it will skip the step. None (always) for a candidate."""
    verdicts = job.verdicts if job.baseline else None
    return None if verdicts is None else lambda: not verdicts.all_rejected()


class EvalSets:
    """Each eval set (and lm-evaluation-harness task) of the spec: one folder and one step each."""
    name = "evals"

    def folders(self, job: VariantJob) -> dict[str, Path]:
        return eval_dirs(job.cache, job.spec)

    def pending(self, job: VariantJob, folders: dict[str, Path]) -> list[str]:
        return [n for n, d in folders.items() if not eval_complete(d)]

    def steps(self, job: VariantJob, folders: dict[str, Path], pending: list[str],
              early: EarlyDecision | None) -> list[Step]:
        def step(srv: Any, n: str) -> None:
            if not job.skips(self.name, early):  # a REJECT decided by then: no set of it changes the decision
                measure_eval(job.spec, job.variant, srv, n, folders[n], job.log)
        return [Step(f"eval {n}", lambda srv, n=n: step(srv, n), wanted=_wanted(job)) for n in pending]

    def phase(self, job: VariantJob, early: EarlyDecision | None) -> float:
        return 1

    def record(self, folders: dict[str, Path], skipped: Mapping[str, str]) -> Recorded:
        """Every set's folder; after a decided REJECT skipped them, only the sets measured before (or cached)."""
        if self.name not in skipped:
            return {"evals": folders}
        return {"evals": {n: d for n, d in folders.items() if eval_complete(d)}}

    def compare(self, run: Path, base: Evidence, cand: Evidence) -> dict[str, SetReport]:
        """compare/<candidate>.json: paired statistics per eval set (also what the summary's rows are made of), of
        the sets both sides measured (a decided REJECT may have skipped them: the gate says so)."""
        out = {name: compare_dirs(base.evals[name], cand.evals[name]) for name in base.evals if name in cand.evals}
        write_json(run / COMPARE_DIR / f"{cand.variant.name}.json", out)
        return out


class _Single:
    """A kind with at most one folder, named after the kind, and one step that a decided REJECT may skip."""
    name = ""
    folder_of: Callable[[Path, ReleaseSpec], Path | None]  # (cache, spec) -> its folder; None: not in the spec
    done: Callable[[Path], bool]                          # its own "done" test of that folder

    def folders(self, job: VariantJob) -> dict[str, Path]:
        d = type(self).folder_of(job.cache, job.spec)
        return {} if d is None else {self.name: d}

    def pending(self, job: VariantJob, folders: dict[str, Path]) -> list[str]:
        return [k for k, d in folders.items() if not type(self).done(d)]

    def phase(self, job: VariantJob, early: EarlyDecision | None) -> float:
        return 2

    def record(self, folders: dict[str, Path], skipped: Mapping[str, str]) -> Recorded:
        return {self.name: None if self.name in skipped else folders.get(self.name)}

    def steps(self, job: VariantJob, folders: dict[str, Path], pending: list[str],
              early: EarlyDecision | None) -> list[Step]:
        if not pending:
            return []

        def step(srv: Any) -> None:
            if job.skips(self.name, early):
                return
            self.run(job, srv, folders[self.name])
        return [Step(self.name, step, wanted=_wanted(job))]

    def run(self, job: VariantJob, srv: Any, out: Path) -> None:
        raise NotImplementedError


class RecallGrid(_Single):
    """The long-context recall grid (quantgate.recall): recall/<digest>/ in the cache."""
    name = "recall"
    folder_of = staticmethod(recall_dir)
    done = staticmethod(recall.is_complete)

    def run(self, job: VariantJob, srv: Any, out: Path) -> None:
        r = job.spec.recall
        assert r is not None  # a recall folder exists only with spec.recall (cachelayout.recall_dir)
        job.log(f"{job.variant.name}: long-context recall, lengths {r.lengths} x depths {r.depths} x {r.kinds}")
        with progress.reporting(f"{job.variant.name}: recall", job.log):
            measure_recall(job.spec, job.variant, srv, out)

    def compare(self, run: Path, base: Evidence, cand: Evidence) -> None:
        if base.recall is not None and cand.recall is not None:
            recall.compare_dirs(base.recall, cand.recall, run / cand.variant.name / "recall", cand.variant.name)


class PerfProbe(_Single):
    """The performance probe of the spec's workload (quantgate.perf): perf/<digest>/ in the cache."""
    name = "perf"
    folder_of = staticmethod(perf_dir)
    done = staticmethod(perf_ok)

    def run(self, job: VariantJob, srv: Any, out: Path) -> None:
        ps = perf_settings(job.spec)
        job.log(f"{job.variant.name}: {job.spec.workload} performance probe at concurrency {ps.levels}, {ps.repeats} "
                f"repeats, budget {ps.budget_s:g} s (vllm bench serve)")
        with progress.reporting(f"{job.variant.name}: perf runs", job.log), \
                progress.watch(len(ps.levels) * ps.repeats, lambda: perf_runs_done(out)):
            measure_perf(job.spec, job.variant, srv, out, job.folder, job.tokenizer)
        done = load_result(out)
        if done.sweep is not None and (why := overrun(done.seconds, done.sweep.budget_s, done.sweep.warmup_s,
                                                      len(done.runs))):
            job.log(f"{job.variant.name}: performance probe took {why}")

    def compare(self, run: Path, base: Evidence, cand: Evidence) -> None:
        """<run>/<candidate>/pay_off.json: the speed and memory ratios against the baseline."""
        if base.perf is not None and cand.perf is not None:
            ratios = perf_compare(load_result(base.perf), load_result(cand.perf))
            write_json(run / cand.variant.name / PAY_OFF, {**ratios, "file": str(cand.perf / PERF)})


class Fidelity:
    """Teacher-forced fidelity of the continuations the baseline sampled (quantgate.release.fidelity_step): one
    folder and one step per scoring path ("main"; the baseline also "alt", the noise floor's). A candidate that
    may be lent slots scores "main" in `job.parts` steps instead (quantgate.fidelity.parts), for its replicas."""
    name = "fidelity"

    def folders(self, job: VariantJob) -> dict[str, Path]:
        if job.spec.fidelity is None:
            return {}
        return fidelity_step.dump_dirs(job.cache, job.spec, job.reference, baseline=job.baseline)

    def pending(self, job: VariantJob, folders: dict[str, Path]) -> list[str]:
        """All paths, or none: the paths score the same samples, which must be complete too."""
        if not folders or fidelity_step.done(folders, fidelity_step.samples_dir(job.spec, job.reference)):
            return []
        return list(folders)

    def phase(self, job: VariantJob, early: EarlyDecision | None) -> float:
        if job.baseline:
            return 0  # the candidates beside it wait for its samples and dumps
        if early is None:
            return 3
        # deciding early: before the recall grid and perf probe it may skip; scored ahead of a baseline sampling beside
        # it (parts: a release on slots), first, as the samples come (a streaming look may decide; its eval sets run
        # after, beside the baseline's); else after its eval sets (on work pools the samples come whole from the store)
        return 0.5 if job.parts > 1 else 1.5

    def record(self, folders: dict[str, Path], skipped: Mapping[str, str]) -> Recorded:
        return {"fidelity": folders}

    def steps(self, job: VariantJob, folders: dict[str, Path], pending: list[str],
              early: EarlyDecision | None) -> list[Step]:
        if not pending:
            return []
        samples = self._sampling(job)
        if job.parts > 1 and not job.baseline:  # only "main": its parts, each on whichever server is free
            parts = [Step(f"fidelity (main, part {i + 1}/{job.parts})",
                          self._part(job, samples, folders["main"], early, i)) for i in range(job.parts)]
            return [Step("fidelity (main, ahead of the samples)", self._ahead(job, folders["main"], early)), *parts]
        scoring = [Step(f"fidelity ({p})", self._scorer(job, samples, p, folders[p], early)) for p in pending]
        return [samples, *scoring] if job.baseline else scoring

    @staticmethod
    def _sampling(job: VariantJob) -> Step:
        """The baseline's: sample the continuations on a server of its own. A candidate's: wait until the
        baseline's job has sampled them (`reference_ready`)."""
        if job.baseline:  # stopped when every candidate's REJECT is decided (not in a ladder: no verdicts there)
            stop = job.verdicts.all_rejected if job.verdicts is not None else None
            return Step("fidelity (samples)", lambda srv: fidelity_step.sample(job.spec, job.reference, job.tokenizer,
                                                                               srv, job.log, stop=stop))
        ready = job.reference_ready
        return Step("fidelity (samples)", lambda srv: ready() if ready is not None else None)

    @staticmethod
    def _scorer(job: VariantJob, samples: Step, path: str, out: Path, early: EarlyDecision | None
                ) -> Callable[[Any], None]:
        def score(srv: Any) -> None:
            samples.run(srv)  # the baseline: sampled here unless done; a candidate: waits for the baseline's
            folder = fidelity_step.samples_dir(job.spec, job.reference)
            if job.baseline and job.verdicts is not None and sampling.is_stopped(folder):
                job.verdicts.stopped_sampling()
            with progress.reporting(f"{job.variant.name}: fidelity ({path})", job.log):
                fidelity_step.measure(job.spec, srv, {path: out}, folder, job.log,
                                      baseline=job.baseline)
            if early is not None and path == "main":
                early.judge(out)
        return score

    @staticmethod
    def _ahead(job: VariantJob, out: Path, early: EarlyDecision | None) -> Callable[[Any], None]:
        """While the baseline beside it samples, the candidate's server scores each continuation as it comes
        (fidelity_step.score_ahead) instead of waiting for all of them; its parts then score the rest."""
        def score(srv: Any) -> None:
            ready = job.reference_ready
            if ready is None:  # no baseline beside it: the samples are complete, or come whole from a store
                return
            judge = StreamJudge(early, job.tokenizer, out, release_started(job.run)) if early is not None else None
            with early.scoring() if early is not None else nullcontext():  # a streaming look may decide first
                fidelity_step.score_ahead(job.spec, srv, out, fidelity_step.samples_dir(job.spec, job.reference),
                                          lambda: (judge is not None and judge.decided()) or bool(ready(block=False)),
                                          job.log)
        return score

    @staticmethod
    def _part(job: VariantJob, samples: Step, out: Path, early: EarlyDecision | None, index: int
              ) -> Callable[[Any], None]:
        def score(srv: Any) -> None:
            with early.scoring() if early is not None else nullcontext():  # the steps after it wait for the decision
                if early is not None and early.stream is not None:
                    return  # decided at a streaming look: nothing left to score
                samples.run(srv)  # waits for the baseline's samples
                if early is not None and early.stream is not None:
                    return
                with progress.reporting(f"{job.variant.name}: fidelity (main, part {index + 1}/{job.parts})",
                                        job.log):
                    merged = fidelity_step.measure_part(job.spec, srv, out, fidelity_step.samples_dir(
                        job.spec, job.reference), job.log, (index, job.parts))
                if merged and early is not None:  # the part that completed the dump decides
                    early.judge(out)
        return score

    def compare(self, run: Path, base: Evidence, cand: Evidence) -> None:
        if base.fidelity and cand.fidelity:
            fidelity_step.compare(run, base.fidelity, cand.variant.name, cand.fidelity)


KINDS: tuple[Measurement, ...] = (EvalSets(), RecallGrid(), PerfProbe(), Fidelity())
_ADDED: list[Measurement] = []  # kinds added as one module each (quantgate/kinds/), by `register`


def register(kind: Measurement) -> None:
    """A kind added as one module (quantgate.kinds.register): measured after the built-in ones of its phase, and
    skipped, as recall and perf are, by a REJECT decided early (quantgate.release.early)."""
    _ADDED[:] = [k for k in _ADDED if k.name != kind.name] + [kind]
    skippable_too(kind.name)


def all_kinds() -> tuple[Measurement, ...]:
    """The built-in kinds, then every installed one (quantgate.base.plugins imports them on first need)."""
    load_kinds()
    return (*KINDS, *_ADDED)


def plan(job: VariantJob) -> tuple[dict[str, dict[str, Path]], dict[str, list[str]]]:
    """Every kind's folders, and those not done yet: {kind: {key: folder}}, {kind: [key, ...]}."""
    folders = {k.name: k.folders(job) for k in all_kinds()}
    return folders, {k.name: k.pending(job, folders[k.name]) for k in all_kinds()}


def ordered_steps(job: VariantJob, folders: Mapping[str, dict[str, Path]], pending: Mapping[str, list[str]],
                  early: EarlyDecision | None) -> list[Step]:
    """Every kind's steps for what is pending, in the variant's order (the module docstring)."""
    kinds = sorted(all_kinds(), key=lambda k: k.phase(job, early))  # stable: the registry's order within a phase
    return [s for k in kinds for s in k.steps(job, folders.get(k.name, {}), pending.get(k.name, []), early)]


def recorded(folders: Mapping[str, dict[str, Path]], skipped: Mapping[str, str]) -> Recorded:
    """The Evidence fields every kind records (the added kinds' folders merged into its `kinds` slot)."""
    out: Recorded = {}
    for k in all_kinds():
        fields = k.record(folders[k.name], skipped)
        added = fields.pop("kinds", None)
        out |= fields
        if isinstance(added, dict):
            before = out.get("kinds")
            out["kinds"] = {**(before if isinstance(before, dict) else {}), **added}
    return out


def compare_all(run: Path, base: Evidence, cand: Evidence) -> dict[str, dict[str, SetReport] | None]:
    """Every kind's comparison of a candidate with the baseline (each writes the files the gate reads)."""
    return {k.name: k.compare(run, base, cand) for k in all_kinds()}


__all__ = ["KINDS", "Measurement", "VariantJob", "all_kinds", "compare_all", "ordered_steps", "plan", "recorded",
           "register"]
