"""Which layers of the demo's INT8 candidate to keep at 16 bits: the one-layer-at-a-time truth, a one-pass proxy, and
the repair each predicts, measured on held-out sequences (transformers, CPU, exact full-vocabulary KL).

    .venv/bin/python bench/repair_sensitivity.py [--samples SAMPLES.jsonl] [--candidate CKPT] [--rank 8] [--hold 16]
                                                 [--max-kept 8] [--threads 2]

Inputs: the baseline's sampled continuations of a demo release (its fidelity samples file: prompt ids + sampled
ids) and the INT8 W8A8 checkpoint that release quantized; by default the newest of each under $QUANTGATE_RESULTS
(results/). Run `make demo` first.

1. The sequences of each category (and the 512-token context slice) are shuffled with a fixed seed and split: the
   first --rank per slice rank the layers, the next --hold are held out to check the repair.
2. On the ranking set (quantgate.quantize.sensitivity): the truth, "keep layer l at 16 bits" for every l (the
   candidate with decoder layer l the baseline's), and the proxy pass alone (each layer's output error on the
   baseline's own input). Both timed.
3. Spearman's rank correlation of each proxy with the truth's pooled gains.
   With --small N, the truth again from N other sequences per slice: does a smaller set find the same layers? Its
   order by the release's rule (quantgate.quantize.repair.order_for: each slice's gain as a share of its limit) is
   one more ranking below, as the release's repair rung ranks on a few prompts per slice.
4. The frontier on the held-out set: keep the top-k layers of each ranking (k = 0..--max-kept) and measure the
   pooled and worst-slice KL and the lowest slice's top-1 agreement, with the size the kept layers add, against
   the default policy's INT8 limits (KL 0.02 per category and pooled, context slices x2; top-1 at least 0.93); and
   the smallest repair quantgate.quantize.repair predicts from the ranking set against what it measures on the
   held-out set.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quantgate.base.paths import results_dir  # noqa: E402
from quantgate.quantize.repair import (POOLED, layer_gains, order_by, order_for, slice_kl,  # noqa: E402
                                       smallest_repair, spearman)
from quantgate.quantize.sensitivity import Pair, Scored, read_samples  # noqa: E402
from quantgate.target.catalogue import ensure_demo_model  # noqa: E402

INT8_MAX_KL, INT8_MIN_TOP1, CONTEXT_FACTOR = 0.02, 0.93, 2.0  # releases/policies/default.yaml: fidelity.families
# .int8 and context_factor


def newest(pattern: str, what: str) -> Path:
    found = sorted(results_dir().glob(pattern), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"no {what} under {results_dir()} ({pattern}): run `make demo` first, or pass it")
    return found[-1]


def split(seqs: list[Scored], rank: int, hold: int, slices: set[str]) -> tuple[list[Scored], list[Scored]]:
    rng = np.random.default_rng(0)
    ranking, held = [], []
    for cat in sorted(slices):
        mine = sorted((s for s in seqs if s.category == cat), key=lambda s: s.id)
        mine = [mine[i] for i in rng.permutation(len(mine))]
        ranking += mine[:rank]
        held += mine[rank:rank + hold]
    return ranking, held


def limits_for(slices: list[str]) -> dict[str, float]:
    return {s: INT8_MAX_KL * (CONTEXT_FACTOR if s.startswith("context:") else 1.0) for s in [POOLED, *slices]}


def layer_bytes(baseline: Path) -> tuple[list[int], int]:
    """Per decoder layer, the bytes its linear weights gain at 16 bits instead of 8; and the INT8 model's bytes."""
    from safetensors import safe_open

    per: dict[int, int] = {}
    total = 0
    for f in sorted(baseline.glob("*.safetensors")):
        with safe_open(str(f), "np") as st:
            for name in st.keys():
                shape = st.get_slice(name).get_shape()
                n = int(np.prod(shape))
                parts = name.split(".")
                if "layers" in parts and name.endswith("proj.weight"):
                    i = int(parts[parts.index("layers") + 1])
                    per[i] = per.get(i, 0) + n  # 2 bytes instead of 1
                    total += n
                else:
                    total += 2 * n
    return [per[i] for i in sorted(per)], total


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=Path)
    ap.add_argument("--candidate", type=Path)
    ap.add_argument("--rank", type=int, default=8, help="sequences per slice that rank the layers")
    ap.add_argument("--hold", type=int, default=16, help="sequences per slice held out to check the repair")
    ap.add_argument("--max-kept", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-proxy", action="store_true", help="leave the one-pass proxies out of the held-out frontier")
    ap.add_argument("--small", type=int, default=0,
                    help="also rank from this many other sequences per slice (after the ranking and held-out ones)")
    ap.add_argument("--slices", default="arithmetic_numbers,factual_qa,instruction_format,multilingual,proper_nouns,"
                                        "summarization,context:512")
    a = ap.parse_args()
    samples = a.samples or newest("cache/variants/*/fidelity/*-samples/samples.jsonl", "fidelity samples")
    cand = a.candidate or newest("checkpoints/*-int8-w8a8-[0-9a-f]*", "INT8 W8A8 checkpoint")  # not a repaired one
    base = ensure_demo_model()
    slices = a.slices.split(",")
    seqs = read_samples(samples)
    ranking, held = split(seqs, a.rank, a.hold, set(slices))
    print(f"CPU: {cpu_model()}, {a.threads} threads; baseline {base}; candidate {cand}; samples {samples}")
    print(f"ranking set {len(ranking)} sequences, held-out {len(held)} ({a.rank} and {a.hold} per slice: {slices})")
    lim = limits_for(slices)
    with Pair(base, cand, threads=a.threads) as pair:
        t0 = time.perf_counter()
        proxy = pair.measure(ranking, proxy=True).proxy
        proxy_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        truth = pair.measure(ranking, restore=range(pair.layers))
        truth_s = time.perf_counter() - t0
        gains = layer_gains(truth.kl, truth.tokens, truth.categories, truth.layers)
        before = slice_kl(truth.kl["all"], truth.tokens, truth.categories)
        print(f"\ncost on {len(ranking)} sequences ({int(truth.tokens.sum())} scored tokens): proxy {proxy_s:.0f} s "
              f"(one baseline pass), truth {truth_s:.0f} s ({truth.layers} layers, one at a time)")
        print("ranking set, as quantized: " + ", ".join(f"{s} {v:.4f}" for s, v in before.items()))
        print("truth, KL removed per layer (pooled): " + " ".join(f"{i}:{g:+.4f}" for i, g in
                                                                  enumerate(gains[POOLED])))
        orders = {"truth": order_by(gains[POOLED])}
        for name, score in ({} if a.no_proxy else proxy).items():
            rho = spearman(score, gains[POOLED])
            orders[f"proxy-{name}"] = order_by(score)
            print(f"proxy {name}: Spearman {rho:+.3f} with the truth; its top 8 {orders[f'proxy-{name}'][:8]}, "
                  f"the truth's {orders['truth'][:8]}")
        if a.small:  # the truth from fewer sequences: is the head of the ranking the same?
            spare, _ = split(seqs, a.rank + a.hold + a.small, 0, set(slices))
            by: dict[str, list[Scored]] = {}
            for s in spare:
                by.setdefault(s.category, []).append(s)
            few = [s for c in sorted(by) for s in by[c][a.rank + a.hold:]]
            t0 = time.perf_counter()
            m = pair.measure(few, restore=range(pair.layers))
            g = layer_gains(m.kl, m.tokens, m.categories, m.layers)[POOLED]
            print(f"truth from {len(few)} other sequences ({int(m.tokens.sum())} tokens) in {time.perf_counter() - t0:.0f} s: "
                  f"Spearman {spearman(g, gains[POOLED]):+.3f} with the ranking set's; its top 8 {order_by(g)[:8]}")
            small = layer_gains(m.kl, m.tokens, m.categories, m.layers)  # the release's rule on the small set
            orders[f"small-{a.small}"] = order_for(small, {s: lim[s] for s in small if s in lim})
        extra, int8_bytes = layer_bytes(base)
        ks = [k for k in (1, 2, 3, 4, 6, 8, 12, 16, 20, 24) if k <= a.max_kept]
        keep_sets = {f"{o}:{k}": orders[o][:k] for o in orders for k in ks}
        t0 = time.perf_counter()
        check = pair.measure(held, keep=keep_sets)
        check_s = time.perf_counter() - t0
    print(f"\nheld-out set: {len(held)} sequences ({int(check.tokens.sum())} tokens), {len(keep_sets)} repairs in "
          f"{check_s:.0f} s; limits: pooled and categories {INT8_MAX_KL}, context x{CONTEXT_FACTOR:g}")
    print(f"{'ranking':<12} {'k':>2} {'+size':>6} {'pooled':>7} {'worst slice KL':>26} {'worst top-1':>26} "
          f"{'passes':>6}  kept")
    rows = [("(none)", 0, [], "all")] + [(o, k, orders[o][:k], f"{o}:{k}") for o in orders for k in ks]
    for o, k, kept, name in rows:
        kl = slice_kl(check.kl[name], check.tokens, check.categories)
        top1 = slice_kl(check.agree[name], check.tokens, check.categories)
        worst = max((s for s in kl if s != POOLED), key=lambda s: kl[s] / lim[s])
        low = min((s for s in top1 if s != POOLED), key=lambda s: top1[s])
        size = sum(extra[i] for i in kept) / int8_bytes
        ok = all(kl[s] <= lim[s] for s in lim if s in kl) and all(v >= INT8_MIN_TOP1 for v in top1.values())
        print(f"{o:<12} {k:>2} {size:>+6.1%} {kl[POOLED]:>7.4f} {worst + ' ' + format(kl[worst], '.4f'):>26}"
              f" {low + ' ' + format(top1[low], '.3f'):>26} {'yes' if ok else 'no':>6}  {kept}")
    plan = smallest_repair(before, gains, lim, max_kept=a.max_kept)
    if plan is None:
        print(f"\nno repair of at most {a.max_kept} layers is predicted to bring every slice within 0.8 x its limit")
        return 0
    with Pair(base, cand, threads=a.threads) as pair:
        got = pair.measure(held, keep={"plan": plan.keep})
    kl = slice_kl(got.kl["plan"], got.tokens, got.categories)
    print(f"\nsmallest repair predicted on the ranking set: keep {plan.keep}")
    for s in plan.predicted:
        print(f"  {s:<20} before {plan.before[s]:.4f}  predicted {plan.predicted[s]:.4f}  held-out {kl.get(s, float('nan')):.4f}"
              f"  limit {lim[s]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
