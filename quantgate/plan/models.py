"""The planner's typed inputs and outputs: policy, request, decisions, layout, capacity, per-node commands, plan."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from quantgate.plan.knobs import CudagraphMode
from quantgate.target.hardware import HardwareProfile
from quantgate.target.modelshape import ModelSpec

Number = int | float | str


class NcclCheck(BaseModel):
    model_config = ConfigDict(extra="forbid")

    env: dict[str, str]
    look_for: list[str]
    bad: list[str]


class SlotRule(BaseModel):
    """planner.yaml `slots`: whether a CPU is split between concurrent variants, and the measurement behind it."""
    model_config = ConfigDict(extra="forbid")

    cpu_split_gain: float = Field(gt=0, description="samples/s of one server per core, all at once, over one server "
                                                    "on every core serving them in turn (bench/slot_split.py)")
    min_gain: float = Field(1.05, gt=0, description="split the cores only when the measured gain is at least this")
    measured: str = Field("", description="how, where and when cpu_split_gain was measured")


class PlannerPolicy(BaseModel):
    """quant_recipes/planner.yaml: the planner's policy numbers."""
    model_config = ConfigDict(extra="forbid")

    version: int = 1
    gpu_memory_utilization: float = Field(gt=0, le=1)
    reserve_gib: dict[Literal["gpu", "cpu"], float]
    cpu_kv_cache_min_gib: int = Field(ge=1)
    cpu_dtype: str
    kv_dtype_bytes: dict[str, float]
    vllm_max_num_seqs: dict[Literal["gpu", "cpu"], int] = Field(description="vLLM's max_num_seqs when none is set")
    visible_devices_env: dict[str, str]
    master_addr: str
    master_port: int
    dp_rpc_port: int
    ray_port: int
    nccl_check: NcclCheck
    slots: SlotRule | None = Field(None, description="None: a CPU serves one variant at a time on every core")


class PlanRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: ModelSpec
    hardware: HardwareProfile
    gpus: int | None = Field(None, ge=1, description="devices per node; default: the profile's devices_per_node")
    nodes: int = Field(1, ge=1)
    context: int = Field(ge=1, description="tokens per request (prompt + output); becomes --max-model-len")
    concurrency: int = Field(ge=1, description="concurrent requests of `context` tokens each replica must hold")
    kv_dtype: str = "auto"
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    max_num_batched_tokens: int | None = Field(None, ge=1, description="--max-num-batched-tokens; None: vLLM's")
    max_num_seqs: int | None = Field(None, ge=1, description="--max-num-seqs; None: vLLM's default")
    enable_prefix_caching: bool | None = Field(None, description="None: vLLM's default (on)")
    enforce_eager: bool | None = Field(None, description="None: the planner's choice (eager on CPU unless PP > 1)")
    cudagraph_mode: CudagraphMode | None = Field(None, description="GPU: compilation_config.cudagraph_mode; None: vLLM's")
    replicas: int | None = Field(None, ge=1, description="required number of replicas (independent servers)")
    cpu_cores_per_worker: int = Field(1, ge=1)
    nodes_share_host: bool = Field(False, description="CPU: the 'nodes' are process groups on one host")
    master_addr: str | None = Field(None, description="multi-node head address; default: the policy's placeholder")
    master_port: int | None = None


class PlannerDecision(BaseModel):
    model_config = ConfigDict(extra="forbid")

    topic: str
    choice: str
    accepted: bool = True
    reason: str
    numbers: dict[str, Number] = Field(default_factory=dict)


class Layout(BaseModel):
    model_config = ConfigDict(extra="forbid")

    devices: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: bool = False

    @property
    def label(self) -> str:
        if self.dp > 1:
            return f"DP={self.dp}+EP, TP={self.tp}"
        return f"TP={self.tp}" + (f" x PP={self.pp}" if self.pp > 1 else "")


class Capacity(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight_gib_per_device: float
    kv_bytes_per_token: float = Field(description="whole model, all layers")
    kv_bytes_per_token_per_device: float
    kv_pool_gib_per_device: float
    kv_pool_gib_per_replica: float
    kv_tokens_per_replica: int
    context: int
    concurrency_per_replica: float = Field(description="requests of `context` tokens the replica's KV pool holds")
    target_concurrency: int
    fits: bool


class NodeCommand(BaseModel):
    model_config = ConfigDict(extra="forbid")

    node_rank: int
    role: Literal["head", "worker"]
    env: dict[str, str]
    commands: list[list[str]] = Field(description="argv lists, run in order on that node")


class MultiNode(BaseModel):
    model_config = ConfigDict(extra="forbid")

    nodes: int
    native: list[NodeCommand]
    ray: list[NodeCommand] | None
    nccl_check: NcclCheck | None
    notes: list[str] = Field(default_factory=list)


class Replica(BaseModel):
    model_config = ConfigDict(extra="forbid")

    index: int
    nodes: list[int]
    devices: list[int] = Field(description="device indices local to the node (per node when multi-node)")
    env: dict[str, str]
    multi_node: MultiNode | None = None


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    hardware: str
    kind: Literal["gpu", "cpu"]
    devices_total: int
    devices_used: int
    layout: Layout
    replicas: int
    vllm_args: dict[str, int | float | str | bool] = Field(description="same for every replica, spelt as vLLM spells them")
    capacity: Capacity
    replica_plans: list[Replica]
    decisions: list[PlannerDecision]
    warnings: list[str] = Field(default_factory=list)

    def argv(self, model_ref: str | None = None) -> list[str]:
        """`vllm serve MODEL --flag value ...` (boolean flags without a value)."""
        out = ["vllm", "serve", model_ref or self.model]
        for flag, value in self.vllm_args.items():
            out += [flag] if value is True else [flag, str(value)]
        return out
