"""The support matrix, measured: a tiny random-weight checkpoint of each model family through quantgate's own
quantize -> serve -> engine parity -> fidelity, for every scheme this machine's vLLM serves.

    .venv/bin/python bench/family_matrix.py                       # every family in quant_recipes/families.yaml
    .venv/bin/python bench/family_matrix.py --families qwen3,mixtral --schemes int8-w8a8
    .venv/bin/python bench/family_matrix.py --write               # also update the matrix and docs/support-matrix.md
    .venv/bin/python bench/family_matrix.py --render              # only re-render docs/support-matrix.md

Per family: `build` makes a checkpoint (hidden 128, 2 layers, the demo model's tokenizer, BF16, seeded random weights:
transformers' `<Family>ForCausalLM(config)` and `save_pretrained`); each scheme is quantized with quantgate's quantize
(16 calibration records x 128 tokens); the baseline is served (FP32, eager) and checked for engine parity against
transformers, then samples continuations of 16 eval prompts with their logprobs; each quantized checkpoint is served
(BF16) and scores those continuations, and the fidelity (mean per-token KL, top-1 agreement) is computed with the
gate's own estimator. A step that fails is recorded with the root cause read from its log
(quantgate.serving.logcause). `--write` replaces this platform's rows of the measured families in
quant_recipes/support_matrix.yaml (the file `quantgate check` reads) and writes docs/support-matrix.md from it.
The CPU model and kernel build are printed and recorded with the figures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from quantgate.base.errors import QuantgateError  # noqa: E402
from quantgate.base.paths import EVAL_SETS, REPO as ROOT, results_dir  # noqa: E402
from quantgate.quantize.calibration import CalibrationSpec  # noqa: E402
from quantgate.quantize.run import QuantizeRequest, quantize  # noqa: E402
from quantgate.serving.kernel_probe import cpuinfo  # noqa: E402
from quantgate.serving.logcause import log_cause, root_cause  # noqa: E402
from quantgate.serving.server import ServerConfig, VLLMServer  # noqa: E402
from quantgate.target.families import (BASELINE, MATRIX_FILE, MatrixOutcome, MeasuredOn, SupportMatrix,  # noqa: E402
                                       load_families, platform_of, render_markdown)
from quantgate.target.hardware import get_profile  # noqa: E402

SCHEMES = ["int8-w8a8", "w4a16-gptq"]
BASE_ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "2048"]
QUANT_ARGS = ["--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "2048"]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
PROMPTS, MAX_TOKENS, TOP_K = 16, 32, 10
DOC = ROOT / "docs" / "support-matrix.md"

# Shape shared by every tiny checkpoint; each family adds what its config needs to be small (experts, MLA ranks).
SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, max_position_embeddings=4096)
TINY: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaForCausalLM", {}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {}),
    "mistral": ("MistralForCausalLM", {}),
    "gemma2": ("Gemma2ForCausalLM", {}),
    "gemma3": ("Gemma3ForCausalLM", {}),
    "phi3": ("Phi3ForCausalLM", {}),
    "mixtral": ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                                          "shared_expert_intermediate_size": 256}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128}),
    "deepseek_v3": ("DeepseekV3ForCausalLM", {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                                              "moe_intermediate_size": 128, "first_k_dense_replace": 1, "n_group": 1,
                                              # MLA at DeepSeek-V3's own head sizes (kv_lora_rank + rope = 576:
                                              # vLLM's MLA backends take no other)
                                              "topk_group": 1, "q_lora_rank": 64, "kv_lora_rank": 512,
                                              "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                                              "num_key_value_heads": 4, "head_dim": 64,  # = qk_rope_head_dim
                                              # as the Hub's DeepSeek-V3 config.json says: vLLM creates the router's
                                              # e_score_correction_bias only for this method
                                              "topk_method": "noaux_tc"}),
}


def build(family: str, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A tiny random-weight checkpoint of `family` in `out` (BF16 safetensors plus the demo model's tokenizer)."""
    import torch
    import transformers

    arch, extra = TINY[family]
    model_cls = getattr(transformers, arch)
    base_cfg = json.loads((tokenizer_dir / "config.json").read_text())
    ids = {k: base_cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in base_cfg}
    cfg = model_cls.config_class(**{**SMALL, **extra, **ids, "vocab_size": base_cfg["vocab_size"]})
    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy2(f, out / f.name)
    return out


def _prompts(tokenizer_dir: Path):
    from quantgate.fidelity.sampling import build_prompts

    records = [json.loads(line) for line in (EVAL_SETS / "default.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    return build_prompts(records, tokenizer_dir, limit=PROMPTS)


def _served(model: Path, name: str, args: list[str], log: Path):
    return VLLMServer(ServerConfig(model=model, name=name, args=args, env=ENV, startup_timeout_s=600, stall_timeout_s=None), log)


def _cause(exc: BaseException, log: Path | None = None) -> str:
    text = exc.message if isinstance(exc, QuantgateError) else f"{type(exc).__name__}: {exc}"
    return (log_cause(log) if log else None) or root_cause(text) or text.splitlines()[0][:300]


def measure(family: str, schemes: list[str], work: Path, tokenizer_dir: Path,
            seed: int = 0) -> dict[str, MatrixOutcome]:
    """The family's row: the baseline and each scheme, each `ok` with its figures or `fails` at a step with its cause."""
    from quantgate.fidelity.run import compare_dumps, score_sequences
    from quantgate.fidelity.sampling import load_sequences, sample_continuations, write_dump
    from quantgate.parity.engine import run_parity

    folder = work / family
    shutil.rmtree(folder, ignore_errors=True)
    row: dict[str, MatrixOutcome] = {}
    t0 = time.monotonic()
    try:
        base = build(family, folder / "base", tokenizer_dir, seed)
    except Exception as exc:  # noqa: BLE001 -- a family transformers cannot build is a finding, recorded
        cause = f"transformers could not build it: {type(exc).__name__}: {exc}"[:300]
        return {BASELINE: MatrixOutcome(status="fails", step="build", cause=cause)} | {
            s: MatrixOutcome(status="fails", step="build", cause=cause) for s in schemes}
    built_s = time.monotonic() - t0
    quantized: dict[str, Path] = {}
    for scheme in schemes:
        t = time.monotonic()
        try:
            res = quantize(QuantizeRequest(model=base, scheme=scheme, out=folder / scheme, hardware=None,
                                           calibration=CalibrationSpec(samples=16, max_seq_length=128)))
            quantized[scheme] = res.out
            row[scheme] = MatrixOutcome(status="ok", seconds={"quantize": round(time.monotonic() - t, 1)})
        except QuantgateError as exc:
            row[scheme] = MatrixOutcome(status="fails", step="quantize", cause=_cause(exc),
                                        seconds={"quantize": round(time.monotonic() - t, 1)})
        print(f"  {family} {scheme}: quantize {row[scheme].status} ({row[scheme].seconds['quantize']:.0f} s)", flush=True)
    log = folder / "base.server.log"
    t = time.monotonic()
    step = "serve"
    try:
        with _served(base, "base", BASE_ARGS, log) as srv:
            started, step = time.monotonic() - t, "parity"
            parity = run_parity(base, srv.base_url, srv.api_key, "base", folder / "parity", dtype="float32")
            sample_continuations(srv.endpoint, _prompts(base), folder / "samples",
                                 max_tokens=MAX_TOKENS, top_k=TOP_K)
            write_dump(folder / "samples", folder / "base-dump")
        status = "ok" if parity.verdict == "pass" else "fails"
        row[BASELINE] = MatrixOutcome(status=status, step=None if status == "ok" else "parity",
                                      cause=None if status == "ok" else parity.reason, parity=parity.reason,
                                      seconds={"build": round(built_s, 1), "serve": round(started, 1)})
    except Exception as exc:  # noqa: BLE001 -- a server that fails, or a reference that raises, is a finding
        cause = _cause(exc, log if step == "serve" or isinstance(exc, QuantgateError) else None)
        row[BASELINE] = MatrixOutcome(status="fails", step=step, cause=cause, seconds={"build": round(built_s, 1)})
        for scheme in quantized:
            row[scheme] = row[scheme].model_copy(update={"status": "fails", "step": step,
                                                         "cause": f"the unquantized baseline fails at {step}"})
        return row
    print(f"  {family} baseline: {row[BASELINE].status} (parity: {parity.reason})", flush=True)
    sequences = load_sequences(folder / "samples")
    for scheme, ckpt in quantized.items():
        log = folder / f"{scheme}.server.log"
        t = time.monotonic()
        step = "serve"
        try:
            with _served(ckpt, scheme, QUANT_ARGS, log) as srv:
                step = "fidelity"
                score_sequences(srv.endpoint, sequences, folder / f"{scheme}-dump", top_k=TOP_K,
                                max_attempts=2)
            per_sample = compare_dumps(folder / "base-dump", folder / f"{scheme}-dump")
            tokens = sum(x.n_tokens for x in per_sample)
            kl, top1 = sum(x.kl_sum for x in per_sample) / tokens, sum(x.top1_agree for x in per_sample) / tokens
            row[scheme] = row[scheme].model_copy(update={"kl": round(kl, 5), "top1": round(top1, 4), "tokens": tokens,
                                                         "seconds": row[scheme].seconds | {"serve_and_score": round(time.monotonic() - t, 1)}})
        except QuantgateError as exc:
            row[scheme] = row[scheme].model_copy(update={"status": "fails", "step": step, "cause": _cause(exc, log)})
        print(f"  {family} {scheme}: {row[scheme].status} {row[scheme].cause or ''} kl={row[scheme].kl}", flush=True)
    return row


def write(results: dict[str, dict[str, MatrixOutcome]], measured: MeasuredOn, matrix: Path = MATRIX_FILE) -> None:
    """Put this run's cells into the matrix file (a cell it measured replaces the old one; the other schemes' cells of
    a family stay, so `--schemes w4a16-awq` adds a column); write the docs page from it."""
    old = SupportMatrix.model_validate(yaml.safe_load(matrix.read_text())) if matrix.is_file() else SupportMatrix(version=1)
    for fam, row in results.items():
        old.results.setdefault(fam, {}).setdefault(measured.platform, {}).update(row)
    old.measured = [m for m in old.measured if m.platform != measured.platform] + [measured]
    header = ("# Written by bench/family_matrix.py --write (do not edit by hand; re-measure instead).\n"
              "# quantgate/target/families.py reads it: `quantgate check` and a release's start refuse what fails here.\n")
    matrix.write_text(header + yaml.safe_dump(old.model_dump(mode="json", exclude_defaults=True), sort_keys=False,
                                              width=120, allow_unicode=True), encoding="utf-8")
    print(f"wrote {matrix}")
    if matrix == MATRIX_FILE:  # the shipped matrix: its page too
        DOC.write_text(render_markdown(load_families(), old), encoding="utf-8")
        print(f"wrote {DOC}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(TINY), help="comma-separated family ids (quant_recipes/families.yaml)")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    ap.add_argument("--work", type=Path, default=None, help="where checkpoints and logs go (default results/family-matrix/<time>)")
    ap.add_argument("--write", action="store_true", help="update quant_recipes/support_matrix.yaml and docs/support-matrix.md")
    ap.add_argument("--matrix", type=Path, default=MATRIX_FILE, help="the matrix file --write updates (default: the "
                    "shipped one; a team's own is read through $QUANTGATE_SUPPORT_MATRIX)")
    ap.add_argument("--render", action="store_true", help="only write docs/support-matrix.md from the data files")
    args = ap.parse_args()
    if args.render:
        DOC.write_text(render_markdown(load_families(), SupportMatrix.model_validate(yaml.safe_load(MATRIX_FILE.read_text()))),
                       encoding="utf-8")
        print(f"wrote {DOC}")
        return 0
    from quantgate.serving.cpu_kernels import probe_kernels
    from quantgate.target.catalogue import ensure_demo_model

    cpu, flags = cpuinfo()
    probe = probe_kernels()
    print(f"CPU: {cpu} ({'AVX-512' if 'avx512f' in flags else 'AVX2 only'}{', AMX' if probe.flags.get('amx') else ''}); "
          f"vLLM kernel build {probe.build}; platform {platform_of(get_profile('x86-cpu'), probe)}", flush=True)
    work = args.work or results_dir() / "family-matrix" / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    tokenizer_dir = ensure_demo_model()
    results: dict[str, dict[str, MatrixOutcome]] = {}
    t0 = time.monotonic()
    for family in args.families.split(","):
        print(f"{family}:", flush=True)
        results[family] = measure(family, args.schemes.split(","), work, tokenizer_dir, args.seed)
        (work / "matrix.json").write_text(json.dumps({f: {k: o.model_dump(exclude_defaults=True) for k, o in r.items()}
                                                      for f, r in results.items()}, indent=2))
    print(f"\n{'family':<12} {'baseline':<10} " + " ".join(f"{s:<28}" for s in args.schemes.split(",")))
    for family, row in results.items():
        cells = [row.get(s) for s in args.schemes.split(",")]
        text = [("-" if c is None else f"ok KL {c.kl:.4f} top1 {c.top1:.2f}" if c.status == "ok" and c.kl is not None
                 else f"{c.status} ({c.step})") for c in cells]
        print(f"{family:<12} {row[BASELINE].status + ('' if row[BASELINE].step is None else f' ({row[BASELINE].step})'):<10} "
              + " ".join(f"{t:<28}" for t in text))
    print(f"total {time.monotonic() - t0:.0f} s; CPU {cpu}")
    if args.write:
        from importlib.metadata import version
        measured = MeasuredOn(
            date=dt.date.today().isoformat(), machine=f"{cpu}, {__import__('os').cpu_count()} cores", platform=platform_of(get_profile("x86-cpu"), probe),
            kernel_build=probe.build, versions={p: version(p) for p in ("llmcompressor", "transformers", "compressed-tensors")}
            | {"vllm": probe.vllm or "?"},
            checkpoint="hidden 128, 2 layers, 4 heads, seeded random weights, BF16; calibration 16 x 128 tokens; "
                       f"fidelity on {PROMPTS} eval prompts x {MAX_TOKENS} sampled tokens",
            command="python bench/family_matrix.py --write")
        write(results, measured, args.matrix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
