"""Where a transformers model runs in quantgate's own processes, and in which dtype (pure).

One rule for the two places that load a model into torch: llmcompressor's calibration (`quantize.runner`) and the
engine-parity reference (`parity.engine`). `place()` takes what the caller read from torch and the environment
(CUDA available, device count, `CUDA_VISIBLE_DEVICES`) and the dtype vLLM serves in, and returns the device and
dtype with the reason. The adapters call it and record the answer (the quantize manifest's `device`, parity.json's
`device`).

- A visible NVIDIA GPU is used: the first visible one (`cuda:0`), whose physical index is the first entry of
  `CUDA_VISIBLE_DEVICES` when that lists indices. `CUDA_VISIBLE_DEVICES` set to nothing or `-1` hides every GPU.
  Given the slot of the server it is compared with (the slot's CUDA_VISIBLE_DEVICES), the parity reference goes to
  that slot's first GPU when this process sees it, not to another slot's.
- On a GPU the dtype is the served one: the parity reference must compute what vLLM computes. vLLM's `auto` serves
  the checkpoint's dtype, except that an FP32 checkpoint is served in BF16 on a GPU (vLLM 0.32's auto rule).
- On a CPU the dtype is the served one too, and FP32 for `auto` or nothing: CPU baselines serve FP32 (BF16 text
  differed from transformers' on this project's CPUs), so the reference runs FP32 as before.

Calibration has a rule of its own (`calibration_dtype`): on a CPU without native arithmetic for the checkpoint's
16-bit dtype, llmcompressor calibrates in FP32 and the quantized model is cast back before it is saved, so the
checkpoint holds the same dtypes and bytes as one calibrated in its own dtype. BF16 arithmetic emulated on an
AVX2-only CPU made the demo's INT8 calibration several times slower than FP32 (docs/gpu.md, "Where models run").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from quantgate.base.errors import SettingError

# dtype spellings vLLM's --dtype and config.json use, to torch's attribute names
DTYPES = {"float32": "float32", "float": "float32", "fp32": "float32",
          "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "half": "float16", "fp16": "float16"}
AUTO = ("auto", "", None)
GPU_AUTO_FOR_FP32 = "bfloat16"  # vLLM's preferred GPU dtype for an FP32 checkpoint served with --dtype auto
HALF = ("bfloat16", "float16")  # the 16-bit float dtypes a CPU may or may not compute in natively


@dataclass(frozen=True)
class Placement:
    device: str               # torch device string: "cuda:0" or "cpu"
    dtype: str                # torch dtype attribute name: "float32", "bfloat16", "float16"
    physical_gpu: str | None  # the GPU's index (or UUID) outside CUDA_VISIBLE_DEVICES; None on CPU or when unknown
    reason: str

    @property
    def is_gpu(self) -> bool:
        return self.device.startswith("cuda")

    def as_record(self) -> dict[str, str | None]:
        return asdict(self)


def torch_dtype_name(name: str | None, setting: str = "dtype", where: str | None = None) -> str | None:
    """The torch name of a dtype spelling; None for `auto`/nothing. Unknown spellings are a SettingError for
    `setting` (the CLI shows it as its flag), or naming `where` when the value came from a file."""
    if name in AUTO:
        return None
    key = str(name).lower().removeprefix("torch.")
    if key not in DTYPES:
        raise SettingError(f"unknown dtype '{name}'", setting=setting, where=where,
                           fix=f"use one of: auto, {', '.join(sorted(set(DTYPES.values())))}")
    return DTYPES[key]


def visible_gpus(cuda_visible_devices: str | None) -> list[str] | None:
    """The entries of CUDA_VISIBLE_DEVICES (None: the variable is unset, every GPU is visible). CUDA stops at the
    first invalid entry, and `-1` is the usual way to hide them all."""
    if cuda_visible_devices is None:
        return None
    out = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if not entry or entry.startswith("-"):
            break
        out.append(entry)
    return out


def _slot_index(slot: list[str], visible: list[str] | None, count: int) -> tuple[int, str] | None:
    """This process's index of the slot's first GPU: its position in our CUDA_VISIBLE_DEVICES, or the number itself
    when ours is unset; None when this process cannot see it."""
    first = slot[0]
    if visible is not None:
        index = visible.index(first) if first in visible else None
    else:
        index = int(first) if first.isdigit() else None
    return None if index is None or index >= count else (index, first)


def choose_device(cuda_available: bool, device_count: int, cuda_visible_devices: str | None,
                  slot_devices: str | None = None) -> tuple[str, str | None, str]:
    """(torch device, physical GPU or None, why): the first visible GPU, or with `slot_devices` (the CUDA_VISIBLE_DEVICES
    of the server a model is compared with) that slot's first GPU when this process sees it; else the CPU."""
    visible = visible_gpus(cuda_visible_devices)
    if visible == []:
        return "cpu", None, f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} hides every GPU"
    if not cuda_available or device_count < 1:
        return "cpu", None, "no CUDA device visible to torch"
    first = visible[0] if visible else "0"
    slot = visible_gpus(slot_devices)
    if not slot:
        return "cuda:0", first, "first visible GPU"
    found = _slot_index(slot, visible, device_count)
    if found is None:
        return "cuda:0", first, f"slot GPU {slot[0]} not visible here: first visible GPU"
    return f"cuda:{found[0]}", found[1], "the slot's GPU"


def place(cuda_available: bool, device_count: int, served_dtype: str | None, cuda_visible_devices: str | None,
          checkpoint_dtype: str | None = None, slot_devices: str | None = None) -> Placement:
    """The device (choose_device) and dtype for a model compared with one vLLM serves in `served_dtype` (see the
    module docstring for the rules); a model on a slot's GPU does not disturb concurrent variants on other slots."""
    device, physical, why = choose_device(cuda_available, device_count, cuda_visible_devices, slot_devices)
    served = torch_dtype_name(served_dtype)
    if device == "cpu":
        return Placement("cpu", served or "float32", None, why)
    if served:
        return Placement(device, served, physical, f"{why}, served dtype {served}")
    ckpt = torch_dtype_name(checkpoint_dtype, "torch_dtype", where="config.json: torch_dtype") or "float32"
    dtype = GPU_AUTO_FOR_FP32 if ckpt == "float32" else ckpt
    return Placement(device, dtype, physical, f"{why}, served dtype auto: checkpoint {ckpt} -> {dtype}")


def calibration_dtype(device: str, checkpoint_dtype: str, native: set[str]) -> tuple[str, str]:
    """(the dtype `oneshot` calibrates in, why): the checkpoint's own, except on a CPU that lacks native arithmetic
    for it (`native`: the 16-bit dtypes this CPU computes in, e.g. {"bfloat16"} with AVX512-BF16 or AMX), where FP32
    is more precise and much faster than emulated 16-bit arithmetic. The caller casts the model back to
    `checkpoint_dtype` to save it."""
    if device != "cpu" or checkpoint_dtype not in HALF:
        return checkpoint_dtype, "the checkpoint's dtype"
    if checkpoint_dtype in native:
        return checkpoint_dtype, f"the checkpoint's dtype: this CPU computes in {checkpoint_dtype} natively"
    return "float32", (f"float32 on a CPU without native {checkpoint_dtype} arithmetic (emulated is slower); "
                       f"saved as {checkpoint_dtype}")
