"""Hardware profiles: what a target device has (memory, links) and which quantization schemes it runs.

The data is `quant_recipes/hardware.yaml`; this module types and looks it up. For CPU targets the profile's table is
narrowed by what the serving environment's vLLM build really runs: `KernelProbe` is what
quantgate.serving.cpu_kernels found there (kernel library, ops, CPU flags), and `missing_kernels`, `refine` and
`profile_for` (pure) turn it into the schemes a profile supports and the profile `hardware: auto` means.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.errors import ConfigError
from quantgate.base.paths import RECIPES
from quantgate.base.yamlconfig import load_model

HARDWARE_FILE = RECIPES / "hardware.yaml"

Interconnect = Literal["nvlink", "xgmi", "pcie", "none"]
FAST_LINKS = {"nvlink", "xgmi"}
AUTO = "auto"  # `hardware: auto` / `--hardware auto`: the CPU profile of this machine's serving build


class HardwareProfile(BaseModel):
    """One device type. For CPU targets a "device" is one vLLM CPU worker (a NUMA node or core group)."""
    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$", description="short lower-case id for the command line")
    name: str
    vendor: Literal["nvidia", "amd", "intel", "arm", "generic"]
    arch: str = Field(description="e.g. volta, turing, ampere, ada, hopper, blackwell, cdna3, x86, arm")
    kind: Literal["gpu", "cpu"]
    compute_capability: str | None = Field(None, description="NVIDIA SM version, e.g. '9.0'")
    memory_gib: float = Field(gt=0, description="memory per device (for CPU: the KV+weights budget per worker)")
    devices_per_node: int = Field(ge=1)
    interconnect: Interconnect = Field(description="link between devices inside a node")
    schemes: list[str] = Field(description="scheme ids this hardware runs (see quant_recipes/README.md)")
    kv_cache_dtypes: list[str] = Field(default_factory=lambda: ["auto"])
    kernel_builds: list[str] = Field(default_factory=list, description="CPU: the vLLM kernel libraries (as "
                                     "KernelProbe.build names them) for which `hardware: auto` picks this profile")
    notes: str = ""

    @property
    def fast_link(self) -> bool:
        """True where tensor parallelism across devices is worth it (NVLink / Infinity Fabric)."""
        return self.interconnect in FAST_LINKS

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 1024**3)

    def supports(self, scheme_id: str) -> bool:
        """True where vLLM runs this scheme id with a real kernel on this hardware (see hardware.yaml)."""
        return scheme_id.strip().lower() in self.schemes


class HardwareCatalogue(BaseModel):
    model_config = ConfigDict(extra="forbid")

    vllm_version: str = Field(description="vLLM release whose published support table the data reflects")
    cpu_kernels: dict[str, list[str]] = Field(default_factory=dict, description="scheme id -> the vLLM ops "
                                              "(torch.ops._C) it needs on a CPU profile")
    source: str
    profiles: list[HardwareProfile]


@lru_cache(maxsize=4)
def load_catalogue(path: Path = HARDWARE_FILE) -> HardwareCatalogue:
    cat = load_model(path, HardwareCatalogue)
    ids = [p.id for p in cat.profiles]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(f"duplicate hardware id(s): {', '.join(dupes)}", where=str(path), fix="give each profile a unique id")
    if AUTO in ids:
        raise ConfigError(f"'{AUTO}' is not a profile id: it means the detected CPU profile", where=str(path),
                          fix="rename that profile")
    builds = [b for p in cat.profiles for b in p.kernel_builds]
    twice = sorted({b for b in builds if builds.count(b) > 1})
    if twice:
        raise ConfigError(f"kernel build(s) {', '.join(twice)} listed by more than one profile", where=str(path),
                          fix="`hardware: auto` must find one profile per build: list each build once")
    return cat


def get_profile(hardware_id: str, path: Path = HARDWARE_FILE) -> HardwareProfile:
    """Look a profile up by id, case-insensitively; an unknown id names the known ones."""
    profiles = {p.id: p for p in load_catalogue(path).profiles}
    found = profiles.get(hardware_id.strip().lower())
    if found is None:
        auto = " ('auto' is resolved by quantgate.serving.cpu_kernels.detect_profile, not here)" \
            if hardware_id.strip().lower() == AUTO else ""
        raise ConfigError(
            f"unknown hardware '{hardware_id}'{auto}",
            where=str(path),
            fix=f"use one of: {', '.join(sorted(profiles))}, or auto (or add a profile to {path.name})",
        )
    return found


class KernelProbe(BaseModel):
    """What the serving environment's vLLM loads on this CPU (quantgate.serving.cpu_kernels writes and caches it)."""
    model_config = ConfigDict(extra="forbid")

    arch: str = Field(description="platform.machine() of the serving interpreter, e.g. x86_64, aarch64")
    build: str | None = Field(description="kernel library loaded: avx512-bf16 (_C), avx512 (_C_AVX512), avx2 "
                                          "(_C_AVX2), arm (_C on Arm); None when none loaded")
    library: str | None = Field(None, description="file name of the loaded kernel library")
    ops: dict[str, bool] = Field(default_factory=dict, description="op name -> present in torch.ops._C")
    flags: dict[str, bool] = Field(default_factory=dict, description="avx2, avx512f, avx512_bf16, amx (cpuinfo)")
    cpu_model: str = ""
    vllm: str = ""
    python: str = ""
    override: str | None = Field(None, description="$QUANTGATE_CPU_KERNELS when it forced the library (tests)")
    error: str | None = Field(None, description="why vLLM's kernels could not be imported, when they could not")

    def describe(self) -> str:
        """How a reason names the build: "this CPU's vLLM build (AVX2, _C_AVX2.abi3.so)"."""
        what = (self.build or "no kernel library").upper().replace("-", "+")
        lib = f", {self.library}" if self.library else ""
        forced = f", forced by QUANTGATE_CPU_KERNELS={self.override}" if self.override else ""
        return f"this CPU's vLLM build ({what}{lib}{forced})"


def missing_kernels(profile: HardwareProfile, probe: KernelProbe, cpu_kernels: dict[str, list[str]]) -> dict[str, str]:
    """Scheme -> why the probed serving build cannot run it, for the schemes a CPU profile lists (GPU profiles: {})."""
    if profile.kind != "cpu":
        return {}
    out = {}
    for scheme in profile.schemes:
        if probe.error:
            out[scheme] = f"{probe.describe()} did not load its kernels: {probe.error}"
            continue
        absent = [op for op in cpu_kernels.get(scheme, []) if not probe.ops.get(op, False)]
        if absent:
            out[scheme] = f"{probe.describe()} has no {', '.join(absent)} kernel"
    return out


def refine(profile: HardwareProfile, probe: KernelProbe, cpu_kernels: dict[str, list[str]]) -> tuple[HardwareProfile, dict[str, str]]:
    """The profile with only the schemes the probed build runs, and scheme -> reason for those it dropped."""
    dropped = missing_kernels(profile, probe, cpu_kernels)
    if not dropped:
        return profile, {}
    kept = [s for s in profile.schemes if s not in dropped]
    return profile.model_copy(update={"schemes": kept}), dropped


def profile_for(probe: KernelProbe, catalogue: HardwareCatalogue) -> HardwareProfile:
    """The profile `hardware: auto` means: the one whose kernel_builds list the probed build."""
    found = next((p for p in catalogue.profiles if probe.build and probe.build in p.kernel_builds), None)
    if found is None:
        why = probe.error or f"no profile in hardware.yaml lists kernel build {probe.build!r}"
        raise ConfigError(f"hardware 'auto' found no profile for {probe.describe()} on {probe.arch}: {why}",
                          where=str(HARDWARE_FILE),
                          fix="name the hardware profile (the `hardware` setting), or add `kernel_builds: "
                              f"[{probe.build}]` to the profile that describes this machine")
    return found
