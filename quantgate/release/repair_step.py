"""The repair rung (spec `repair`): when the gate REJECTs a quantized scheme by fidelity, find which decoder layers
cost that KL and quantize the scheme again with the fewest of them kept at 16 bits (docs/repair.md).

    pick = to_repair(spec, decisions, variants)        # (its decision, its variant), or None
    rung = plan(spec, run, model_dir, baseline, pick)   # ranks in a child process, writes <run>/<name>/repair.json
    ... the flow measures `rung` like any scheme (quantize_variant with rung.ignore), and the gate judges it

1. The ranking prompts: the first `repair.rank_prompts` prompts of each slice in the stream order (seeded, fixed
   before any value is seen) that the baseline sampled: every eval category, and a context length whose check
   failed. Every draw of each is scored.
2. quantgate.quantize.rankjob, in a child process on the cores the release's jobs have left (all of them: the
   rung's servers are stopped): the one-layer-at-a-time truth, the order, and each top-k set the size budget allows
   measured kept together.
3. The fewest layers whose measured KL is within `repair.margin` x the limit in every slice, and whose top-1
   disagreement is within `repair.margin` x what each slice's top-1 limit allows (repair.choose); the largest the
   budget allows when none is (the gate still decides it: the record says it was not predicted to pass).

The ranking prompts are held out of the repaired candidate's fidelity sample (fidelity_step.held_out), and the
gate judges it at `repair.alpha_share` of the policy's fidelity alpha and every quantized scheme at the rest
(`looks`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from quantgate.base.errors import QuantgateError
from quantgate.base.runfiles import REPAIR
from quantgate.fidelity.sampling import SAMPLES
from quantgate.fidelity.run import read_lines
from quantgate.fidelity.stream import DRAW, stream_ids
from quantgate.gate.looks import repair_split
from quantgate.gate.models import Decision, KeptLayer, Look
from quantgate.gate.policy import load_policy
from quantgate.gate.repairfile import LayerRanking, RepairRecord, load_repair
from quantgate.quantize.preflight import read_layout
from quantgate.quantize.rankjob import PROGRESS, RankJob, RankResult
from quantgate.quantize.repair import POOLED, choose, layer_of, layer_patterns, ranking_prompts
from quantgate.quantize.schemes import load_schemes
from quantgate.release import fidelity_step
from quantgate.release.variants import Evidence, RepairRung, Variant
from quantgate.spec.schema import ReleaseSpec, policy_path
from quantgate.spec.sections import RepairSpec

Log = Callable[[str], None]
SUFFIX = RepairSpec.SUFFIX
KL_CHECK = "fidelity:kl"  # the pooled check; per slice: fidelity:kl:<slice>
TOP1_CHECK = "fidelity:top1"


def repair_name(scheme: str) -> str:
    return scheme + SUFFIX


def to_repair(spec: ReleaseSpec, decisions: list[Decision], variants: Mapping[str, Variant]
              ) -> tuple[Decision, Variant] | None:
    """The first scheme, in the spec's order, that the gate REJECTed by fidelity (a failed KL or top-1 check) and that
    has no repair yet, while nothing is promoted; None otherwise (one repair per release)."""
    if spec.repair is None or any(d.promoted for d in decisions):
        return None
    by = {d.candidate: d for d in decisions}
    for scheme in spec.schemes:
        d, v = by.get(scheme), variants.get(scheme)
        if (d is not None and v is not None and d.decision == "REJECT" and v.origin == "quantized"
                and repair_name(scheme) not in variants
                and any(c.name.startswith((KL_CHECK, TOP1_CHECK)) and c.outcome == "fail" for c in d.checks)):
            return d, v
    return None


def limits(decision: Decision, slices: list[str], check: str = KL_CHECK) -> dict[str, float]:
    """The limit of `check` (fidelity:kl, fidelity:top1) in each slice the repair must bring within (and `pooled`):
    a slice's own check's limit where the decision has one, else the pooled limit; a context length only where its
    check failed. {} when the decision has no pooled `check` (the policy has none)."""
    checks = {c.name: c for c in decision.checks if c.name.startswith(check)}
    pooled = checks.get(check)
    if pooled is None or not isinstance(pooled.limit, (int, float)):
        return {}
    out = {POOLED: float(pooled.limit)}
    for s in slices:
        c = checks.get(f"{check}:{s}")
        if s.startswith("context:") and (c is None or c.outcome != "fail"):
            continue
        out[s] = float(c.limit) if c is not None and isinstance(c.limit, (int, float)) else float(pooled.limit)
    return out


def plan(spec: ReleaseSpec, run: Path, model_dir: Path, baseline: Evidence, pick: tuple[Decision, Variant],
         log: Log) -> RepairRung:
    """Rank the rejected candidate's layers, choose the layers to keep, write <run>/<name>/repair.json (kept when
    it is there already: a re-run repairs the same way) and return the rung to measure."""
    r = spec.repair
    assert r is not None
    decision, cand = pick
    name = repair_name(cand.name)
    folder = run / name
    if (folder / REPAIR).is_file():
        rec = load_repair(folder / REPAIR)
        log(f"{name}: repair planned before ({folder / REPAIR}): keeps layers {[k.layer for k in rec.kept]}")
        return RepairRung(name, cand.scheme or cand.name, [k.modules for k in rec.kept], cand.name)
    if "main" not in baseline.fidelity:
        raise QuantgateError("the baseline has no fidelity samples to rank the layers on", where="repair",
                             fix="the repair rung needs `fidelity`; re-run the release")
    samples = fidelity_step.samples_beside(baseline.fidelity) / SAMPLES
    category = _sampled(samples)
    slices = sorted(set(category.values()))
    lim, top1 = limits(decision, slices), limits(decision, slices, TOP1_CHECK)
    if not lim:
        raise QuantgateError(f"{decision.candidate}'s decision has no pooled KL limit", where="repair",
                             fix="the repair rung needs the policy's fidelity KL check")
    order = stream_ids(fidelity_step.sampled_prompts(spec, model_dir)[0])
    drawn = ranking_prompts(order, category, set(category), [s for s in lim if s != POOLED], r.rank_prompts)
    if not any(drawn.values()):
        raise QuantgateError(f"none of the {len(category)} prompts in {samples} is one of this release's fidelity "
                             "prompts", where="repair", fix="a bug or a foreign samples file: re-run the release")
    layout = read_layout(model_dir)
    bits = load_schemes().get(cand.scheme or cand.name).weight_bits
    extra = _extra_bytes(layout.linears, bits)
    job = RankJob(baseline=model_dir, candidate=cand.path, samples=samples,
                  prompts=[p for ids in drawn.values() for p in ids], limits=lim, extra_bytes=extra,
                  candidate_bytes=cand.size_bytes or 1, max_kept=r.max_kept, max_size_ratio=r.max_size_ratio,
                  threads=len(os.sched_getaffinity(0)))
    log(f"{name}: ranking {cand.name}'s decoder layers by the KL they cost {', '.join(lim)} "
        f"(limits {', '.join(f'{v:g}' for v in lim.values())}) on {len(job.prompts)} prompts the baseline sampled")
    result = _run_job(job, log)
    pick_ = choose(result.measured, result.order, lim, result.sizes, r.margin, result.measured_top1, top1)
    if pick_ is None:
        raise QuantgateError(f"no repair of {cand.name} fits the size budget (max_size_ratio {r.max_size_ratio})",
                             where="repair", fix="raise repair.max_size_ratio or repair.max_kept")
    patterns = layer_patterns(pick_.keep, [lin.name for lin in layout.linears])
    kept = [KeptLayer(layer=i, modules=p, removes={s: round(result.gains[s][i], 6) for s in lim},
                      added_bytes=extra[i]) for i, p in zip(pick_.keep, patterns)]
    k = len(pick_.keep)
    rec = RepairRecord(candidate=name, repairs=cand.name, scheme=cand.scheme or cand.name, failing=lim, kept=kept,
                       min_top1=top1, measured={s: round(v, 6) for s, v in pick_.measured.items()},
                       measured_top1={s: round(v, 6) for s, v in result.measured_top1[k].items()}, passes=pick_.passes,
                       margin=r.margin, added_size=round(sum(extra[i] for i in pick_.keep) / (cand.size_bytes or 1), 4),
                       alpha=looks(spec, [name])[name].alpha,
                       ranking=LayerRanking(prompts=job.prompts, per_slice=r.rank_prompts,
                                       sequences=result.sequences, scored_tokens=result.scored_tokens,
                                       before=result.before, before_top1=result.before_top1, gains=result.gains,
                                       order=result.order, tried=result.measured, tried_top1=result.measured_top1,
                                       truth_s=result.truth_s, sets_s=result.sets_s))
    rec.write(folder)
    log(_chosen(rec))
    return RepairRung(name, rec.scheme, patterns, cand.name)


def _chosen(rec: RepairRecord) -> str:
    """The log line of a chosen repair: the layers, their bytes, and each slice before and after on the prompts."""
    r = rec.ranking
    kl = ", ".join(f"{s} {r.before.get(s, float('nan')):.4f} -> {v:.4f}" for s, v in rec.measured.items())
    top1 = ", ".join(f"{s} {r.before_top1.get(s, float('nan')):.1%} -> {rec.measured_top1.get(s, float('nan')):.1%}"
                     for s in rec.min_top1)
    return (f"{rec.candidate}: keeps layers {[k.layer for k in rec.kept]} at 16 bits (+{rec.added_size:.1%} bytes); on "
            f"the ranking prompts, KL {kl}; top-1 {top1}"
            + ("" if rec.passes else f"; not within {rec.margin:g} x every limit: the largest repair the budget allows"))


def _sampled(samples: Path) -> dict[str, str]:
    """prompt id -> its slice, for the prompts the baseline sampled (a stopped sampling: those it reached)."""
    return {row["id"].split(DRAW, 1)[0]: row["category"] for row in read_lines(samples)}


def _extra_bytes(linears, weight_bits: int) -> list[int]:
    """Per decoder layer: the bytes its Linear weights add at 16 bits instead of `weight_bits`."""
    per: dict[int, int] = {}
    for lin in linears:
        if (found := layer_of(lin.name)) is not None:
            per[found[0]] = per.get(found[0], 0) + lin.in_features * lin.out_features
    return [per.get(i, 0) * (16 - weight_bits) // 8 for i in range(max(per) + 1 if per else 0)]


def _run_job(job: RankJob, log: Log) -> RankResult:
    with tempfile.TemporaryDirectory(prefix="quantgate-rank-") as tmp:
        job_path, out = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(job.model_dump_json(), encoding="utf-8")
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "quantgate.quantize.rankjob", str(job_path), str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        tail: list[str] = []
        try:
            for line in proc.stdout:
                tail = (tail + [line.rstrip()])[-20:]
                if line.startswith(PROGRESS):  # its own lines; the libraries' warnings stay in `tail`
                    log(f"repair: {line.removeprefix(PROGRESS).rstrip()} ({time.monotonic() - t0:.0f} s)")
            rc = proc.wait()
        except BaseException:
            proc.kill()
            raise
        if rc != 0 or not out.is_file():
            raise QuantgateError(f"ranking the layers failed (exit {rc}): " + " | ".join(tail[-5:]), where="repair",
                                 fix="the last lines of the ranking's output say why; `repair: null` gates without it")
        return RankResult.model_validate_json(out.read_text(encoding="utf-8"))


def looks(spec: ReleaseSpec, names: list[str]) -> dict[str, Look]:
    """With `repair`, each candidate's look of the split alpha: a repaired one at `alpha_share`, a quantized scheme
    at the rest (planned before any look: whichever scheme is repaired); {} without `repair` or fidelity."""
    if spec.repair is None or spec.fidelity is None:
        return {}
    policy = load_policy(policy_path(spec))
    if policy.fidelity is None:
        return {}
    first, second = repair_split(policy.fidelity.alpha, spec.repair.alpha_share)
    repairs = {repair_name(s) for s in spec.schemes}
    return {n: second if n in repairs else first for n in names if n in repairs or n in spec.schemes}


__all__ = ["RepairRung", "looks", "plan", "repair_name", "to_repair"]
