"""Does calibrating on the team's own domain help where it should? The demo model quantized to INT8 W8A8 three times:
with the default calibration set (64 records), with a domain set alone (bench/data/calibration_multilingual.jsonl:
40 translation chats and paragraphs in the five languages of the eval set's multilingual category, written for this
bench and disjoint from the eval prompts), and with both together; each compared with the FP32 baseline on the same
sampled continuations: fidelity per category (mean per-token KL and top-1 agreement, 90% two-sided intervals from the
gate's own summary). Re-running into the same --out reuses the samples, checkpoints and scores already there.

    .venv/bin/python bench/calibration_domain.py [--domain FILE] [--limit 300] [--max-tokens 64] [--out DIR]

The domain file can be any calibration source a release spec takes (`quantization.calibration.path`: JSONL, Parquet,
CSV, or a folder saved by `datasets`). The CPU model is printed with the figures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quantgate.base.paths import EVAL_SETS, results_dir  # noqa: E402
from quantgate.fidelity.core import summarize  # noqa: E402
from quantgate.fidelity.run import compare_dumps, score_sequences  # noqa: E402
from quantgate.fidelity.sampling import build_prompts, load_sequences, sample_continuations, write_dump  # noqa: E402
from quantgate.quantize.calibration import DEFAULT_CALIBRATION, CalibrationSpec  # noqa: E402
from quantgate.quantize.run import QuantizeRequest, quantize  # noqa: E402
from quantgate.serving.kernel_probe import cpuinfo  # noqa: E402
from quantgate.serving.server import ServerConfig, VLLMServer  # noqa: E402

DOMAIN = REPO / "bench" / "data" / "calibration_multilingual.jsonl"
BASE_ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "2048"]
QUANT_ARGS = ["--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "2048"]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
TOP_K = 20


def serve(model: Path, name: str, args: list[str], log: Path) -> VLLMServer:
    return VLLMServer(ServerConfig(model=model, name=name, args=args, env=ENV, startup_timeout_s=900), log)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--domain", type=Path, default=DOMAIN)
    ap.add_argument("--limit", type=int, default=300, help="eval prompts (stratified by category)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from quantgate.target.catalogue import ensure_demo_model

    cpu, flags = cpuinfo()
    print(f"CPU: {cpu} ({'AVX-512' if 'avx512f' in flags else 'AVX2 only'})", flush=True)
    out = args.out or results_dir() / "calibration-domain" / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    demo = ensure_demo_model()
    t0 = time.monotonic()
    both = out / "default+domain.jsonl"
    both.write_text(DEFAULT_CALIBRATION.read_text(encoding="utf-8").rstrip("\n") + "\n"
                    + args.domain.read_text(encoding="utf-8"), encoding="utf-8")
    variants = {"default": CalibrationSpec(), "domain": CalibrationSpec(path=args.domain, samples=10_000),
                "default+domain": CalibrationSpec(path=both, samples=10_000)}
    ckpts = {}
    for name, calib in variants.items():
        t = time.monotonic()
        res = quantize(QuantizeRequest(model=demo, scheme="int8-w8a8", out=out / f"int8-{name}", hardware="x86-cpu",
                                       calibration=calib, name_by_key=True))
        c = res.manifest.calibration
        ckpts[name] = res.out
        print(f"quantized int8 with {name} calibration: {c.samples if c else '?'} records, {c.tokens if c else '?'} "
              f"tokens from {c.source if c else '?'} ({time.monotonic() - t:.0f} s{', reused' if res.reused else ''})", flush=True)
    records = [json.loads(x) for x in (EVAL_SETS / "default.jsonl").read_text(encoding="utf-8").splitlines() if x.strip()]
    prompts = build_prompts(records, demo, limit=args.limit)
    with serve(demo, "baseline", BASE_ARGS, out / "baseline.server.log") as srv:
        t = time.monotonic()
        sample_continuations(srv.endpoint, prompts, out / "samples", max_tokens=args.max_tokens,
                             top_k=TOP_K)
        print(f"baseline sampled {len(prompts)} continuations ({time.monotonic() - t:.0f} s)", flush=True)
    write_dump(out / "samples", out / "baseline-dump")
    sequences = load_sequences(out / "samples")
    summaries = {}
    for name, ckpt in ckpts.items():
        with serve(ckpt, name, QUANT_ARGS, out / f"{name}.server.log") as srv:
            score_sequences(srv.endpoint, sequences, out / f"{name}-dump", top_k=TOP_K)
        summaries[name] = summarize(compare_dumps(out / "baseline-dump", out / f"{name}-dump"))
    cats = sorted(summaries["default"].by_category)
    print(f"\nINT8 W8A8 on the demo model, fidelity to the FP32 baseline per category (90% intervals); "
          f"{len(sequences)} continuations of up to {args.max_tokens} tokens; CPU {cpu}\n")
    print("| category | n | " + " | ".join(f"KL, {n} calibration" for n in summaries) + " | "
          + " | ".join(f"top-1, {n}" for n in summaries) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in range(2 * len(summaries))) + " |")
    rows = []
    for cat in [*cats, "(pooled)"]:
        got = {n: (x if cat == "(pooled)" else x.by_category[cat]) for n, x in summaries.items()}
        n = next(iter(got.values())).n_samples
        print(f"| {cat} | {n} | " + " | ".join(f"{g.kl.mean:.4f} [{g.kl.low:.4f}, {g.kl.high:.4f}]" for g in got.values())
              + " | " + " | ".join(f"{g.top1.mean:.3f}" for g in got.values()) + " |")
        rows.append({"category": cat} | {k: g.model_dump(include={"n_samples", "n_tokens", "kl", "top1"}) for k, g in got.items()})
    (out / "table.json").write_text(json.dumps({"cpu": cpu, "rows": rows}, indent=1))
    print(f"\ntotal {time.monotonic() - t0:.0f} s; files in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
