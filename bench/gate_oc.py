"""Operating characteristics of the promotion gate: how often it promotes a candidate of known quality.

Simulated paired evidence goes through the project's own code, as a release's does: per-sample scores ->
quantgate.evals.compare.compare_runs -> quantgate.gate.evidence (comparison_evidence, paired_harm,
fidelity_evidence) -> quantgate.gate.checks.evaluate with a real policy file. Only the per-sample scores are
simulated; every statistic and decision is the gate's.

Shapes:
- demo: the samples of eval_sets/default.jsonl (300: their categories and metrics) and the recall grid of
  releases/demo.yaml (3 lengths x 4 kinds x 2 samples = 24 haystacks, a needle at each of 5 depths: 120 needles,
  as `make demo` asks them); fidelity over 100 of the samples at about 70 tokens each;
- r500: 500 samples drawn from the same set (new ids) and the same recall grid.
Recall needles that share a haystack are not independent: each haystack draws its own difficulty (the baseline's
chance of recalling its needles varies around RECALL_RATE with intra-haystack correlation RECALL_ICC), so the
simulated evidence has the clustering a real grid has, and the gate's per-needle test is judged on it.
Scenarios (per scheme family, each with its own limits in the policy):
- lossless-F: accuracy unchanged, F of the samples flip (half right->wrong, half wrong->right), fidelity at the floor;
- kl-2x-limit: fidelity at twice the family's KL limit, accuracy unchanged (5% flips);
- drop-10%: every task measure loses 10% of its baseline value (binary ones by right->wrong flips only,
  continuous ones by a 10% lower score), fidelity at the floor: harm only the task checks can see;
- drop-10%-binary: the same drop on the binary metrics and recall only, continuous scores unchanged: the hard case,
  where only the pooled binary test and recall can see it. drop-10%+2%flips adds 2% background flips to that
  (printed, not a target).

Targets for the default policy at the demo shape: P(PROMOTE | lossless, flips <= 5%) >= 0.90;
P(PROMOTE | kl-2x-limit) <= 0.05; P(PROMOTE | drop-10%) <= 0.10 and P(PROMOTE | drop-10%-binary) <= 0.10.

    .venv/bin/python bench/gate_oc.py [--trials 200] [--policy releases/policies/default.yaml] [--shape demo r500]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from quantgate.base.paths import EVAL_SETS, RELEASES
from quantgate.evals.compare import compare_runs
from quantgate.fidelity.core import SampleFidelity
from quantgate.gate.checks import evaluate
from quantgate.gate.evidence import comparison_evidence, fidelity_evidence, paired_harm
from quantgate.gate.models import Decision, GateEvidence, ParityEvidence, RateEvidence, Ratio, Stat
from quantgate.perf.models import PayOffFigures
from quantgate.gate.policy import GatePolicy, load_policy

# Baseline behaviour of the simulated model, per metric: the share answered right (binary) or the mean score
# (continuous). Set near the demo model's own baseline on the default set; --rates FILE overrides them.
RATES = {"exact_match": 0.45, "contains": 0.55, "numeric_match": 0.30, "choice_accuracy": 0.50, "chrf": 0.35,
         "bleu": 0.15, "token_f1": 0.45, "rouge_l": 0.30}
BINARY = {"exact_match", "contains", "numeric_match", "choice_accuracy"}
RECALL_RATE, RECALL_ICC = 0.5, 0.10  # baseline recall per needle; correlation of needles within one haystack


def recall_grid(spec: Path = RELEASES / "demo.yaml") -> tuple[int, int]:
    """(haystacks, needles per haystack) of a release spec's recall grid, layout `turns` or `together`."""
    r = yaml.safe_load(spec.read_text(encoding="utf-8"))["recall"]
    return len(r["lengths"]) * len(r["kinds"]) * r["samples"], len(r["depths"])


HAYSTACKS, NEEDLES_PER_HAYSTACK = recall_grid()
FIDELITY_SAMPLES, TOKENS_PER_SAMPLE = 100, 70
FLOOR_KL = 0.0005            # per-token KL of the baseline against itself on another execution path
FAMILY_SCHEME = {"fp8": "fp8-dynamic", "int8": "int8-w8a8", "w4a16": "w4a16-gptq"}


@dataclass(frozen=True)
class Scenario:
    name: str
    flips: float                 # share of samples that flip, balanced so that accuracy is unchanged
    drop: float = 0.0            # relative drop of every task measure (right -> wrong flips only)
    kl_factor: float | None = None  # fidelity at this multiple of the family's KL limit (None: at the floor)
    binary_only: bool = False    # the drop hits binary metrics and recall only; continuous scores are unchanged


SCENARIOS = [Scenario("lossless-2%", 0.02), Scenario("lossless-5%", 0.05), Scenario("lossless-10%", 0.10),
             Scenario("kl-2x-limit", 0.05, kl_factor=2.0), Scenario("drop-10%", 0.0, drop=0.10),
             Scenario("drop-10%-binary", 0.0, drop=0.10, binary_only=True),
             Scenario("drop-10%+2%flips", 0.02, drop=0.10, binary_only=True)]


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


def _candidate(rng: np.random.Generator, metric: str, base: float, sc: Scenario) -> float:
    if metric in BINARY:
        p = RATES[metric]
        if base == 1.0:  # right -> wrong: half the flips, plus the drop
            return 0.0 if rng.random() < sc.flips / (2 * p) + sc.drop else 1.0
        return 1.0 if rng.random() < sc.flips / (2 * (1 - p)) else 0.0
    value = _score(rng, metric) if rng.random() < sc.flips else base
    return value if sc.binary_only else value * (1 - sc.drop)


def simulate_runs(rng: np.random.Generator, samples: list[dict], sc: Scenario) -> tuple[list[dict], list[dict]]:
    base, cand = [], []
    for s in samples:
        b = {m: _score(rng, m) for m in s["metrics"]}
        c = {m: _candidate(rng, m, v, sc) for m, v in b.items()}
        base.append({"id": s["id"], "category": s["category"], "output": "b", "scores": b})
        cand.append({"id": s["id"], "category": s["category"], "output": "b" if c == b else "c", "scores": c})
    return base, cand


def simulate_recall(rng: np.random.Generator, sc: Scenario) -> Stat:
    """Per-needle (baseline, candidate) recall over the grid; a haystack's needles share its difficulty: a beta
    draw with mean RECALL_RATE whose spread gives intra-haystack correlation RECALL_ICC."""
    a = RECALL_RATE * (1 / RECALL_ICC - 1)
    b_ = (1 - RECALL_RATE) * (1 / RECALL_ICC - 1)
    pairs = []
    for _ in range(HAYSTACKS):
        rate = float(rng.beta(a, b_))
        for _ in range(NEEDLES_PER_HAYSTACK):
            b = float(rng.random() < rate)
            pairs.append((b, _candidate_recall(rng, b, sc)))
    bm, cm = sum(p[0] for p in pairs) / len(pairs), sum(p[1] for p in pairs) / len(pairs)
    return Stat(n=len(pairs), base=bm, cand=cm, delta=cm - bm, **paired_harm(pairs, binary=False))


def _candidate_recall(rng: np.random.Generator, base: float, sc: Scenario) -> float:
    if base == 1.0:
        return 0.0 if rng.random() < sc.flips / (2 * RECALL_RATE) + sc.drop else 1.0
    return 1.0 if rng.random() < sc.flips / (2 * (1 - RECALL_RATE)) else 0.0


def simulate_fidelity(rng: np.random.Generator, kl_mean: float) -> list[SampleFidelity]:
    """Per-sample token counts, KL sums (gamma-spread across samples) and top-1 agreement; top-1 falls with KL
    roughly as llama.cpp's published pairs do (0.0014 nats ~ 97.7%, 0.031 ~ 91.9%)."""
    out = []
    top1_rate = max(0.0, 1 - 0.6 * math.sqrt(kl_mean))
    for i in range(FIDELITY_SAMPLES):
        n = int(rng.poisson(TOKENS_PER_SAMPLE - 10)) + 10
        kl = float(rng.gamma(1.5, kl_mean / 1.5)) * n
        agree = int(rng.binomial(n, top1_rate))
        out.append(SampleFidelity(id=f"s{i}", category="x", n_tokens=n, kl_sum=kl, top1_agree=agree,
                                  dnll_sum=kl, kl_max=kl))
    return out


# Speed is not what this bench simulates: every candidate is clearly faster (the pay-off checks pass), so the
# decisions measure the quality checks alone.
FAST = PayOffFigures.model_validate({"workload": "latency", "decide": [
    {"figure": "tpot_p50_ms", "at": "lowest", "concurrency": 1, "lower_is_better": True,
     "ratio": {"value": 0.5, "low": 0.45, "high": 0.55, "level": 0.9, "method": "welch-log", "n_base": 3, "n_cand": 3}}]})


def trial(rng: np.random.Generator, samples: list[dict], sc: Scenario, family: str, policy: GatePolicy,
          metrics: dict) -> Decision:
    base, cand = simulate_runs(rng, samples, sc)
    cmp_ = compare_runs(base, cand, metrics, n_boot=1000, seed=int(rng.integers(1 << 30)))
    ev: dict = {"candidate": family, "scheme": FAMILY_SCHEME[family], "metrics": {}, "categories": {}, "pooled": {},
                "gaps": {}}
    comparison_evidence({"default": cmp_}, Path("compare.json"), ev)
    limit = policy.fidelity.families[family].max_kl if policy.fidelity else 0.01
    level = 1 - 2 * policy.fidelity.alpha if policy.fidelity else 0.90
    kl = FLOOR_KL if sc.kl_factor is None else sc.kl_factor * limit
    evidence = GateEvidence(**ev, recall={"recall": simulate_recall(rng, sc)},
                            fidelity=fidelity_evidence(simulate_fidelity(rng, kl), level, None),
                            floor=fidelity_evidence(simulate_fidelity(rng, FLOOR_KL), level, None),
                            parity=ParityEvidence(verdict="pass"), size_ratio=Ratio(value=0.5), pay_off=FAST,
                            error_rates=[RateEvidence(name="baseline/default", rate=0.0, n=len(samples))])
    return evaluate(policy, evidence)


def run(policy: GatePolicy, shape: str, families: list[str], scenarios: list[Scenario], trials: int, seed: int
        ) -> tuple[dict, dict]:
    """{(family, scenario): Counter of decisions}, {(family, check name): [mdd, ...]} over lossless-5% trials."""
    rng = np.random.default_rng(seed)
    samples = load_samples(shape, rng)

    class Info:
        def __init__(self, m: str):
            self.higher_is_better, self.binary = True, m in BINARY

    metrics = {m: Info(m) for m in sorted({m for s in samples for m in s["metrics"]})}
    counts: dict = defaultdict(Counter)
    mdds: dict = defaultdict(list)
    for family in families:
        for sc in scenarios:
            for _ in range(trials):
                d = trial(rng, samples, sc, family, policy, metrics)
                counts[(family, sc.name)][d.decision] += 1
                if sc.name == "lossless-5%":
                    for c in d.checks:
                        if c.power and c.power.mdd is not None:
                            mdds[(family, c.name)].append((c.power.mdd, c.limit, c.power.limit_below_mdd,
                                                           c.power.n))
    return counts, mdds


def targets(counts: dict, trials: int, families: list[str]) -> list[tuple[str, float, str, bool]]:
    """(what, measured, target, met) for each family."""
    def p(f, s):
        return counts[(f, s)]["PROMOTE"] / trials

    out = []
    for f in families:
        worst_lossless = min(p(f, "lossless-2%"), p(f, "lossless-5%"))
        out += [(f"{f}: P(PROMOTE | lossless, flips <= 5%)", worst_lossless, ">= 0.90", worst_lossless >= 0.90),
                (f"{f}: P(PROMOTE | fidelity at 2x the limit)", p(f, "kl-2x-limit"), "<= 0.05", p(f, "kl-2x-limit") <= 0.05),
                (f"{f}: P(PROMOTE | 10% accuracy drop, fidelity at floor)", p(f, "drop-10%"), "<= 0.10",
                 p(f, "drop-10%") <= 0.10),
                (f"{f}: P(PROMOTE | 10% drop on binary metrics only, fidelity at floor)", p(f, "drop-10%-binary"),
                 "<= 0.10", p(f, "drop-10%-binary") <= 0.10)]
    return out


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", type=Path, default=RELEASES / "policies" / "default.yaml")
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--shape", nargs="+", default=["demo", "r500"], choices=["demo", "r500"])
    ap.add_argument("--family", nargs="+", default=list(FAMILY_SCHEME), choices=list(FAMILY_SCHEME))
    ap.add_argument("--seed", type=int, default=20261130)
    ap.add_argument("--rates", type=Path, help="JSON {metric: baseline rate or mean} to simulate instead of RATES")
    args = ap.parse_args(argv)
    if args.rates:
        RATES.update(json.loads(args.rates.read_text()))
    policy = load_policy(args.policy)
    print(f"# gate operating characteristics: policy {args.policy} ({policy.name}), {args.trials} trials per cell, "
          f"seed {args.seed}; recall grid {HAYSTACKS} haystacks x {NEEDLES_PER_HAYSTACK} needles "
          f"(intra-haystack correlation {RECALL_ICC}); CPU {_cpu()} (a simulation: the figures do not depend on it)")
    met_all = True
    for shape in args.shape:
        t0 = time.time()
        counts, mdds = run(policy, shape, args.family, SCENARIOS, args.trials, args.seed)
        print(f"\n## shape {shape} ({time.time() - t0:.0f} s)\n")
        print("| family | scenario | P(PROMOTE) | P(REJECT) | P(INCONCLUSIVE) |\n|---|---|---|---|---|")
        for (f, s), c in counts.items():
            print(f"| {f} | {s} | {c['PROMOTE'] / args.trials:.3f} | {c['REJECT'] / args.trials:.3f} | "
                  f"{c['INCONCLUSIVE'] / args.trials:.3f} |")
        print("\nMinimum detectable drop per check at 80% power (median over lossless-5% trials; units of its limit):\n")
        print("| family | check | n | MDD | limit | limit below MDD |\n|---|---|---|---|---|---|")
        for (f, name), vals in sorted(mdds.items()):
            mdd = statistics.median(v[0] for v in vals)
            below = sum(v[2] for v in vals) / len(vals)
            print(f"| {f} | {name} | {vals[0][3]} | {mdd:.4f} | {vals[0][1]} | {below:.0%} of trials |")
        if shape == "demo":
            print("\nTargets (demo shape):\n")
            for what, value, target, met in targets(counts, args.trials, args.family):
                met_all &= met
                print(f"- {what} = {value:.3f} (target {target}): {'met' if met else 'NOT MET'}")
    print(f"\n{'all targets met' if met_all else 'some targets NOT met'}")
    return 0 if met_all else 1


if __name__ == "__main__":
    sys.exit(main())
