"""Scheme catalogue and selection: which quantization scheme to use for (hardware, workload, model size).

The catalogue is data (`quant_recipes/schemes.yaml`); `rank_schemes` is pure. Rules (docs/design.md, "Planner rules", rule 1):
FP8 W8A8 by default where the hardware runs it; W4A16 for latency (decode-bound, low concurrency) or when an
8-bit scheme does not fit; INT8 W8A8 (throughput) or W4A16 where FP8 is missing. Unsupported schemes stay in
the table, ranked last, with the reason: the support table's, or for a CPU profile the kernel probe's finding
(`missing`: scheme -> reason, from quantgate.serving.cpu_kernels; e.g. an AVX2 build without cpu_gemm_wna16).
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from quantgate.base.errors import ConfigError, QuantgateError, did_you_mean
from quantgate.base.paths import RECIPES
from quantgate.base.yamlconfig import item_error, load_model
from quantgate.target.hardware import HardwareCatalogue, HardwareProfile
from quantgate.target.modelshape import ModelShape

SCHEMES_FILE = RECIPES / "schemes.yaml"
Workload = Literal["latency", "throughput", "fit"]
WORKLOADS: tuple[str, ...] = ("latency", "throughput", "fit")
GIB = 1024**3


class CalibrationDefaults(BaseModel):
    model_config = ConfigDict(extra="forbid")
    samples: int = Field(ge=1)
    max_seq_length: int = Field(ge=8)


class SchemeInfo(BaseModel):
    """One scheme: its recipe file and what the selection needs to know about it."""
    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    label: str
    recipe: str = Field(description="recipe file name inside quant_recipes/")
    weight_bits: int = Field(ge=1, le=16)
    activation_bits: int = Field(ge=1, le=16)
    group_size: int | None = Field(None, description="default weight group size; None = per channel")
    calibration: CalibrationDefaults | None = Field(None, description="None = data-free")
    accuracy_risk: Literal["low", "medium", "high"]
    effect: dict[Workload, str]

    @property
    def needs_calibration(self) -> bool:
        return self.calibration is not None

    def bits_per_weight(self, group_size: int | None = None) -> float:
        """Stored bits per quantized weight, including one 16-bit scale per group (8-bit for NVFP4's FP8 scales)."""
        g = group_size if group_size is not None else self.group_size
        if not g:
            return float(self.weight_bits)
        scale_bits = 8 if self.weight_bits == 4 and self.activation_bits == 4 else 16
        return self.weight_bits + scale_bits / g


class SelectionPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weight_budget_fraction: float = Field(gt=0, le=1)
    preference: dict[Workload, list[str]]


class SchemeCatalogue(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int
    selection: SelectionPolicy
    schemes: list[SchemeInfo]

    @model_validator(mode="after")
    def _consistent(self) -> SchemeCatalogue:
        ids = [s.id for s in self.schemes]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate scheme ids in {ids}")
        for workload in WORKLOADS:
            order = self.selection.preference.get(workload)  # type: ignore[call-overload]
            if order is None:
                raise ValueError(f"selection.preference lacks workload '{workload}'")
            if sorted(order) != sorted(ids):
                raise ValueError(f"selection.preference.{workload} must list each scheme once: {sorted(ids)}")
        return self

    def get(self, scheme_id: str) -> SchemeInfo:
        found = {s.id: s for s in self.schemes}.get(scheme_id.strip().lower())
        if found is None:
            raise QuantgateError(f"unknown scheme '{scheme_id}'", fix=f"use one of: {', '.join(s.id for s in self.schemes)}")
        return found


@lru_cache(maxsize=4)
def load_schemes(path: Path = SCHEMES_FILE) -> SchemeCatalogue:
    cat = load_model(path, SchemeCatalogue)
    for s in cat.schemes:
        if not (path.parent / s.recipe).is_file():
            raise ConfigError(f"scheme '{s.id}': recipe file '{s.recipe}' not found", where=str(path), fix=f"add {path.parent / s.recipe} or correct the name")
    return cat


def known_scheme_ids(ids: list[str]) -> list[str]:
    """`ids` when each is an id of quant_recipes/schemes.yaml; else a pydantic item error at the first unknown one,
    naming the id it most likely means (`INT8-W8A8`: an unknown spelling, not a scheme that 'does not run'). The
    release spec's `schemes` and a policy family's `schemes` validate with it."""
    known = [s.id for s in load_schemes().schemes]
    for i, s in enumerate(ids):
        if s not in known:
            raise item_error(i, f"unknown scheme {s!r}{did_you_mean(s, known)}; quant_recipes/schemes.yaml has: "
                                f"{', '.join(known)}")
    return ids


def check_hardware_schemes(hardware: HardwareCatalogue, schemes: SchemeCatalogue) -> None:
    """Every scheme id a hardware profile lists must exist in the scheme catalogue."""
    known = {s.id for s in schemes.schemes}
    for p in hardware.profiles:
        unknown = sorted(set(p.schemes) - known)
        if unknown:
            raise ConfigError(
                f"hardware '{p.id}' lists unknown scheme(s): {', '.join(unknown)}",
                where="quant_recipes/hardware.yaml",
                fix=f"use scheme ids from schemes.yaml: {', '.join(sorted(known))}",
            )


class ModelSize(BaseModel):
    """Parameter counts of a checkpoint: what a recipe quantizes, and what stays at 16 bits."""
    model_config = ConfigDict(extra="forbid")
    quantizable_params: int = Field(ge=0, description="weights of the targeted Linear layers")
    other_params: int = Field(ge=0, description="embeddings, norms, lm_head, router gates, biases")
    group_sizes_ok: dict[int, bool] = Field(default_factory=dict, description="group size -> divides every input size")

    @property
    def bytes_16bit(self) -> int:
        return 2 * (self.quantizable_params + self.other_params)

    def bytes_after(self, scheme: SchemeInfo, group_size: int | None = None) -> int:
        return int(self.quantizable_params * scheme.bits_per_weight(group_size) / 8) + 2 * self.other_params


def size_from_shape(shape: ModelShape) -> ModelSize:
    """A ModelSize from a model's config alone (quantgate.target.modelshape: no weights read): the Linear layers of
    the blocks are what a recipe quantizes; embeddings, lm_head, norms and router gates stay at 16 bits. A group
    size is fine when it divides every targeted layer's input (hidden, attention output, MLP widths)."""
    counts = shape.param_counts()
    inputs = {shape.hidden, shape.heads * shape.head_dim, shape.intermediate}
    if shape.is_moe:
        inputs |= {shape.moe_intermediate} | ({shape.shared_expert_intermediate} if shape.shared_expert_intermediate else set())
    ok = {g: all(i % g == 0 for i in inputs) for g in (128, 64, 32)}
    return ModelSize(quantizable_params=counts["linear"],
                     other_params=counts["embed"] + counts["lm_head"] + counts["other"], group_sizes_ok=ok)


class SchemeRow(BaseModel):
    rank: int
    scheme: str
    label: str
    supported: bool
    fits_node: bool
    weight_bytes: int
    devices_needed: int
    accuracy_risk: str
    effect: str
    reason: str


class Ranking(BaseModel):
    hardware: str
    workload: Workload
    bytes_16bit: int
    budget_per_device: int
    rows: list[SchemeRow]
    recommended: str | None
    explanation: str


def _devices_needed(weight_bytes: int, budget_per_device: int) -> int:
    return max(1, math.ceil(weight_bytes / budget_per_device))


def _group_for(scheme: SchemeInfo, size: ModelSize) -> int | None:
    """The group size the pre-flight check would pick (largest of 128/64/32 that divides), for memory estimates."""
    if scheme.group_size is None or scheme.activation_bits == 4:
        return scheme.group_size
    for g in (scheme.group_size, 128, 64, 32):
        if g <= scheme.group_size and size.group_sizes_ok.get(g, True):
            return g
    return 32


def rank_schemes(profile: HardwareProfile, workload: str, size: ModelSize, catalogue: SchemeCatalogue,
                 missing: dict[str, str] | None = None) -> Ranking:
    """Rank every scheme for this hardware and workload; each row says why it sits where it does. `missing`:
    schemes the profile lists that this machine's serving build cannot run, with the reason (the kernel probe)."""
    missing = missing or {}
    if workload not in WORKLOADS:
        raise QuantgateError(f"unknown workload '{workload}'", fix=f"use one of: {', '.join(WORKLOADS)}")
    policy = catalogue.selection
    order = policy.preference[workload]  # type: ignore[index]
    budget = int(profile.memory_bytes * policy.weight_budget_fraction)
    node = f"{profile.devices_per_node} x {profile.memory_gib:g} GiB"
    drafts = []
    for scheme in catalogue.schemes:
        supported = scheme.id in profile.schemes and scheme.id not in missing
        wbytes = size.bytes_after(scheme, _group_for(scheme, size))
        devices = _devices_needed(wbytes, budget)
        fits = devices <= profile.devices_per_node
        if scheme.id in missing:
            why = missing[scheme.id]
        elif not supported:
            why = f"{profile.id} ({profile.arch}) has no vLLM kernel for {scheme.label} (support table)"
        elif not fits:
            why = f"weights {wbytes / GIB:.1f} GiB need {devices} devices; one node has {node}"
        else:
            where = "one device" if devices == 1 else f"{devices} of {profile.devices_per_node} devices"
            why = f"fits on {where}; {scheme.effect[workload]}"  # type: ignore[index]
        # sort: supported and fitting first; for `fit`, fewer devices first; then the workload's preference
        key = (not supported, not fits, devices if workload == "fit" else 0, order.index(scheme.id))
        drafts.append((key, scheme, supported, fits, wbytes, devices, why))
    drafts.sort(key=lambda d: d[0])
    rows = [
        SchemeRow(rank=i + 1, scheme=s.id, label=s.label, supported=sup, fits_node=fits, weight_bytes=wb,
                  devices_needed=dev, accuracy_risk=s.accuracy_risk, effect=s.effect[workload], reason=why)  # type: ignore[index]
        for i, (_, s, sup, fits, wb, dev, why) in enumerate(drafts)
    ]
    best = next((r for r in rows if r.supported and r.fits_node), None)
    return Ranking(hardware=profile.id, workload=workload, bytes_16bit=size.bytes_16bit, budget_per_device=budget,
                   rows=rows, recommended=best.scheme if best else None,
                   explanation=_explain(profile, workload, size, rows, best, budget, policy.weight_budget_fraction))


def top_schemes(ranking: Ranking, n: int) -> tuple[list[str], str]:
    """The first `n` schemes of a ranking that run here and fit a node, in rank order (a ladder tries them in that
    order), and one sentence saying which and why (for the release's notes)."""
    usable = [r for r in ranking.rows if r.supported and r.fits_node]
    picked = usable[:n]
    if not picked:
        return [], f"no scheme runs and fits on {ranking.hardware}: {ranking.explanation}"
    left = [f"{r.scheme} (#{r.rank}: {r.reason})" for r in ranking.rows if r not in picked]
    why = "; ".join(f"#{r.rank} {r.scheme}: {r.reason}" for r in picked)
    short = f" (asked for {n}, {len(usable)} run and fit)" if len(picked) < n else ""
    return [r.scheme for r in picked], (f"schemes auto (top {n}) for workload {ranking.workload} on {ranking.hardware}: "
                                        f"{', '.join(r.scheme for r in picked)}{short}. {why}. Not picked: "
                                        + ("; ".join(left) or "none"))


def _explain(profile: HardwareProfile, workload: str, size: ModelSize, rows: list[SchemeRow], best: SchemeRow | None,
             budget: int, fraction: float) -> str:
    bf16 = size.bytes_16bit / GIB
    if best is not None:
        too_big = [r.scheme for r in rows if r.supported and not r.fits_node]
        extra = f" Supported but too large for one node: {', '.join(too_big)}." if too_big else ""
        return (f"{best.scheme} for {workload} on {profile.id}: {best.weight_bytes / GIB:.1f} GiB of weights "
                f"(BF16: {bf16:.1f} GiB) on {best.devices_needed} device(s).{extra}")
    supported = [r for r in rows if r.supported]
    if not supported:
        return f"{profile.id} runs none of the known schemes; serve it unquantized or pick other hardware."
    smallest = min(supported, key=lambda r: r.weight_bytes)
    nodes = math.ceil(smallest.devices_needed / profile.devices_per_node)
    return (f"too large for one {profile.id} node even at 4 bits: the smallest supported scheme "
            f"({smallest.scheme}) leaves {smallest.weight_bytes / GIB:.1f} GiB of weights (BF16: {bf16:.1f} GiB), "
            f"but a node holds {profile.devices_per_node} x {profile.memory_gib:g} GiB x {fraction:g} "
            f"= {profile.devices_per_node * budget / GIB:.1f} GiB for weights (the rest is KV cache). "
            f"Use {nodes} nodes (tensor parallel inside a node, pipeline parallel across nodes) or hardware "
            f"with more memory per node.")
