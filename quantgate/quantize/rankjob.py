"""Rank a rejected candidate's decoder layers and measure the repairs the ranking proposes, in a child process
(adapter: transformers and torch on the CPU, through quantgate.quantize.sensitivity).

    python -m quantgate.quantize.rankjob JOB.json OUT.json        # what quantgate.release.repair_step runs

The job names the baseline and candidate checkpoints, the baseline's fidelity samples file and the prompts to rank
on (every draw of each), the failing slices with their limits, the layers' added bytes and the size budget:

1. the truth of "keep layer l at 16 bits", one layer at a time (sensitivity.Pair.measure with `restore`);
2. the layers in order of the limits' share they remove (repair.order_for), and the numbers of layers the budget
   allows (repair.within_budget);
3. each such top-k set kept together, measured in one pass each: its slices' KL and top-1 agreement as the gate
   reads them.

A child process, so that torch's memory and threads go when it ends and a kill of the release takes it too. It
prints one progress line per measured batch (`PROGRESS` first: the parent relays them) and writes OUT.json last.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from quantgate.base.fileio import write_json
from quantgate.quantize.repair import POOLED, layer_gains, order_for, slice_kl, within_budget
from quantgate.quantize.sensitivity import Pair, read_samples


PROGRESS = "progress: "  # the prefix of the lines the parent relays


class RankJob(BaseModel):
    model_config = ConfigDict(extra="forbid")

    baseline: Path
    candidate: Path
    samples: Path                  # the baseline's fidelity samples.jsonl (prompt ids + sampled continuation)
    prompts: list[str]             # prompt ids to rank on: every draw of each (`<id>#<k>`) is scored
    limits: dict[str, float]       # the failing slices (and "pooled") -> their KL limit
    extra_bytes: list[int]         # per decoder layer: the bytes keeping it at 16 bits adds
    candidate_bytes: int
    max_kept: int
    max_size_ratio: float | None
    threads: int | None = None


class RankResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    layers: int
    sequences: int
    scored_tokens: int
    before: dict[str, float]               # each slice's KL of the candidate as quantized, on the ranking sequences
    before_top1: dict[str, float]          # and its top-1 agreement
    gains: dict[str, list[float]]          # slice -> per layer: KL removed by keeping that layer alone
    order: list[int]
    sizes: list[int]                       # the numbers of layers the budget allows, measured below
    measured: dict[int, dict[str, float]]  # k -> each slice's KL with order[:k] kept together
    measured_top1: dict[int, dict[str, float]]  # k -> each slice's top-1 agreement with them kept
    truth_s: float
    sets_s: float


def run(job: RankJob, say=print) -> RankResult:
    wanted = set(job.prompts)
    # a prompt's k-th draw is `<id>#<k>` (quantgate.fidelity.stream.DRAW, a layer above this one)
    seqs = [s for s in read_samples(job.samples) if s.id.split("#", 1)[0] in wanted]
    if not seqs:
        raise SystemExit(f"none of the {len(wanted)} ranking prompts is in {job.samples}")
    slices = [s for s in job.limits if s != POOLED]
    t0 = time.perf_counter()
    with Pair(job.baseline, job.candidate, threads=job.threads) as pair:
        say(f"ranking {pair.layers} layers on {len(seqs)} sequences ({', '.join(slices) or 'pooled'})")
        truth = pair.measure(seqs, restore=range(pair.layers),
                             progress=lambda n, total: say(f"one layer at a time: {n}/{total} sequences"))
        truth_s = time.perf_counter() - t0
        gains = layer_gains(truth.kl, truth.tokens, truth.categories, truth.layers)
        order = order_for(gains, job.limits)
        sizes = within_budget(order, job.extra_bytes, job.candidate_bytes, job.max_kept, job.max_size_ratio)
        t1 = time.perf_counter()
        sets = pair.measure(seqs, keep={f"top{k}": order[:k] for k in sizes},
                            progress=lambda n, total: say(f"{len(sizes)} repairs kept together: {n}/{total} sequences"))
        sets_s = time.perf_counter() - t1
    before = slice_kl(truth.kl["all"], truth.tokens, truth.categories)
    measured = {k: slice_kl(sets.kl[f"top{k}"], sets.tokens, sets.categories) for k in sizes}
    top1 = {k: slice_kl(sets.agree[f"top{k}"], sets.tokens, sets.categories) for k in sizes}
    return RankResult(layers=truth.layers, sequences=len(seqs), scored_tokens=int(truth.tokens.sum()), before=before,
                      before_top1=slice_kl(truth.agree["all"], truth.tokens, truth.categories),
                      gains={s: [round(float(x), 8) for x in g] for s, g in gains.items()}, order=order, sizes=sizes,
                      measured=measured, measured_top1=top1, truth_s=round(truth_s, 1), sets_s=round(sets_s, 1))


def main(argv: list[str]) -> int:
    job = RankJob.model_validate_json(Path(argv[0]).read_text(encoding="utf-8"))
    result = run(job, say=lambda line: print(PROGRESS + line, flush=True))
    write_json(Path(argv[1]), result.model_dump(mode="json"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
