"""Workload profiles (quant_recipes/workloads.yaml): what the probe measures per deployment kind, what pays off,
and what a probe may cost on each hardware.

    s = settings("throughput", get_profile("x86-cpu"), PerfOverrides(slo=SLO(ttft_ms=1000)), concurrency=8)
    run_probe(endpoint, out, s, ...)                 # quantgate.perf.probe

`settings` resolves, field by field: the release spec's (or command line's) override, else the workload profile
(levels, sweep, pay-off figures), else the hardware's budget (repeats, requests, lengths, time), and for the SLO the
file's default. The `fit` profile has no levels of its own: it probes the spec's `concurrency`. Request lengths are
given (random prompts, `input_len` -> `output_len`, +-`range_ratio`) or the prompts of an eval set with their own
lengths (`lengths: eval_sets`: `write_requests` writes them as a prompts file, passed as `requests`), each
generating `output_len` tokens.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.errors import ConfigError
from quantgate.base.paths import RECIPES
from quantgate.base.yamlconfig import load_model
from quantgate.evals.dataset import load_evalset, stratified_subset
from quantgate.perf.models import SLO, Decide, ProbeSettings
from quantgate.target.hardware import HardwareProfile

WORKLOADS_FILE = RECIPES / "workloads.yaml"
WorkloadName = Literal["latency", "throughput", "fit"]
WORKLOADS: tuple[str, ...] = ("latency", "throughput", "fit")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Profile(_Strict):
    description: str
    measures: str
    pays_off: str
    levels: list[int] = Field(description="concurrency levels; empty: the release spec's concurrency")
    sweep: bool = Field(False, description="stop at the level where throughput stops rising or the SLO breaks")
    decide: list[Decide] = Field(min_length=1, description="figures whose candidate/baseline ratio decides pay-off")


class Budget(_Strict):
    """What one variant's probe may cost on a kind of hardware."""
    seconds_per_variant: float = Field(gt=0, description="no run starts after this; one run in flight may finish")
    repeats: int = Field(ge=2, description="runs per level: at least 2, or a ratio has no interval")
    num_prompts: int = Field(ge=1)
    waves: int = Field(1, ge=1)
    warmup_prompts: int = Field(0, ge=0)
    input_len: int = Field(ge=1)
    output_len: int = Field(ge=1)
    range_ratio: float = Field(0.0, ge=0, lt=1)


class WorkloadCatalogue(_Strict):
    version: Literal[1]
    source: str
    profiles: dict[WorkloadName, Profile]
    slo: SLO
    saturation_gain: float = Field(1.1, ge=1)
    budgets: dict[str, Budget] = Field(description="hardware profile id or kind (cpu, gpu) -> budget")


class PerfOverrides(_Strict):
    """What a release spec (`perf:`) or the command line may set; None: from the profile and the budget."""
    concurrency: list[int] | None = Field(None, min_length=1, description="concurrency levels")
    sweep: bool | None = None
    slo: SLO | None = Field(None, description="fields given replace the default SLO's")
    repeats: int | None = Field(None, ge=1)
    num_prompts: int | None = Field(None, ge=1)
    input_len: int | None = Field(None, ge=1)
    output_len: int | None = Field(None, ge=1)
    range_ratio: float | None = Field(None, ge=0, lt=1)
    budget_s: float | None = Field(None, gt=0, description="seconds per variant")
    lengths: Literal["given", "eval_sets"] = Field("given", description="given: random prompts of input_len -> "
                                                  "output_len tokens; eval_sets: the spec's first eval set's prompts "
                                                  "(their own lengths), each generating output_len tokens")


@lru_cache(maxsize=4)
def load_workloads(path: Path = WORKLOADS_FILE) -> WorkloadCatalogue:
    cat = load_model(path, WorkloadCatalogue)
    missing = sorted(set(WORKLOADS) - set(cat.profiles))
    if missing:
        raise ConfigError(f"workload profile(s) {missing} missing", where=str(path), fix=f"define all of {list(WORKLOADS)}")
    return cat


def budget_for(hardware: HardwareProfile, cat: WorkloadCatalogue) -> Budget:
    found = cat.budgets.get(hardware.id) or cat.budgets.get(hardware.kind)
    if found is None:
        raise ConfigError(f"no probe budget for hardware {hardware.id!r} (kind {hardware.kind})", where=str(WORKLOADS_FILE),
                          fix=f"add `budgets: {{{hardware.id}: ...}}` or one for the kind {hardware.kind!r}")
    return found


def _pick(override, default):
    return default if override is None else override


def settings(workload: str, hardware: HardwareProfile, overrides: PerfOverrides | None = None, *,
             concurrency: int | None = None, path: Path = WORKLOADS_FILE) -> ProbeSettings:
    """The probe of `workload` on `hardware` (see the module doc); `concurrency`: the release spec's, for `fit`."""
    cat = load_workloads(path)
    if workload not in cat.profiles:
        raise ConfigError(f"unknown workload {workload!r}; {path} has: {', '.join(cat.profiles)}", where="workload",
                          fix=f"use one of {', '.join(cat.profiles)}")
    prof, budget, o = cat.profiles[workload], budget_for(hardware, cat), overrides or PerfOverrides()
    levels = o.concurrency or prof.levels or [concurrency or 1]
    slo = cat.slo.model_copy(update={k: getattr(o.slo, k) for k in o.slo.model_fields_set}) if o.slo else cat.slo
    return ProbeSettings(profile=workload, levels=levels, sweep=_pick(o.sweep, prof.sweep),
                         saturation_gain=cat.saturation_gain, slo=slo, decide=prof.decide,
                         repeats=_pick(o.repeats, budget.repeats), num_prompts=_pick(o.num_prompts, budget.num_prompts),
                         waves=budget.waves, input_len=_pick(o.input_len, budget.input_len),
                         output_len=_pick(o.output_len, budget.output_len),
                         range_ratio=_pick(o.range_ratio, budget.range_ratio), warmup_prompts=budget.warmup_prompts,
                         budget_s=_pick(o.budget_s, budget.seconds_per_variant))


def write_requests(evalset: Path, out: Path, limit: int | None = None) -> Path:
    """An eval set's prompts as a prompts file for vLLM's benchmark client (its ShareGPT JSON layout, which needs
    no pandas in the serving environment): one conversation per sample, the prompt text and its first reference;
    the client sends the prompt and asks for the probe's output_len tokens. The first `limit` samples, round-robin
    over categories. Prompts shorter than 4 tokens are dropped by the client."""
    es = load_evalset(evalset, with_dataset=False)
    rows = [{"id": s.id, "conversations": [{"from": "human", "value": s.prompt_text()},
                                          {"from": "gpt", "value": (s.references or [""])[0]}]}
            for s in stratified_subset(es.samples, limit)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, ensure_ascii=False, indent=0), encoding="utf-8")
    return out
