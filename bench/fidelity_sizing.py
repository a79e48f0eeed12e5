"""How well `quantgate check` predicts a fidelity slice too small to bound (quantgate.gate.sizing).

For slice sizes n, draws n samples at random from a shipped per-sample shape (bench/data/*.json: the demo's INT8
candidate), computes the gate's own one-sided bound (quantgate.fidelity.bounds, level 0.90: 95% one-sided) and
reads it as a share of a limit twice the slice's true figure (a candidate at half its limits). Prints the median and
80th percentile of that share beside sizing's prediction, per measure: the prediction is meant to sit at or above
the median (a slice predicted inside the limit is bounded inside it at least half the time).

    .venv/bin/python bench/fidelity_sizing.py [--trials 300] [SHAPE.json ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from quantgate.fidelity.bounds import ratio_bounds
from quantgate.gate.sizing import SPREAD, fidelity_bound_share
from quantgate.serving.kernel_probe import cpuinfo

HERE = Path(__file__).resolve().parent
SHAPES = sorted((HERE / "data").glob("demo_*_fidelity_shape*.json"))
SIZES = {"prompt": (10, 12, 16, 30, 50), "haystack": (8, 10, 12, 20)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="*", type=Path, default=SHAPES)
    ap.add_argument("--trials", type=int, default=300)
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    print(f"CPU {cpuinfo()[0]}; {args.trials} random subsets per row; share = 95% one-sided bound / limit, limit = 2 x truth")
    print(f"{'shape':38s} {'slice':8s} {'measure':7s} {'n':>3s} {'median':>7s} {'p80':>6s} {'predicted':>9s}")
    for path in args.shapes:
        samples = json.loads(path.read_text())["samples"]
        for kind, sizes in SIZES.items():
            sub = [x for x in samples if x["category"].startswith("context:") == (kind == "haystack")]
            tokens = np.array([x["n_tokens"] for x in sub], float)
            sums = np.array([[x["kl_sum"], x["n_tokens"] - x["top1_agree"]] for x in sub])
            truth = sums.sum(0) / tokens.sum()
            for n in sizes:
                shares = []
                for _ in range(args.trials):
                    pick = rng.choice(len(sub), n, replace=False)
                    _, high = ratio_bounds(sums[pick], tokens[pick], level=0.90)
                    shares.append(high / (2 * truth))
                got = np.array(shares)
                for j, measure in enumerate(("kl", "top1")):
                    pred = fidelity_bound_share(n, 0.05, *SPREAD[kind][measure])
                    print(f"{path.name:38s} {kind:8s} {measure:7s} {n:3d} {np.median(got[:, j]):7.3f} "
                          f"{np.percentile(got[:, j], 80):6.3f} {pred:9.3f}")


if __name__ == "__main__":
    main()
