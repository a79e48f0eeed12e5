"""Steps of the release flow (flows/release.py), as plain functions over files.

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

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import write_json
from quantgate.base.paths import results_dir
from quantgate.evals.dataset import load_evalset, stratified_subset
from quantgate.evals.run import compare_dirs, run_eval
from quantgate.gate.evidence import gate_run, overall
from quantgate.gate.policy import load_policy
from quantgate.gate.sizing import sizing
from quantgate.gate.sizing import warnings as size_warnings
from quantgate.parity.engine import run_parity
from quantgate.perf.compare import compare as perf_compare
from quantgate.perf.probe import load_result, probe
from quantgate.recall import run as recall
from quantgate.recall.run import build_checked_grid, run_recall
from quantgate.release import fidelity_step, registry
from quantgate.release.judge_step import api_key, failure, judge_candidates
from quantgate.release.ladder import describe, next_rung, rungs
from quantgate.release.runrecord import git_state, new_run_id, package_versions, run_dir
from quantgate.release.spec import ReleaseSpec
from quantgate.release.variants import (Evidence, Log, Variant, baseline_variant, make_server, policy_path,
                                        quantize_variant, server_config)
from quantgate.report.page import write_report
from quantgate.report.store import Store, default_path
from quantgate.serving.env import serve_python, vllm_version
from quantgate.target.catalogue import checkpoint_hash, resolve_model

__all__ = ["resolve_model"]


def start_run(spec: ReleaseSpec, spec_path: str | Path, run_id: str | None) -> Path:
    load_policy(policy_path(spec))  # a bad policy is refused before any work
    if spec.judge is not None and spec.judge.endpoint is not None:
        api_key(spec.judge)  # and a judge API key that is not there
    run = run_dir(new_run_id(spec.name) if run_id is None else run_id)  # '' is refused, not replaced
    write_json(run / "run.json", {"spec_file": str(spec_path), "spec": spec.model_dump(mode="json"), "git": git_state(),
                                  "packages": package_versions()})
    return run


def sizing_warnings(spec: ReleaseSpec) -> list[str]:
    """The task checks whose limits this spec's sample sizes cannot prove (they then only detect harm), per family
    of the spec's schemes: said at the start of a release, so that nobody reads a pass as a proven limit."""
    policy = load_policy(policy_path(spec))
    if policy.primary is None:
        return []
    counts: dict[str, int] = {}
    for path in spec.eval_sets:
        samples = stratified_subset(load_evalset(path, with_dataset=False).samples, spec.eval.limit)
        counts["primary"] = counts.get("primary", 0) + len(samples)
        for cat in policy.categories:
            n = sum(1 for s in samples if s.category == cat)
            if n:
                counts[f"category:{cat}"] = counts.get(f"category:{cat}", 0) + n
    if policy.pooled is not None and "primary" in counts:
        counts["pooled"] = counts["primary"]
    families = {f for s in spec.schemes if (f := policy.primary.family_of(s))}
    return [f"{f}: {w}" for f in sorted(families) for w in size_warnings(sizing(policy, f, counts))]


def _grow(current: int | None, budget: int | None, available: int) -> int | None:
    """The next sample count: twice the current one (or all available), within the budget; None: cannot grow."""
    now = current or available
    if budget is None or now >= min(budget, available):
        return None
    return min(budget, available, max(2 * now, now + 1))


def widen(spec: ReleaseSpec, decisions: list) -> ReleaseSpec | None:
    """The spec with more eval and fidelity samples when a candidate is INCONCLUSIVE and the `adaptive` budget and
    the eval sets allow more; None when there is nothing to add (the decision stands)."""
    a = spec.adaptive
    if a is None or not any(d.decision == "INCONCLUSIVE" for d in decisions):
        return None
    available = min((len(load_evalset(p, with_dataset=False).samples) for p in spec.eval_sets), default=0)
    update: dict[str, Any] = {}
    if (n := _grow(spec.eval.limit, a.max_eval_samples, available)) is not None:
        update["eval"] = spec.eval.model_copy(update={"limit": n})
    if spec.fidelity is not None:
        reach = (update["eval"].limit if "eval" in update else spec.eval.limit) or available
        if (k := _grow(spec.fidelity.limit, a.max_fidelity_samples, reach * max(len(spec.eval_sets), 1))) is not None:
            update["fidelity"] = spec.fidelity.model_copy(update={"limit": k})
    return spec.model_copy(update=update) if update else None


def _cache_key(variant: Variant, config, engine: str) -> str:
    blob = {"model": variant.content_hash, "args": config.args, "env": config.env, "engine": engine}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:20]


def _eval_dir(cache: Path, evalset: Path, limit: int | None) -> Path:
    digest = hashlib.sha256(evalset.read_bytes()).hexdigest()[:12]
    return cache / "evals" / f"{evalset.stem}-{digest}-{limit or 'all'}"


def _recall_dir(cache: Path, spec: ReleaseSpec) -> Path | None:
    if spec.recall is None:
        return None
    digest = hashlib.sha256(spec.recall.model_dump_json().encode()).hexdigest()[:12]
    return cache / "recall" / digest


def _run_recall(spec: ReleaseSpec, variant: Variant, srv, out: Path) -> None:
    r = spec.recall
    prompts, grid = build_checked_grid(variant.path, r.lengths, r.depths, r.kinds, r.samples, seed=r.seed,
                                       max_model_len=spec.context, max_answer_tokens=r.max_answer_tokens, source="spec context")
    run_recall(prompts, out, endpoint=srv.base_url, model=variant.name, api_key=srv.api_key, grid=grid,
               max_answer_tokens=r.max_answer_tokens, concurrency=spec.eval.concurrency,
               max_error_rate=spec.eval.max_error_rate, progress=False)


def _perf_dir(cache: Path, spec: ReleaseSpec) -> Path | None:
    if spec.perf is None:
        return None
    return cache / "perf" / hashlib.sha256(spec.perf.model_dump_json().encode()).hexdigest()[:12]


def _run_perf(spec: ReleaseSpec, variant: Variant, srv, out: Path, folder: Path, tokenizer: Path) -> None:
    p = spec.perf
    probe(srv.base_url, variant.name, out, concurrency=p.concurrency, num_prompts=p.num_prompts, input_len=p.input_len,
          output_len=p.output_len, repeats=p.repeats, tokenizer=tokenizer, api_key=srv.api_key, checkpoint=variant.path,
          server_log=srv.log_path, plan=folder / "plan.json", python=srv.config.python)


def _perf_ok(folder: Path) -> bool:
    try:
        return json.loads((folder / "perf.json").read_text()).get("status") == "ok"
    except (OSError, ValueError):
        return False


def _complete(eval_dir: Path) -> bool:
    try:
        return json.loads((eval_dir / "manifest.json").read_text()).get("status") == "complete"
    except (OSError, ValueError):
        return False


def _measure(spec: ReleaseSpec, variant: Variant, srv, cache: Path, evals: dict[str, Path], todo: list[str],
             recall: Path | None, perf: Path | None, fidelity: Mapping[str, Path], *, parity_dtype: str | None,
             tokenizer: Path, reference: Mapping[str, Path], log: Log) -> None:
    """Everything measured on one running server: engine parity, the eval sets, teacher-forced fidelity (of the
    baseline's answers: `reference` holds its eval folders), the recall grid, the perf probe."""
    if parity_dtype:
        report = run_parity(variant.path, srv.base_url, srv.api_key, variant.name, cache, dtype=parity_dtype)
        log(f"{variant.name}: engine parity {report.verdict}: {report.reason}")
    for name in todo:
        log(f"{variant.name}: eval set {name} ({spec.eval.limit or 'all'} samples)")
        run_eval(next(p for p in spec.eval_sets if p.stem == name), srv.base_url, variant.name, evals[name],
                 concurrency=spec.eval.concurrency, limit=spec.eval.limit, api_key=srv.api_key,
                 model_hash=variant.content_hash, max_error_rate=spec.eval.max_error_rate, progress=False)
    if fidelity:
        fidelity_step.measure(spec, variant.name, srv, fidelity, fidelity_step.sequences(spec, reference, tokenizer), log)
    if recall is not None:
        r = spec.recall
        log(f"{variant.name}: long-context recall, lengths {r.lengths} x depths {r.depths} x {r.kinds}")
        _run_recall(spec, variant, srv, recall)
    if perf is not None:
        log(f"{variant.name}: performance probe at concurrency {spec.perf.concurrency} (vllm bench serve)")
        _run_perf(spec, variant, srv, perf, srv.log_path.parent, tokenizer)


def serve_and_evaluate(spec: ReleaseSpec, variant: Variant, run: Path, *, parity: bool, tokenizer: Path | None = None,
                       reference: Mapping[str, Path] | None = None, log: Log = print) -> Evidence:
    """Serve one variant under its plan and measure it. `tokenizer` (default: the variant's) makes the perf probe
    and the fidelity sequences the same for every variant: pass the baseline's. `reference`: the baseline's eval
    folders, whose answers every candidate scores for fidelity (default: this variant's own: the baseline).

    The activation dtype is the plan's (or serving.dtype): on CPU the unquantized baseline runs FP32 (BF16 fails
    engine parity there) while quantized kernels need BF16 ("cpu_gemm_wna16 not implemented for 'Float'"), so the
    summary notes when a candidate's activations differ from the baseline's."""

    folder = run / variant.name
    config = server_config(spec, variant, folder)
    engine = vllm_version(serve_python(config.python))
    cache = results_dir() / "cache" / "variants" / _cache_key(variant, config, engine)
    evals = {p.stem: _eval_dir(cache, p, spec.eval.limit) for p in spec.eval_sets}
    parity_file = cache / "parity.json"
    todo = [name for name, d in evals.items() if not _complete(d)]
    need_parity = parity and not parity_file.is_file()
    recall = _recall_dir(cache, spec)
    need_recall = recall is not None and not (recall / "cells.json").is_file()
    perf = _perf_dir(cache, spec)
    need_perf = perf is not None and not _perf_ok(perf)
    fid = fidelity_step.dump_dirs(cache, spec, reference or evals, baseline=reference is None) if spec.fidelity else {}
    need_fid = bool(fid) and not fidelity_step.done(fid)
    server = make_server(config, folder)
    served = bool(todo or need_parity or need_recall or need_perf or need_fid)
    if served:
        nodes = getattr(config, "nodes", None)
        if nodes:
            for node, argv in zip(nodes, server.commands):
                log(f"{variant.name}: {node.label} serving with `{' '.join(argv)}` {node.env}")
        else:
            log(f"{variant.name}: serving with `{' '.join(server.command)}` {config.env}")
        with server as srv:
            try:
                _measure(spec, variant, srv, cache, evals, todo, recall if need_recall else None, perf if need_perf else None,
                         fid if need_fid else {}, parity_dtype=_arg(config.args, "--dtype", "float32") if need_parity
                         else None, tokenizer=tokenizer or variant.path, reference=reference or evals, log=log)
            except Exception:
                srv.raise_if_dead()  # a dead server explains the failure better than a refused connection
                raise
    else:
        log(f"{variant.name}: every result is cached in {cache}; not serving")
    parity_report = json.loads(parity_file.read_text()) if parity else None
    if parity_report is not None and parity_report["verdict"] != "pass":
        raise QuantgateError(f"engine parity failed for the baseline: {parity_report['reason']}", where=str(parity_file),
                             fix="the serving engine, not quantization, is wrong: change serving.dtype or the engine version")
    ev = Evidence(variant=variant, folder=folder, cache=cache, serve_command=server.command, parity=parity_report,
                  node_commands=getattr(server, "commands", []),
                  dtype=_arg(config.args, "--dtype", None),
                  evals=evals, recall=recall, perf=perf, fidelity=fid, served=served)
    write_json(folder / "evidence.json", ev.model_dump(mode="json"))
    return ev


def _arg(args: list[str], flag: str, default: str | None) -> str | None:
    return args[args.index(flag) + 1] if flag in args else default


def compare_variants(baseline: Evidence, candidate: Evidence, run: Path) -> dict[str, Any]:
    out = {name: compare_dirs(baseline.evals[name], candidate.evals[name]) for name in baseline.evals}
    write_json(run / "compare" / f"{candidate.variant.name}.json", out)
    if baseline.recall is not None and candidate.recall is not None:
        recall.compare_dirs(baseline.recall, candidate.recall, run / candidate.variant.name / "recall", candidate.variant.name)
    if baseline.fidelity and candidate.fidelity:
        fidelity_step.compare(run, baseline.fidelity, candidate.variant.name, candidate.fidelity)
    if baseline.perf is not None and candidate.perf is not None:
        ratios = perf_compare(load_result(baseline.perf), load_result(candidate.perf))
        write_json(run / candidate.variant.name / "pay_off.json", {**ratios, "file": str(candidate.perf / "perf.json")})
    return out


def judge(spec: ReleaseSpec, run: Path, baseline: Evidence, candidates: list[Evidence], log: Log = print) -> dict[str, Path]:
    """The spec's LLM judge on every candidate against the baseline (<run>/<candidate>/judge/report.json, read by
    the gate); one judge server for all of them when the judge is served. Failures are recorded for the gate, then
    raised (quantgate.release.judge_step)."""

    return judge_candidates(spec, run, baseline, candidates, log=log)


def next_schemes(spec: ReleaseSpec, decisions: list) -> list[str]:
    """The schemes to try next given the gate's decisions so far: all at once without a ladder; with one, the next
    in the spec's order while none is promoted. [] when the release is done (quantgate.release.ladder)."""

    return next_rung(spec.schemes, {d.candidate: d.decision for d in decisions}, spec.ladder)


def _rungs(spec: ReleaseSpec, decisions: list) -> list[dict]:
    return rungs(spec.schemes, {d.candidate: d.decision for d in decisions}, {d.candidate: d.reasons for d in decisions})


def _summary_row(base: Evidence, cand: Evidence, comparison: dict[str, Any]) -> dict[str, Any]:
    metrics = {}
    for set_name, report in comparison.items():
        for metric, m in report["metrics"].items():
            o = m["overall"]
            metrics[f"{set_name}/{metric}"] = {k: o.get(k) for k in ("n", "base_mean", "cand_mean", "delta", "ci_low", "ci_high", "mcnemar_p")}
    return {
        "scheme": cand.variant.scheme,
        "size_bytes": cand.variant.size_bytes,
        "size_ratio": round(cand.variant.size_bytes / base.variant.size_bytes, 4),
        "metrics": metrics,
        "regressions": sum(len(r["regressions"]) for r in comparison.values()),
        "agreement": {s: r["agreement"]["overall"] for s, r in comparison.items()},
    }


def gate(spec: ReleaseSpec, run: Path, candidates: list[str]) -> list:
    """The policy's decision for every candidate (<run>/decision.json and <run>/<candidate>/decision.json); with a
    ladder, decision.json also lists every rung with its decision and reasons, or why it was not tried."""

    decisions, path = gate_run(run, policy_path(spec), candidates)
    if spec.ladder:
        write_json(path, {**json.loads(path.read_text(encoding="utf-8")), "ladder": _rungs(spec, decisions)})
    return decisions


def promote(spec: ReleaseSpec, run: Path, decision, variant: Variant) -> dict[str, Any]:
    """Register a promoted candidate; the version is its content hash, so promoting twice gives one entry."""
    model = spec.model if "/" not in spec.model else Path(spec.model).name
    entry = registry.promote(decision, model=model, version=f"{variant.name}-{variant.content_hash[:12]}",
                             checkpoint=variant.path, run=run, expected_sha256=variant.content_hash)
    write_json(run / variant.name / "promotion.json", entry)
    return entry


def finish_run(spec: ReleaseSpec, run: Path, base: Evidence, cands: list[Evidence], comparisons: dict[str, dict],
               decisions: list, promotions: dict[str, dict]) -> dict[str, Any]:
    """<run>/summary.json: a row per candidate tried; with a ladder, the rungs (schemes not tried are no row)."""
    by_name = {d.candidate: d for d in decisions}
    promoted = [d.candidate for d in decisions if d.promoted]
    summary = {
        "release": spec.name, "run": run.name, "model": spec.model, "hardware": spec.hardware,
        "baseline": {"size_bytes": base.variant.size_bytes, "parity": base.parity and {k: base.parity[k] for k in ("verdict", "reason")}},
        "candidates": {c.variant.name: {**_summary_row(base, c, comparisons[c.variant.name]),
                                        "decision": by_name[c.variant.name].decision,
                                        "reasons": by_name[c.variant.name].reasons,
                                        "registry": promotions.get(c.variant.name, {}).get("path")} for c in cands},
        "decision": overall([d.decision for d in decisions]),
        "promoted": promoted,
        "notes": [f"{c.variant.name} was served with {c.dtype or 'auto'} activations, the baseline with {base.dtype or 'auto'}: "
                  "its deltas include the engine's numerics at that dtype, not only the quantized weights"
                  for c in cands if c.dtype != base.dtype],
        "policy": decisions[0].policy if decisions else None,
    }
    summary["notes"] += [f"the judge failed for {c.variant.name}: {err}" for c in cands
                         if (err := failure(run, c.variant.name))]
    if spec.ladder:
        summary["ladder"] = _rungs(spec, decisions)
        summary["notes"].append(describe(summary["ladder"]))
    write_json(run / "summary.json", summary)
    return summary


def publish(run: Path) -> str:
    """The run's HTML/Markdown report (<run>/report.html, report.md) and its row in the results database;
    returns the Markdown for the Prefect artifact."""

    _, md = write_report(run)
    with Store(default_path()) as store:
        store.ingest(run)
    return md.read_text(encoding="utf-8")
