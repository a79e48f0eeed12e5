"""The release flow: a release spec in, evidence for every variant out (results/runs/<run-id>/).

    spec -> model -> the release's slots (quantgate.release.schedule: disjoint devices or CPU cores)
         -> at once, each job on a free slot:  baseline: plan -> serve -> engine parity -> fidelity (sampled
                                                continuations with their logprobs; a subset prefilled: the
                                                floor) -> evals -> recall -> perf -> stop
                                               each scheme of the rung: quantize -> serve and measure like the
                                                baseline, scoring the baseline's continuations for fidelity
            (all schemes at once, or one at a time with `ladder: true`; everything cached)
         -> compare with the baseline -> judge (spec.judge) -> gate (policy); a ladder stops at the first PROMOTE
         -> promote -> publish (spec.publish, PROMOTE entries) -> report (HTML, Markdown artifact, results DB)
         -> notify (spec.notify: the decision to each webhook)

The flow run ends Failed when no candidate is promoted, named "Rejected" (harm detected) or "Inconclusive" (too
little evidence to decide), so pipelines can branch on its state; a promotion whose publishing or notification
failed ends Failed too, named "Publish failed" (the entry stays promoted).

Orchestration only: every step is a call into `quantgate`. Jobs are submitted to Prefect's thread-pool task runner
and each waits for a slot of the release's SlotPool, so at most one job per slot computes at a time. Run it with
`quantgate release SPEC`, as a Prefect deployment (prefect.yaml names `flows/release.py:release`, a thin entry that
imports this flow), or directly: `python flows/release.py SPEC`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture
from prefect.states import Completed, Failed
from prefect.task_runners import ThreadPoolTaskRunner

from quantgate.base import progress
from quantgate.base.errors import QuantgateError
from quantgate.fidelity import run as fidelity_run, sampling
from quantgate.evals.comparefile import Comparison
from quantgate.gate.models import Decision
from quantgate.gate.summaryfile import NotifyRecord, PublishRecord, Summary, as_json, write_summary
from quantgate.release import fidelity_step, judge_cache, outcome, repair_step, rungjobs, schedule
from quantgate.release.executors import remote
from quantgate.spec import familycheck, warn as spec_warnings
from quantgate.publishing import publish as publishing, webhook
from quantgate.spec.adaptive import fidelity_looks, widen
from quantgate.spec.autoschemes import at_flow_start
from quantgate.spec.external import candidate_names
from quantgate.release.early import Verdicts
from quantgate.release.variants import RepairRung
from quantgate.release.perf_window import keep_window, perf_window
from quantgate.release import steps as rel
from quantgate.release.runrecord import recording_status, timed
from quantgate.spec.resolve import load_spec
from quantgate.spec.schema import ReleaseSpec, in_window

WORKERS = 16  # threads for submitted jobs; the SlotPool, not this, limits how many compute at once


@task(retries=2, retry_delay_seconds=10, cache_policy=NO_CACHE)
def prepare_model(spec: ReleaseSpec, run: Path) -> Path:
    """Catalogue id -> verified checkpoint (downloads are the transient part, hence the retries)."""
    with timed(run, "model"):
        return rel.resolve_model(spec.model)


@task(cache_policy=NO_CACHE)
def quantize(spec: ReleaseSpec, model_dir: Path, what: str | RepairRung, run: Path, pool: schedule.SlotPool,
             verdicts: Verdicts | None = None) -> rel.Variant:
    """llmcompressor in a child process, pinned to a CPU slot; an artifact with the same inputs is reused. `what`: a
    scheme, or a repair of one (the scheme with the layers it keeps left out: quantgate.release.repair_step)."""
    log = get_run_logger().info
    name = what if isinstance(what, str) else what.name
    try:
        with pool.take_for_quantize(f"quantize {name}", then=name) as slot, schedule.pinned(slot), \
                timed(run, f"quantize {name}") as row:
            row.slot = slot.label if slot else None
            return rel.quantize_variant(spec, model_dir, what, run, log=log)
    except BaseException:
        pool.withdraw(f"quantize {name}", name)  # its server will not come: lend its slot to the others
        if verdicts is not None:
            verdicts.settle(name)  # nor its early verdict
        raise


@task(cache_policy=NO_CACHE)
def repair(spec: ReleaseSpec, run: Path, model_dir: Path, baseline: rel.Evidence | None, decisions: list[Decision],
           variants: dict[str, rel.Variant]) -> list[RepairRung]:
    """The repair rung once the schemes are decided (quantgate.release.repair_step): the first scheme REJECTed by
    fidelity, again with the layers that cost the most KL kept at 16 bits; [] when there is none to repair."""
    pick = repair_step.to_repair(spec, decisions, variants)
    if pick is None or baseline is None:
        return []
    with timed(run, f"rank layers of {pick[1].name}"):
        return [repair_step.plan(spec, run, model_dir, baseline, pick, get_run_logger().info)]


# log_prints off: dill (under `datasets`) disassembles functions with print() into a captured stdout, which
# Prefect's print capture would turn into pages of bytecode in the run log; our own messages go through `log`
@task(retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE, log_prints=False)
def serve_and_evaluate(req: rel.MeasureRequest, pool: schedule.SlotPool,
                       baseline_failed: Callable[[], bool] = lambda: False) -> rel.Evidence:
    """On a free slot: plan, serve, check the engine, run the eval sets, recall grid, perf probe and fidelity, stop
    the server (cached: no server). Candidates score the continuations the baseline samples (in its cache beside
    its eval folders, `req.reference`) for fidelity, waiting for them when the baseline's job beside them has not
    finished them yet (`baseline_failed`: it will not)."""
    log = get_run_logger().info
    spec, variant, reference = req.spec, req.variant, req.reference
    ready = None
    if reference is not None and spec.fidelity is not None:
        def ready(dumps: bool = False, block: bool = True) -> bool:  # the baseline's fidelity samples (or its
            # dumps of them), in its cache; block=False: whether they are complete now
            if dumps:
                folders, final = (fidelity_step.baseline_dumps(spec, reference),
                                  lambda d: fidelity_run.is_complete(d, None))
            else:
                folders, final = {"samples": fidelity_step.samples_dir(spec, reference)}, sampling.is_final
            if not block:
                return schedule.reference_final(folders, baseline_failed, final)
            schedule.wait_for_reference(folders, baseline_failed, log, final=final)
            return True
    if (req.verdicts is not None and reference is None and variant.endpoint is None  # the baseline, on a slot
            and rel.only_skippable_left(req, pool.sample)):
        pool.withdraw(variant.name)  # its slot is the candidates' meanwhile (a quantization or a replica takes it)
        log(f"{variant.name}: only its recall grid and perf probe are left; waiting for the candidates' early "
            "verdicts before serving them")
        req.verdicts.wait_settled()
    rank = schedule.BASELINE if req.parity else schedule.CANDIDATE
    with pool.take_for(variant.name, rank, variant.endpoint is not None) as slot, schedule.pinned(slot), \
            progress.reporting(variant.name, log=log), timed(req.run, f"serve and measure {variant.name}") as row:
        try:
            ev = rel.serve_and_evaluate(req, log=log, slot=slot, reference_ready=ready, lender=pool)
        finally:  # a candidate decides nothing more early (quantgate.release.early.Verdicts)
            if req.verdicts is not None and reference is not None:
                req.verdicts.settle(variant.name)
        row.served, row.slot = ev.served, slot.label if slot else None
        return ev


@task(cache_policy=NO_CACHE)
def compare(baseline: rel.Evidence, candidate: rel.Evidence, run: Path) -> Comparison:
    with timed(run, f"compare {candidate.variant.name}"):
        return rel.compare_variants(baseline, candidate, run)


@task(retries=1, retry_delay_seconds=10, cache_policy=NO_CACHE)
def judge(spec: ReleaseSpec, run: Path, baseline: rel.Evidence, candidates: list[rel.Evidence]) -> dict[str, Path]:
    """The LLM judge on each candidate vs the baseline (cached by its inputs); a retry resumes. A failure is
    recorded for the gate."""
    log = get_run_logger().info
    with progress.reporting("judge", log=log), timed(run, "judge " + ", ".join(c.variant.name for c in candidates)):
        return judge_cache.judge(spec, run, baseline, candidates, rel.judge, log=log)


@task(cache_policy=NO_CACHE)
def speed_window(spec: ReleaseSpec, run: Path, pool: schedule.SlotPool, baseline: rel.Evidence,
                 candidates: list[rel.Evidence]) -> dict[str, Path]:
    """The baseline and the candidates probed side by side, after the other measurements (quantgate.release.
    perf_window): each candidate's pay_off.json, paired by round, with the A/A floor; variant -> its pooled probe."""
    log = get_run_logger().info
    with timed(run, "speed window"):
        return perf_window(spec, run, pool, baseline, candidates, log)


@task(cache_policy=NO_CACHE)
def gate(spec: ReleaseSpec, run: Path, candidates: list[str], looks: list[int] | None = None) -> list[Decision]:
    with timed(run, "gate"):
        return rel.gate(spec, run, candidates, looks)


@task(retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def promote(spec: ReleaseSpec, run: Path, decision: Decision, variant: rel.Variant) -> Path | None:
    with timed(run, f"promote {variant.name}"):
        return rel.promote(spec, run, decision, variant)


@task(cache_policy=NO_CACHE)
def publish(spec: ReleaseSpec, run: Path, promotions: dict[str, Path]) -> list[PublishRecord]:
    """Every promoted entry to the spec's `publish:` targets (<run>/publish.json); a failure is recorded, not raised,
    and never un-does the promotion."""
    with timed(run, "publish"):
        return publishing.publish_run(spec.publish, run, promotions)


@task(cache_policy=NO_CACHE)
def notify(spec: ReleaseSpec, run: Path, summary: Summary) -> list[NotifyRecord]:
    """The decision POSTed to the spec's `notify:` webhooks (<run>/notify.json); failures recorded, not raised."""
    with timed(run, "notify"):
        return webhook.notify_run(spec.notify, run, summary)


@task(cache_policy=NO_CACHE)
def report(run: Path) -> str:
    """report.html + report.md in the run folder, a row in the results database; the Markdown for the artifact."""
    with timed(run, "report"):
        return rel.publish(run)


def measure(s: ReleaseSpec, run: Path, pool: schedule.SlotPool, model_dir: Path, candidates: list,
            baseline: bool = True) -> tuple[rel.Evidence | None, list[rel.Evidence]]:
    """Serve and measure the baseline and the candidates (Variants, scheme ids to quantize first, or names of the
    spec's `candidates`) side by side on the pool's slots, the baseline submitted first so that it takes the first
    free slot. With one slot the candidates wait for a served baseline (they score its answers). An endpoint takes
    no slot: it is measured where it runs, beside whatever the slots hold. `executor: pools`: each variant in a
    child flow run on its work pool instead (quantgate.pools.executor)."""
    if s.executor.kind == "pools":
        return remote(s.executor.kind).measure(s, run, candidates, get_run_logger().info, baseline)
    base = rel.baseline_for(s, model_dir)
    reference = rel.planned_evals(s, base, run, pool.sample)  # first: it also asks vLLM its version, once
    candidates = [c if not isinstance(c, str) or c in s.schemes else rel.external_variant(s, c, model_dir, run)
                  for c in candidates]
    coming = rungjobs.slot_jobs(pool, base if baseline else None, candidates)
    pool.announce(*coming)  # no slot is lent to a variant's extra server while these still have to take theirs
    # The candidates' early verdicts, for a baseline measured beside them (not one slot: it goes first there); in a
    # ladder every rung from this one on is a candidate: the baseline skips only once the last is decided too
    names, rungs = [c if isinstance(c, str) else c.name for c in candidates], candidate_names(s)
    verdicts = (Verdicts(rungs[rungs.index(names[0]):] if s.ladder and names[0] in rungs else names)
                if baseline and s.decide_early and s.fidelity and pool.width > 1 else None)
    try:
        return _measure(pool, model_dir, rel.MeasureRequest(s, base, run, parity=True, verdicts=verdicts), reference,
                        candidates, baseline)
    finally:
        pool.withdraw(*coming)


def _measure(pool: schedule.SlotPool, model_dir: Path, base: rel.MeasureRequest, reference: Mapping[str, Path],
             candidates: list, baseline: bool) -> tuple[rel.Evidence | None, list[rel.Evidence]]:
    s, run = base.spec, base.run
    base_job = serve_and_evaluate.submit(base, pool=pool) if baseline else None
    verdicts = base.verdicts
    after = [base_job] if base_job is not None and pool.width == 1 and base.variant.endpoint is None else None

    def start(c: str | RepairRung | rel.Variant) -> PrefectFuture:  # a scheme (or a repair) is quantized first:
        variant: Any = (quantize.submit(s, model_dir, c, run, pool, verdicts)  # Prefect hands the job its Variant
                        if isinstance(c, (str, RepairRung)) else c)
        return serve_and_evaluate.submit(  # type: ignore[call-overload]  # Task.submit's overloads omit wait_for
            rel.MeasureRequest(s, variant, run, parity=False, tokenizer=model_dir, reference=reference,
                               verdicts=verdicts),
            pool=pool, baseline_failed=rungjobs.failed(base_job), wait_for=after)
    jobs, started = [start(c) for c in candidates], {c if isinstance(c, str) else c.name for c in candidates}
    coming: list[str] = []
    try:  # a ladder's next rung starts at its last rung's early REJECT, beside the baseline's remaining measurement
        while s.ladder and s.decide_early and (nxt := rungjobs.next_at_verdict(s, jobs[-1])) is not None:
            rung = nxt if nxt in s.schemes else rel.external_variant(s, nxt, model_dir, run)
            pool.announce(*(named := rungjobs.slot_jobs(pool, None, [rung])))
            coming, started = coming + named, started | {nxt}
            jobs.append(start(rung))
        if verdicts is not None:  # the rungs this measurement does not start: the gate decides their predecessor first
            for later in verdicts.candidates - started:
                verdicts.settle(later)
        base_ev = base_job.result() if base_job is not None else None
    finally:
        pool.withdraw(*coming)
    if base_ev is not None and not base_ev.evals_as_planned(reference):
        raise QuantgateError(f"the baseline's eval folders {base_ev.evals} are not the planned {reference}: the "
                             "candidates scored other answers", where="quantgate.release.flow measure",
                             fix="a bug: the slot's cache key changed between planning and serving; report it")
    return base_ev, [j.result() for j in jobs]


# Prefect's flow decorator types task_runner as TaskRunner[PrefectFuture]; ThreadPoolTaskRunner's futures are a
# subtype it does not accept (TaskRunner is invariant in its future type): the runner is the documented one.
@flow(name="release", log_prints=True,
      task_runner=ThreadPoolTaskRunner(max_workers=WORKERS))  # type: ignore[arg-type]
def release(spec: str = "releases/demo.yaml", run_id: str | None = None, executor: dict | None = None,
            not_promoted: outcome.EndAs = "failed"):
    """Run a release spec to a decision; the summary is results/runs/<run-id>/summary.json, and status.json says
    whether it completed, failed (the step and its root cause) or was interrupted. `executor`: fields that replace
    the spec's `executor:` ones (the CLI's --executor and --store). `not_promoted`: how a decided REJECT or
    INCONCLUSIVE ends the flow run (quantgate.release.outcome.EndAs)."""
    s = load_spec(spec)
    if executor:
        s = s.model_copy(update={"executor": s.executor.with_fields(executor)})
    run = rel.start_run(s, spec, run_id)
    with recording_status(run) as done:
        state = _release(s, run, not_promoted)
        done["decision"] = (outcome.summary_of(state.data) or {}).get("decision")
    if s.executor.kind == "pools":  # the whole run folder, status included, beside what the children shared
        remote(s.executor.kind).share_run(s, run)
    return state


def _release(s: ReleaseSpec, run: Path, not_promoted: outcome.EndAs = "failed"):
    """The release in its run folder: model, quantize, measure, compare, judge, gate, promote, publish, report."""
    logger = get_run_logger()
    spec_warnings.say_before_work(s, logger.warning, logger.info)
    for note in s.machine_notes:  # `hardware: auto` and skip_unsupported: what was decided for this machine, and why
        logger.warning(note)
    model_dir = prepare_model(s, run)
    familycheck.at_flow_start(s, model_dir, log=logger.warning)  # the support matrix for the model's family
    s = at_flow_start(s, model_dir, run, log=logger.info)  # `schemes: auto` ranked with the model's real size
    pool = schedule.release_pool(s, model_dir, log=(lambda _: None) if s.executor.kind == "pools" else logger.info)
    schedule.preload_libraries()  # before any job thread imports them
    looks = fidelity_looks(s)  # planned before the first look: each look spends its share of the fidelity alpha
    base_ev: rel.Evidence | None = None
    variants: dict[str, rel.Variant] = {}
    cand_ev, comparisons = list[rel.Evidence](), dict[str, Comparison]()
    decisions: list[Decision] = []
    probed: dict[str, Path] = {}  # variant -> its pooled probe of the speed window
    while rung := rel.next_schemes(s, decisions) or (repair(s, run, model_dir, base_ev, decisions, variants)
                                                      if repair_step.to_repair(s, decisions, variants) else []):
        again = base_ev is None or isinstance(rung[0], RepairRung) and bool(base_ev.skipped)  # a repair: what the
        measured_base, evidence = measure(s, run, pool, model_dir, rung, baseline=again)  # baseline skipped, resumed
        base_ev = measured_base or base_ev
        assert base_ev is not None  # the first rung measures the baseline (or its job raised)
        comparisons |= {c.variant.name: compare(base_ev, c, run) for c in evidence}
        if s.judge is not None:
            judged = judge(s, run, base_ev, evidence, return_state=True)
            if judged.is_failed():  # recorded in <candidate>/judge/error.json: the gate shows it
                logger.warning(f"judge step failed: {judged.message}")
        if in_window(s):  # after every other measurement of this rung, the judge's included
            probed |= speed_window(s, run, pool, base_ev, evidence)
            keep_window([base_ev, *evidence], probed)
        variants |= {c.variant.name: c.variant for c in evidence}
        cand_ev += evidence
        decisions = gate(s, run, list(variants), looks)
        for _ in range(s.adaptive.rounds if s.adaptive else 0):  # INCONCLUSIVE: more samples, then decide again
            wider = widen(s, decisions)
            if wider is None:
                break
            s = wider
            logger.info(f"INCONCLUSIVE: widening to eval.limit={s.eval.limit}, fidelity.limit="
                        f"{s.fidelity.limit if s.fidelity else None}")
            undecided = {d.candidate for d in decisions if d.decision == "INCONCLUSIVE"}
            # a second round of measurement on new samples: its servers start again (the first round's stopped
            # at the end of their measurement, before the gate could ask for more)
            # measured in full: these candidates were undecided, and the early check is planned for the first look
            base_ev, redo = measure(s.model_copy(update={"decide_early": False}), run, pool, model_dir,
                                    [variants[n] for n in undecided])
            assert base_ev is not None
            comparisons |= {c.variant.name: compare(base_ev, c, run) for c in redo}
            keep_window([base_ev, *redo], probed)  # their speed was probed in the window: not again
            cand_ev = [c for c in cand_ev if c.variant.name not in undecided] + redo
            decisions = gate(s, run, list(variants), looks)
    rel.record_decisions(s, run, decisions)  # decision.json (and its JUnit XML): the last look's, written once
    outcome.emit_decisions(s.name, run, decisions)  # `quantgate.release.decided`, for Prefect Automations
    promotions = _promote(s, run, decisions, variants)
    published = publish(s, run, promotions) if s.publish and promotions else None  # PROMOTE entries only
    assert base_ev is not None  # a spec has at least one candidate (ReleaseSpec), so a rung ran
    summary = rel.finish_run(s, run, base_ev, [(c, comparisons[c.variant.name]) for c in cand_ev], decisions, promotions)
    outcome.create_artifacts(s.name, run, decisions)  # the report's link and the checks' table
    return conclude(s, run, summary, published, outcome.headline(summary.decision or "", decisions), not_promoted)


def _promote(s: ReleaseSpec, run: Path, decisions: list[Decision], variants: dict[str, rel.Variant]
             ) -> dict[str, Path]:
    """Every PROMOTE candidate into the registry (candidate -> its entry's folder; an endpoint has none); on work
    pools its checkpoint is pulled from the store first and the registry entry shared there after."""
    promotions = {}
    for d in decisions:
        if d.promoted:
            if s.executor.kind == "pools":
                remote(s.executor.kind).pull_checkpoint(s, variants[d.candidate])
            entry = promote(s, run, d, variants[d.candidate])
            if entry is None:
                continue
            promotions[d.candidate] = entry
            if s.executor.kind == "pools":
                remote(s.executor.kind).share_entry(s, entry)
    return promotions


def conclude(s: ReleaseSpec, run: Path, summary: Summary, published: list[PublishRecord] | None, headline: str,
             not_promoted: outcome.EndAs = "failed"):
    """After the gate: the publish and notify records into the summary, summary.json written (once), the report
    and its artifact, the flow run's state (quantgate.release.outcome: `not_promoted` says how a decided REJECT or
    INCONCLUSIVE ends; its message opens with `headline`, the decision and the deciding checks)."""
    logger = get_run_logger()
    if published is not None:
        summary = publishing.with_records(summary, "publish", published)
    if s.notify:  # every decision, after the gate
        summary = publishing.with_records(summary, "notify", notify(s, run, summary))
    write_summary(run, summary)
    create_markdown_artifact(key=outcome.artifact_key(s.name), markdown=report(run),
                             description=f"quantgate release {s.name}: {summary.decision} ({run / 'report.html'})")
    message = f"{headline} ({run / 'summary.json'})"
    for failure in publishing.failures(summary):
        logger.error(failure)
    data = as_json(summary)  # the flow run's result, as summary.json holds it
    if summary.promoted:
        if publishing.failures(summary):  # promoted and registered, but it did not all go out
            return Failed(name="Publish failed", message=message, data=outcome.NotPromoted(message, data))
        return Completed(message=message, data=data)
    name = "Rejected" if summary.decision == "REJECT" else "Inconclusive"
    if not_promoted == "completed":  # a decided outcome as a result: no ERROR line, no traceback in the worker's log
        return Completed(name=name, message=message, data=data)
    return Failed(name=name, message=message, data=outcome.NotPromoted(message, data))  # data: an exception

