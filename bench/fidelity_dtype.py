"""How much of a CPU candidate's fidelity gap is its activation dtype: the unquantized baseline served in FP32 (as
the release serves it) and in BF16 (as CPU W4A16 candidates must run), each scoring the FP32 baseline's own answers.

    .venv/bin/python bench/fidelity_dtype.py [MODEL_DIR] [--samples 60]

Prints, per comparison, mean per-token KL with its 90% interval, top-1 agreement and mean NLL increase:
- floor: FP32 at concurrency 8 vs FP32 at concurrency 1 (the release's noise floor);
- dtype: FP32 vs BF16 activations, same weights (what a BF16 candidate carries before any quantization).
Compare the dtype line with the fidelity limits in releases/policies/default.yaml.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quantgate.base.paths import EVAL_SETS
from quantgate.evals.client import read_results
from quantgate.evals.dataset import load_evalset
from quantgate.evals.run import run_eval
from quantgate.fidelity.core import summarize
from quantgate.fidelity.run import build_sequences, compare_dumps, score_sequences
from quantgate.serving.server import ServerConfig, VLLMServer
from quantgate.target.catalogue import ensure_demo_model

ARGS = ["--enforce-eager", "--max-model-len", "2048"]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _line(name: str, samples) -> str:
    s = summarize(samples)
    return (f"| {name} | {s.n_samples} | {s.n_tokens} | {s.kl.mean:.5f} [{s.kl.low:.5f}, {s.kl.high:.5f}] | "
            f"{s.top1.mean:.2%} | {s.dnll.mean:+.5f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", type=Path)
    ap.add_argument("--samples", type=int, default=60)
    args = ap.parse_args()
    model = args.model or ensure_demo_model()
    evalset = EVAL_SETS / "default.jsonl"
    work = Path(tempfile.mkdtemp(prefix="fidelity-dtype-"))
    t0 = time.time()
    cfg = ServerConfig(model=model, name="m", args=[*ARGS, "--dtype", "float32"], env=ENV)
    with VLLMServer(cfg, log_path=work / "fp32.log") as srv:
        run_eval(evalset, srv.endpoint, work / "eval", limit=args.samples, progress=False)
        answers = read_results(work / "eval" / "results.jsonl")
        records = [{"id": s.id, "category": s.category, "messages": s.chat(), "output": answers[s.id]["output"]}
                   for s in load_evalset(evalset, with_dataset=False).samples
                   if s.id in answers and answers[s.id].get("error") is None and answers[s.id].get("output")]
        seqs = build_sequences(records, model, max_len=2048)
        score_sequences(srv.endpoint, seqs, work / "fp32-main", concurrency=8)
        score_sequences(srv.endpoint, seqs, work / "fp32-alt", concurrency=1)
    cfg = ServerConfig(model=model, name="m", args=[*ARGS, "--dtype", "bfloat16"], env=ENV)
    with VLLMServer(cfg, log_path=work / "bf16.log") as srv:
        score_sequences(srv.endpoint, seqs, work / "bf16", concurrency=8)
    print(f"# fidelity of the activation dtype on CPU: {model.name}, {len(seqs)} of the default set's answers; "
          f"CPU {_cpu()}; {time.time() - t0:.0f} s\n")
    print("| comparison | samples | tokens | mean KL, nats [90% interval] | top-1 agreement | mean dNLL |")
    print("|---|---|---|---|---|---|")
    print(_line("floor: FP32 c=8 vs FP32 c=1", compare_dumps(work / "fp32-main", work / "fp32-alt")))
    print(_line("dtype: FP32 vs BF16 activations", compare_dumps(work / "fp32-main", work / "bf16")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
