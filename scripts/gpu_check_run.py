"""`gpu_check.py run`: the GPU check's steps, through quantgate's own code (scripts/gpu_check.sh starts it).

1. a model of the demo's shape with random BF16 weights, built on the GPU (gpu_check.build_model);
2. quantgate's quantization (quantize.run, llmcompressor in its child process) to fp8-dynamic and w4a16-gptq: the
   manifest says where oneshot calibrated, its seconds and peak GPU memory, and the checkpoint's size;
3. the engine-parity reference (parity.engine) on the GPU in the served dtype;
4. where an interpreter with vLLM is given: the baseline and the w4a16-gptq candidate served one after the other,
   engine parity against the served baseline, and `--eval-samples` of eval_sets/default.jsonl through quantgate's
   eval runner on each.
Each finished step prints its row at once and rewrites OUT/figures.json, so a run cut short by the hard timeout
still shows what it measured. Random weights answer nothing right: accuracy is ~0, and greedy parity between
engines is fragile on near-uniform logits; both are reported, neither fails the check. A crash fails it.
"""

from __future__ import annotations

import gc
import json
import os
import random
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_check import EXIT_NO_GPU, NO_GPU, SCHEMES, build_model, mib, table  # noqa: E402

SERVE_ARGS = ["--max-model-len", "2048", "--gpu-memory-utilization", "0.5", "--enforce-eager"]
# --cpu (a rehearsal of the script itself on a machine without a GPU, e.g. before carrying it to one)
CPU_SERVE_ARGS = ["--max-model-len", "2048", "--enforce-eager"]
CPU_SERVE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


class Device:
    """The GPU (cuda:0) or, in a rehearsal, the CPU; peak memory is the GPU's only."""
    def __init__(self, gpu: bool):
        self.gpu, self.name = gpu, "cuda:0" if gpu else "cpu"

    def reset(self) -> None:
        import torch

        if self.gpu:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(0)

    def peak(self) -> str:
        import torch

        return mib(torch.cuda.max_memory_allocated(0)) if self.gpu else ""


class Figures:
    def __init__(self, out: Path):
        self.rows: list[dict[str, Any]] = []
        self.path = out / "figures.json"

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        print("  " + "  ".join(f"{k}={v}" for k, v in row.items() if v not in (None, "")), flush=True)
        self.path.write_text(json.dumps(self.rows, indent=2), encoding="utf-8")


def gpu_facts() -> dict[str, Any] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return {"name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}


def step_build(out: Path, tokenizer: Path | None, layers: int | None, dev: Device, figs: Figures) -> tuple[Path, bool]:
    """The random BF16 model, built on the device; returns its folder and whether its tokenizer is the synthetic one."""
    dev.reset()
    base = out / "base"
    info = build_model(base, layers, device=dev.name, dtype="bfloat16", tokenizer=tokenizer)
    size = sum(f.stat().st_size for f in base.glob("*.safetensors"))
    figs.add({"step": "build random model", "device": dev.name, "dtype": "bfloat16", "seconds": info["seconds"],
              "peak_gpu_mib": dev.peak(), "size_mib": mib(size),
              "result": f"{info['params']:,} params, {info['layers']} layers, {info['tokenizer']} tokenizer"})
    dev.reset()
    return base, info["tokenizer"] == "synthetic"


def synthetic_calibration(path: Path, vocab_size: int, samples: int = 64, words: int = 256, seed: int = 0) -> Path:
    """Text records of random t<id> words: token ids through the synthetic tokenizer (gpu_check.synthetic_tokenizer)."""
    rng = random.Random(seed)
    path.write_text("".join(json.dumps({"text": " ".join(f"t{rng.randrange(6, vocab_size)}" for _ in range(words))}) + "\n"
                            for _ in range(samples)), encoding="utf-8")
    return path


def step_quantize(base: Path, out: Path, scheme: str, synthetic: bool, calib_size: tuple[int | None, int | None],
                  timeout_s: float, figs: Figures) -> Path:
    """quantgate's quantization of `base` to `scheme` (the scheme's calibration size unless `calib_size` says)."""
    from quantgate.quantize.calibration import CalibrationSpec
    from quantgate.quantize.run import QuantizeRequest, quantize
    from quantgate.quantize.schemes import load_schemes

    calib = CalibrationSpec()
    if load_schemes().get(scheme).needs_calibration:
        samples, length = calib_size
        path = None
        if synthetic:  # the synthetic tokenizer's own words as calibration text
            vocab = json.loads((base / "config.json").read_text(encoding="utf-8"))["vocab_size"]
            path = synthetic_calibration(out / "calibration.jsonl", vocab)
        calib = CalibrationSpec(path=path, samples=samples, max_seq_length=length)
    res = quantize(QuantizeRequest(model=base, scheme=scheme, out=out / scheme, calibration=calib),
                   log=lambda s: print(f"    {s}"), timeout_s=timeout_s)
    m = res.manifest.dump()  # the quantize manifest (quantgate.quantize.manifest.QuantManifest) as a dict
    dev = m.get("device") or {}
    figs.add({"step": f"quantize {scheme}", "device": f"{dev.get('device')} {dev.get('name', '')}".strip(),
              "dtype": dev.get("load_dtype"), "seconds": m["timings_s"]["oneshot_s"],
              "peak_gpu_mib": mib(dev.get("peak_memory_bytes")), "size_mib": mib(m["weights_bytes"]),
              "result": f"{m['compression_ratio']}x smaller; calibration tokens {(m.get('calibration') or {}).get('tokens')}"})
    return res.out


def step_reference(base: Path, dev: Device, figs: Figures) -> None:
    """The parity reference alone: the parity prompts, greedy, where parity.engine places it (the served dtype)."""
    from transformers import AutoTokenizer

    from quantgate.base.yamlconfig import load_model
    from quantgate.parity.engine import PROMPTS_FILE, ParityPrompts, reference_greedy, reference_placement

    prompts = load_model(PROMPTS_FILE, ParityPrompts)
    tok = AutoTokenizer.from_pretrained(base)
    ids = [list(tok.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True, return_dict=False))
           for p in prompts.prompts]
    where = reference_placement(base, "auto")
    dev.reset()
    t0 = time.perf_counter()
    outs = reference_greedy(base, ids, prompts.max_tokens, where)
    figs.add({"step": "parity reference", "device": where.device, "dtype": where.dtype,
              "seconds": round(time.perf_counter() - t0, 2), "peak_gpu_mib": dev.peak(),
              "result": f"{sum(map(len, outs))} tokens for {len(ids)} prompts ({where.reason})"})
    dev.reset()  # vLLM, started next, needs the memory this process cached


def step_serve(model: Path, name: str, python: Path, out: Path, samples: int, parity: bool, dev: Device,
               figs: Figures) -> None:
    """Serve `model` with vLLM; engine parity against it when `parity`; `samples` of the default eval set."""
    from quantgate.evals.run import run_eval
    from quantgate.parity.engine import run_parity
    from quantgate.serving.server import ServerConfig, VLLMServer

    cfg = ServerConfig(model=model, name=name, args=SERVE_ARGS if dev.gpu else CPU_SERVE_ARGS,
                       env={} if dev.gpu else CPU_SERVE_ENV, python=python, startup_timeout_s=300)
    t0 = time.perf_counter()
    with VLLMServer(cfg, log_path=out / f"{name}.server.log") as srv:
        figs.add({"step": f"vLLM start {name}", "device": dev.name, "seconds": round(time.perf_counter() - t0, 2)})
        if parity:
            t1 = time.perf_counter()
            report = run_parity(model, srv.base_url, srv.api_key, name, out / f"parity-{name}", dtype=None)
            rec = json.loads((out / f"parity-{name}" / "parity.json").read_text(encoding="utf-8"))
            figs.add({"step": f"engine parity {name}", "device": rec["device"]["device"], "dtype": rec["dtype"],
                      "seconds": round(time.perf_counter() - t1, 2), "result": f"{report.verdict}: {report.reason}"[:90]})
        t2 = time.perf_counter()
        evalset, note = eval_set(out)
        summary = run_eval(evalset, srv.base_url, name, out / f"eval-{name}", limit=samples, api_key=srv.api_key,
                           progress=False)
        means = {m: v["overall"]["mean"] for m, v in summary["metrics"].items() if m in ("exact_match", "token_f1")}
        figs.add({"step": f"eval {name} ({summary['n_answered']}/{summary['n_samples']})", "device": dev.name,
                  "seconds": round(time.perf_counter() - t2, 2),
                  "result": ", ".join(f"{m} {v:.3f}" for m, v in sorted(means.items()) if v is not None) + note})


def eval_set(out: Path) -> tuple[Path, str]:
    """eval_sets/default.jsonl; without sacrebleu (it needs lxml, which the wheel folder does not carry), a copy in
    `out` without the samples scored by BLEU or chrF, beside the same sidecar."""
    src = Path(__file__).resolve().parents[1] / "eval_sets" / "default.jsonl"
    try:
        import sacrebleu  # noqa: F401
        return src, ""
    except ImportError:
        pass
    folder = out / "evalset"
    folder.mkdir(exist_ok=True)
    keep = [line for line in src.read_text(encoding="utf-8").splitlines()
            if line.strip() and not {"bleu", "chrf"} & set(json.loads(line)["metrics"])]
    (folder / src.name).write_text("\n".join(keep) + "\n", encoding="utf-8")
    shutil.copy(src.with_name("default.meta.yaml"), folder / "default.meta.yaml")
    return folder / src.name, " (no sacrebleu: BLEU/chrF samples left out)"


def run(out: Path, wheels: Path | None, serve_python: Path | None, samples: int, layers: int | None,
        cpu: bool = False, calib_size: tuple[int | None, int | None] = (None, None)) -> int:
    """Every step in turn (see the module docstring); `cpu`: rehearse them on the CPU instead of refusing."""
    facts = {"rehearsal": "on the CPU, no GPU figures"} if cpu else gpu_facts()
    if facts is None:
        print(f"gpu_check: {NO_GPU} (torch.cuda.is_available() is False; CUDA_VISIBLE_DEVICES="
              f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})", file=sys.stderr)
        return EXIT_NO_GPU
    print(f"gpu_check: {facts}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    figs, step, dev = Figures(out), "start", Device(not cpu)
    tokenizer = wheels / "tokenizer" if wheels is not None and (wheels / "tokenizer").is_dir() else None
    try:
        step = "build"
        base, synthetic = step_build(out, tokenizer, layers, dev, figs)
        made = {}
        for scheme in SCHEMES:
            step = f"quantize {scheme}"
            made[scheme] = step_quantize(base, out, scheme, synthetic, calib_size, 1800 if cpu else 300, figs)
        step = "parity reference"
        step_reference(base, dev, figs)
        if serve_python is not None:
            step = "serve baseline"
            step_serve(base, "baseline", serve_python, out, samples, True, dev, figs)
            step = "serve w4a16-gptq"
            step_serve(made["w4a16-gptq"], "w4a16-gptq", serve_python, out, samples, False, dev, figs)
    except Exception as exc:  # any failure ends the check: say which step, what, and where the details are
        traceback.print_exc()
        what = exc.render() if hasattr(exc, "render") else str(exc)  # a QuantgateError names where and the fix
        print(f"\ngpu_check: FAILED at step '{step}': {type(exc).__name__}: {what[:600]}\n"
              f"  details: the traceback above; logs under {out}", file=sys.stderr)
        print(table(figs.rows))
        return 1
    print("\n" + table(figs.rows))
    if serve_python is None:
        print("\n(vLLM not installed: serving, engine parity against vLLM and the eval were skipped)")
    return 0
