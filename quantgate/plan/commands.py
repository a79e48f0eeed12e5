"""Per-replica environment and per-node commands of a plan (pure): device selection, CPU core binding and KV
space, and for replicas that span nodes the Ray and native (`--nnodes` / `--data-parallel-*`) command lines."""

from __future__ import annotations

import math

from quantgate.plan.models import (Capacity, Layout, MultiNode, NodeCommand, PlannerDecision, PlannerPolicy,
                                   PlanRequest, Replica)
from quantgate.target.modelshape import gib

# "0" in a one-worker CPU server's environment: vLLM runs the worker inside its engine process instead of spawning a
# process for it (quantgate.serving.server binds that process's OpenMP threads, as vLLM binds a worker process's)
ONE_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"


def cpu_env(lay: Layout, cap: Capacity, req: PlanRequest, policy: PlannerPolicy) -> tuple[int, str]:
    """VLLM_CPU_KVCACHE_SPACE per worker: the KV the target needs (whole GiB), within the worker's budget."""
    tokens = max(req.context, math.ceil(req.concurrency * req.context / lay.dp))
    need = gib(tokens * cap.kv_bytes_per_token_per_device)
    budget = max(policy.cpu_kv_cache_min_gib, math.floor(cap.kv_pool_gib_per_device))
    space = min(max(policy.cpu_kv_cache_min_gib, math.ceil(need)), budget)
    return space, (f"{req.concurrency} x {req.context:,} tokens need {need:.2f} GiB of KV per worker; vLLM on CPU "
                   f"allocates exactly VLLM_CPU_KVCACHE_SPACE (at least {policy.cpu_kv_cache_min_gib} GiB)")


def _bind(workers: list[int], cores: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND: one core group per rank, ranks separated by '|'."""
    groups = [str(w * cores) if cores == 1 else f"{w * cores}-{(w + 1) * cores - 1}" for w in workers]
    return "|".join(groups)


def _node_env(global_devs: list[int], gpus: int, req: PlanRequest, policy: PlannerPolicy, kv_gib: int | None) -> dict[str, str]:
    hw = req.hardware
    local = [d % gpus for d in global_devs]
    if hw.kind == "cpu":
        workers = global_devs if req.nodes_share_host else local
        return {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": _bind(workers, req.cpu_cores_per_worker)}
    var = policy.visible_devices_env.get(hw.vendor, "CUDA_VISIBLE_DEVICES")
    return {var: ",".join(str(d) for d in local)}


def _flags(args: dict) -> list[str]:
    out: list[str] = []
    for flag, value in args.items():
        out += [flag] if value is True else [flag, str(value)]
    return out


def multi_node(lay: Layout, per_node: list[list[int]], gpus: int, req: PlanRequest, policy: PlannerPolicy,
               args: dict, kv_gib: int | None) -> MultiNode:
    """Commands for one replica spanning len(per_node) nodes: native multi-node and (GPU only) Ray."""
    m = len(per_node)
    addr = req.master_addr or policy.master_addr
    port = req.master_port or policy.master_port
    base = ["vllm", "serve", req.model.ref, *_flags(args)]
    native = []
    for i, devs in enumerate(per_node):
        if lay.dp > 1:  # vLLM's multi-node data parallel: the head serves the API, others are headless engines
            extra = ["--data-parallel-size-local", str(len(devs)), "--data-parallel-address", addr,
                     "--data-parallel-rpc-port", str(policy.dp_rpc_port)]
            if i:
                extra += ["--headless", "--data-parallel-start-rank", str(i * len(devs))]
        else:
            extra = ["--nnodes", str(m), "--node-rank", str(i), "--master-addr", addr, "--master-port", str(port)]
            if i:
                extra.append("--headless")
        native.append(NodeCommand(node_rank=i, role="head" if i == 0 else "worker",
                                  env=_node_env(devs, gpus, req, policy, kv_gib), commands=[base + extra]))
    notes = []
    ray = None
    nccl = None
    if req.hardware.kind == "gpu":
        backend = ["--data-parallel-backend", "ray"] if lay.dp > 1 else ["--distributed-executor-backend", "ray"]
        ray = [NodeCommand(node_rank=0, role="head", env=native[0].env,
                           commands=[["ray", "start", "--head", f"--port={policy.ray_port}"], base + backend])]
        ray += [NodeCommand(node_rank=i, role="worker", env=n.env,
                            commands=[["ray", "start", f"--address={addr}:{policy.ray_port}"]])
                for i, n in enumerate(native[1:], start=1)]
        notes.append("Ray: start Ray on every worker node before the head's `vllm serve`; vLLM runs from the head only")
        nccl = policy.nccl_check
        notes.append("First start: set NCCL_DEBUG=INFO on every node and check the log shows "
                     f"{' or '.join(nccl.look_for)}, not {' / '.join(nccl.bad)} (a silent TCP fallback is an order "
                     "of magnitude slower)")
    else:
        notes.append("Ray is not offered: vLLM refuses the Ray executor on CPU (docs/design.md, 'Measured facts'); use the native commands")
        notes.append("CPU ranks talk over gloo, not NCCL: no transport check applies")
    return MultiNode(nodes=m, native=native, ray=ray, nccl_check=nccl, notes=notes)


def replica_plans(lay: Layout, cap: Capacity, replicas: int, gpus: int, req: PlanRequest, policy: PlannerPolicy,
                  args: dict, decisions: list[PlannerDecision]) -> list[Replica]:
    """Contiguous device blocks per replica; env per replica, or per node when a replica spans nodes."""
    kv_gib = None
    if req.hardware.kind == "cpu":
        kv_gib = next(int(d.numbers["kv_gib_per_worker"]) for d in decisions if d.topic == "cpu" and "kv_gib_per_worker" in d.numbers)
    out = []
    for r in range(replicas):
        devs = list(range(r * lay.devices, (r + 1) * lay.devices))
        nodes = sorted({d // gpus for d in devs})
        per_node = [[d for d in devs if d // gpus == n] for n in nodes]
        if len(nodes) == 1:
            env = _node_env(devs, gpus, req, policy, kv_gib)
            if req.hardware.kind == "cpu" and lay.devices == 1:
                env[ONE_PROCESS] = "0"
            out.append(Replica(index=r, nodes=nodes, devices=[d % gpus for d in devs], env=env))
        else:
            mn = multi_node(lay, per_node, gpus, req, policy, args, kv_gib)
            out.append(Replica(index=r, nodes=nodes, devices=[d % gpus for d in per_node[0]], env={}, multi_node=mn))
    if any(rep.multi_node for rep in out):
        m = len(out[0].nodes)
        how = (f"DP={lay.dp} ranks over {m} nodes ({lay.dp // m} per node)" if lay.dp > 1
               else f"TP={lay.tp} inside each node, PP={lay.pp} across {m} nodes")
        decisions.append(PlannerDecision(topic="multi-node", choice=how,
                                         reason="TP stays inside a node (all-reduce per layer needs NVLink); only "
                                                "layer-boundary activations or expert all-to-all cross nodes"))
    return out
