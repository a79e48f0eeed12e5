"""The sections of a release spec (quantgate.spec.schema): serving, quantization, eval, recall, perf, fidelity,
judge and adaptive sampling, each a strict model whose fields the spec's YAML sets under its key.

Relative paths are relative to the spec file's folder (`resolve_path`, with the spec's path in the validation context).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar, Literal, overload

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from quantgate.base.errors import QuantgateError
from quantgate.base.paths import JUDGES
from quantgate.base.yamlconfig import item_error
from quantgate.judge.run import JudgeSettings, load_judge
from quantgate.perf.models import ProbeSettings
from quantgate.perf.workloads import PerfOverrides
from quantgate.perf.workloads import settings as probe_settings
from quantgate.plan.knobs import ServingKnobs, knob_arg
from quantgate.quantize.calibration import CalibrationSpec
from quantgate.quantize.recipes import RecipeOverrides
from quantgate.serving.watchdog import STALL_S
from quantgate.target.hardware import get_profile


class ServingSpec(ServingKnobs):
    """How vLLM serves every variant. The parallel layout and CPU settings come from the planner; these override.
    The engine knobs (kv_cache_dtype, gpu_memory_utilization, max_num_batched_tokens, max_num_seqs,
    enable_prefix_caching, enforce_eager, cudagraph_mode) are quantgate.plan.knobs.ServingKnobs'."""
    model_config = ConfigDict(extra="forbid")

    python: Path | None = Field(None, description="serving interpreter (default: $QUANTGATE_SERVE_PYTHON or .venv-serve)")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] | None = Field(None, description="None: the planner's choice")
    replicas: int | None = Field(None, ge=1, description="required replicas (the planner's --replicas)")
    startup_timeout_s: float = Field(600.0, gt=0)
    stall_timeout_s: float | None = Field(STALL_S, gt=0, description="stop a server and name it stalled when requests "
                                          "are in flight and no token or finished request came for this long (its "
                                          "watchdog, quantgate.serving.watchdog); null: no watchdog. Default: twice "
                                          "the clients' whole-request deadline")
    extra_args: list[str] = Field(default_factory=list, description="appended verbatim to `vllm serve`")
    local_nodes: bool = Field(False, description="multi-node plans: the `nodes` are process groups on this host, "
                                                 "launched and watched by quantgate (remote nodes: run `quantgate plan`'s commands)")
    join_timeout_s: float = Field(300.0, gt=0, description="multi-node: every node must have joined by then")

    @field_validator("extra_args")
    @classmethod
    def _no_managed_args(cls, v: list[str]) -> list[str]:
        for i, arg in enumerate(v):
            if (why := _managed_arg(arg)) is not None:
                raise item_error(i, why)
        return v


# vLLM arguments quantgate sets itself: a spec's extra_args may not change where and to whom a server answers, nor
# let a checkpoint run its own code. vLLM reads '_' as '-' in flag names, takes `--flag=value`, and argparse takes
# any unambiguous prefix of a flag (`--api-k`), so a flag is refused when it is one of these or a prefix of one.
MANAGED_ARGS = {
    "--host": "quantgate binds every server to loopback itself",
    "--port": "quantgate picks a free port for every server itself",
    "--uds": "quantgate serves over TCP on loopback; a socket file would change where the server answers",
    "--api-key": "quantgate sets a fresh API key for every server (a key in a spec would also be a secret in a file)",
    "--trust-remote-code": "running code shipped with a checkpoint is not allowed through the spec",
    "--allowed-origins": "cross-origin access to the server is not opened through the spec",
    "--allowed-methods": "cross-origin access to the server is not opened through the spec",
    "--allowed-headers": "cross-origin access to the server is not opened through the spec",
    "--allow-credentials": "cross-origin access to the server is not opened through the spec",
    "--config": "a vLLM config file could set any of the arguments quantgate manages (host, port, API key, ...)",
}


def _managed_arg(arg: str) -> str | None:
    """Why `arg` may not be in serving.extra_args, or None when it may."""
    if (knob := knob_arg(arg)) is not None:  # a serving knob's flag: set through its field
        return knob
    if not arg.startswith("--") or len(arg) < 3:
        return None
    given = arg.split("=", 1)[0]
    flag = given.replace("_", "-").lower()
    for name, why in MANAGED_ARGS.items():
        if name.startswith(flag):
            shown = given + ("=..." if "=" in arg else "")  # the value is not repeated: it may be a key
            return f"{shown!r} is not allowed in serving.extra_args: {why} ({name} and {name}=VALUE are refused)"
    return None


class QuantizationSpec(BaseModel):
    """Recipe parameters and calibration data for the candidates (defaults: quant_recipes/schemes.yaml)."""
    model_config = ConfigDict(extra="forbid")

    overrides: dict[str, RecipeOverrides] = Field(default_factory=dict, description="scheme id -> recipe overrides")
    calibration: CalibrationSpec = Field(default_factory=CalibrationSpec)
    requantize: bool = Field(False, description="true: quantize `schemes` from a `model` that is quantized already "
                             "(its config.json has a quantization_config); false: check and the release refuse it")


class AdaptiveSpec(BaseModel):
    """More samples for an INCONCLUSIVE candidate: up to these budgets, then the gate decides again. The eval
    sets must hold more samples than `eval.limit` (or `fidelity.limit`) took for this to add anything."""
    model_config = ConfigDict(extra="forbid")

    max_eval_samples: int | None = Field(None, ge=1, description="eval.limit may grow to this; None: keep it")
    max_fidelity_samples: int | None = Field(None, ge=1, description="fidelity.limit may grow to this; None: keep it")
    rounds: int = Field(1, ge=1, le=5, description="times to widen and decide again")


class RepairSpec(BaseModel):
    """The repair rung: after the gate REJECTs a quantized scheme by fidelity, rank its decoder layers by the KL they
    cost the failing slices (on the baseline's own sampled continuations of a few prompts per slice, in
    transformers on the CPU), keep the fewest at 16 bits that bring those slices within `margin` x their limits
    together, quantize again and gate that candidate with the same policy (docs/repair.md)."""
    model_config = ConfigDict(extra="forbid")
    SUFFIX: ClassVar[str] = "-repaired"  # a repair of scheme S is measured and gated as S + SUFFIX

    max_kept: int = Field(8, ge=1, description="decoder layers kept at 16 bits, at most")
    max_size_ratio: float | None = Field(1.25, gt=1, description="the repaired checkpoint at most this many times the "
                                         "rejected one's bytes (the kept layers' weights at 16 bits); null: no bound")
    rank_prompts: int = Field(3, ge=1, le=50, description="prompts per slice that rank the layers (every draw of each, "
                              "the first in the stream order); they are held out of the repaired candidate's fidelity "
                              "sample")
    margin: float = Field(0.7, gt=0, le=1, description="the layers kept together must bring each failing slice's KL "
                          "on the ranking prompts within margin x its limit (room for the gate's upper bound)")
    alpha_share: float = Field(0.5, gt=0, lt=1, description="the repaired candidate's share of the policy's fidelity "
                               "alpha; every quantized scheme is gated at the rest, so that a scheme and its repair "
                               "together promote a candidate at its limit at most alpha of the time")


class ExecutorSpec(BaseModel):
    """Where a release serves and measures its variants (quantgate.pools.executor). `local`: on this host's slots.
    `pools`: one Prefect child flow run per variant on the work pool named for it, results shared through `store`."""
    model_config = ConfigDict(extra="forbid")

    kind: Literal["local", "pools"] = Field("local", description="local: this host; pools: Prefect work pools")
    store: str | None = Field(None, description="pools: where every host shares its results, an fsspec URL "
                              "(s3://bucket/prefix, gs://..., or a path every host mounts)")
    pools: dict[str, str] = Field(default_factory=dict, description="variant name (baseline, a scheme id, a "
                                  "`candidates` name) or `default` -> work pool; unnamed variants go to `default`, "
                                  "else to the pool named like the spec's hardware profile")
    retries: int = Field(1, ge=0, le=5, description="a child run whose host was lost (Crashed) is submitted again "
                         "this many times; its answers already on the store are not asked again")
    timeout_s: float = Field(6 * 3600.0, gt=0, description="how long to wait for a variant's child run")
    sync_s: float = Field(15.0, gt=0, description="how often a child shares its unfinished answers with the store")
    lost_after_s: float = Field(120.0, gt=0, description="a running child that wrote no sign of life to the store "
                                "for this long (it writes one every sync_s) is taken as lost with its host")

    @model_validator(mode="after")
    def _pools_need_a_store(self) -> ExecutorSpec:
        if self.kind == "pools" and not self.store:
            raise ValueError("executor kind pools needs `store`: the URL where every host shares its results "
                             "(s3://bucket/prefix, or a path every host mounts)")
        return self

    def with_fields(self, fields: dict[str, str]) -> ExecutorSpec:
        """This section with `fields` replaced (the CLI's --executor and --store), validated again."""
        return ExecutorSpec.model_validate({**self.model_dump(), **fields})

    def pool_for(self, variant: str, hardware: str) -> str:
        return self.pools.get(variant) or self.pools.get("default") or hardware


class EvalSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    limit: int | None = Field(None, ge=1, description="N samples of each set, drawn at random within each category "
                              "(quantgate.base.subsets: seeded, nested as N grows); None: all")
    # 32: the eval set's 300 greedy answers took 65.3 s against 70.9 s at 16 on the FP32 demo baseline (one core)
    concurrency: int = Field(32, ge=1, description="requests in flight")
    max_error_rate: float = Field(0.05, ge=0, le=1)


def _all_kinds() -> list[Literal["number", "name", "multilingual", "multi"]]:
    return ["number", "name", "multilingual", "multi"]


class RecallSpec(BaseModel):
    """Long-context needle grid (quantgate recall); every length plus the answer must fit `context`.
    `ask` is the layout (quantgate/recall/haystack.py): turns packs a needle per depth into one haystack per
    (length, kind, sample) and asks each in its own request over the shared haystack (prefix caching)."""
    model_config = ConfigDict(extra="forbid")

    lengths: list[int] = Field(default_factory=lambda: [1024, 2048], min_length=1)
    depths: list[int] = Field(default_factory=lambda: [0, 25, 50, 75, 100], min_length=1)
    kinds: list[Literal["number", "name", "multilingual", "multi"]] = Field(
        default_factory=_all_kinds, min_length=1)
    samples: int = Field(2, ge=1, description="needles per (length, depth, kind) cell (haystacks per length and kind)")
    ask: Literal["turns", "together", "single"] = Field("turns", description="layout: a question per needle over a "
                                                        "shared haystack, one question for all, or one needle per haystack")
    seed: int = 0
    max_answer_tokens: int = Field(32, ge=1, description="answer cap per needle; each request gets what its needles need")
    deadline_s: float = Field(300.0, gt=0, description="the work in flight must fit this at the measured prefill rate")

    @field_validator("depths")
    @classmethod
    def _percent(cls, v: list[int]) -> list[int]:
        if any(d < 0 or d > 100 for d in v):
            raise ValueError("depths are percentages from 0 to 100")
        if len(set(v)) != len(v):
            raise ValueError("each depth once: the needles of one haystack sit at distinct depths")
        return v


class PerfSpec(PerfOverrides):
    """Serving performance probe (quantgate perf, vLLM's own benchmark client), the same work for every variant.
    What it measures comes from the spec's `workload` profile (quant_recipes/workloads.yaml) and the hardware's
    budget there; a field set here overrides them: `concurrency` (levels), `sweep`, `slo: {ttft_ms, tpot_ms,
    attainment}`, `repeats`, `num_prompts`, `input_len`, `output_len`, `range_ratio`, `budget_s`."""

    rounds: int | None = Field(3, ge=2, le=50, description="the speed window's rounds: after the other "
                               "measurements, the baseline and every candidate are probed side by side on one slot, "
                               "round by round (baseline, candidates, baseline again; one probe repeat each), and "
                               "the ratios are paired by round with the baseline against itself as the A/A floor "
                               "(quantgate.release.perf_window). null: each variant is probed on its own server as "
                               "it is measured (unpaired; a probe cached by an earlier release is reused). A release "
                               "on work pools or with an endpoint probes that way whatever this says")

    def settings(self, workload: str, hardware: str, concurrency: int) -> ProbeSettings:
        """The probe this spec asks for (quantgate.perf.workloads.settings)."""
        return probe_settings(workload, get_profile(hardware), self, concurrency=concurrency)


class FidelitySpec(BaseModel):
    """Teacher-forced fidelity (quantgate.fidelity): continuations the baseline sampled after the eval prompts (with
    their logprobs: the baseline's side), scored by every candidate through prompt logprobs; the baseline prefills a
    subset of them for the noise floor. Token-level evidence, thousands of tokens."""
    model_config = ConfigDict(extra="forbid")

    limit: int | None = Field(120, ge=1, description="eval prompts to continue and score (drawn at random within "
                                                     "each category, every category its share); None: all")
    max_new_tokens: int = Field(64, ge=1, le=4096, description="tokens the baseline samples per prompt (the scored "
                                                               "tokens)")
    context_prompts: int = Field(20, ge=0, description="per length of the recall grid: haystack documents of that "
                                 "length, continued by the baseline and scored as the category context:<length>, so "
                                 "that fidelity is proven at long context too; 0: none")
    context_new_tokens: int = Field(256, ge=1, le=4096, description="tokens the baseline samples after each haystack "
                                    "document: scoring a haystack costs a full prefill of its length and its "
                                    "continuation little, so a long continuation is the cheap way to tokens there")
    context_instruction: str = Field("Continue this document with a few more sentences in the same style.",
                                     min_length=1, description="what follows a haystack document in its prompt")
    draws: int = Field(4, ge=1, le=32, description="continuations sampled per prompt (short answers give few "
                       "tokens each); a prompt's draws count as one sample in the intervals")
    top_k: int = Field(20, ge=1, le=20, description="prompt logprobs per position (vLLM's --max-logprobs bounds it, "
                                                    "default 20)")
    concurrency: int = Field(8, ge=1, description="scoring requests in flight")
    floor_samples: int | None = Field(60, ge=1, description="sequences the baseline also scores by prefill, for the "
                                      "noise floor (its decoded against its prefilled logprobs; drawn at random within "
                                      "the categories, one haystack per context length; the floor is one mean "
                                      "against a cap); None: every sequence")
    corpus: Path | None = Field(None, description="optional text file of passages scored as well")

    @field_validator("corpus")
    @classmethod
    def _corpus_exists(cls, v: Path | None, info: ValidationInfo) -> Path | None:
        return resolve_path(v, info)


@overload
def resolve_path(value: Path, info: ValidationInfo) -> Path: ...


@overload
def resolve_path(value: None, info: ValidationInfo) -> None: ...


def resolve_path(value: Path | None, info: ValidationInfo) -> Path | None:
    """Resolve a path relative to the spec file and check that it exists."""
    if value is None:
        return None
    base = (info.context or {}).get("path")
    path = value if value.is_absolute() or base is None else (Path(base).parent / value)
    if not path.exists():
        what = "a symlink loop or a broken link" if os.path.lexists(path) else "file not found"
        raise ValueError(f"{what}: {path} (relative paths are relative to the spec file's folder)")
    return path.resolve()


class JudgeSpec(BaseModel):
    """The release's LLM judge (quantgate.judge.run): each candidate's answers on the first eval set against the
    baseline's, in both orders, after a calibration. Exactly one of `endpoint` (a remote OpenAI-compatible judge)
    or `serve` (a model quantgate serves with vLLM for the judge step, one server for all candidates)."""

    model_config = ConfigDict(extra="forbid")

    template: Path = Field(str(JUDGES / "pairwise.md"), validate_default=True,  # text: files validate as JSON
                           description="judges/*.md prompt template, its .yaml sidecar beside it")
    endpoint: str | None = Field(None, pattern=r"^https?://", description="remote judge server, e.g. https://host/v1")
    model: str | None = Field(None, description="the model name the endpoint serves (required with endpoint)")
    api_key_env: str | None = Field(None, description="environment variable holding the endpoint's API key")
    prefect_secret: str | None = Field(None, description="Prefect Secret block holding the endpoint's API key")
    serve: str | None = Field(None, description="catalogue id or checkpoint folder served as the judge")
    limit: int | None = Field(None, ge=1, description="judge the first N pairs; None: all")
    calibration_per_type: int | None = Field(None, ge=1, description="calibration pairs per corruption type; "
                                                                      "None: judges/calibration.yaml")
    calibration_bar: float | None = Field(None, ge=0, le=1, description="None: judges/calibration.yaml")
    margin: float | None = Field(None, ge=0, le=1, description="non-inferiority margin on win - loss; "
                                                               "None: the policy's judge.margin (else 0.05)")
    not_stronger: bool = Field(False, description="declare that the judge is not stronger than the judged models")
    concurrency: int = Field(8, ge=1, description="judge requests in flight")
    timeout_s: float = Field(120.0, gt=0, description="seconds per judge request")

    @field_validator("template")
    @classmethod
    def _template_loads(cls, v: Path, info: ValidationInfo) -> Path:
        path = resolve_path(v, info)
        try:
            load_judge(path)
        except QuantgateError as exc:
            raise ValueError(f"{exc.where}: {exc.message}" + (f"; {exc.fix}" if exc.fix else "")) from None
        return path

    def settings(self, margin: float) -> JudgeSettings:
        """How quantgate.judge.run judges for this spec, with the non-inferiority `margin` the policy resolved."""
        shared = {k: getattr(self, k) for k in JudgeSettings.model_fields if k in type(self).model_fields}
        return JudgeSettings(**(shared | {"margin": margin}))

    @model_validator(mode="after")
    def _one_judge(self) -> JudgeSpec:
        if (self.endpoint is None) == (self.serve is None):
            raise ValueError("give exactly one of `endpoint` (a remote judge, with `model`) or `serve` (a catalogue id "
                             "or checkpoint folder that quantgate serves as the judge)")
        if self.endpoint is not None and not self.model:
            raise ValueError(f"`model` is required with `endpoint`: the model name {self.endpoint} serves")
        if self.serve is not None:
            extra = [k for k in ("model", "api_key_env", "prefect_secret") if getattr(self, k) is not None]
            if extra:
                raise ValueError(f"not with `serve`: {', '.join(extra)} (they describe an `endpoint`; quantgate names "
                                 "and keys the judge it serves)")
        if self.api_key_env and self.prefect_secret:
            raise ValueError("give either api_key_env or prefect_secret, not both")
        return self
