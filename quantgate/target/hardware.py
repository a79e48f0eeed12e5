"""Hardware profiles: what a target device has (memory, links) and which quantization schemes it runs.

The data is `quant_recipes/hardware.yaml`; this module only types and looks it up.
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
    source: str
    profiles: list[HardwareProfile]


@lru_cache(maxsize=4)
def load_catalogue(path: Path = HARDWARE_FILE) -> HardwareCatalogue:
    cat = load_model(path, HardwareCatalogue)
    ids = [p.id for p in cat.profiles]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(f"duplicate hardware id(s): {', '.join(dupes)}", where=str(path), fix="give each profile a unique id")
    return cat


def get_profile(hardware_id: str, path: Path = HARDWARE_FILE) -> HardwareProfile:
    """Look a profile up by id, case-insensitively; an unknown id names the known ones."""
    profiles = {p.id: p for p in load_catalogue(path).profiles}
    found = profiles.get(hardware_id.strip().lower())
    if found is None:
        raise ConfigError(
            f"unknown hardware '{hardware_id}'",
            where=str(path),
            fix=f"use one of: {', '.join(sorted(profiles))} (or add a profile to {path.name})",
        )
    return found
