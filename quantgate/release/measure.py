"""What one variant's servers measure (adapter): the steps of a variant's measurement, each runnable on any running
server of the variant (quantgate.release.replicas hands them out), engine parity, and extra servers on lent slots.

The steps: each eval set (or lm-evaluation-harness task), the recall grid, the perf probe, and teacher-forced
fidelity of the baseline's answers, one step per fidelity path. quantgate.release.steps decides what is still to be
measured (the cache) and runs these on the variant's servers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from quantgate.base.runfiles import PLAN
from quantgate.base import progress
from quantgate.evals.lmeval import run_spec_task, task_of as lmeval_task
from quantgate.evals.run import run_eval
from quantgate.parity.engine import run_parity
from quantgate.perf.probe import run_probe
from quantgate.plan.slots import Slot
from quantgate.recall.run import build_checked_grid, run_recall
from quantgate.release import fidelity_step
from quantgate.release.cachelayout import perf_runs_done, perf_settings
from quantgate.release.early import EarlyDecision
from quantgate.release.replicas import Step
from quantgate.release.spec import ReleaseSpec
from quantgate.release.variants import Log, Variant, make_server, server_config


def _run_recall(spec: ReleaseSpec, variant: Variant, srv, out: Path) -> None:
    r = spec.recall
    assert r is not None  # a recall step exists only with spec.recall (cachelayout.recall_dir)
    prompts, grid = build_checked_grid(variant.path, r.lengths, r.depths, r.kinds, r.samples, seed=r.seed, ask=r.ask,
                                       max_model_len=spec.context, max_answer_tokens=r.max_answer_tokens, source="spec context")
    run_recall(prompts, out, endpoint=srv.base_url, model=srv.config.name, api_key=srv.api_key, grid=grid,
               concurrency=spec.eval.concurrency, deadline_s=r.deadline_s, max_error_rate=spec.eval.max_error_rate)


def _run_perf(spec: ReleaseSpec, variant: Variant, srv, out: Path, folder: Path, tokenizer: Path) -> None:
    local = variant.endpoint is None  # an endpoint has no weights, engine log or plan here
    run_probe(srv.base_url, srv.config.name, out, perf_settings(spec), tokenizer=tokenizer, api_key=srv.api_key,
              checkpoint=variant.path if local else None, server_log=srv.log_path if local else None,
              plan=folder / PLAN if local else None, python=srv.config.python)


def _run_eval(spec: ReleaseSpec, variant: Variant, srv, name: str, out: Path, log: Log) -> None:
    if (task := lmeval_task(name)) is not None:  # an lm-evaluation-harness task (quantgate.evals.lmeval)
        assert spec.lm_eval is not None  # its tasks are the only lm-eval names (cachelayout.eval_dirs)
        run_spec_task(spec.lm_eval, task, srv.base_url, srv.config.name, out, api_key=srv.api_key,
                      model_hash=variant.content_hash, label=variant.name, log=log)
        return
    log(f"{variant.name}: eval set {name} ({spec.eval.limit or 'all'} samples)")
    with progress.reporting(f"{variant.name}: eval {name}", log):  # counts, rate, ETA (quantgate.base.progress)
        run_eval(next(p for p in spec.eval_sets if p.stem == name), srv.base_url, srv.config.name, out,
                 concurrency=spec.eval.concurrency, limit=spec.eval.limit, api_key=srv.api_key,
                 model_hash=variant.content_hash, max_error_rate=spec.eval.max_error_rate, progress=False)


def measure_steps(spec: ReleaseSpec, variant: Variant, evals: dict[str, Path], todo: list[str], recall: Path | None,
                   perf: Path | None, fidelity: Mapping[str, Path], *, folder: Path, tokenizer: Path,
                   reference: Mapping[str, Path], log: Log, reference_ready: Callable[..., None] | None,
                   early: EarlyDecision | None = None) -> list[Step]:
    """What is measured on a running server of the variant, as independent steps (quantgate.release.replicas): the
    eval sets, the recall grid, the perf probe, teacher-forced fidelity of the continuations the baseline sampled
    (in its cache beside its eval folders, `reference`), each fidelity path its own step. The baseline samples
    first and scores them next, so that the candidates beside it can score and decide early. A candidate's fidelity
    waits for those samples when they are not complete yet; with `early` (quantgate.release.early) it comes before
    the recall grid and the perf probe, which a REJECT decided by it skips. Without, it comes last."""
    steps = [Step(f"eval {n}", lambda srv, n=n: _run_eval(spec, variant, srv, n, evals[n], log)) for n in todo]
    if recall is not None:
        def recall_step(srv) -> None:
            if early is not None and early.skips("recall"):
                return
            r = spec.recall
            assert r is not None  # a recall step exists only with spec.recall (cachelayout.recall_dir)
            log(f"{variant.name}: long-context recall, lengths {r.lengths} x depths {r.depths} x {r.kinds}")
            with progress.reporting(f"{variant.name}: recall", log):
                _run_recall(spec, variant, srv, recall)
        steps.append(Step("recall", recall_step))
    if perf is not None:
        def perf_step(srv) -> None:
            if early is not None and early.skips("perf"):
                return
            ps = perf_settings(spec)
            log(f"{variant.name}: {spec.workload} performance probe at concurrency {ps.levels}, {ps.repeats} repeats, "
                f"budget {ps.budget_s:g} s (vllm bench serve)")
            with progress.reporting(f"{variant.name}: perf runs", log), \
                    progress.watch(len(ps.levels) * ps.repeats, lambda: perf_runs_done(perf)):
                _run_perf(spec, variant, srv, perf, folder, tokenizer)
        steps.append(Step("perf", perf_step))
    samples = _sampling_step(spec, fidelity, reference, tokenizer, reference_ready, log)
    scoring = []
    for path_name, out in fidelity.items():
        def fidelity_step_(srv, path_name=path_name, out=out) -> None:
            samples.run(srv)  # the baseline: sampled here unless done; a candidate: waits for the baseline's
            with progress.reporting(f"{variant.name}: fidelity ({path_name})", log):
                fidelity_step.measure(spec, srv.config.name, srv, {path_name: out},
                                      fidelity_step.sequences(spec, reference), log)
            if early is not None and path_name == "main":
                early.judge(out)
        scoring.append(Step(f"fidelity ({path_name})", fidelity_step_))
    if "alt" in fidelity:  # the baseline: samples, then scores them (both paths), then the rest
        return [samples, *scoring, *steps]
    if early is not None:  # a candidate deciding early: after its eval sets, before the recall grid and perf probe
        return steps[:len(todo)] + scoring + steps[len(todo):]
    return steps + scoring


def _sampling_step(spec: ReleaseSpec, fidelity: Mapping[str, Path], reference: Mapping[str, Path], tokenizer: Path,
                   reference_ready: Callable[[], None] | None, log: Log) -> Step:
    """The baseline's (its fidelity has the `alt` path): sample the continuations on a server of its own. A
    candidate's: wait until the baseline's job has sampled them (`reference_ready`)."""
    if "alt" in fidelity:
        return Step("fidelity (samples)", lambda srv: fidelity_step.sample(spec, reference, tokenizer, srv, log))
    return Step("fidelity (samples)", lambda srv: reference_ready() if reference_ready is not None else None)


def check_parity(variant: Variant, srv, cache: Path, dtype: str | None, log: Log) -> None:
    with progress.reporting(f"{variant.name}: engine parity", log):
        report = run_parity(variant.path, srv.base_url, srv.api_key, variant.name, cache, dtype=dtype,
                            gpus=getattr(srv.config, "env", {}).get("CUDA_VISIBLE_DEVICES"))  # its slot's GPUs
    log(f"{variant.name}: engine parity {report.verdict}: {report.reason}")


def replica_starter(spec: ReleaseSpec, variant: Variant, folder: Path) -> Callable[[Slot], Any]:
    """`start(slot)` for quantgate.release.replicas: one more server of the variant on `slot` (its plan and log
    in <folder>/replica-<slot>/)."""
    def start(slot: Slot):
        sub = folder / f"replica-{slot.index}"
        sub.mkdir(parents=True, exist_ok=True)
        return make_server(server_config(spec, variant, sub, slot), sub)
    return start
