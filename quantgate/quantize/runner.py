"""Child process that runs llmcompressor `oneshot`: `python -m quantgate.quantize.runner JOB.json`.

Started by `quantgate.quantize.run` so that a crash or an out-of-memory kill here cannot take the orchestrator down.
It validates the recipe with llmcompressor and renders the calibration set before loading the model, then
quantizes and saves a compressed-tensors checkpoint into the job's (temporary) output folder. It writes a result
JSON; exit code 0 = done, 3 = input refused before the model was loaded, anything else = crash (see the log). Both
files go through quantize.jobfile's models (RunnerJob, RunnerResult), which the parent uses too.

Device: the model is loaded on the CPU in its checkpoint's dtype, as llmcompressor's own examples do
(`device_map=None`); `oneshot` then onloads one layer at a time to the first visible GPU (its sequential and data-free
pipelines use `torch.accelerator`), and calibrates on the CPU where none is visible. `quantize.devices.choose_device` states
the same rule; the result's `device` records what it said, the GPU's name and the peak GPU memory of `oneshot`.
Calibrating on a CPU without native arithmetic for the checkpoint's 16-bit dtype, the model is loaded in FP32 and
cast back to its own dtype before saving (`quantize.devices.calibration_dtype`; the record's `load_dtype` and
`calibration_dtype_reason` say which).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

from quantgate.quantize.devices import calibration_dtype, choose_device, torch_dtype_name
from quantgate.quantize.jobfile import DeviceRecord, RunnerJob, RunnerResult
from quantgate.quantize.preflight import checkpoint_dtype

if TYPE_CHECKING:
    from quantgate.quantize.calibration import CalibrationSample

EXIT_REFUSED = 3
# Upstream version whose AWQ path pins CPU memory unconditionally (see pin_memory_workaround below).
PIN_MEMORY_BUG_VERSION = "0.14.0.1"
LIBRARIES = ("llmcompressor", "compressed-tensors", "transformers", "torch", "datasets")

# A lower CPU priority than the release's own work: quantization is batch work that a candidate's measurement
# waits for anyway, while work the release runs on no slot's cores (the engine-parity reference, beside the
# baseline's server start: quantgate.release.measure) is on the path to every verdict. Such work then takes the
# core from quantization first, not from the baseline. Alone on its cores, quantization runs as fast as before.
NICE = 10


def versions() -> dict[str, str]:
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def needs_pin_memory_workaround(llmcompressor_version: str, has_accelerator: bool) -> bool:
    """Only llmcompressor 0.14.0.1, only without an accelerator (pinning needs one; there it is useful)."""
    return llmcompressor_version == PIN_MEMORY_BUG_VERSION and not has_accelerator


def pin_memory_workaround() -> str | None:
    """Make `IntermediatesCache.pin_memory` a no-op when no accelerator exists (llmcompressor 0.14.0.1).

    Upstream's AWQModifier pins every cached activation before its grid search so that later host-to-device
    copies can be non-blocking; `Tensor.pin_memory()` raises "Cannot access accelerator device when none is
    available" on a CPU-only machine. Pinning only speeds up copies to an accelerator, so skipping it on a
    machine without one changes no numbers. Applied in this child process only; returns a description of
    what was patched, or None when the version/hardware does not need it.
    """
    import torch
    from llmcompressor import __version__ as llmc_version

    if not needs_pin_memory_workaround(llmc_version, torch.accelerator.is_available()):
        return None
    from llmcompressor.pipelines.cache import IntermediatesCache

    def pin_memory(self, batch_index: int, input_names: list[str] | None = None) -> None:
        return None

    IntermediatesCache.pin_memory = pin_memory  # type: ignore[method-assign]
    return f"llmcompressor {llmc_version}: IntermediatesCache.pin_memory skipped (no accelerator)"


class _Device(TypedDict):
    """Where calibration runs (jobfile.DeviceRecord's first fields)."""
    device: str
    physical_gpu: str | None
    reason: str
    name: NotRequired[str]


def device_record(torch: Any) -> _Device:
    """Where `oneshot` calibrates in this process (quantize.devices.choose_device), with the GPU's name if any."""
    cuda = torch.cuda.is_available()
    device, physical, why = choose_device(cuda, torch.cuda.device_count() if cuda else 0, os.environ.get("CUDA_VISIBLE_DEVICES"))
    out: _Device = {"device": device, "physical_gpu": physical, "reason": why}
    if device != "cpu":
        out["name"] = torch.cuda.get_device_name(0)
        torch.cuda.reset_peak_memory_stats(0)
    return out


def native_half(torch: Any) -> set[str]:
    """The 16-bit float dtypes this CPU computes in natively, as torch itself detects them (AVX512-BF16 or AMX for
    bfloat16, AMX-FP16 for float16)."""
    cpu = torch.cpu
    native = {"bfloat16"} if cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported() else set()
    return native | {"float16"} if cpu._is_amx_fp16_supported() else native


def render(records: list[CalibrationSample], tokenizer: Any, max_len: int | None) -> dict[str, list]:
    """Token ids for each record; chat records go through the model's chat template."""
    ids, masks = [], []
    for rec in records:
        if "messages" in rec:
            text = tokenizer.apply_chat_template(rec["messages"], tokenize=False)
            enc = tokenizer(text, truncation=True, max_length=max_len, add_special_tokens=False)
        else:
            enc = tokenizer(rec["text"], truncation=True, max_length=max_len)
        ids.append(enc["input_ids"])
        masks.append(enc["attention_mask"])
    return {"input_ids": ids, "attention_mask": masks}


def run(job: RunnerJob) -> tuple[int, RunnerResult]:
    t0 = time.perf_counter()
    result = RunnerResult(versions=versions(), workarounds=[])
    uses_awq = "AWQModifier" in Path(job.recipe).read_text(encoding="utf-8")
    patched = pin_memory_workaround() if uses_awq else None  # only AWQ reaches the pinning upstream
    if patched:
        result.workarounds.append(patched)
    from llmcompressor.recipe import Recipe

    try:
        Recipe.create_instance(job.recipe)
    except Exception as exc:  # noqa: BLE001 - llmcompressor raises ValueError/ValidationError/...: all mean "bad recipe"
        result.refused, result.message = "recipe", f"{type(exc).__name__}: {exc}"
        return EXIT_REFUSED, result
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(job.model)
    dataset = None
    if job.calibration:
        records = [json.loads(line) for line in Path(job.calibration).read_text(encoding="utf-8").splitlines() if line.strip()]
        if any("messages" in r for r in records) and not getattr(tokenizer, "chat_template", None):
            result.refused, result.message = "calibration", "chat records but the model has no chat template"
            return EXIT_REFUSED, result
        import datasets

        dataset = datasets.Dataset.from_dict(render(records, tokenizer, job.max_seq_length))
        result.calibration_tokens = sum(len(x) for x in dataset["input_ids"])
    result.prepare_s = round(time.perf_counter() - t0, 2)

    import torch
    from llmcompressor import oneshot

    torch.manual_seed(job.seed)
    t1 = time.perf_counter()
    device = device_record(torch)
    own = torch_dtype_name(checkpoint_dtype(job.model), "torch_dtype", where="config.json: torch_dtype") or "float32"
    dtype, why = calibration_dtype(device["device"], own, native_half(torch))
    model = AutoModelForCausalLM.from_pretrained(job.model, dtype=getattr(torch, dtype), device_map=None)  # see above
    result.load_s = round(time.perf_counter() - t1, 2)
    result.device = rec = DeviceRecord.model_validate(
        device | {"load_dtype": str(model.dtype).removeprefix("torch."), "calibration_dtype_reason": why})
    t2 = time.perf_counter()
    # a tokenizer is the processor of a text model (llmcompressor's annotation names ProcessorMixin alone)
    if dataset is not None:
        oneshot(model=model, recipe=job.recipe, processor=tokenizer, dataset=dataset,  # type: ignore[arg-type]
                num_calibration_samples=len(dataset), max_seq_length=job.max_seq_length,
                shuffle_calibration_samples=False)
    else:
        oneshot(model=model, recipe=job.recipe, processor=tokenizer)  # type: ignore[arg-type]
    result.oneshot_s = round(time.perf_counter() - t2, 2)
    if rec.device.startswith("cuda"):
        rec.peak_memory_bytes = torch.cuda.max_memory_allocated(0)
    t3 = time.perf_counter()
    if dtype != own:  # calibrated in FP32: saved in the checkpoint's own dtype (same tensors, same bytes)
        model.to(getattr(torch, own))
    model.save_pretrained(job.out, save_compressed=True)
    tokenizer.save_pretrained(job.out)
    result.save_s = round(time.perf_counter() - t3, 2)
    result.total_s = round(time.perf_counter() - t0, 2)
    return 0, result


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m quantgate.quantize.runner JOB.json", file=sys.stderr)
        return 2
    os.nice(NICE)  # before torch starts a thread: they inherit it
    job = RunnerJob.read(argv[1])
    try:
        code, result = run(job)
    except Exception:  # noqa: BLE001 - printed, and the result file says it crashed
        traceback.print_exc()
        code, result = 1, RunnerResult(crashed=traceback.format_exc(limit=5))
    result.write(job.result)
    if code == EXIT_REFUSED:
        print(f"refused: {result.message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
