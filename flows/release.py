"""The release flow: a release spec in, evidence for every variant out (results/runs/<run-id>/).

    spec -> model -> baseline: plan -> serve -> engine parity -> eval sets -> recall grid -> perf probe -> stop
         -> for each rung of schemes (all of them at once, or one at a time with `ladder: true`):
              quantize -> serve and measure each candidate like the baseline (one server at a time, all cached)
              -> compare with the baseline -> judge (spec.judge) -> gate (policy); a ladder stops at the first PROMOTE
         -> promote -> report (HTML, Markdown artifact, results DB)

The flow run ends Failed when no candidate is promoted, named "Rejected" (harm detected) or "Inconclusive" (too
little evidence to decide), so pipelines can branch on its state.

Orchestration only: every step is a call into `quantgate`. Run it with `quantgate release SPEC`, as a Prefect
deployment (prefect.yaml), or directly: `python flows/release.py releases/demo.yaml`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, Failed

from quantgate.release import steps as rel
from quantgate.release.runrecord import timed
from quantgate.release.spec import ReleaseSpec, load_spec


@task(retries=2, retry_delay_seconds=10, cache_policy=NO_CACHE)
def prepare_model(spec: ReleaseSpec, run: Path) -> Path:
    """Catalogue id -> verified checkpoint (downloads are the transient part, hence the retries)."""
    with timed(run, "model"):
        return rel.resolve_model(spec.model)


@task(cache_policy=NO_CACHE)
def quantize(spec: ReleaseSpec, model_dir: Path, scheme: str, run: Path) -> rel.Variant:
    """llmcompressor in a child process; an artifact with the same inputs is reused."""
    with timed(run, f"quantize {scheme}"):
        return rel.quantize_variant(spec, model_dir, scheme, run, log=get_run_logger().info)


# log_prints off: dill (under `datasets`) disassembles functions with print() into a captured stdout, which
# Prefect's print capture would turn into pages of bytecode in the run log; our own messages go through `log`
@task(retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE, log_prints=False)
def serve_and_evaluate(spec: ReleaseSpec, variant: rel.Variant, run: Path, parity: bool,
                       tokenizer: Path | None = None, reference: dict[str, Path] | None = None) -> rel.Evidence:
    """Plan, serve, check the engine, run the eval sets, fidelity, recall grid and perf probe, stop the server
    (cached: no server). Candidates score the baseline's answers for fidelity (`reference`)."""
    with timed(run, f"serve and measure {variant.name}"):
        return rel.serve_and_evaluate(spec, variant, run, parity=parity, tokenizer=tokenizer, reference=reference,
                                      log=get_run_logger().info)


@task(cache_policy=NO_CACHE)
def compare(baseline: rel.Evidence, candidate: rel.Evidence, run: Path) -> dict:
    with timed(run, f"compare {candidate.variant.name}"):
        return rel.compare_variants(baseline, candidate, run)


@task(retries=1, retry_delay_seconds=10, cache_policy=NO_CACHE)
def judge(spec: ReleaseSpec, run: Path, baseline: rel.Evidence, candidates: list[rel.Evidence]) -> dict:
    """The LLM judge on each candidate vs the baseline; a retry resumes. A failure is recorded for the gate."""
    with timed(run, "judge " + ", ".join(c.variant.name for c in candidates)):
        return rel.judge(spec, run, baseline, candidates, log=get_run_logger().info)


@task(cache_policy=NO_CACHE)
def gate(spec: ReleaseSpec, run: Path, candidates: list[str]) -> list:
    with timed(run, "gate"):
        return rel.gate(spec, run, candidates)


@task(retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def promote(spec: ReleaseSpec, run: Path, decision, variant: rel.Variant) -> dict:
    with timed(run, f"promote {variant.name}"):
        return rel.promote(spec, run, decision, variant)


@task(cache_policy=NO_CACHE)
def report(run: Path) -> str:
    """report.html + report.md in the run folder, a row in the results database; the Markdown for the artifact."""
    with timed(run, "report"):
        return rel.publish(run)


@flow(name="release", log_prints=True)
def release(spec: str = "releases/demo.yaml", run_id: str | None = None):
    """Run a release spec to a decision; the summary is results/runs/<run-id>/summary.json."""
    s = load_spec(spec)
    run = rel.start_run(s, spec, run_id)
    for warning in rel.sizing_warnings(s):
        get_run_logger().warning(f"sample size: {warning}")
    model_dir = prepare_model(s, run)
    base_ev = serve_and_evaluate(s, rel.baseline_variant(model_dir), run, parity=True)
    variants, cand_ev, comparisons, decisions = {}, [], {}, []
    while rung := rel.next_schemes(s, decisions):
        candidates = [quantize(s, model_dir, scheme, run) for scheme in rung]
        evidence = [serve_and_evaluate(s, c, run, parity=False, tokenizer=model_dir, reference=base_ev.evals)
                    for c in candidates]
        comparisons |= {c.variant.name: compare(base_ev, c, run) for c in evidence}
        if s.judge is not None:
            judged = judge(s, run, base_ev, evidence, return_state=True)
            if judged.is_failed():  # recorded in <candidate>/judge/error.json: the gate shows it
                get_run_logger().warning(f"judge step failed: {judged.message}")
        variants |= {c.name: c for c in candidates}
        cand_ev += evidence
        decisions = gate(s, run, list(variants))
        for _ in range(s.adaptive.rounds if s.adaptive else 0):  # INCONCLUSIVE: more samples, then decide again
            wider = rel.widen(s, decisions)
            if wider is None:
                break
            s = wider
            get_run_logger().info(f"INCONCLUSIVE: widening to eval.limit={s.eval.limit}, fidelity.limit="
                                  f"{s.fidelity.limit if s.fidelity else None}")
            base_ev = serve_and_evaluate(s, rel.baseline_variant(model_dir), run, parity=True)
            undecided = {d.candidate for d in decisions if d.decision == "INCONCLUSIVE"}
            redo = [serve_and_evaluate(s, variants[n], run, parity=False, tokenizer=model_dir, reference=base_ev.evals)
                    for n in undecided]
            comparisons |= {c.variant.name: compare(base_ev, c, run) for c in redo}
            cand_ev = [c for c in cand_ev if c.variant.name not in undecided] + redo
            decisions = gate(s, run, list(variants))
    promotions = {d.candidate: promote(s, run, d, variants[d.candidate]) for d in decisions if d.promoted}
    summary = rel.finish_run(s, run, base_ev, cand_ev, comparisons, decisions, promotions)
    create_markdown_artifact(key=f"release-{s.name}", markdown=report(run),
                             description=f"quantgate release {s.name}: {summary['decision']} ({run / 'report.html'})")
    message = f"{summary['decision']}: {run / 'summary.json'}"
    if summary["promoted"]:
        return Completed(message=message, data=summary)
    return Failed(name="Rejected" if summary["decision"] == "REJECT" else "Inconclusive", message=message, data=summary)


if __name__ == "__main__":
    release(sys.argv[1] if len(sys.argv) > 1 else "releases/demo.yaml")
