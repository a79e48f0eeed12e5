"""Steps of the release flow (quantgate.release.flow), as plain functions over files.

Run folder (results/runs/<run-id>/):
    run.json                   the spec as loaded, git state, package versions
    <variant>/plan.json        the parallel layout the variant was served with
    <variant>/server.log       vLLM's log (absent when every result came from the cache)
    <variant>/evidence.json    what was measured and where it lives (cache folders)
    compare/<candidate>.json   paired statistics against the baseline
    <candidate>/judge/         the spec's LLM judge, candidate vs baseline (quantgate.release.judge_step)
    judge-server/              plan.json and server.log of a judge quantgate serves (judge.serve)
    decision.json              the gate's decisions; with `ladder: true` also every rung, tried or not
    summary.json               one page of figures per candidate tried (and the ladder's rungs)

Variant evidence is cached under results/cache/variants/<key>/, keyed by the checkpoint's content hash, the exact
serving arguments and the engine version: the baseline is served and evaluated once and reused by every release
that shares it. With `ladder: true` the schemes are tried one at a time in the spec's order until one is
promoted (quantgate.release.ladder); schemes never reached have no folder and are listed as not tried, not as failures.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from quantgate.base.runfiles import PARITY
from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import is_locked, lock, lock_holder
from quantgate.evals.comparefile import Comparison
from quantgate.fidelity.record import StreamLook
from quantgate.gate.decisionfile import overall, write_decision
from quantgate.gate.models import Decision
from quantgate.gate.evidence import decide_run
from quantgate.gate.policy import load_policy
from quantgate.gate.summaryfile import Summary
from quantgate.base.runinfo import write_run_record
from quantgate.parity.engine import load_parity, passed as parity_passed
from quantgate.plan.slots import Slot
from quantgate.recall import run as recall
from quantgate.publishing import registry
from quantgate.publishing.registryfile import NoEntry
from quantgate.spec.adaptive import fidelity_size
from quantgate.release.early import SKIPPABLE, early_decision, waited_for
from quantgate.release.cachelayout import engine_of, eval_dirs, variant_cache
from quantgate.release.judge_step import api_key, failure, judge_candidates
from quantgate.publishing.publish import check_env
from quantgate.spec.external import candidate_names
from quantgate.release.ladder import describe, next_rung, rungs
from quantgate.release import measurements, repair_step
from quantgate.release.measure import check_parity, gpus_of, parity_reference, replica_starter
from quantgate.release.measurements import MeasureRequest, VariantJob
from quantgate.release.replicas import Lender, Lending, StepRunner
from quantgate.release.runrecord import new_run_id, run_dir, run_record
from quantgate.release.schedule import pinned
from quantgate.spec.schema import ReleaseSpec, policy_path
from quantgate.release.variants import (Evidence, Log, ServingFailure, SummaryRow, Variant, baseline_for,
                                        baseline_variant, endpoint_keys, external_variant, failed_evidence, failed_row,
                                        make_server, not_applicable, quantize_variant, server_config)
from quantgate.report.junit import write_junit
from quantgate.report.page import write_report
from quantgate.report.store import Store, default_path
from quantgate.target.catalogue import resolve_model

# A candidate's fidelity scoring in this many steps when slots may be lent to it (quantgate.fidelity.parts): a slot
# that falls free (the baseline's, once it is done) takes parts. Four, not two, so that a slot freed late still
# takes a share: on the AVX2 CPU, the demo candidate's scoring took 25 minutes on one core, 21 of them after the
# baseline's slot was free.
FIDELITY_PARTS = 4

__all__ = ["MeasureRequest", "baseline_for", "baseline_variant", "external_variant", "quantize_variant", "resolve_model"]  # the flow calls them as steps


def start_run(spec: ReleaseSpec, spec_path: str | Path, run_id: str | None) -> Path:
    load_policy(policy_path(spec))  # a bad policy is refused before any work
    if spec.judge is not None and spec.judge.endpoint is not None:
        api_key(spec.judge)  # and a judge API key that is not there
    endpoint_keys(spec)  # and an endpoint's (the error names its spec field)
    check_env(spec.notify)  # and a webhook secret (quantgate.publishing.publish)
    run = run_dir(new_run_id(spec.name) if run_id is None else run_id)  # '' is refused, not replaced
    write_run_record(run, run_record(spec, spec_path))
    return run


def serve_and_evaluate(req: MeasureRequest, *, log: Log = print, slot: Slot | None = None,
                       reference_ready: Callable[..., object] | None = None, lender: Lender | None = None) -> Evidence:
    """Serve one variant under its plan and measure it (`req`: which, in which run, against which reference).

    The activation dtype is the plan's (or serving.dtype): on CPU the unquantized baseline runs FP32 (BF16 fails
    engine parity there) while quantized kernels need BF16 ("cpu_gemm_wna16 not implemented for 'Float'"), so the
    summary notes when a candidate's activations differ from the baseline's.

    `slot` (quantgate.release.schedule): the devices or cores to serve on (the caller pins the thread to them, so the
    server's processes stay there); None: the plan's first replica. `reference_ready` blocks until the baseline's
    answers are complete (before fidelity). `lender` (the release's SlotPool): slots that fall free while this
    variant is measured take extra servers of it (quantgate.release.replicas)."""
    spec, variant, run = req.spec, req.variant, req.run
    folder = run / variant.name
    config = server_config(spec, variant, folder, slot)
    try:
        cache = variant_cache(variant, config, engine_of(config), run)  # an endpoint's: this run only
    except QuantgateError as exc:  # an endpoint candidate that does not answer is its failure, as a server's
        if variant.endpoint is None:
            raise
        return failed_evidence(variant, folder, run / "endpoints", ServingFailure("start", exc, make_server(
            config, folder)), log, baseline=req.parity)
    if is_locked(cache):  # another release measures this very variant: wait, then reuse what it finished
        h = lock_holder(cache) or {}
        log(f"{variant.name}: waiting for pid {h.get('pid')} on {h.get('host')} ({h.get('what')}) to finish {cache}")
    try:
        job = VariantJob(spec=spec, variant=variant, run=run, folder=folder, cache=cache,
                         tokenizer=req.tokenizer or variant.path, reference=req.reference or eval_dirs(cache, spec),
                         baseline=req.reference is None, log=log, reference_ready=reference_ready,
                         parts=FIDELITY_PARTS if _lends(slot, lender, variant) else 1, verdicts=req.verdicts)
        with lock(cache, timeout=None, what=f"measure {variant.name} for run {run.name}"):
            return _measure_cached(job, config, parity=req.parity, replicas=(slot, lender))
    except ServingFailure as exc:  # a candidate's server that cannot start or dies: its failure, the others go on
        return failed_evidence(variant, folder, cache, exc, log, baseline=req.parity)


def planned_evals(spec: ReleaseSpec, variant: Variant, run: Path, slot: Slot | None) -> dict[str, Path]:
    """The eval folders serve_and_evaluate will fill for `variant` on a slot of this size, known before it runs:
    candidates served beside the baseline are given the baseline's as their fidelity reference."""
    config = server_config(spec, variant, None, slot)  # its cache key: no plan.json yet
    cache = variant_cache(variant, config, engine_of(config), run)
    return eval_dirs(cache, spec)


def only_skippable_left(req: MeasureRequest, slot: Slot | None) -> bool:
    """Whether the baseline `req`, measured on a slot of this size, has nothing left but steps that every
    candidate's decided REJECT would skip (its engine checked and its answers cached, as in a re-run of a release
    whose baseline skipped them): the flow then waits for the candidates' verdicts before it takes a slot."""
    spec, variant = req.spec, req.variant
    config = server_config(spec, variant, None, slot)  # its cache key: no plan.json yet
    cache = variant_cache(variant, config, engine_of(config), req.run)
    job = VariantJob(spec=spec, variant=variant, run=req.run, folder=req.run / variant.name, cache=cache,
                     tokenizer=variant.path, reference=eval_dirs(cache, spec), baseline=True, log=lambda _: None)
    pending = {kind for kind, keys in measurements.plan(job)[1].items() if keys}
    return bool(pending) and pending <= waited_for() and parity_passed(cache)


def _measure_cached(job: VariantJob, config, *, parity: bool,
                    replicas: tuple[Slot | None, Lender | None] = (None, None)) -> Evidence:
    """serve_and_evaluate's work, under the cache key's lock: what is not finished in the cache is measured, kind by
    kind (quantgate.release.measurements)."""
    variant, log = job.variant, job.log
    parity_file = job.cache / PARITY
    parity = parity and variant.endpoint is None  # an endpoint: no local weights for the reference to run
    need_parity = parity and not parity_passed(job.cache)  # a failed check is run again, never reused
    folders, todo = measurements.plan(job)
    job.drop_skippable(todo, need_parity)
    server = make_server(config, job.folder)
    early = early_decision(job.spec, job.run, variant, None if job.baseline else job.reference,
                           _dumps_ready(job.reference_ready), log)
    if early is not None:
        early.verdicts = job.verdicts  # its decided REJECT is the release's to know (the baseline may skip steps)
    if early is not None and not todo["fidelity"]:  # fidelity cached: decided now (as the first run did), before
        early.judge(folders["fidelity"]["main"])  # anything is served: what it skipped stays skipped, and the
        for kind in SKIPPABLE:  # judge skips the candidate again
            if todo.get(kind) and early.skips(kind):
                todo[kind] = []
    served = need_parity or any(todo.values())
    if served:
        _log_serving(variant, config, server, log)
        steps = measurements.ordered_steps(job, folders, todo, early)
        slot, lender = replicas  # slots that fall free take extra servers of this variant, from its start on
        lending = (Lending(lender, replica_starter(job.spec, variant, job.folder), pinned)
                   if lender is not None and _lends(slot, lender, variant) else None)
        runner = StepRunner(steps, name=variant.name, lending=lending, log=log)
        dtype = config.dtype or "auto"
        # on a CPU the parity reference is computed while the server starts
        reference = parity_reference(variant, dtype, gpus_of(config)) if need_parity else None
        with runner, server as srv:
            try:
                if need_parity:  # first, alone: a failed engine stops everything else
                    check_parity(variant, srv, job.cache, dtype, log, reference)
                runner.work(srv)
                if runner.servers > 1:
                    log(f"{variant.name}: measured on {runner.servers} servers (the extra ones on slots that fell free)")
            except Exception:
                srv.raise_if_dead()  # a dead server explains the failure better than a refused connection
                raise
    else:
        log(f"{variant.name}: every result is cached in {job.cache}; not serving")
    skipped = early.skipped if early is not None else (job.verdicts.skipped if job.baseline and job.verdicts else {})
    parity_record = load_parity(job.cache) if parity else None
    if parity_record is not None and parity_record.verdict != "pass":
        raise QuantgateError(f"engine parity failed for the baseline: {parity_record.reason}", where=str(parity_file),
                             fix="the serving engine, not quantization, is wrong: change serving.dtype or the engine version")
    ev = Evidence(variant=variant, folder=job.folder, cache=job.cache, serve_command=server.command,
                  parity=parity_record.model_dump(exclude_unset=True) if parity_record else None,  # the file's keys
                  node_commands=getattr(server, "commands", []),
                  dtype=config.dtype, served=served, skipped=dict(skipped),
                  **measurements.recorded(folders, skipped),
                  decided=early.reason if early is not None else None,
                  not_applicable=not_applicable(variant, baseline=job.baseline))
    ev.write()
    return ev


def _at_look(look: StreamLook | None) -> str:
    """Where a streaming look decided the REJECT: prompts read of the full sample, per slice, and when."""
    if look is None:
        return ""
    slices = ", ".join(f"{c} {n}" for c, n in sorted(look.by_category.items()))
    return (f", at streaming look {look.index} of {look.of} of {look.scope}: {look.n} of {look.total} prompts ({slices}), "
            f"{look.elapsed_s:g} s after the release began, judged at alpha {look.alpha:.4g}")


def _lends(slot: Slot | None, lender: Lender | None, variant: Variant) -> bool:
    """Whether slots that fall free may take extra servers of this variant (a served variant on a slot of its own)."""
    return lender is not None and slot is not None and variant.endpoint is None


def _log_serving(variant: Variant, config, server, log: Log) -> None:
    nodes = getattr(config, "nodes", None)
    if nodes:
        for node, argv in zip(nodes, server.commands):
            log(f"{variant.name}: {node.label} serving with `{' '.join(argv)}` {node.env}")
    elif variant.endpoint is not None:
        log(f"{variant.name}: measuring the endpoint {server.base_url} (model {config.name}): quantgate starts "
            "and stops nothing")
    else:
        log(f"{variant.name}: serving with `{' '.join(server.command)}` {config.env}")


def _dumps_ready(reference_ready: Callable[..., object] | None) -> Callable[[], object] | None:
    """The flow's wait for the baseline's fidelity dumps (its `reference_ready(dumps=True)`); None: the caller
    measured the baseline first (nothing to wait for)."""
    return None if reference_ready is None else (lambda: reference_ready(dumps=True))


def compare_variants(baseline: Evidence, candidate: Evidence, run: Path) -> Comparison:
    """Every measurement kind's comparison files for the candidate (quantgate.release.measurements); returns the
    eval sets' (compare/<candidate>.json, typed as it is read back), which the summary's rows are made of."""
    if candidate.failure is not None:  # its server failed: nothing to compare (the gate reads <candidate>/error.json)
        return Comparison({})
    return Comparison.model_validate(measurements.compare_all(run, baseline, candidate)["evals"] or {})


def judge(spec: ReleaseSpec, run: Path, baseline: Evidence, candidates: list[Evidence], log: Log = print) -> dict[str, Path]:
    """The spec's LLM judge on every candidate against the baseline (<run>/<candidate>/judge/report.json, read by
    the gate); one judge server for all of them when the judge is served. Failures are recorded for the gate, then
    raised (quantgate.release.judge_step)."""

    served = [c for c in candidates if c.failure is None]  # a candidate whose server failed has no answers
    for c in served:
        if c.decided is not None:  # its REJECT is decided (quantgate.release.early): the verdicts cannot change it
            log(f"judge: skipping {c.variant.name}: decided early: REJECT by fidelity")
    served = [c for c in served if c.decided is None]
    return judge_candidates(spec, run, baseline, served, log=log) if served else {}


def next_schemes(spec: ReleaseSpec, decisions: list) -> list[str]:
    """The candidates to try next given the gate's decisions so far (the schemes, then `candidates`): all at once
    without a ladder; with one, the next in that order while none is promoted. [] when the release is done
    (quantgate.release.ladder)."""

    return next_rung(candidate_names(spec), {d.candidate: d.decision for d in decisions}, spec.ladder)


def _rungs(spec: ReleaseSpec, decisions: list) -> list[dict]:
    return rungs(candidate_names(spec), {d.candidate: d.decision for d in decisions}, {d.candidate: d.reasons for d in decisions})


def _summary_row(base: Evidence, cand: Evidence, comparison: Comparison) -> SummaryRow:
    sets = comparison.root
    metrics = {f"{set_name}/{metric}": m.overall.headline() for set_name, report in sets.items()
               for metric, m in report.metrics.items()}
    return {
        "scheme": cand.variant.scheme,
        "size_bytes": cand.variant.size_bytes,
        "size_ratio": round(cand.variant.size_bytes / base.variant.size_bytes, 4)
        if cand.variant.size_bytes and base.variant.size_bytes else None,  # an endpoint has no files
        "metrics": metrics,
        "regressions": sum(len(r.regressions) for r in sets.values()),
        "agreement": {s: r.agreement.overall if r.agreement else None for s, r in sets.items()},
    }


def gate(spec: ReleaseSpec, run: Path, candidates: list[str], looks: list[int] | None = None) -> list[Decision]:
    """The policy's decision for every candidate at this look; nothing is written (record_decisions writes the
    last look's, once). `looks`: the fidelity sizes planned at flow start (fidelity_looks); this look is the spec's
    current size."""
    plan = (looks, fidelity_size(spec)) if looks and spec.fidelity is not None else None
    return decide_run(run, policy_path(spec), candidates, looks=plan, split=repair_step.looks(spec, candidates))


def record_decisions(spec: ReleaseSpec, run: Path, decisions: list[Decision]) -> Path:
    """The run's final decisions, written once: <run>/decision.json (with a ladder, every rung with its decision
    and reasons, or why it was not tried), each <run>/<candidate>/decision.json, and <run>/decision.junit.xml (the
    checks as CI test cases)."""
    path = write_decision(run, decisions, ladder=_rungs(spec, decisions) if spec.ladder else None)
    write_junit(path, spec.junit_inconclusive)
    return path


def promote(spec: ReleaseSpec, run: Path, decision: Decision, variant: Variant) -> Path | None:
    """Register a promoted candidate (the entry's manifest in <run>/<candidate>/promotion.json); returns the entry's
    folder. The version is its content hash, so promoting twice gives one entry. An endpoint candidate has no
    checkpoint to register: promotion.json says so, and None is returned."""
    if variant.endpoint is not None:
        NoEntry(reason=f"not applicable: endpoint: {variant.endpoint.endpoint} serves it; there is no checkpoint "
                "here to register").write_promotion(run / variant.name)
        return None
    model = spec.model if "/" not in spec.model else Path(spec.model).name
    entry = registry.promote(registry.Promotion(decision, model=model, version=f"{variant.name}-{variant.content_hash[:12]}",
                                                checkpoint=variant.path, run=run, expected_sha256=variant.content_hash))
    entry.write_promotion(run / variant.name)
    return Path(entry.path)


def finish_run(spec: ReleaseSpec, run: Path, base: Evidence, measured: list[tuple[Evidence, Comparison]],
               decisions: list, promotions: Mapping[str, Path]) -> Summary:
    """What <run>/summary.json will hold: a row per candidate tried (its evidence and its comparison with the
    baseline, as compare_variants returned it); with a ladder, the rungs (schemes not tried are no row). Not
    written here: the publish and notify records join it first (quantgate.publishing.publish.with_records), then
    quantgate.gate.summaryfile.write_summary writes it, once per run."""
    cands = [c for c, _ in measured]
    comparisons = {c.variant.name: comparison for c, comparison in measured}
    by_name = {d.candidate: d for d in decisions}
    promoted = [d.candidate for d in decisions if d.promoted]
    notes = [f"{c.variant.name} was served with {c.dtype or 'auto'} activations, the baseline with {base.dtype or 'auto'}: "
             "its deltas include the engine's numerics at that dtype, not only the quantized weights"
             for c in cands if c.dtype != base.dtype and base.variant.endpoint is None and c.variant.endpoint is None]
    summary: dict[str, object] = {  # validated into the Summary, whose field order its file keeps
        "release": spec.name, "run": run.name, "model": spec.model, "hardware": spec.hardware,
        "baseline": {"size_bytes": base.variant.size_bytes, "parity": base.parity and {k: base.parity[k] for k in ("verdict", "reason")}},
        "candidates": {c.variant.name: {**(failed_row(c) or _summary_row(base, c, comparisons[c.variant.name])),
                                        "decision": by_name[c.variant.name].decision,
                                        "reasons": by_name[c.variant.name].reasons,
                                        "registry": str(promotions[c.variant.name]) if c.variant.name in promotions
                                                    else None} for c in cands},
        "decision": overall([d.decision for d in decisions]),
        "promoted": promoted,
        "notes": notes,
        "policy": decisions[0].policy if decisions else None,
        "recall_cost": recall.costs({e.variant.name: e.recall for e in (base, *cands)}),
    }
    notes += [f"the judge failed for {c.variant.name}: {err}" for c in cands
              if (err := failure(run, c.variant.name))]
    notes += [f"{c.variant.name}: REJECT decided early by fidelity, so "
              f"{', '.join([*c.skipped, *(['judge'] if spec.judge else [])]) or 'nothing'} did not run "
              f"(decide_early: false measures everything){_at_look(by_name[c.variant.name].stream)}: {c.decided}"
              for c in cands if c.decided]
    notes += [f"{c.variant.name} was not measured: {r['failure']} ({r['error']})" for c in cands
              if (r := failed_row(c))] + spec.machine_notes
    notes += [f"{e.variant.name} is the endpoint {e.variant.endpoint.endpoint} (model {e.variant.endpoint.model}):"
              " quantgate neither started nor stopped it; its engine, dtype and hardware are not the spec's, "
              "and its results are cached for this run only" for e in (base, *cands) if e.variant.endpoint]
    if spec.ladder:
        summary["ladder"] = ladder = _rungs(spec, decisions)
        notes.append(describe(ladder))
    return Summary.model_validate(summary)


def publish(run: Path) -> str:
    """The run's HTML/Markdown report (<run>/report.html, report.md) and its row in the results database;
    returns the Markdown for the Prefect artifact."""

    _, md = write_report(run)
    with Store(default_path()) as store:
        store.ingest(run)
    return md.read_text(encoding="utf-8")
