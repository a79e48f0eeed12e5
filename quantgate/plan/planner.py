"""Parallelism planner (pure): model shape + weight bytes + hardware + workload -> TP/PP/DP/EP layout and vLLM args.

Rules (docs/design.md, "Planner rules"): one device when weights fit with enough KV, spare devices become replicas; the smallest TP that
gives enough capacity, inside a node and over a fast link only; PP when TP cannot divide the heads, without a fast
link, or across nodes; MoE: data-parallel attention + expert parallel. "Enough" means each replica's KV pool holds
`concurrency` requests of `context` tokens. Every choice and rejection is a PlannerDecision with its numbers.
The serving knobs of the request (quantgate.plan.knobs: KV dtype, memory utilization, max_num_seqs, batched tokens,
prefix caching, eager/compiled, CUDA-graph mode) win over the policy's defaults: the KV dtype and memory share enter
the capacity math, the others the vLLM arguments, and max_num_seqs is reported against the concurrency.
"""

from __future__ import annotations

import json
import math

from quantgate.base.errors import ConfigError, QuantgateError, SettingError
from quantgate.plan.commands import cpu_env, replica_plans
from quantgate.plan.knobs import ServingKnobs, knob_problems
from quantgate.plan.models import (Capacity, Layout, MultiNode, NcclCheck, NodeCommand, Number, Plan, PlannerDecision,
                                   PlannerPolicy, PlanRequest, Replica)
from quantgate.target.modelshape import gib

__all__ = ["Capacity", "Layout", "MultiNode", "NcclCheck", "NodeCommand", "Plan", "PlannerDecision", "PlannerPolicy",
           "PlanRequest", "Replica", "capacity", "layouts_for", "plan"]


# ---------------------------------------------------------------- the pieces


def _tp_problem(t: int, req: PlanRequest) -> str | None:
    """Why TP=t is not allowed (None: allowed)."""
    s, hw = req.model.shape, req.hardware
    if t == 1:
        return None
    if s.heads % t:
        return f"TP={t} cannot divide {s.heads} attention heads"
    if s.kv_heads % t and t % s.kv_heads:
        return f"TP={t} cannot split or replicate {s.kv_heads} KV heads evenly"
    if not hw.fast_link:
        return f"TP={t} rejected: no fast link between devices ({hw.interconnect}); all-reduce per layer would dominate"
    return None


def layouts_for(k: int, per_node: int, req: PlanRequest, moe_dp_only: bool = True) -> tuple[list[Layout], list[str]]:
    """Allowed layouts for a replica of k devices, most preferred first, and why others were dropped.

    A MoE gets DP attention + EP only, unless `moe_dp_only` is False (its non-expert weights alone overflow a
    device, so every rank cannot hold a full attention copy): then TP/PP layouts follow, experts split over TP."""
    s = req.model.shape
    nodes = max(1, k // per_node) if k > per_node else 1
    g = k if k <= per_node else per_node
    why: list[str] = []
    if k == 1:
        return [Layout(devices=1)], why
    out: list[Layout] = []
    if s.is_moe:
        out.append(Layout(devices=k, dp=k, ep=True))
        if moe_dp_only:
            return out, why
    problem = _tp_problem(g, req)
    if problem is None and nodes <= s.layers:
        out.append(Layout(devices=k, tp=g, pp=nodes))
    elif problem:
        why.append(problem)
    if k <= s.layers:
        out.append(Layout(devices=k, pp=k))
    else:
        why.append(f"PP={k} exceeds {s.layers} layers")
    for t in sorted((t for t in range(2, g) if g % t == 0), reverse=True):
        if _tp_problem(t, req) is None and k // t <= s.layers:
            out.append(Layout(devices=k, tp=t, pp=k // t))
    if s.is_moe and len(out) > 1:  # TP/PP fallbacks of a MoE still split experts over the TP group
        out = [out[0]] + [lay.model_copy(update={"ep": lay.tp > 1}) for lay in out[1:]]
    seen: set[tuple[int, int, int]] = set()
    unique: list[Layout] = []
    for lay in out:  # the first layout of each shape
        if (key := (lay.tp, lay.pp, lay.dp)) not in seen:
            seen.add(key)
            unique.append(lay)
    return unique, why


def serve_dtype_factor(layout: Layout, req: PlanRequest, policy: PlannerPolicy) -> float:
    """CPU + unquantized: served in policy.cpu_dtype (BF16 mismatched the reference), so weights and auto-KV grow."""
    s = req.model.shape
    if req.hardware.kind == "cpu" and not s.weights.quantized:
        return {"float32": 4, "bfloat16": 2, "float16": 2}[policy.cpu_dtype] / s.dtype_bytes
    return 1.0


def capacity(layout: Layout, req: PlanRequest, policy: PlannerPolicy, pool_gib: float | None = None) -> Capacity:
    """Weights per device, KV pool per device and replica, and the concurrency it holds at `context`."""
    s, w, hw = req.model.shape, req.model.weights, req.hardware
    factor = serve_dtype_factor(layout, req, policy)
    shards = layout.tp * layout.pp
    if layout.dp > 1:
        w_dev = (w.total_bytes - w.expert_bytes) / shards + w.expert_bytes / (shards * layout.dp)
    else:
        w_dev = w.total_bytes / shards
    w_dev *= factor
    util = (req.gpu_memory_utilization or policy.gpu_memory_utilization) if hw.kind == "gpu" else 1.0
    budget = hw.memory_bytes * util - w_dev - policy.reserve_gib[hw.kind] * 1024**3
    pool = budget if pool_gib is None else min(budget, pool_gib * 1024**3)
    kv_b = policy.kv_dtype_bytes.get(req.kv_dtype, s.dtype_bytes * factor)
    per_tok = s.kv_bytes_per_token(kv_b)
    stage = math.ceil(s.layers / layout.pp) / s.layers
    heads = 1.0 if s.uses_mla else max(1, s.kv_heads // layout.tp) / s.kv_heads
    per_dev = per_tok * stage * heads
    tokens = int(pool // per_dev) if pool > 0 else 0
    conc = layout.dp * tokens / req.context
    return Capacity(
        weight_gib_per_device=round(gib(w_dev), 2), kv_bytes_per_token=per_tok,
        kv_bytes_per_token_per_device=round(per_dev, 1), kv_pool_gib_per_device=round(gib(pool), 2),
        kv_pool_gib_per_replica=round(gib(max(pool, 0)) * layout.devices, 2), kv_tokens_per_replica=tokens * layout.dp,
        context=req.context, concurrency_per_replica=round(conc, 2), target_concurrency=req.concurrency,
        fits=pool > 0 and tokens >= req.context and conc >= req.concurrency,
    )


def _g(x: float) -> str:
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def _capacity_text(lay: Layout, cap: Capacity) -> str:
    return (f"{lay.label} on {lay.devices} device(s): {_g(cap.weight_gib_per_device)} GiB of weights per device "
            f"leave {_g(cap.kv_pool_gib_per_device)} GiB ({_g(cap.kv_pool_gib_per_device * 1.073741824)} GB) for KV "
            f"-> {cap.kv_tokens_per_replica:,} tokens per replica = {cap.concurrency_per_replica:.1f} concurrent "
            f"requests of {cap.context:,} tokens (target {cap.target_concurrency})")


def _numbers(cap: Capacity) -> dict[str, Number]:
    keys = ("weight_gib_per_device", "kv_pool_gib_per_device", "kv_tokens_per_replica", "concurrency_per_replica")
    out: dict[str, Number] = {k: getattr(cap, k) for k in keys}
    out["kv_pool_gb_per_device"] = round(cap.kv_pool_gib_per_device * 1.073741824, 2)
    return out


def _shortfall(lay: Layout, cap: Capacity, req: PlanRequest) -> str:
    need_tokens = max(req.context, math.ceil(req.concurrency * req.context / lay.dp))
    need = gib(need_tokens * cap.kv_bytes_per_token_per_device)
    short = need - cap.kv_pool_gib_per_device
    return (f"{_capacity_text(lay, cap)}; the KV cache needs {_g(need)} GiB per device: short by {_g(short)} GiB "
            f"per device")


def _check_request(req: PlanRequest, policy: PlannerPolicy) -> int:
    hw, s = req.hardware, req.model.shape
    gpus = req.gpus or hw.devices_per_node
    if gpus > hw.devices_per_node:
        raise SettingError(f"{gpus} devices per node is more than the {hw.devices_per_node} of '{hw.id}'",
                           setting="gpus", fix=f"use at most {hw.devices_per_node} (more machines: more nodes)")
    if req.kv_dtype not in hw.kv_cache_dtypes:
        raise SettingError(f"KV cache dtype '{req.kv_dtype}' is not supported on '{hw.id}'",
                           setting="serving.kv_cache_dtype", fix=f"use one of: {', '.join(hw.kv_cache_dtypes)}")
    knobs = ServingKnobs(gpu_memory_utilization=req.gpu_memory_utilization, max_num_seqs=req.max_num_seqs,
                         max_num_batched_tokens=req.max_num_batched_tokens, enforce_eager=req.enforce_eager,
                         cudagraph_mode=req.cudagraph_mode)
    for field, why in knob_problems(knobs, hw, default_seqs=policy.vllm_max_num_seqs[hw.kind]):  # (seqs below
        # the concurrency: a warning of the plan, not an error)
        raise SettingError(why, setting=f"serving.{field}", fix="change or drop it")
    if req.kv_dtype != "auto" and req.kv_dtype not in policy.kv_dtype_bytes:
        raise ConfigError(f"no byte size known for KV dtype '{req.kv_dtype}'", where="quant_recipes/planner.yaml",
                          fix="add it under kv_dtype_bytes")
    if req.context > s.max_positions:
        raise SettingError(f"context {req.context} exceeds the model's max_position_embeddings {s.max_positions}",
                           setting="context", fix=f"use at most {s.max_positions}")
    total = gpus * req.nodes
    if req.replicas:
        k = total // req.replicas
        if total % req.replicas or (k > gpus and k % gpus) or (k < gpus and gpus % k):
            raise SettingError(f"{total} devices ({req.nodes} node(s) x {gpus}) do not split into {req.replicas} "
                               "equal replicas that each sit in one node or span whole nodes",
                               setting="serving.replicas",
                               fix="choose a replica count that divides the devices per node, or the node count")
    return gpus


def _sizing_decisions(req: PlanRequest, policy: PlannerPolicy, total: int) -> list[PlannerDecision]:
    """What the plan starts from: the weights, the KV bytes per token and, without a fast link, no TP."""
    hw, s, w = req.hardware, req.model.shape, req.model.weights
    kv_b = policy.kv_dtype_bytes.get(req.kv_dtype, s.dtype_bytes * serve_dtype_factor(Layout(devices=1), req, policy))
    per_tok = s.kv_bytes_per_token(kv_b)
    decisions = [
        PlannerDecision(topic="weights", choice=f"{_g(gib(w.total_bytes))} GiB",
                        reason=f"from {w.source}" + (f" ({w.files} file(s))" if w.files else "") +
                               f"; linear weights {s.weights.method} at {s.weights.bytes_per_param:.3g} bytes/param",
                        numbers={"weight_gib": round(gib(w.total_bytes), 2),
                                 "expert_gib": round(gib(w.expert_bytes), 2),
                                 "bytes_per_param": round(s.weights.bytes_per_param, 4)}),
        PlannerDecision(topic="kv-cache", choice=f"{per_tok / 1024:.1f} KiB per token ({req.kv_dtype})",
                        reason=(f"MLA latent: {s.layers} layers x ({s.kv_lora_rank}+{s.qk_rope_head_dim})"
                                f" x {kv_b:g} bytes"
                                if s.uses_mla else
                                f"2 x {s.layers} layers x {s.kv_heads} KV heads x {s.head_dim} head_dim"
                                f" x {kv_b:g} bytes"),
                        numbers={"kv_bytes_per_token": per_tok}),
    ]
    if hw.kind == "gpu" and not hw.fast_link and total > 1:
        decisions.append(PlannerDecision(topic="interconnect", choice="no tensor parallel",
                                         reason=f"{hw.id} links devices over {hw.interconnect}: spare devices become "
                                                "independent replicas; a replica that must span devices uses PP"))
    return decisions


def _replica_sizes(req: PlanRequest, gpus: int, total: int) -> list[int]:
    """Devices per replica to try, smallest first: the given split, else divisors of a node, then whole nodes."""
    if req.replicas:
        return [total // req.replicas]
    return [k for k in range(1, gpus + 1) if gpus % k == 0] + [gpus * m for m in range(2, req.nodes + 1)]


def _nothing_fits(req: PlanRequest, last: tuple[Layout, Capacity] | None, no_layout: list[str]) -> QuantgateError:
    """The error when no layout fits: none allowed at all, or the largest one short by how much."""
    s = req.model.shape
    if last is None:
        return SettingError(f"no allowed layout for {s.heads} heads / {s.kv_heads} KV heads / {s.layers} layers: "
                           + " | ".join(no_layout), setting="gpus / nodes / serving.replicas",
                           fix="use a device count whose TP divides the heads, or fewer devices per replica")
    lay, cap = last
    scope = f"with serving.replicas {req.replicas}" if req.replicas else f"even at maximum parallelism ({lay.devices} devices)"
    return QuantgateError(f"{s.name} does not fit {scope}: {_shortfall(lay, cap, req)}", where="plan",
                          fix="quantize the weights (FP8/INT8/W4A16), set serving.kv_cache_dtype fp8 where supported, "
                              "lower context or concurrency, add devices/nodes"
                              + (", or fewer replicas" if req.replicas else ""))


def _choose(req: PlanRequest, policy: PlannerPolicy, gpus: int, total: int,
            decisions: list[PlannerDecision]) -> tuple[Layout, Capacity]:
    """The first layout, over replica sizes smallest first, whose KV pool holds the target; rejections are noted
    in `decisions`. Raises when none does."""
    hw, w = req.hardware, req.model.weights
    last: tuple[Layout, Capacity] | None = None
    no_layout: list[str] = []
    util = (req.gpu_memory_utilization or policy.gpu_memory_utilization) if hw.kind == "gpu" else 1.0
    device_budget = hw.memory_bytes * util - policy.reserve_gib[hw.kind] * 1024**3
    moe_dp_only = (w.total_bytes - w.expert_bytes) < device_budget
    for k in _replica_sizes(req, gpus, total):
        layouts, why = layouts_for(k, gpus, req, moe_dp_only)
        for reason in why:
            decisions.append(PlannerDecision(topic="layout", choice=f"{k} device(s)", accepted=False, reason=reason))
        if not layouts:
            no_layout.append(f"{k} device(s): " + "; ".join(why))
            continue
        for i, lay in enumerate(layouts):
            cap = capacity(lay, req, policy)
            last = (lay, cap) if last is None or i == 0 else last
            if cap.fits:
                return lay, cap
            if i == 0:  # the preferred layout of this size; its alternatives split the same memory
                decisions.append(PlannerDecision(topic="layout", choice=lay.label, accepted=False,
                                                 reason=_capacity_text(lay, cap) + ": not enough",
                                                 numbers=_numbers(cap)))
    raise _nothing_fits(req, last, no_layout)


def _layout_decisions(lay: Layout, cap: Capacity, req: PlanRequest, replicas: int,
                      total: int) -> list[PlannerDecision]:
    """The chosen layout, expert parallelism for a MoE, and the replica count."""
    s = req.model.shape
    out = [PlannerDecision(topic="layout", choice=lay.label, reason=_capacity_text(lay, cap) + ": enough",
                           numbers=_numbers(cap))]
    if s.is_moe and lay.dp > 1:
        out.append(PlannerDecision(topic="moe", choice=f"--data-parallel-size {lay.dp} --enable-expert-parallel",
                                   reason=f"MoE with {s.num_experts} experts: attention data-parallel (each rank keeps "
                                          f"its own requests' KV, no duplication across TP), experts split "
                                          f"{lay.dp} ways",
                                   numbers={"experts_per_device": round(s.num_experts / lay.dp, 2)}))
    elif s.is_moe:
        where = ("one device holds every expert with room for the KV pool, so a replica needs no expert parallelism "
                 "(EP would only add an all-to-all per layer)") if lay.devices == 1 else (
                 f"the attention weights alone overflow a device, so each expert is split over the {lay.label} group "
                 "like the dense layers instead of placing whole experts per rank")
        out.append(PlannerDecision(topic="moe", choice="no expert parallelism",
                                   reason=f"MoE with {s.num_experts} experts: {where}",
                                   numbers={"experts": float(s.num_experts)}))
    spare = "; spare devices become independent replicas" if replicas > 1 and not req.replicas else ""
    out.append(PlannerDecision(topic="replicas", choice=str(replicas),
                               reason=f"{total} device(s) / {lay.devices} per replica" + spare,
                               numbers={"devices_unused": total - replicas * lay.devices}))
    return out


def _cpu_settings(lay: Layout, cap: Capacity, req: PlanRequest, policy: PlannerPolicy, args: dict,
                  decisions: list[PlannerDecision]) -> tuple[Capacity, list[str]]:
    """CPU serving: the KV space variable, executor, dtype and eager mode; returns the capacity of the configured
    KV space and the warnings. Adds to `args` and `decisions`."""
    kv_gib, reason = cpu_env(lay, cap, req, policy)
    cap = capacity(lay, req, policy, pool_gib=kv_gib)
    decisions.append(PlannerDecision(topic="cpu", choice=f"VLLM_CPU_KVCACHE_SPACE={kv_gib}", reason=reason,
                                     numbers={"kv_gib_per_worker": kv_gib}))
    if lay.pp > 1 or lay.dp > 1:
        args["--distributed-executor-backend"] = "mp"
    if lay.devices == 1:
        decisions.append(PlannerDecision(
            topic="cpu", choice="one process: VLLM_ENABLE_V1_MULTIPROCESSING=0",
            reason="one worker on one core needs no process of its own: the demo model's server was ready in 17.2 s "
                   "instead of 22.4 s, at the same throughput (docs/measurements.md, 'One-process CPU servers'); "
                   "quantgate binds its OpenMP thread as vLLM binds a worker process's. Served on more cores (a "
                   "lone variant's slot), it keeps the worker process: 0.65x the throughput in one process there"))
    if serve_dtype_factor(lay, req, policy) != 1.0:
        args["--dtype"] = policy.cpu_dtype
        decisions.append(PlannerDecision(topic="cpu", choice=f"--dtype {policy.cpu_dtype}",
                                         reason="BF16 serving on this CPU did not match transformers' greedy output "
                                                "(docs/design.md, 'Measured facts'; tests/conftest.py); "
                                                f"{policy.cpu_dtype} did. Weights and KV are counted at that width"))
    if lay.pp > 1 and req.enforce_eager:
        raise SettingError(f"enforce_eager with {lay.label} on CPU: PP=2 in eager mode crashed on the first request "
                           "(docs/design.md, 'Measured facts')", setting="serving.enforce_eager",
                          fix="drop enforce_eager (the planner serves CPU pipeline parallelism compiled)")
    if lay.pp > 1 or req.enforce_eager is False:
        why = ("PP=2 in eager mode crashed on the first request (docs/design.md, 'Measured facts')" if lay.pp > 1
               else "asked for (enforce_eager: false): start-up takes longer (100-120 s for the demo model)")
        decisions.append(PlannerDecision(topic="cpu", choice="compiled, no --enforce-eager", reason=why))
    else:
        args["--enforce-eager"] = True
        decisions.append(PlannerDecision(topic="cpu", choice="--enforce-eager",
                                         reason="start-up in about 30 s instead of 100-120 s compiled; eager output "
                                                "matched the reference (docs/design.md, 'Measured facts')"))
    warnings = [] if cap.fits else ["the configured VLLM_CPU_KVCACHE_SPACE holds fewer requests than the target"]
    return cap, warnings


def _engine_settings(req: PlanRequest, policy: PlannerPolicy, cap: Capacity, args: dict,
                     decisions: list[PlannerDecision]) -> list[str]:
    """Scheduler, prefix-cache and compile settings asked for (quantgate.plan.knobs); adds to `args` and
    `decisions`, returns warnings (max_num_seqs below the concurrency)."""
    warnings: list[str] = []
    if req.hardware.kind == "gpu" and req.enforce_eager:
        args["--enforce-eager"] = True
    if req.cudagraph_mode is not None:
        args["--compilation-config"] = json.dumps({"cudagraph_mode": req.cudagraph_mode})
    if req.max_num_batched_tokens is not None:
        args["--max-num-batched-tokens"] = req.max_num_batched_tokens
    if req.enable_prefix_caching is not None:
        args["--enable-prefix-caching" if req.enable_prefix_caching else "--no-enable-prefix-caching"] = True
    seqs = req.max_num_seqs or policy.vllm_max_num_seqs[req.hardware.kind]
    if req.max_num_seqs is not None:
        args["--max-num-seqs"] = req.max_num_seqs
    held = cap.kv_tokens_per_replica // max(1, req.context)
    default = "" if req.max_num_seqs else " (vLLM's default)"
    decisions.append(PlannerDecision(topic="scheduler", choice=f"max_num_seqs {seqs}{default}",
                                     reason=f"at most {seqs} requests run at once per replica; its KV pool holds "
                                            f"{held} requests of {req.context:,} tokens; target concurrency "
                                            f"{req.concurrency}",
                                     numbers={"max_num_seqs": seqs, "requests_kv_holds": held}))
    if seqs < req.concurrency:
        warnings.append(f"max_num_seqs {seqs} is below the target concurrency {req.concurrency}: requests beyond "
                        f"{seqs} queue in the server")
    return warnings


def plan(req: PlanRequest, policy: PlannerPolicy) -> Plan:
    """Choose the layout; raise QuantgateError when nothing fits, saying by how much."""
    hw = req.hardware
    gpus = _check_request(req, policy)
    total = gpus * req.nodes
    decisions = _sizing_decisions(req, policy, total)
    lay, cap = _choose(req, policy, gpus, total, decisions)
    replicas = req.replicas or total // lay.devices
    decisions += _layout_decisions(lay, cap, req, replicas, total)
    args: dict[str, int | float | str | bool] = {"--tensor-parallel-size": lay.tp, "--pipeline-parallel-size": lay.pp}
    if lay.dp > 1:
        args["--data-parallel-size"] = lay.dp
    if lay.ep:
        args["--enable-expert-parallel"] = True
    args["--kv-cache-dtype"] = req.kv_dtype
    args["--max-model-len"] = req.context
    warnings: list[str] = []
    if hw.kind == "gpu":
        args["--gpu-memory-utilization"] = req.gpu_memory_utilization or policy.gpu_memory_utilization
    else:
        cap, warnings = _cpu_settings(lay, cap, req, policy, args, decisions)
    warnings += _engine_settings(req, policy, cap, args, decisions)
    reps = replica_plans(lay, cap, replicas, gpus, req, policy, args, decisions)
    return Plan(model=req.model.ref, hardware=hw.id, kind=hw.kind, devices_total=total, devices_used=replicas * lay.devices,
                layout=lay, replicas=replicas, vllm_args=args, capacity=cap, replica_plans=reps,
                decisions=decisions, warnings=warnings)
