"""A real candidate damaged only at long context, through the release's own steps: the demo model with every
attention layer limited to a sliding window of W tokens (config.json `layer_types` + `sliding_window`, which vLLM's
Llama honours). Its weights are the baseline's, so prompts and answers shorter than W are computed exactly as the
baseline computes them; past W tokens each position loses the start of the context (the chat template's opening
tokens, which the model leans on, included). The eval sets' short answers cannot see that; a haystack continuation
at 1k or 2k tokens can.

    .venv/bin/python bench/long_context_damage.py [--window 384] [--lengths 1024 2048] [--work DIR]

Serves the baseline and the windowed candidate (vLLM, CPU), runs the eval set, a small recall grid and fidelity
(eval prompts and `--context-prompts` haystack documents per length), then gates the candidate under the default
policy without the pay-off check (the candidate is not smaller: it is the baseline's weights). Prints the decision,
the pooled fidelity check and the per-length checks, and the wall time of each step. Expected: every short-answer
category's KL passes and a per-length check (fidelity:kl:context:<L>) fails or is inconclusive, so the
candidate is not promoted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quantgate.base.paths import EVAL_SETS, RELEASES  # noqa: E402
from quantgate.release import steps as rel  # noqa: E402
from quantgate.spec.resolve import load_spec  # noqa: E402
from quantgate.release.variants import Variant, size_bytes  # noqa: E402
from quantgate.serving.kernel_probe import cpuinfo  # noqa: E402
from quantgate.target.catalogue import MANIFEST, checkpoint_hash, ensure_demo_model  # noqa: E402

SPEC = """\
version: 1
name: long-damage
model: {model}
hardware: x86-cpu
context: {context}
concurrency: 4
schemes: [int8-w8a8]
eval_sets: [{evalset}]
policy: {policy}
eval: {{limit: {limit}, concurrency: 8}}
recall: {{lengths: {lengths}, depths: [50], kinds: [number, name], samples: 1}}
fidelity: {{limit: {limit}, draws: 2, context_prompts: {context_prompts}, context_new_tokens: {new_tokens}}}
perf: null
"""


def windowed_copy(src: Path, dst: Path, window: int) -> Path:
    """A copy of the checkpoint whose every attention layer sees only the last `window` tokens."""
    shutil.copytree(src, dst)
    cfg_path = dst / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["layer_types"] = ["sliding_attention"] * int(cfg["num_hidden_layers"])
    cfg["sliding_window"] = int(window)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    (dst / MANIFEST).unlink(missing_ok=True)  # its recorded hashes are the original's: hash the files instead
    return dst


def policy_file(path: Path, min_category_samples: int) -> Path:
    """The default policy without the pay-off check (the candidate has the baseline's size) and with recall not
    required (a two-haystack grid is a harm detector only)."""
    policy = yaml.safe_load((RELEASES / "policies" / "default.yaml").read_text())
    policy.update(name="long-damage", min_samples=3)
    policy["fidelity"]["min_category_samples"] = min_category_samples
    policy["pay_off"] = None
    policy["recall"]["required"] = False
    path.write_text(yaml.safe_dump(policy))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--window", type=int, default=384)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--limit", type=int, default=60, help="eval samples and fidelity eval prompts")
    ap.add_argument("--context-prompts", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=128, help="fidelity.context_new_tokens")
    ap.add_argument("--work", type=Path, help="folder for results (default: a temporary one)")
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="long-damage-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ["QUANTGATE_RESULTS"] = str(work / "results")
    model = ensure_demo_model()
    spec_path = work / "spec.yaml"
    spec_path.write_text(SPEC.format(model=model, context=max(args.lengths) + args.new_tokens + 256,
                                     evalset=EVAL_SETS / "default.jsonl", limit=args.limit,
                                     policy=policy_file(work / "policy.yaml", 5), lengths=args.lengths,
                                     context_prompts=args.context_prompts, new_tokens=args.new_tokens))
    spec = load_spec(spec_path)
    print(f"# a candidate damaged only past {args.window} tokens (sliding-window attention on the demo model); "
          f"CPU {cpuinfo()[0]}; work {work}", flush=True)
    cand_dir = work / "windowed"
    if not cand_dir.exists():
        windowed_copy(model, cand_dir, args.window)
    cand = Variant(name="int8-w8a8", path=cand_dir, scheme="int8-w8a8", content_hash=checkpoint_hash(cand_dir),
                   size_bytes=size_bytes(cand_dir))
    run = rel.start_run(spec, spec_path, f"long-damage-{int(time.time())}")
    t0 = time.monotonic()
    base = rel.serve_and_evaluate(rel.MeasureRequest(spec, rel.baseline_variant(model), run, parity=False))
    t_base = time.monotonic() - t0
    measured = rel.serve_and_evaluate(rel.MeasureRequest(spec, cand, run, parity=False, tokenizer=model,
                                                         reference=base.evals))
    t_cand = time.monotonic() - t0 - t_base
    rel.compare_variants(base, measured, run)
    (decision,) = rel.gate(spec, run, ["int8-w8a8"])
    rel.record_decisions(spec, run, [decision])  # the run folder's decision.json, for `quantgate report`
    checks = {c.name: c for c in decision.checks}
    print(f"\nbaseline {t_base:.0f} s, candidate {t_cand:.0f} s; decision {decision.decision}\n")
    print("| check | outcome | measured | limit | reason |\n|---|---|---|---|---|")
    for name, c in checks.items():
        if name.startswith("fidelity:"):
            print(f"| {name} | {c.outcome} | {c.measured} | {c.limit} | {c.reason[:110]} |")
    print("\nreasons: " + "; ".join(decision.reasons[:4]))
    short = [c for n, c in checks.items() if n.startswith("fidelity:kl:") and ":context:" not in n]
    pooled_ok = bool(short) and all(c.outcome == "pass" for c in short)  # every short-answer category within
    long_bad = any(checks[f"fidelity:kl:context:{n}"].outcome != "pass" for n in args.lengths
                   if f"fidelity:kl:context:{n}" in checks)
    print(f"\nevery short-answer category's KL passes: {pooled_ok}; a per-length check blocks: {long_bad}; "
          f"not promoted: {decision.decision != 'PROMOTE'}")
    return 0 if pooled_ok and long_bad and decision.decision != "PROMOTE" else 1


if __name__ == "__main__":
    sys.exit(main())
