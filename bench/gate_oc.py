"""Operating characteristics of the promotion gate: how often it promotes a candidate of known quality.

Simulated paired evidence goes through the project's own code, as a release's does: per-sample scores ->
quantgate.evals.compare.compare_runs -> quantgate.gate.evidence (comparison_evidence, paired_harm,
fidelity_evidence) -> quantgate.gate.checks.evaluate with a real policy file. Only the per-sample scores are
simulated; every statistic and decision is the gate's.

Shapes:
- demo: the samples of eval_sets/default.jsonl (300: their categories and metrics) and the recall grid of
  releases/demo.yaml (3 lengths x 4 kinds x 2 samples = 24 haystacks, a needle at each of 5 depths: 120 needles,
  as `make demo` asks them); fidelity as releases/demo.yaml sets it (read through the spec model: every one of the
  300 samples, 50 per category, each with `fidelity.draws` sampled answers of about 25 tokens; its
  `context_prompts` haystacks per recall length, each a continuation of about 230 tokens; the floor on a
  stratified subset of 60);
- r500: 500 samples drawn from the same set (new ids) and the same recall grid.
Recall needles that share a haystack are not independent: each haystack draws its own difficulty (the baseline's
chance of recalling its needles varies around RECALL_RATE with intra-haystack correlation RECALL_ICC), so the
simulated evidence has the clustering a real grid has, and the gate's per-needle test is judged on it.
Fidelity per sample, as the gate measures it on sampled continuations, in one of two models:
- a real run's (the default: bench/data/demo_int8_fidelity_shape.json and demo_int8_fidelity_shape_fresh.json, the
  per-sample figures of two `make demo` runs' INT8 candidate, kept with --save-shape, each in turn; or any runs'
  <run>/fidelity/<candidate>.json with --fidelity-file): its
  samples drawn with replacement, each kind for its own slices (haystack continuations for context lengths, eval
  prompts' draws for categories), their token counts as they were and their KL and top-1 residuals moved to the
  scenario's values (`real_shape`: the spread between samples, the estimator's noise and top-1's clustering as
  measured);
- simulated (--simulated): a per-sample mean KL drawn around the scenario's KL (gamma, coefficient of variation
  --fidelity-cv) plus the sampled estimator's own noise: each token's estimate has the position's KL as its mean
  and about NOISE_V x KL as its variance (a plain log-ratio: 2 x KL; the exact part over the shared top-k lowers
  it), so a sample's sum is n x kl plus normal noise of sd sqrt(NOISE_V x kl x n); top-1 agreements binomial. A
  stress model: next to the demo's INT8 run its per-sample variance is 1.4-3x too high, and an eval prompt's two
  draws hold 50 tokens where the run's held 50-90.
Top-1 agreement falls with KL as 1 - 0.42 sqrt(KL) (the demo's INT8 candidate: KL 0.031, 92.7%; llama.cpp's 8-bit
pair: 0.0014, 97.7%), and a scenario at f times the limits keeps its top-1 disagreement at most f times the
family's limit on it (`_miss_of`).
Scenarios (per scheme family, each with its own limits in the policy):
- lossless-F: accuracy unchanged, F of the samples flip (half right->wrong, half wrong->right), fidelity at the floor;
- good-0.4x / good-0.5x: fidelity at 0.4x / 0.5x the family's limits in every category, 5% balanced flips;
- kl-2x-limit: fidelity at twice the family's KL limit, accuracy unchanged (5% flips);
- numbers-2.5x: arithmetic_numbers carries 2.5x the KL limit while the pooled KL stays at 0.6x (the other
  categories at 0.22x), numeric_match 20% lower there; multilingual-2.5x: the same in multilingual, chrF 10% lower;
  numbers-2x: arithmetic_numbers at exactly 2x, the others at 0.3x (pooled 0.58x), accuracy unchanged;
- at-limit: fidelity exactly at the KL limit in every category; at-limit+adaptive: the same with an adaptive
  widening (the spec's own looks when it plans one, else half the fidelity sample, then all of it if
  INCONCLUSIVE), each look spending its share of alpha;
  both also under the policy with per-category fidelity off (pooled only), where the pooled bound alone decides;
- fidelity at each context length: fidelity.context_prompts haystack prompts per recall length, the category
  context:<length>, with the same spread; long-2x: context:4096 at 2x the KL limit, all else at 0.4x;
  recall-halved-at-<length>: the recall at one context length (a third of the grid) halves, all else fine (the
  per-length recall checks' harm tests see it), one scenario per length; long-2x+recall-halved: both, at the
  longest; --recall-samples N judges a grid of N haystacks per kind and length instead of the spec's;
- numbers-later-1.4x (looks [150, 300], [75, 150, 300], or the default fidelity.limit of 120 at one look): an
  ordered set. arithmetic_numbers sits exactly at its KL limit on average, but its first half of ids (file order) at
  0.6x and its later half at 1.4x; the other categories at 0.5x. Each look reads the subset the release draws
  (quantgate.fidelity.run.stratified: seeded, nested, within each category); --first-ids draws the first ids
  instead, as the release did before, to show what that let through;
- pooled-at-limit, haystacks 0.5x, looks [75, 150, 300], judged with per-category fidelity off: the context slices
  at 0.5x the limit and the eval categories above it, so that the last look's pooled KL is exactly at the limit
  (per-slice KL that differs: the mix matters). An interim look weights its eval prompts as the last look will hold
  them (Look.growth); --unweighted judges each look's own, haystack-heavier mix, as the gate did before;
- drop-10%: every task measure loses 10% of its baseline value (binary ones by right->wrong flips only,
  continuous ones by a 10% lower score), fidelity at the floor: harm only the task checks can see;
- drop-10%-binary: the same drop on the binary metrics and recall only, continuous scores unchanged: the hard case,
  where only the pooled binary test and recall can see it. drop-10%+2%flips adds 2% background flips to that
  (printed, not a target).

Targets for the default policy at the demo shape: P(PROMOTE | lossless, flips <= 5%) >= 0.90;
P(PROMOTE | good, fidelity <= 0.5x the limits) >= 0.90; P(PROMOTE | kl-2x-limit) <= 0.05;
P(PROMOTE | one category at >= 2x its limit, pooled under) <= 0.10; P(PROMOTE | at the limit) <= 0.05 for one look
and with adaptive widening (pooled only too), and on every subset a release draws (numbers-later-1.4x at each look
plan, pooled-at-limit); P(PROMOTE | drop-10%) <= 0.10 and P(PROMOTE | drop-10%-binary) <= 0.10. Each target is
checked on every per-sample shape given (--fidelity-file: by default the shipped shape and a fresh run's).

--draws N (sampled answers per eval prompt, a multiple of the spec's) and --context-prompts N (haystacks per length)
give the fidelity evidence a larger token budget; --simulated --lognormal SIGMA draws each sample's KL from a
lognormal (a heavy tail) instead of the gamma.

--stream adds the release's streaming looks (quantgate.gate.stream) to every scenario with one fidelity look: the
full sample (its eval prompts and haystacks) in stream order (quantgate.base.subsets.interleave), and at each planned
prefix (10%..90%) the gate's fidelity checks at that look's share of alpha, as quantgate.gate.early.stream_checks
judges them: the pooled checks on prefixes of the whole stream (none below 24 prompts), each slice's on prefixes of
its own order (none below the policy's min_category_samples). A failed check is a REJECT decided there; a streaming look never
PROMOTEs (else the full sample is judged as before), so the same targets hold over all looks. A second table gives,
per cell, the share of trials decided at a streaming look and the mean fraction of the sample read at the decision.

    .venv/bin/python bench/gate_oc.py [--trials 200] [--policy releases/policies/default.yaml] [--shape demo r500]
        [--fidelity-file SHAPE ...] [--scenario NAME ...] [--first-ids] [--unweighted] [--stream]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's quantgate

from quantgate.serving.kernel_probe import cpuinfo  # noqa: E402
from quantgate.base.paths import EVAL_SETS, RELEASES  # noqa: E402
from quantgate.base.subsets import interleave
from quantgate.evals.compare import compare_runs  # noqa: E402
from quantgate.fidelity.core import SampleFidelity  # noqa: E402
from quantgate.fidelity.run import stratified  # noqa: E402
from quantgate.fidelity.record import POOLED
from quantgate.gate import stream
from quantgate.gate.checks import evaluate  # noqa: E402
from quantgate.gate.evidence import comparison_evidence, paired_harm  # noqa: E402
from quantgate.gate.fidelityevidence import fidelity_evidence  # noqa: E402
from quantgate.gate.looks import repair_split, spend  # noqa: E402
from quantgate.gate.models import (Decision, GateEvidence, Look, ParityEvidence, RateEvidence, Ratio,  # noqa: E402
                                   PairedStat)
from quantgate.perf.models import PayOffFigures  # noqa: E402
from quantgate.gate.policy import GatePolicy, load_policy  # noqa: E402
from quantgate.gate.statistical import fidelity_checks
from quantgate.spec.adaptive import fidelity_looks, fidelity_size  # noqa: E402
from quantgate.spec.schema import ReleaseSpec  # noqa: E402

# Baseline behaviour of the simulated model, per metric: the share answered right (binary) or the mean score
# (continuous). Set near the demo model's own baseline on the default set; --rates FILE overrides them.
RATES = {"exact_match": 0.45, "contains": 0.55, "numeric_match": 0.30, "choice_accuracy": 0.50, "chrf": 0.35,
         "bleu": 0.15, "token_f1": 0.45, "rouge_l": 0.30}
BINARY = {"exact_match", "contains", "numeric_match", "choice_accuracy"}
RECALL_RATE, RECALL_ICC = 0.5, 0.10  # baseline recall per needle; correlation of needles within one haystack


def recall_grid(spec: Path = RELEASES / "demo.yaml") -> tuple[int, int, list[int]]:
    """(haystacks, needles per haystack, lengths) of a release spec's recall grid, layout `turns` or `together`;
    the haystacks are ordered by length."""
    r = yaml.safe_load(spec.read_text(encoding="utf-8"))["recall"]
    return len(r["lengths"]) * len(r["kinds"]) * r["samples"], len(r["depths"]), sorted(r["lengths"])


HAYSTACKS, NEEDLES_PER_HAYSTACK, LENGTHS = recall_grid()
RECALL_KINDS = len(yaml.safe_load((RELEASES / "demo.yaml").read_text(encoding="utf-8"))["recall"]["kinds"])
CONTEXT = [f"context:{n}" for n in LENGTHS]  # fidelity at each recall length (fidelity.context_prompts each)


def fidelity_shape(spec: Path = RELEASES / "demo.yaml") -> tuple[int, int, int, int, int, int]:
    """(fidelity samples at the first look, at the last look the adaptive design plans, haystack prompts per length,
    sampled answers per eval prompt, tokens per haystack continuation, sequences of the floor's path) of a release
    spec, read through the project's own spec model and look plan (quantgate.spec.adaptive.fidelity_looks)."""
    raw = yaml.safe_load(spec.read_text(encoding="utf-8"))
    raw["hardware"] = "a100"  # a GPU profile: no kernel probe; the shape does not depend on the machine
    s = ReleaseSpec.model_validate(raw, context={"path": str(spec)})
    f = s.fidelity
    assert f is not None, f"{spec} has no fidelity section"
    looks = fidelity_looks(s) or [fidelity_size(s)]
    return looks[0], looks[-1], f.context_prompts, f.draws, f.context_new_tokens, f.floor_samples or looks[-1]


ANSWER_TOKENS = 25           # a sampled answer to an eval prompt of the default set: about 25 tokens (demo runs)
FIDELITY_SAMPLES, WIDENED, CONTEXT_PROMPTS, DRAWS, CONTEXT_NEW, FLOOR_SAMPLES = fidelity_shape()
# the looks of the adaptive scenarios: the spec's own when it plans a widening, else a first look at half the
# sample and a second at all of it (the demo scores every eval prompt at once: one look)
ADAPTIVE_PLAN = [FIDELITY_SAMPLES, WIDENED] if WIDENED > FIDELITY_SAMPLES else \
    [FIDELITY_SAMPLES // 2, FIDELITY_SAMPLES]
TOKENS_PER_SAMPLE = DRAWS * ANSWER_TOKENS  # an eval prompt's draws are one sample
CONTEXT_TOKENS = int(0.9 * CONTEXT_NEW)  # a haystack document's continuation (a few end early)
FIDELITY_CV = 0.5            # spread of the per-sample mean KL (real runs: about 0.3)
LOGNORMAL: float | None = None  # --lognormal SIGMA: the per-sample mean KL lognormal (its log's sd) instead of gamma
DRAW_SETS = 1                # --draws N: an eval prompt's sample holds N / DRAWS run samples' draws (N x its tokens)
NOISE_V = 1.0                # the estimator's per-token variance, in units of the KL (plain log-ratio: about 2;
                             # the exact head over the shared top-k takes part of it away)
FLOOR_KL = 0.0005            # per-token KL of the baseline against itself on another execution path
FAMILY_SCHEME = {"fp8": "fp8-dynamic", "int8": "int8-w8a8", "w4a16": "w4a16-gptq"}
# A real run's samples (--fidelity-file), per kind ("context" for a haystack continuation, "eval" for an eval prompt's
# draws): (n_tokens, its category's KL, its KL residual, its category's top-1 miss rate, its misses' residual)
REAL_SHAPE: dict[str, list[tuple[int, float, float, float, float]]] = {}


@dataclass(frozen=True)
class Scenario:
    name: str
    flips: float                 # share of samples that flip, balanced so that accuracy is unchanged
    drop: float = 0.0            # relative drop of every task measure (right -> wrong flips only)
    kl_factor: float | None = None  # fidelity at this multiple of the family's KL limit (None: at the floor)
    binary_only: bool = False    # the drop hits binary metrics and recall only; continuous scores are unchanged
    category: str | None = None  # the category whose fidelity is at cat_kl_factor x the limit (others at kl_factor)
    cat_kl_factor: float = 0.0
    cat_metric: str | None = None  # that category's metric loses cat_drop (relative) as well
    cat_drop: float = 0.0
    adaptive: bool = False       # INCONCLUSIVE at 120 fidelity samples -> a second look at 240
    halved_at: int | None = None  # the recall at this context length (a third of the grid) halves
    later: float | None = None   # `category` ordered: its later half (file order) at `later` x the limit, its first
                                 # half at (2 - later) x: the category's mean at the limit, its first ids below it
    looks: tuple[int, ...] | None = None  # the fidelity sample of each look (fidelity.limit and adaptive), drawn by
                                          # the release's own code; None: the spec's (FIDELITY_SAMPLES)
    pooled_only: bool = False    # judged with per-category fidelity off: the pooled bound alone decides
    context_kl: float | None = None  # the context slices at this x the limit; with `pooled_at_limit` the eval
    pooled_at_limit: bool = False    # categories are set so that the last look's pooled KL is exactly at the limit


# the looks of the ordered-set scenarios: an adaptive plan of 2 and of 3 looks, and the default fidelity.limit (120
# eval prompts of the 300) at one look
ORDERED_LOOKS = {", looks [150, 300]": (150, 300), ", looks [75, 150, 300]": (75, 150, 300), ", limit 120": (120,)}
SCENARIOS = [Scenario("lossless-2%", 0.02), Scenario("lossless-5%", 0.05), Scenario("lossless-10%", 0.10),
             Scenario("good-0.4x", 0.05, kl_factor=0.4), Scenario("good-0.5x", 0.05, kl_factor=0.5),
             Scenario("kl-2x-limit", 0.05, kl_factor=2.0),
             Scenario("numbers-2.5x", 0.05, kl_factor=0.22, category="arithmetic_numbers", cat_kl_factor=2.5,
                      cat_metric="numeric_match", cat_drop=0.20),
             Scenario("multilingual-2.5x", 0.05, kl_factor=0.22, category="multilingual", cat_kl_factor=2.5,
                      cat_metric="chrf", cat_drop=0.10),
             Scenario("numbers-2x", 0.05, kl_factor=0.3, category="arithmetic_numbers", cat_kl_factor=2.0),
             Scenario("at-limit", 0.05, kl_factor=1.0), Scenario("at-limit+adaptive", 0.05, kl_factor=1.0, adaptive=True),
             *[Scenario(f"recall-halved-at-{n}", 0.05, kl_factor=0.4, halved_at=n) for n in LENGTHS],
             Scenario("long-2x", 0.05, kl_factor=0.4, category=f"context:{max(LENGTHS)}", cat_kl_factor=2.0),
             Scenario("long-2x+recall-halved", 0.05, kl_factor=0.4, category=f"context:{max(LENGTHS)}",
                      cat_kl_factor=2.0, halved_at=max(LENGTHS)),
             *[Scenario(f"numbers-later-1.4x{tag}", 0.05, kl_factor=0.5, category="arithmetic_numbers",
                        cat_kl_factor=1.0, later=1.4, looks=looks) for tag, looks in ORDERED_LOOKS.items()],
             Scenario("pooled-at-limit, haystacks 0.5x, looks [75, 150, 300]", 0.05, context_kl=0.5,
                      pooled_at_limit=True, pooled_only=True, looks=(75, 150, 300)),
             Scenario("drop-10%", 0.0, drop=0.10),
             Scenario("drop-10%-binary", 0.0, drop=0.10, binary_only=True),
             Scenario("drop-10%+2%flips", 0.02, drop=0.10, binary_only=True)]
AT_LIMIT = {"at-limit", "at-limit+adaptive"}  # also judged under the pooled-only policy, with the same looks
AT_LIMIT_SUBSETS = [sc.name for sc in SCENARIOS if sc.later is not None or sc.pooled_at_limit]


def load_samples(shape: str, rng: np.random.Generator) -> list[dict]:
    rows = [json.loads(x) for x in (EVAL_SETS / "default.jsonl").read_text(encoding="utf-8").splitlines() if x.strip()]
    if shape == "demo":
        return rows
    picked = rng.choice(len(rows), size=500, replace=True)
    return [{**rows[i], "id": f"s{k:04d}"} for k, i in enumerate(picked)]


def _score(rng: np.random.Generator, metric: str) -> float:
    m = RATES[metric]
    if metric in BINARY:
        return float(rng.random() < m)
    return float(rng.beta(m * 4, (1 - m) * 4))


def _candidate(rng: np.random.Generator, metric: str, base: float, sc: Scenario, category: str) -> float:
    hit = sc.category == category and sc.cat_metric == metric
    drop = sc.drop + (sc.cat_drop if hit else 0.0)
    if metric in BINARY:
        p = RATES[metric]
        if base == 1.0:  # right -> wrong: half the flips, plus the drop
            return 0.0 if rng.random() < sc.flips / (2 * p) + drop else 1.0
        return 1.0 if rng.random() < sc.flips / (2 * (1 - p)) else 0.0
    value = _score(rng, metric) if rng.random() < sc.flips else base
    return value * (1 - sc.cat_drop) if hit else value if sc.binary_only else value * (1 - sc.drop)


def simulate_runs(rng: np.random.Generator, samples: list[dict], sc: Scenario) -> tuple[list[dict], list[dict]]:
    base, cand = [], []
    for s in samples:
        b = {m: _score(rng, m) for m in s["metrics"]}
        c = {m: _candidate(rng, m, v, sc, s["category"]) for m, v in b.items()}
        base.append({"id": s["id"], "category": s["category"], "output": "b", "scores": b})
        cand.append({"id": s["id"], "category": s["category"], "output": "b" if c == b else "c", "scores": c})
    return base, cand


def simulate_recall(rng: np.random.Generator, sc: Scenario) -> tuple[PairedStat, dict[str, PairedStat]]:
    """Per-needle (baseline, candidate) recall over the grid; a haystack's needles share its difficulty: a beta
    draw with mean RECALL_RATE whose spread gives intra-haystack correlation RECALL_ICC."""
    a = RECALL_RATE * (1 / RECALL_ICC - 1)
    b_ = (1 - RECALL_RATE) * (1 / RECALL_ICC - 1)
    pairs, by_length = [], defaultdict(list)
    for h in range(HAYSTACKS):
        rate = float(rng.beta(a, b_))
        length = LENGTHS[h * len(LENGTHS) // HAYSTACKS]  # the grid is ordered by length, a third at each
        for _ in range(NEEDLES_PER_HAYSTACK):
            b = float(rng.random() < rate)
            c = _candidate_recall(rng, b, sc)
            if length == sc.halved_at and c == 1.0 and rng.random() < 0.5:
                c = 0.0
            pairs.append((b, c))
            by_length[length].append((b, c))
    return _stat(pairs), {str(n): _stat(at) for n, at in sorted(by_length.items())}


def _stat(pairs: list[tuple[float, float]]) -> PairedStat:
    bm, cm = sum(p[0] for p in pairs) / len(pairs), sum(p[1] for p in pairs) / len(pairs)
    return PairedStat(n=len(pairs), base_mean=bm, cand_mean=cm, delta=cm - bm, **paired_harm(pairs, binary=False))


def _candidate_recall(rng: np.random.Generator, base: float, sc: Scenario) -> float:
    if base == 1.0:
        return 0.0 if rng.random() < sc.flips / (2 * RECALL_RATE) + sc.drop else 1.0
    return 1.0 if rng.random() < sc.flips / (2 * (1 - RECALL_RATE)) else 0.0


SHAPE_FILE = Path(__file__).resolve().parent / "data" / "demo_int8_fidelity_shape.json"
# a second real run's shape: a fresh `make demo` of 2026-12-06 (AMD EPYC; KL 0.0264, 336 samples with 12 haystacks
# per length; its heaviest slice instruction_format, per-sample KL CV 1.67 against the shipped run's 1.05)
FRESH_SHAPE_FILE = SHAPE_FILE.with_name("demo_int8_fidelity_shape_fresh.json")
SHAPE_FILES = [SHAPE_FILE, FRESH_SHAPE_FILE]
SHAPE_FIELDS = ("category", "n_tokens", "kl_sum", "top1_agree")


def save_shape(run_file: Path, out: Path) -> None:
    """The per-sample figures of a run's fidelity file (category, tokens, KL sum, top-1 agreements: no ids, no
    text), with where they came from, as a small file the bench can ship (one sample per line)."""
    doc = json.loads(run_file.read_text(encoding="utf-8"))
    head = {"made": f"bench/gate_oc.py --save-shape {run_file} {out}", "cpu": cpuinfo()[0],
            "estimator": doc.get("estimator"),
            "summary": {k: doc["summary"][k] for k in ("n_samples", "n_tokens", "kl", "top1")}}
    rows = [json.dumps({k: x[k] for k in SHAPE_FIELDS}) for x in doc["samples"]]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(head)[:-1] + ', "samples": [\n' + ",\n".join(rows) + "\n]}\n", encoding="utf-8")
    print(f"{out}: {len(rows)} samples from {run_file}")


def real_shape(path: Path) -> dict[str, list[tuple[int, float, float, float, float]]]:
    """A run's fidelity file as residuals that can be moved to any KL: for each sample with n tokens in a category
    of mean per-token KL m and top-1 disagreement rate d, (n, m, kl_sum - n m, d, misses - n d). A scenario's KL k
    then gets kl_sum = n k + residual x s(k / m), with s(r) = max(sqrt(r), r), and the same for misses. The
    estimator's noise scales like sqrt(r) (its variance is proportional to the KL), the spread between samples like
    r; the larger of the two keeps more spread than the truth would have on either side of the run's KL: below it,
    where power is measured, and above it, where error rates are. Kinds are kept apart: a haystack continuation is
    drawn only for a context slice, an eval prompt's draws only for a category."""
    rows = [x for x in json.loads(path.read_text(encoding="utf-8"))["samples"] if x["n_tokens"] > 0]
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for x in rows:
        by_cat[x["category"]].append(x)
    out: dict[str, list[tuple[int, float, float, float, float]]] = defaultdict(list)
    for cat, xs in by_cat.items():
        tok = sum(x["n_tokens"] for x in xs)
        m = max(sum(x["kl_sum"] for x in xs) / tok, 1e-9)
        d = max(sum(x["n_tokens"] - x["top1_agree"] for x in xs) / tok, 1e-9)
        kind = "context" if cat.startswith("context:") else "eval"
        out[kind].extend((x["n_tokens"], m, x["kl_sum"] - x["n_tokens"] * m, d,
                          x["n_tokens"] - x["top1_agree"] - x["n_tokens"] * d) for x in xs)
    return dict(out)


def _moved(residual: float, run_value: float, value: float) -> float:
    r = value / run_value
    return residual * max(math.sqrt(r), r)


def _miss_rate(kl: float, cap: float = 1.0) -> float:
    """Top-1 disagreement at a per-token KL: 0.42 sqrt(KL) (the demo's INT8 candidate: KL 0.031, 92.7% agreement;
    llama.cpp's 8-bit pair: 0.0014, 97.7%), at most `cap`."""
    return min(cap, 0.42 * math.sqrt(max(kl, 0.0)))


def _sample_estimate(rng: np.random.Generator, kl_mean: float, tokens: int, kind: str,
                     miss_cap: float = 1.0) -> tuple[int, float, int]:
    """(scored tokens, the sample's KL estimate (a sum), top-1 agreements) at a scenario KL of kl_mean, about
    `tokens` tokens; from a real run's residuals of the same kind when --fidelity-file gave them."""
    miss = _miss_rate(kl_mean, miss_cap)
    pool = REAL_SHAPE.get(kind)
    if pool:
        n, m, r_kl, d, r_miss = pool[int(rng.integers(len(pool)))]
        misses = int(round(min(max(n * miss + _moved(r_miss, d, miss), 0.0), n)))
        return n, n * kl_mean + _moved(r_kl, m, kl_mean), n - misses
    n = int(rng.poisson(tokens - 10)) + 10
    if LOGNORMAL is not None:  # a heavier tail than the gamma's, the same mean
        kl = kl_mean * float(np.exp(rng.normal(-LOGNORMAL ** 2 / 2, LOGNORMAL)))
    else:
        shape = 1 / FIDELITY_CV ** 2
        kl = float(rng.gamma(shape, kl_mean / shape))
    est = n * kl + (float(rng.normal(0.0, math.sqrt(NOISE_V * kl * n))) if kl > 0 else 0.0)
    return n, est, int(rng.binomial(n, 1 - miss))


def _draws(rng: np.random.Generator, kl: float, cap: float) -> tuple[int, float, int]:
    """An eval prompt's sample: DRAW_SETS samples of the spec's draws each (--draws), their sums added."""
    parts = [_sample_estimate(rng, kl, TOKENS_PER_SAMPLE, "eval", cap) for _ in range(DRAW_SETS)]
    return sum(p[0] for p in parts), sum(p[1] for p in parts), sum(p[2] for p in parts)


def simulate_fidelity(rng: np.random.Generator, kl_of: dict[str, float], n: int, categories: list[str],
                      tokens: int = TOKENS_PER_SAMPLE, miss_of: dict[str, float] | None = None) -> list[SampleFidelity]:
    """n samples stratified round-robin over `categories`, as the release draws them; a category's KL is kl_of[c]
    (kl_of["*"] for the others), its top-1 disagreement 0.42 sqrt(KL) up to miss_of[c] (miss_of["*"])."""
    out = []
    for i in range(n):
        cat = categories[i % len(categories)]
        kl_mean = kl_of.get(cat, kl_of["*"])
        cap = (miss_of or {}).get(cat, (miss_of or {}).get("*", 1.0))
        n_tok, est, agree = _sample_estimate(rng, kl_mean, tokens, "context" if cat.startswith("context:") else "eval",
                                             cap)
        out.append(SampleFidelity(id=f"{cat}-{i}", category=cat, n_tokens=n_tok, kl_sum=est, top1_agree=agree,
                                  dnll_sum=est, kl_max=kl_mean, kl_topk_sum=kl_mean * n_tok))
    return out


def first_ids(items: list[dict], limit: int | None) -> list[dict]:
    """The draw before the seeded one (--first-ids): the first ids of each category, round-robin over the sorted
    categories, to show what a fixed prefix let through."""
    if limit is None or limit >= len(items):
        return items
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for it in sorted(items, key=lambda it: it["id"]):
        by_cat[it["category"]].append(it)
    groups = [by_cat[c] for c in sorted(by_cat)]
    return [g[d] for d in range(max(map(len, groups))) for g in groups if d < len(g)][:limit]


DRAW = stratified  # how a look's subset is drawn: the release's own (quantgate.fidelity.run), or --first-ids
REWEIGHT = True  # an interim look's pooled estimate weights the eval prompts as the last look will (--unweighted: not)
STREAM = False  # --stream: a scenario with one fidelity look may REJECT at the release's streaming looks first


def eval_fidelity(rng: np.random.Generator, samples: list[dict], sc: Scenario, limit: float, kl_of: dict[str, float],
                  miss_of: dict[str, float] | None, max_miss: float | None) -> dict[str, SampleFidelity]:
    """Every eval sample's simulated fidelity, by id: its category's KL (kl_of, "*" for the others) and top-1 cap
    (miss_of); an ordered category (sc.later) has its later half, in file order, at sc.later x the limit and its
    first half at (2 - sc.later) x. A look then reads the subset the release draws (fidelity.run.stratified)."""
    size = Counter(s["category"] for s in samples)
    seen: Counter = Counter()
    out = {}
    for s in samples:
        cat = s["category"]
        kl, cap = kl_of.get(cat, kl_of["*"]), (miss_of or {}).get(cat, (miss_of or {}).get("*", 1.0))
        if sc.later is not None and cat == sc.category:
            f = sc.later if seen[cat] >= size[cat] / 2 else 2 - sc.later
            kl, cap = f * limit, f * max_miss if max_miss is not None else 1.0
        seen[cat] += 1
        n_tok, est, agree = _draws(rng, kl, cap)
        out[s["id"]] = SampleFidelity(id=s["id"], category=cat, n_tokens=n_tok, kl_sum=est, top1_agree=agree,
                                      dnll_sum=est, kl_max=kl, kl_topk_sum=kl * n_tok)
    return out


def _mean_tokens(kind: str, simulated: float) -> float:
    pool = REAL_SHAPE.get(kind)
    return statistics.fmean(x[0] for x in pool) if pool else simulated


def pooled_mix(sc: Scenario, final_eval: int) -> float:
    """The factor of the limit at which the eval categories sit so that the last look's pooled KL (its expected
    tokens: `final_eval` eval prompts and the haystacks) is exactly at the limit, the haystacks at sc.context_kl."""
    t_eval = _mean_tokens("eval", TOKENS_PER_SAMPLE) * final_eval
    t_ctx = _mean_tokens("context", CONTEXT_TOKENS) * CONTEXT_PROMPTS * len(CONTEXT)
    return (t_eval + t_ctx - (sc.context_kl or 0.0) * t_ctx) / t_eval


# Speed is not what this bench simulates: every candidate is clearly faster (the pay-off checks pass), so the
# decisions measure the quality checks alone.
FAST = PayOffFigures.model_validate({"workload": "latency", "decide": [
    {"figure": "tpot_p50_ms", "at": "lowest", "concurrency": 1, "lower_is_better": True,
     "ratio": {"value": 0.5, "low": 0.45, "high": 0.55, "level": 0.9, "method": "welch-log", "n_base": 3, "n_cand": 3}}]})


def _kl_of(sc: Scenario, limit: float) -> dict[str, float]:
    """Per category (and "*" for the others): the scenario's factor times `limit`; at the floor, FLOOR_KL."""
    kl = {"*": FLOOR_KL if sc.kl_factor is None else sc.kl_factor * limit}
    if sc.category is not None:
        kl[sc.category] = sc.cat_kl_factor * limit
    if sc.context_kl is not None:
        kl.update({c: sc.context_kl * limit for c in CONTEXT})
    return kl


def _miss_of(sc: Scenario, max_miss: float) -> dict[str, float]:
    """A candidate at f times its limits has its top-1 disagreement at most f times the family's (1 - min_top1): the
    law 0.42 sqrt(KL) up to that. So good-0.5x is at or under half of both limits (the law alone put int8's top-1
    at 0.6x and w4a16's at 0.66x), and at-limit keeps top-1 inside its limit (KL alone at it: the harder case for the
    error rate, since PROMOTE needs both)."""
    miss = {"*": 1.0 if sc.kl_factor is None else sc.kl_factor * max_miss}  # at the floor: the law alone
    if sc.category is not None:
        miss[sc.category] = sc.cat_kl_factor * max_miss
    if sc.context_kl is not None:
        miss.update({c: sc.context_kl * max_miss for c in CONTEXT})
    return miss


def trial(rng: np.random.Generator, samples: list[dict], sc: Scenario, family: str, policy: GatePolicy,
          metrics: dict, split: Look | None = None) -> Decision:
    """One simulated release of `sc`; `split`: the look of a scheme or its repair (--repair), judged at its share."""
    base, cand = simulate_runs(rng, samples, sc)
    cmp_ = compare_runs(base, cand, metrics, n_boot=1000, seed=int(rng.integers(1 << 30)))
    ev: dict = {"candidate": family, "scheme": FAMILY_SCHEME[family], "metrics": {}, "categories": {}, "pooled": {},
                "gaps": {}}
    comparison_evidence({"default": cmp_}, Path("compare.json"), ev)
    f = policy.fidelity
    limit = f.families[family].max_kl if f else 0.01
    cats = sorted({s["category"] for s in samples})
    plan = _plan(sc)
    sequential = len(plan) > 1
    kl_of = _kl_of(sc, limit)
    if sc.pooled_at_limit:
        kl_of["*"] = pooled_mix(sc, min(plan[-1], len(samples))) * limit
    lim = f.families[family] if f else None
    max_miss = 1 - lim.min_top1 if lim and lim.min_top1 is not None else None
    miss_of = _miss_of(sc, max_miss) if max_miss is not None else None
    by_id = eval_fidelity(rng, samples, sc, limit, kl_of, miss_of, max_miss)
    items = [{"id": s["id"], "category": s["category"]} for s in samples]
    floor = simulate_fidelity(rng, {"*": FLOOR_KL}, FLOOR_SAMPLES, cats + CONTEXT)  # its own stratified subset
    n_context = CONTEXT_PROMPTS * len(CONTEXT)  # the same at every look
    context = simulate_fidelity(rng, kl_of, n_context, CONTEXT, CONTEXT_TOKENS, miss_of)
    recall, recall_by_length = simulate_recall(rng, sc)
    fixed = dict(recall={"recall": recall}, recall_by_length=recall_by_length, parity=ParityEvidence(verdict="pass"),
                 size_ratio=Ratio(value=0.5), pay_off=FAST,
                 error_rates=[RateEvidence(name="baseline/default", rate=0.0, n=len(samples))])
    if STREAM and f and not sequential:  # the streaming looks first: a REJECT there ends the trial
        early = streamed(policy, ev, fixed, floor, [by_id[it["id"]] for it in DRAW(items, plan[0])] + context)
        if early is not None:
            return early
    for n in plan:  # each look on the subset of n eval prompts the release draws, at its share of alpha
        look = spend(f.alpha, plan, n) if f and sequential else split if f else None
        level = 1 - 2 * (look.alpha if look else f.alpha) if f else 0.90
        fid = [by_id[it["id"]] for it in DRAW(items, n)]
        evidence = GateEvidence(**ev, **fixed, floor=fidelity_evidence(floor, level, None),
                                fidelity=fidelity_evidence(fid + context, level, None,
                                                           growth=look.growth if look and REWEIGHT else 1.0))
        d = evaluate(policy, evidence, look=look)
        if d.decision != "INCONCLUSIVE":
            break
    return d


REPAIR: float | None = None  # --repair SHARE: the repair rung's share of the fidelity alpha


def repaired(rng: np.random.Generator, samples: list[dict], sc: Scenario, family: str, policy: GatePolicy,
             metrics: dict) -> str:
    """A scheme at its limit judged at its part of the split alpha, and when it is not promoted its repair, a second
    candidate at the limit (the worst case: keeping layers at 16 bits removed nothing), at the repair's share
    (quantgate.gate.looks.repair_split): PROMOTE when either is."""
    assert REPAIR is not None and policy.fidelity is not None
    first, second = repair_split(policy.fidelity.alpha, REPAIR)
    d = trial(rng, samples, sc, family, policy, metrics, split=first)
    return d.decision if d.promoted else trial(rng, samples, sc, family, policy, metrics, split=second).decision


def _plan(sc: Scenario) -> list[int]:
    """The fidelity sample of each of the scenario's looks."""
    return list(sc.looks) if sc.looks else ADAPTIVE_PLAN if sc.adaptive else [FIDELITY_SAMPLES]


def streamed(policy: GatePolicy, ev: dict, fixed: dict, floor: list[SampleFidelity], full: list[SampleFidelity]
             ) -> Decision | None:
    """The REJECT decided at the first streaming look (quantgate.gate.stream) whose prefix fails a fidelity check,
    judged as quantgate.gate.early.stream_checks judges it (the same floor, at the look's share of alpha); None when
    no look decides, and the full sample is then judged as before. `full`: one sample per prompt, eval and haystack.
    The pooled checks look at prefixes of the whole stream, each slice's at prefixes of its own order (as
    quantgate.release.streaming takes them); looks are taken fraction by fraction, every scope at each."""
    f = policy.fidelity
    assert f is not None
    order = interleave(full, lambda s: s.id, lambda s: s.category)
    family = policy.primary.family_of(ev["scheme"]) if policy.primary else None
    scopes = {POOLED: (order, stream.MIN_PROMPTS)}
    if f.per_category:
        scopes |= {c: ([s for s in order if s.category == c], f.min_category_samples)
                   for c in sorted({s.category for s in order})}
    looks = sorted((n / len(o), scope, n) for scope, (o, m) in scopes.items() for n in stream.planned(len(o), minimum=m))
    for _, scope, n in looks:
        o, m = scopes[scope]
        prefix = o[:n]
        look = stream.look(f.alpha, len(o), n, scope=scope, minimum=m, by_category=Counter(s.category for s in prefix),
                           scored_tokens=sum(s.n_tokens for s in prefix))
        level = 1 - 2 * look.alpha
        evidence = GateEvidence(**ev, **fixed, floor=fidelity_evidence(floor, level, None),
                                fidelity=fidelity_evidence(prefix, level, None), stream=look)
        if any(c.outcome == "fail" for c in fidelity_checks(policy, evidence, family)):
            d = evaluate(policy, evidence)
            assert d.decision == "REJECT", d.reasons  # any failed check rejects
            return d
    return None


def run(policy: GatePolicy, shape: str, families: list[str], scenarios: list[Scenario], trials: int, seed: int,
        reads: dict | None = None) -> tuple[dict, dict]:
    """{(family, scenario): Counter of decisions}, {(family, check name): [mdd, ...]} over lossless-5% trials.
    `reads` (with --stream): filled with {(family, scenario): [fraction of the fidelity sample read at the decision,
    ...]} for each scenario that streams (1.0 for a trial decided at the full sample)."""
    rng = np.random.default_rng(seed)
    samples = load_samples(shape, rng)

    class Info:
        def __init__(self, m: str):
            self.higher_is_better, self.binary = True, m in BINARY

    metrics = {m: Info(m) for m in sorted({m for s in samples for m in s["metrics"]})}
    counts: dict = defaultdict(Counter)
    mdds: dict = defaultdict(list)
    pooled_only = policy.model_copy(update={"fidelity": policy.fidelity.model_copy(update={"per_category": False})}) \
        if policy.fidelity else policy

    def note(key: tuple[str, str], sc: Scenario, d: Decision) -> None:  # the fraction read, where streaming looks are
        if STREAM and reads is not None and policy.fidelity is not None and len(_plan(sc)) == 1:
            reads.setdefault(key, []).append(d.stream.n / d.stream.total if d.stream else 1.0)

    for family in families:
        for sc in scenarios:
            for _ in range(trials):
                d = trial(rng, samples, sc, family, pooled_only if sc.pooled_only else policy, metrics)
                counts[(family, sc.name)][d.decision] += 1
                note((family, sc.name), sc, d)
                if sc.name in AT_LIMIT and policy.fidelity:  # the pooled bound alone, with the same looks
                    d2 = trial(rng, samples, sc, family, pooled_only, metrics)
                    counts[(family, f"{sc.name} (pooled only)")][d2.decision] += 1
                    note((family, f"{sc.name} (pooled only)"), sc, d2)
                if REPAIR and sc.name == "at-limit" and policy.fidelity:  # a scheme, then its repair, both at the limit
                    for pol, tag in ((policy, ""), (pooled_only, " (pooled only)")):
                        counts[(family, f"at-limit, then a repair at the limit{tag}")][
                            repaired(rng, samples, sc, family, pol, metrics)] += 1
                if sc.name == "lossless-5%":
                    for c in d.checks:
                        if c.power and c.power.mdd is not None:
                            mdds[(family, c.name)].append((c.power.mdd, c.limit, c.power.limit_below_mdd,
                                                           c.power.n))
    return counts, mdds


TARGETS = [  # (what, scenarios (the worst of them counts), at least / at most, bound)
    ("P(PROMOTE | lossless, flips <= 5%)", ["lossless-2%", "lossless-5%"], ">=", 0.90),
    ("P(PROMOTE | good, fidelity <= 0.5x the limits everywhere)", ["good-0.4x", "good-0.5x"], ">=", 0.90),
    ("P(PROMOTE | fidelity at 2x the limit)", ["kl-2x-limit"], "<=", 0.05),
    ("P(PROMOTE | one category at >= 2x its limit, pooled KL under the limit)",
     ["numbers-2.5x", "multilingual-2.5x", "numbers-2x"], "<=", 0.10),
    ("P(PROMOTE | the longest length at 2x the limit, or the recall at one length halved)",
     ["long-2x", *[f"recall-halved-at-{n}" for n in LENGTHS], "long-2x+recall-halved"], "<=", 0.10),
    *[(f"P(PROMOTE | fidelity exactly at the limit, {v})", [v], "<=", 0.05)
      for name in sorted(AT_LIMIT) for v in (name, f"{name} (pooled only)")],
    *[(f"P(PROMOTE | at the limit, on the subsets a release draws: {v})", [v], "<=", 0.05) for v in AT_LIMIT_SUBSETS],
    *[(f"P(PROMOTE | a scheme and its repair both at the limit{tag})", [f"at-limit, then a repair at the limit{tag}"],
       "<=", 0.05) for tag in ("", " (pooled only)")],
    ("P(PROMOTE | 10% accuracy drop, fidelity at floor)", ["drop-10%"], "<=", 0.10),
    ("P(PROMOTE | 10% drop on binary metrics only, fidelity at floor)", ["drop-10%-binary"], "<=", 0.10),
]


def targets(counts: dict, trials: int, families: list[str]) -> list[tuple[str, float, str, bool]]:
    """(what, measured, target, met) for each family and each target of which some scenario was run."""
    out = []
    for f in families:
        for what, names, side, bound in TARGETS:
            ran = [counts[(f, n)]["PROMOTE"] / trials for n in names if (f, n) in counts]
            if not ran:
                continue
            value = min(ran) if side == ">=" else max(ran)
            out.append((f"{f}: {what}", value, f"{side} {bound:.2f}", value >= bound if side == ">=" else value <= bound))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", type=Path, default=RELEASES / "policies" / "default.yaml")
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--shape", nargs="+", default=["demo", "r500"], choices=["demo", "r500"])
    ap.add_argument("--family", nargs="+", default=list(FAMILY_SCHEME), choices=list(FAMILY_SCHEME))
    ap.add_argument("--seed", type=int, default=20261130)
    ap.add_argument("--rates", type=Path, help="JSON {metric: baseline rate or mean} to simulate instead of RATES")
    ap.add_argument("--fidelity-file", type=Path, nargs="+", default=SHAPE_FILES, help="runs' fidelity/<candidate>"
                    ".json (or shapes saved with --save-shape): draw the per-sample shape (tokens, KL, top-1) from "
                    "each one's samples in turn, moved to each scenario's values (default: the two shipped shapes of "
                    "real demo runs)")
    ap.add_argument("--first-ids", action="store_true", help="draw each look's subset as the release did before the "
                    "seeded draw (the first ids of each category), to show what that let through")
    ap.add_argument("--unweighted", action="store_true", help="judge an interim look's pooled bound on its own mix "
                    "(haystack-heavier than the last look's), as the gate did before, to show what that let through")
    ap.add_argument("--stream", action="store_true", help="a scenario with one fidelity look may REJECT first at "
                    "the release's streaming looks (prefixes of the stream order, each at its share of alpha); prints "
                    "how many trials each look decided and how much of the sample they read")
    ap.add_argument("--simulated", action="store_true", help="the simulated per-sample model (gamma spread, "
                    "--fidelity-cv, plus the estimator's noise) instead of a real run's shape")
    ap.add_argument("--save-shape", nargs=2, type=Path, metavar=("RUN_FIDELITY_FILE", "OUT"),
                    help="keep the per-sample figures of a run's fidelity file (no text) as a shape file, and exit")
    ap.add_argument("--fidelity-cv", type=float, default=FIDELITY_CV, help="per-sample KL spread (gamma CV)")
    ap.add_argument("--scenario", nargs="+", help="only these scenarios (names as printed)")
    ap.add_argument("--repair", type=float, metavar="SHARE", help="with the at-limit scenario: also a release with a "
                    "repair rung (quantgate.release.repair_step), the scheme and its repair both at the limit, the "
                    "repair judged at SHARE of the fidelity alpha and the scheme at the rest")
    ap.add_argument("--recall-samples", type=int, help="haystacks per recall kind and length instead of the spec's "
                                                       "`recall.samples` (the grid the recall checks judge)")
    ap.add_argument("--context-prompts", type=int, help="haystack prompts per context length instead of the spec's "
                    "fidelity.context_prompts (what a larger demo would buy)")
    ap.add_argument("--lognormal", type=float, metavar="SIGMA", help="--simulated only: each sample's mean KL "
                    "lognormal around the scenario's (SIGMA: its log's sd; 1 is a heavy tail) instead of gamma")
    ap.add_argument("--draws", type=int, help="sampled answers per eval prompt instead of the spec's fidelity.draws, "
                    "a multiple of it (a real run's eval samples are summed in groups); with --context-prompts, "
                    "what a larger token budget buys")
    ap.add_argument("--context-new-tokens", type=int, help="tokens sampled after each haystack instead of the spec's "
                    "fidelity.context_new_tokens (--simulated only: a real run's samples keep their own counts)")
    args = ap.parse_args(argv)
    if args.rates:
        RATES.update(json.loads(args.rates.read_text()))
    globals()["FIDELITY_CV"] = args.fidelity_cv
    if args.context_prompts:
        globals()["CONTEXT_PROMPTS"] = args.context_prompts
    if args.lognormal is not None:
        globals()["LOGNORMAL"] = args.lognormal
    if args.draws:
        if args.draws % DRAWS:
            ap.error(f"--draws {args.draws} is no multiple of the spec's fidelity.draws {DRAWS}")
        globals()["DRAW_SETS"] = args.draws // DRAWS
    if args.context_new_tokens:
        globals()["CONTEXT_TOKENS"] = int(0.9 * args.context_new_tokens)
    if args.save_shape:
        save_shape(*args.save_shape)
        return 0
    if args.first_ids:
        globals()["DRAW"] = first_ids
    if args.unweighted:
        globals()["REWEIGHT"] = False
    if args.stream:
        globals()["STREAM"] = True
    if args.repair:
        globals()["REPAIR"] = args.repair
    if args.recall_samples:
        globals()["HAYSTACKS"] = len(LENGTHS) * RECALL_KINDS * args.recall_samples
    scenarios = [sc for sc in SCENARIOS if not args.scenario or sc.name in args.scenario]
    policy = load_policy(args.policy)
    met_all = True
    for shape_file in [None] if args.simulated else args.fidelity_file:
        REAL_SHAPE.clear()
        if shape_file is not None:
            REAL_SHAPE.update(real_shape(shape_file))
        met_all &= report(args, policy, scenarios, shape_file)
    print(f"\n{'all targets met' if met_all else 'some targets NOT met'}")
    return 0 if met_all else 1


def _stream_note() -> str:
    """The header's words on the streaming looks: where they are planned for the scenarios' one-look samples."""
    sizes = sorted({_plan(sc)[0] for sc in SCENARIOS if len(_plan(sc)) == 1})
    plans = ", ".join(f"{stream.planned(n + CONTEXT_PROMPTS * len(CONTEXT))} of {n + CONTEXT_PROMPTS * len(CONTEXT)}"
                      for n in sizes)
    return f"streaming looks (REJECT only, linear alpha spending) at {plans} prompts; "


def _spread_note(shape_file: Path | None) -> str:
    if shape_file is not None:
        return f"the shape of {shape_file}"
    return f"simulated per-sample {f'lognormal sigma {LOGNORMAL}' if LOGNORMAL is not None else f'CV {FIDELITY_CV}'}"


def report(args: argparse.Namespace, policy: GatePolicy, scenarios: list[Scenario], shape_file: Path | None) -> bool:
    """Run and print every shape of the bench on one per-sample fidelity shape; True when every target is met."""
    print(f"\n# gate operating characteristics: policy {args.policy} ({policy.name}), {args.trials} trials per cell, "
          f"seed {args.seed}; recall grid {HAYSTACKS} haystacks x {NEEDLES_PER_HAYSTACK} needles "
          f"(intra-haystack correlation {RECALL_ICC}); fidelity {FIDELITY_SAMPLES} samples (adaptive scenarios: looks "
          f"{ADAPTIVE_PLAN}), each look's subset drawn {'as the first ids' if args.first_ids else 'by the release'}"
          f"{', interim pooled estimates unweighted' if args.unweighted else ''}; "
          f"{_spread_note(shape_file)}; {DRAWS * DRAW_SETS} sampled answers per eval prompt; "
          f"{CONTEXT_PROMPTS} haystacks per context length"
          f"{f', about {CONTEXT_TOKENS} scored tokens each' if args.simulated else ''}; "
          f"{_stream_note() if args.stream else ''}"
          f"CPU {cpuinfo()[0]} (a simulation: the figures do not depend on it)")
    met_all = True
    for shape in args.shape:
        t0 = time.time()
        reads: dict = defaultdict(list)
        counts, mdds = run(policy, shape, args.family, scenarios, args.trials, args.seed, reads)
        print(f"\n## shape {shape} ({time.time() - t0:.0f} s)\n")
        print("| family | scenario | P(PROMOTE) | P(REJECT) | P(INCONCLUSIVE) |\n|---|---|---|---|---|")
        for (f, s), c in counts.items():
            print(f"| {f} | {s} | {c['PROMOTE'] / args.trials:.3f} | {c['REJECT'] / args.trials:.3f} | "
                  f"{c['INCONCLUSIVE'] / args.trials:.3f} |")
        if reads:
            print("\nStreaming looks (--stream; scenarios with one fidelity look): the share of trials whose REJECT a "
                  "streaming look decided, and the fraction of the fidelity sample (prompts) read at the decision "
                  "(1.0 at the full sample)\n")
            print("| family | scenario | P(REJECT at a streaming look) | share of REJECTs decided early | mean fraction "
                  "read | mean fraction read, REJECTs |\n|---|---|---|---|---|---|")
            for (f, s), fr in reads.items():
                early = sum(x < 1.0 for x in fr)
                rejects = counts[(f, s)]["REJECT"]
                rej_read = (sum(x for x in fr if x < 1.0) + rejects - early) / rejects if rejects else None
                print(f"| {f} | {s} | {early / len(fr):.3f} | {f'{early / rejects:.3f}' if rejects else '-'} | "
                      f"{statistics.fmean(fr):.3f} | {f'{rej_read:.3f}' if rej_read is not None else '-'} |")
        if mdds:
            print("\nMinimum detectable drop per check at 80% power (median over lossless-5% trials; units of its "
                  "limit):\n")
            print("| family | check | n | MDD | limit | limit below MDD |\n|---|---|---|---|---|---|")
        for (f, name), vals in sorted(mdds.items()):
            mdd = statistics.median(v[0] for v in vals)
            below = sum(v[2] for v in vals) / len(vals)
            print(f"| {f} | {name} | {vals[0][3]} | {mdd:.4f} | {vals[0][1]} | {below:.0%} of trials |")
        if shape == "demo":
            print("\nTargets (demo shape; the worst of each target's scenarios):\n")
            for what, value, target, met in targets(counts, args.trials, args.family):
                met_all &= met
                print(f"- {what} = {value:.3f} (target {target}): {'met' if met else 'NOT MET'}")
    return met_all


if __name__ == "__main__":
    sys.exit(main())
