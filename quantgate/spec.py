"""The release spec: one YAML file in `releases/` saying what to release, for which hardware, checked how.

    version: 1                      # schema version of this file
    name: demo                      # run ids and registry entries start with it
    model: demo                     # catalogue id (releases/models.yaml) or a checkpoint folder
    hardware: x86-cpu               # profile id in quant_recipes/hardware.yaml
    workload: latency               # latency | throughput | fit
    schemes: [w4a16-gptq]           # candidate schemes, each must run on the hardware
    eval_sets: [../eval_sets/default.jsonl]
    judge: ../judges/pairwise.md
    policy: policies/default.yaml
    quantization: {calibration: {samples: 64, max_seq_length: 256}}
    serving: {dtype: float32}
    eval: {limit: 50}

Relative paths are relative to the spec file's folder. Cross-field checks (the hardware exists and runs each
scheme, referenced files exist) happen at load time and name the field and line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from quantgate.calibration import CalibrationSpec
from quantgate.errors import QuantgateError
from quantgate.recipes import RecipeOverrides
from quantgate.yamlconfig import load_model


class ServingSpec(BaseModel):
    """How vLLM serves every variant. The parallel layout and CPU settings come from the planner; these override."""

    model_config = ConfigDict(extra="forbid")

    python: Path | None = Field(None, description="serving interpreter (default: $QUANTGATE_SERVE_PYTHON or .venv-serve)")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] | None = Field(None, description="None: the planner's choice")
    replicas: int | None = Field(None, ge=1, description="required replicas (the planner's --replicas)")
    startup_timeout_s: float = Field(600.0, gt=0)
    extra_args: list[str] = Field(default_factory=list, description="appended verbatim to `vllm serve`")


class QuantizationSpec(BaseModel):
    """Recipe parameters and calibration data for the candidates (defaults: quant_recipes/schemes.yaml)."""

    model_config = ConfigDict(extra="forbid")

    overrides: dict[str, RecipeOverrides] = Field(default_factory=dict, description="scheme id -> recipe overrides")
    calibration: CalibrationSpec = Field(default_factory=CalibrationSpec)


class EvalSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    limit: int | None = Field(None, ge=1, description="first N samples of each set (CI subsets); None: all")
    concurrency: int = Field(16, ge=1)
    max_error_rate: float = Field(0.05, ge=0, le=1)


class RecallSpec(BaseModel):
    """Long-context needle grid (quantgate recall); every length plus the answer must fit `context`."""

    model_config = ConfigDict(extra="forbid")

    lengths: list[int] = Field(default_factory=lambda: [1024, 2048], min_length=1)
    depths: list[int] = Field(default_factory=lambda: [0, 25, 50, 75, 100], min_length=1)
    kinds: list[Literal["number", "name", "multilingual", "multi"]] = Field(
        default_factory=lambda: ["number", "name", "multilingual", "multi"], min_length=1)
    samples: int = Field(1, ge=1, description="prompts per (length, depth, kind) cell")
    seed: int = 0
    max_answer_tokens: int = Field(32, ge=1)

    @field_validator("depths")
    @classmethod
    def _percent(cls, v: list[int]) -> list[int]:
        if any(d < 0 or d > 100 for d in v):
            raise ValueError("depths are percentages from 0 to 100")
        return v


class PerfSpec(BaseModel):
    """Serving performance probe (quantgate perf, vLLM's own benchmark client): same workload for every variant."""

    model_config = ConfigDict(extra="forbid")

    concurrency: list[int] = Field(default_factory=lambda: [1, 8], min_length=1)
    num_prompts: int = Field(32, ge=1)
    input_len: int = Field(128, ge=1)
    output_len: int = Field(32, ge=1)
    repeats: int = Field(2, ge=1, description="medians over this many runs per level")


def _resolve(value: Path | None, info: ValidationInfo) -> Path | None:
    """Resolve a path relative to the spec file and check that it exists."""
    if value is None:
        return None
    base = (info.context or {}).get("path")
    path = value if value.is_absolute() or base is None else (Path(base).parent / value)
    if not path.exists():
        raise ValueError(f"file not found: {path} (relative paths are relative to the spec file's folder)")
    return path.resolve()


class ReleaseSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = Field(description="schema version of release specs")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    model: str = Field(description="catalogue id or checkpoint folder")
    hardware: str
    gpus: int | None = Field(None, ge=1, description="devices to use per node; default: all of the profile's")
    nodes: int = Field(1, ge=1)
    workload: Literal["latency", "throughput", "fit"] = "latency"
    context: int = Field(4096, ge=128, description="tokens per request for the capacity estimate")
    concurrency: int = Field(8, ge=1, description="concurrent requests the deployment must hold")
    schemes: list[str] = Field(min_length=1)
    eval_sets: list[Path] = Field(default_factory=list)
    judge: Path | None = None
    policy: Path | None = None
    quantization: QuantizationSpec = Field(default_factory=QuantizationSpec)
    serving: ServingSpec = Field(default_factory=ServingSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    recall: RecallSpec | None = Field(default_factory=RecallSpec, description="null: no recall run (a policy requiring it rejects)")
    perf: PerfSpec | None = Field(default_factory=PerfSpec, description="null: no performance probe")

    @field_validator("eval_sets")
    @classmethod
    def _eval_sets_exist(cls, v: list[Path], info: ValidationInfo) -> list[Path]:
        return [_resolve(p, info) for p in v]

    @field_validator("judge", "policy")
    @classmethod
    def _file_exists(cls, v: Path | None, info: ValidationInfo) -> Path | None:
        return _resolve(v, info)

    @field_validator("hardware")
    @classmethod
    def _known_hardware(cls, v: str) -> str:
        from quantgate.hardware import get_profile

        try:
            return get_profile(v).id
        except QuantgateError as exc:
            raise ValueError(f"{exc.message}; {exc.fix}") from None

    @field_validator("schemes")
    @classmethod
    def _schemes_run_on_hardware(cls, v: list[str], info: ValidationInfo) -> list[str]:
        from quantgate.hardware import get_profile

        hardware = info.data.get("hardware")
        if hardware is None:  # the hardware field already failed; its error says why
            return v
        profile = get_profile(hardware)
        unsupported = [s for s in v if s not in profile.schemes]
        if unsupported:
            raise ValueError(f"{unsupported} do not run on {profile.id} ({profile.name}); it runs: {', '.join(profile.schemes)}")
        return v


    @model_validator(mode="after")
    def _recall_fits_context(self) -> "ReleaseSpec":
        if self.recall is not None:
            need = max(self.recall.lengths) + self.recall.max_answer_tokens
            if need > self.context:
                raise ValueError(f"recall.lengths up to {max(self.recall.lengths)} + {self.recall.max_answer_tokens} answer tokens "
                                 f"= {need} do not fit context {self.context}: raise `context` or shorten recall.lengths")
        return self


def load_spec(path: Path | str) -> ReleaseSpec:
    return load_model(Path(path), ReleaseSpec)
