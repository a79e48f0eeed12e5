"""The variants of a release and their servers: the baseline and quantized checkpoints, the evidence a measured
variant leaves, and the planned vLLM server (single or multi-node) each is served with.

A server that cannot start or dies while it is measured raises `ServingFailure` (make_server's `WatchedServer`);
for a candidate that is the candidate's failure, not the release's: `failed_evidence` writes it to
<run>/<candidate>/error.json with the log tail, and the gate rejects the candidate with that reason
(quantgate.gate.evidence).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel

from quantgate.base.errors import ConfigError, QuantgateError
from quantgate.base.fileio import log_tail, write_json
from quantgate.base.paths import results_dir
from quantgate.gate.evidence import CANDIDATE_ERROR
from quantgate.gate.policy import DEFAULT_POLICY
from quantgate.plan.build import build_plan
from quantgate.plan.slots import Slot, slots
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
    failure: str | None = None     # its server could not start or died: why (<folder>/error.json has the log tail)


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


def server_config(spec: ReleaseSpec, variant: Variant, folder: Path, slot: Slot | None = None):
    """The plan's server for this variant: one VLLMServer config, or a MultiNodeConfig when the plan's replica spans
    nodes (launched here only when serving.local_nodes says the nodes are process groups on this host). `slot`
    (quantgate.plan.slots) replaces the first replica's devices or core binding with the slot's; without one, a CPU
    server is a lone variant and binds every core of the plan (a judge server, a release serving one at a time)."""

    s = spec.serving
    plan = build_plan(variant.path, spec.hardware, context=spec.context, concurrency=spec.concurrency,
                      gpus=spec.gpus, nodes=spec.nodes, replicas=s.replicas, nodes_share_host=s.local_nodes or None,
                      master_addr="127.0.0.1" if s.local_nodes else None)
    write_json(folder / "plan.json", plan.model_dump(mode="json"))
    if plan.replica_plans[0].multi_node is None:
        cfg = config_from_plan(plan, variant.path, variant.name, dtype=s.dtype, extra_args=s.extra_args, python=s.python,
                               startup_timeout_s=s.startup_timeout_s)
        slot = slot or (next(iter(slots(plan, 1)), None) if plan.kind == "cpu" else None)
        return cfg if slot is None else cfg.model_copy(update={"env": {**cfg.env, **slot.env}})
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
        return WatchedServer(MultiNodeServer(config, log_dir=folder))
    return WatchedServer(VLLMServer(config, log_path=folder / "server.log"))


DEATH_GRACE_S = 20.0  # a client can see the connection reset before the server process has exited


class ServingFailure(QuantgateError):
    """The variant's vLLM server could not start (`phase` "start") or died while measured ("measure")."""

    def __init__(self, phase: str, cause: QuantgateError, server):
        super().__init__(cause.message, where=cause.where, fix=cause.fix)
        self.phase, self.log_path = phase, Path(server.log_path)
        self.command, self.commands = list(server.command), list(getattr(server, "commands", []))


class WatchedServer:
    """A VLLMServer or MultiNodeServer whose start-up failure, or death under load, is raised as ServingFailure;
    everything else is the wrapped server's (attributes included)."""

    def __init__(self, server):
        self._server = server

    def __getattr__(self, name: str):
        return getattr(self._server, name)

    def __enter__(self) -> "WatchedServer":
        try:
            self._server.start()
        except QuantgateError as exc:
            raise ServingFailure("start", exc, self._server) from None
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._server.stop(raising=exc_type is None)  # never hide the error already on its way out

    def raise_if_dead(self) -> None:
        """ServingFailure when the server has exited (waiting DEATH_GRACE_S for a dying one); else nothing."""
        deadline = time.monotonic() + DEATH_GRACE_S
        while self._server.alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        try:
            self._server.raise_if_dead()
        except QuantgateError as exc:
            raise ServingFailure("measure", exc, self._server) from None


def failed_evidence(variant: Variant, folder: Path, cache: Path, dtype: str | None, exc: ServingFailure,
                    log: Log = print, *, baseline: bool = False) -> Evidence:
    """Record a candidate whose server could not start or died: <folder>/error.json (the error, the phase, the
    server log's tail) and evidence.json with `failure` set; the gate rejects it with this reason. For the
    baseline (`baseline`) the error is raised again: with nothing to compare with, the release cannot go on."""
    if baseline:
        raise exc
    what = "could not start" if exc.phase == "start" else "died while it was measured"
    first = exc.message.splitlines()[0].removesuffix("; last log lines:").removesuffix(" last log lines:")
    reason = f"the vLLM server of {variant.name} {what}: {first}"
    write_json(folder / CANDIDATE_ERROR, {"candidate": variant.name, "step": "serve and measure", "phase": exc.phase,
                                          "error": reason, "detail": exc.message, "server_log": str(exc.log_path),
                                          "log_tail": log_tail(exc.log_path, 40).splitlines()})
    log(f"{variant.name}: FAILED, recorded in {folder / CANDIDATE_ERROR}: {reason}")
    ev = Evidence(variant=variant, folder=folder, cache=cache, serve_command=exc.command, node_commands=exc.commands,
                  dtype=dtype, served=True, failure=reason)
    write_json(folder / "evidence.json", ev.model_dump(mode="json"))
    return ev


def failed_row(ev: Evidence) -> dict[str, Any] | None:
    """summary.json's row for a candidate whose server failed (its scheme, why, the error file); None otherwise."""
    if ev.failure is None:
        return None
    return {"scheme": ev.variant.scheme, "failure": ev.failure, "error": str(ev.folder / CANDIDATE_ERROR)}
