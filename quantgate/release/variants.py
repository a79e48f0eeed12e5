"""The variants of a release and their servers: the baseline and quantized checkpoints, the evidence a measured
variant leaves, and the planned vLLM server (single or multi-node) each is served with."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel

from quantgate.base.errors import ConfigError
from quantgate.base.fileio import write_json
from quantgate.base.paths import results_dir
from quantgate.gate.policy import DEFAULT_POLICY
from quantgate.plan.build import build_plan
from quantgate.quantize.run import QuantizeRequest, quantize
from quantgate.release.spec import ReleaseSpec
from quantgate.serving.multinode import MultiNodeConfig, MultiNodeServer, multinode_config_from_plan
from quantgate.serving.server import VLLMServer, config_from_plan
from quantgate.target.catalogue import checkpoint_hash

Log = Callable[[str], None]


class Variant(BaseModel):
    name: str                      # "baseline" or the scheme id
    path: Path
    scheme: str | None = None
    content_hash: str
    size_bytes: int
    quantization: dict[str, Any] | None = None  # the quantization manifest


class Evidence(BaseModel):
    variant: Variant
    folder: Path                   # <run>/<variant>
    cache: Path                    # results/cache/variants/<key>
    serve_command: list[str]       # the head's, for a multi-node server
    node_commands: list[list[str]] = []  # multi-node: every node's `vllm serve` line, by rank
    dtype: str | None              # the --dtype it was served with (None: vLLM's auto)
    parity: dict[str, Any] | None = None
    evals: dict[str, Path] = {}    # eval set name -> run directory of quantgate.evals.run
    recall: Path | None = None     # run directory of quantgate.recall.run (None: no recall in the spec)
    perf: Path | None = None       # output directory of quantgate.perf.probe (None: no probe in the spec)
    fidelity: dict[str, Path] = {}  # "main" (and for the baseline "alt") -> logprob dump folder (quantgate.fidelity)
    served: bool                   # False when every result came from the cache


def size_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and p.suffix == ".safetensors")


def policy_path(spec: ReleaseSpec) -> Path:
    return spec.policy or DEFAULT_POLICY


def baseline_variant(model_dir: Path) -> Variant:
    return Variant(name="baseline", path=model_dir, content_hash=checkpoint_hash(model_dir), size_bytes=size_bytes(model_dir))


def quantize_variant(spec: ReleaseSpec, model_dir: Path, scheme: str, run: Path, log: Log = print) -> Variant:
    """The scheme's checkpoint in results/checkpoints/<base hash12>-<scheme>-<key12>: named by the full quantization
    key (recipe, overrides, calibration, library versions, base hash), reused when the key matches and never
    overwritten, so a checkpoint that was evaluated (and promoted) keeps its weights whatever a later release does."""
    base_hash = checkpoint_hash(model_dir)[:12]
    prefix = results_dir() / "checkpoints" / f"{base_hash}-{scheme}"
    req = QuantizeRequest(model=model_dir, scheme=scheme, out=prefix, name_by_key=True, hardware=spec.hardware,
                          overrides=spec.quantization.overrides.get(scheme, {}), calibration=spec.quantization.calibration)
    result = quantize(req, log=log)
    write_json(run / scheme / "quantization.json", {"reused": result.reused, **result.manifest})
    return Variant(name=scheme, path=result.out, scheme=scheme, content_hash=checkpoint_hash(result.out),
                   size_bytes=size_bytes(result.out), quantization=result.manifest)


def server_config(spec: ReleaseSpec, variant: Variant, folder: Path):
    """The plan's server for this variant: one VLLMServer config, or a MultiNodeConfig when the plan's replica spans
    nodes (launched here only when serving.local_nodes says the nodes are process groups on this host)."""

    s = spec.serving
    plan = build_plan(variant.path, spec.hardware, context=spec.context, concurrency=spec.concurrency,
                      gpus=spec.gpus, nodes=spec.nodes, replicas=s.replicas, nodes_share_host=s.local_nodes or None,
                      master_addr="127.0.0.1" if s.local_nodes else None)
    write_json(folder / "plan.json", plan.model_dump(mode="json"))
    if plan.replica_plans[0].multi_node is None:
        return config_from_plan(plan, variant.path, variant.name, dtype=s.dtype, extra_args=s.extra_args, python=s.python,
                                startup_timeout_s=s.startup_timeout_s)
    if not s.local_nodes:
        raise ConfigError(f"the plan for {variant.name} spans {len(plan.replica_plans[0].nodes)} nodes and quantgate launches "
                          "multi-node servers only when the nodes are process groups on this host",
                          where="serving.local_nodes",
                          fix="set serving.local_nodes: true for one big host, or start the nodes with the commands "
                              f"`quantgate plan` prints (saved in {folder / 'plan.json'})")
    return multinode_config_from_plan(plan, variant.path, variant.name, dtype=s.dtype, extra_args=s.extra_args,
                                      python=s.python, startup_timeout_s=s.startup_timeout_s, join_timeout_s=s.join_timeout_s)


def make_server(config, folder: Path):
    if isinstance(config, MultiNodeConfig):
        return MultiNodeServer(config, log_dir=folder)
    return VLLMServer(config, log_path=folder / "server.log")
