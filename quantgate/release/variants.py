"""The variants of a release and their servers: the baseline and quantized checkpoints, the evidence a measured
variant leaves, and the planned vLLM server (single or multi-node) each is served with.

A server that cannot start or dies while it is measured raises `ServingFailure` (make_server's `WatchedServer`);
for a candidate that is the candidate's failure, not the release's: `failed_evidence` writes it to
<run>/<candidate>/error.json with the log tail, and the gate rejects the candidate with that reason
(quantgate.gate.evidence).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Literal, TypedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.runfiles import CHECKPOINT, EVIDENCE, PLAN, QUANTIZATION
from quantgate.base.errors import ConfigError, QuantgateError
from quantgate.base.fileio import log_tail, write_json
from quantgate.base.pairedstat import PairedStat
from quantgate.base.paths import results_dir
from quantgate.base.typedfile import read_migrated
from quantgate.gate.failurefile import CANDIDATE_ERROR, CandidateError
from quantgate.plan.build import build_plan
from quantgate.plan.models import Plan
from quantgate.plan.slots import Slot, slots
from quantgate.quantize.recipes import RecipeOverrides
from quantgate.quantize.run import QuantizeRequest, quantize
from quantgate.spec.external import CandidateSpec, EndpointRef, external
from quantgate.release.secrets import endpoint_api_key
from quantgate.spec.schema import ReleaseSpec
from quantgate.serving.endpoint import EndpointConfig, EndpointServer
from quantgate.serving.multinode import MultiNodeConfig, MultiNodeServer, multinode_config_from_plan
from quantgate.serving.server import ServerConfig, VLLMServer, config_from_plan
from quantgate.serving.logcause import log_cause
from quantgate.target.catalogue import checkpoint_hash

Log = Callable[[str], None]


class Variant(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field nobody declared is a mistake, not data to drop

    name: str                      # "baseline", the scheme id, or the name of a `candidates` entry
    path: Path                     # its checkpoint; an endpoint's: the spec's `model` (the tokenizer, no weights)
    scheme: str | None = None
    content_hash: str              # an endpoint's: of its URL and model name
    size_bytes: int | None         # None: no checkpoint files (an endpoint)
    quantization: dict[str, object] | None = None  # the quantization manifest (QuantManifest.dump)
    origin: Literal["model", "quantized", "checkpoint", "endpoint"] = "model"  # `model`, quantized here, or elsewhere
    endpoint: EndpointRef | None = None  # origin endpoint: where it answers (quantgate starts and stops nothing)


EVIDENCE_SCHEMA = 2  # 1: before 2026-12-04, no schema_version (the same fields)
EVIDENCE_MIGRATIONS: dict[int, Callable[[dict[str, object]], dict[str, object]]] = {1: lambda doc: {**doc, "schema_version": 2}}


class Evidence(BaseModel):
    """<run>/<variant>/evidence.json: what was measured for a variant and where its results are. Written by `write`
    alone and read by `load_evidence` in the release (the gate and the report, below it, read it as JSON). Unknown
    fields are refused: a measurement kind whose `record()` returns a key this model lacks fails loudly at once,
    instead of its result being dropped from evidence.json without a word."""
    model_config = ConfigDict(extra="forbid")

    schema_version: int = EVIDENCE_SCHEMA
    variant: Variant
    folder: Path                   # <run>/<variant>
    cache: Path                    # results/cache/variants/<key>
    serve_command: list[str]       # the head's, for a multi-node server
    node_commands: list[list[str]] = []  # multi-node: every node's `vllm serve` line, by rank
    dtype: str | None              # the --dtype it was served with (None: vLLM's auto)
    parity: dict[str, object] | None = None
    evals: dict[str, Path] = {}    # eval set name -> run directory of quantgate.evals.run
    recall: Path | None = None     # run directory of quantgate.recall.run (None: no recall in the spec)
    perf: Path | None = None       # output directory of quantgate.perf.probe (None: no probe in the spec)
    fidelity: dict[str, Path] = {}  # "main" (and for the baseline "alt") -> logprob dump folder (quantgate.fidelity)
    kinds: dict[str, Path] = {}     # a kind added as one module (quantgate/kinds/) -> its folder in the cache
    served: bool                   # False when every result came from the cache
    failure: str | None = None     # its server could not start or died: why (<folder>/error.json has the log tail)
    not_applicable: dict[str, str] = {}  # evidence slot (parity, size) -> why it cannot exist for this variant
    decided: str | None = None     # a REJECT decided early by fidelity: the failed checks (quantgate.release.early)
    skipped: dict[str, str] = {}   # step (evals, recall, perf, ...) -> why it did not run

    def evals_as_planned(self, planned: Mapping[str, Path]) -> bool:
        """Whether its eval folders are the planned ones: all of them, or those measured (or cached) before a
        decided REJECT skipped the rest (quantgate.release.early)."""
        if any(planned.get(name) != folder for name, folder in self.evals.items()):
            return False
        return "evals" in self.skipped or self.evals.keys() == planned.keys()

    def write(self) -> Path:
        """<folder>/evidence.json, its one writer."""
        write_json(self.folder / EVIDENCE, self.model_dump(mode="json"))
        return self.folder / EVIDENCE


def load_evidence(path: Path) -> Evidence:
    """An evidence.json at the current schema (an older one migrated); RunFileError naming the file and field."""
    return read_migrated(path, Evidence, "evidence", "re-run the release with the same --run-id: the variant's step "
                         "writes it again from its cache", EVIDENCE_MIGRATIONS, EVIDENCE_SCHEMA)


def size_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and p.suffix == ".safetensors")




def baseline_variant(model_dir: Path) -> Variant:
    return Variant(name="baseline", path=model_dir, content_hash=checkpoint_hash(model_dir), size_bytes=size_bytes(model_dir))


@dataclass(frozen=True)
class RepairRung:
    """A scheme quantized again with decoder layers kept at 16 bits (`ignore` patterns added to its recipe), measured
    and gated as `name` (quantgate.release.repair_step chooses them)."""
    name: str
    scheme: str
    ignore: list[str]
    repairs: str


def quantize_variant(spec: ReleaseSpec, model_dir: Path, what: str | RepairRung, run: Path, log: Log = print
                     ) -> Variant:
    """The scheme's checkpoint (`what`: a scheme id, or a repair of one) in results/checkpoints/<base hash12>-<name>-
    <key12>: named by the full quantization key (recipe, overrides, calibration, library versions, base hash),
    reused when the key matches and never overwritten, so a checkpoint that was evaluated (and promoted) keeps its
    weights whatever a later release does."""
    name, scheme = (what, what) if isinstance(what, str) else (what.name, what.scheme)
    result = quantize(quantize_request(spec, model_dir, what), log=log)
    result.manifest.write_run_copy(run / name / QUANTIZATION, reused=result.reused)
    return Variant(name=name, path=result.out, scheme=scheme, content_hash=checkpoint_hash(result.out),
                   size_bytes=size_bytes(result.out), quantization=result.manifest.dump(), origin="quantized")


def quantize_request(spec: ReleaseSpec, model_dir: Path, what: str | RepairRung) -> QuantizeRequest:
    """What quantize_variant asks llmcompressor for: its checkpoint lands in results/checkpoints/<base hash12>-<name>-
    <key12> (quantgate.quantize.run.keyed_folder with the plan's key); a repair's `ignore` added to the spec's."""
    name, scheme = (what, what) if isinstance(what, str) else (what.name, what.scheme)
    prefix = results_dir() / "checkpoints" / f"{checkpoint_hash(model_dir)[:12]}-{name}"
    overrides = spec.quantization.overrides.get(scheme) or RecipeOverrides()
    if not isinstance(what, str):
        keep = [k for k in what.ignore if k not in overrides.ignore]
        overrides = overrides.model_copy(update={"ignore": [*overrides.ignore, *keep]})
    return QuantizeRequest(model=model_dir, scheme=scheme, out=prefix, name_by_key=True, hardware=spec.hardware,
                           overrides=overrides, calibration=spec.quantization.calibration)


def endpoint_variant(name: str, ref: EndpointRef, model_dir: Path, scheme: str | None = None) -> Variant:
    """A variant someone else serves at `ref`; `model_dir` (the spec's `model`) gives the tokenizer."""
    ident = hashlib.sha256(f"{ref.endpoint}\n{ref.model}".encode()).hexdigest()
    return Variant(name=name, path=model_dir, scheme=scheme, content_hash=ident, size_bytes=None, origin="endpoint",
                   endpoint=ref)


def baseline_for(spec: ReleaseSpec, model_dir: Path) -> Variant:
    """The release's baseline: `model` served by quantgate, or the spec's `baseline` endpoint."""
    if spec.baseline is None:
        return baseline_variant(model_dir)
    return endpoint_variant("baseline", spec.baseline, model_dir)


def external_variant(spec: ReleaseSpec, name: str, model_dir: Path, run: Path) -> Variant:
    """The `candidates` entry `name` as a Variant: an endpoint, or a checkpoint folder served like a quantized one
    (not quantized: <run>/<name>/checkpoint.json records the folder and what its config.json says)."""
    c: CandidateSpec | None = external(spec, name)
    assert c is not None, name
    if (ref := c.endpoint_ref()) is not None:
        return endpoint_variant(name, ref, model_dir, c.scheme)
    assert c.checkpoint is not None
    size = size_bytes(c.checkpoint) or None  # no .safetensors: size unknown (a gap), not zero
    CheckpointRecord(checkpoint=str(c.checkpoint), scheme=c.scheme, detected=c.note, size_bytes=size).write(run / name)
    return Variant(name=name, path=c.checkpoint, scheme=c.scheme, content_hash=checkpoint_hash(c.checkpoint),
                   size_bytes=size, origin="checkpoint")


class CheckpointRecord(BaseModel):
    """<run>/<candidate>/checkpoint.json: a `candidates:` checkpoint folder served as it is (not quantized here)."""
    checkpoint: str
    scheme: str | None = Field(description="the scheme its config.json's quantization_config was read as")
    detected: str | None = Field(description="what was detected in the folder, in words (the spec's machine note)")
    size_bytes: int | None = Field(description="its .safetensors bytes; None when it has none (a gap, not zero)")

    def write(self, folder: Path) -> None:
        write_json(folder / CHECKPOINT, self.model_dump(mode="json"))


def endpoint_config(spec: ReleaseSpec, variant: Variant) -> EndpointConfig:
    ref = variant.endpoint
    assert ref is not None
    names = [c.name for c in spec.candidates]
    where = f"candidates.{names.index(variant.name)}" if variant.name in names else "baseline"
    return EndpointConfig(url=ref.endpoint, name=ref.model, api_key_env=ref.api_key_env,
                          prefect_secret=ref.prefect_secret, where=where, python=spec.serving.python)


def not_applicable(variant: Variant, baseline: bool) -> dict[str, str]:
    """Evidence slots that cannot exist for this variant, and why (the gate's policy decides: not_applicable)."""
    if variant.endpoint is None:
        return {}
    where = f"{variant.endpoint.endpoint} (model {variant.endpoint.model})"
    out = {"size": f"not applicable: endpoint: {variant.name} is served at {where}, with no checkpoint files here"}
    if baseline:
        out["parity"] = (f"not applicable: endpoint: the baseline is served at {where}, with no local weights for "
                         "the transformers reference")
    return out


def endpoint_keys(spec: ReleaseSpec) -> None:
    """Read every endpoint's API key now (ConfigError naming its spec field), before any work is done."""
    ends = [endpoint_variant("baseline", spec.baseline, Path(spec.model))] if spec.baseline else []
    ends += [endpoint_variant(c.name, ref, Path(spec.model)) for c in spec.candidates if (ref := c.endpoint_ref())]
    for variant in ends:
        endpoint_api_key(endpoint_config(spec, variant))


_PLANS: dict[tuple[str, str, str | None], Plan] = {}  # (spec, checkpoint, scheme) -> its plan, made once per process


def serving_plan(spec: ReleaseSpec, variant: Variant) -> Plan:
    """The planner's layout for this variant under the spec, computed once per spec and variant (the release asks
    for it before a variant runs, to know its cache key, and again where it serves it). The spec's serving knobs win
    over the planner's defaults; serving.kv_cache_dtype applies to candidates (a variant with a scheme), the baseline
    keeps auto KV as the reference."""
    key = (spec.model_dump_json(), str(variant.path), variant.scheme)
    if key not in _PLANS:
        s = spec.serving
        _PLANS[key] = build_plan(variant.path, spec.hardware, context=spec.context, concurrency=spec.concurrency,
                                 gpus=spec.gpus, nodes=spec.nodes, replicas=s.replicas,
                                 nodes_share_host=s.local_nodes or None,
                                 master_addr="127.0.0.1" if s.local_nodes else None,
                                 **s.plan_options(candidate=variant.scheme is not None))
    return _PLANS[key]


def server_config(spec: ReleaseSpec, variant: Variant, folder: Path | None, slot: Slot | None = None):
    """The plan's server for this variant: one VLLMServer config, or a MultiNodeConfig when the plan's replica spans
    nodes (launched here only when serving.local_nodes says the nodes are process groups on this host). `folder`:
    where the server will run, and its plan.json is written; None: the config only (to know its cache key). `slot`
    (quantgate.plan.slots) replaces the first replica's devices or core binding with the slot's; without one, a CPU
    server is a lone variant and binds every core of the plan (a judge server, a release serving one at a time)."""

    if variant.endpoint is not None:  # nothing to plan: it runs elsewhere
        return endpoint_config(spec, variant)
    s = spec.serving
    plan = serving_plan(spec, variant)
    if folder is not None:
        write_json(folder / PLAN, plan.model_dump(mode="json"))
    cfg: ServerConfig | MultiNodeConfig
    if plan.replica_plans[0].multi_node is None:
        cfg = config_from_plan(plan, variant.path, variant.name, dtype=s.dtype, extra_args=s.extra_args, python=s.python,
                               startup_timeout_s=s.startup_timeout_s, stall_timeout_s=s.stall_timeout_s)
        slot = slot or (next(iter(slots(plan, 1)), None) if plan.kind == "cpu" else None)
        return cfg if slot is None else cfg.model_copy(update={"env": {**cfg.env, **slot.env}})
    if not s.local_nodes:
        raise ConfigError(f"the plan for {variant.name} spans {len(plan.replica_plans[0].nodes)} nodes and quantgate launches "
                          "multi-node servers only when the nodes are process groups on this host",
                          where="serving.local_nodes",
                          fix="set serving.local_nodes: true for one big host, or start the nodes with the commands "
                              f"`quantgate plan` prints{f' (saved in {folder / PLAN})' if folder else ''}")
    cfg = multinode_config_from_plan(plan, variant.path, variant.name, dtype=s.dtype, extra_args=s.extra_args,
                                     python=s.python, startup_timeout_s=s.startup_timeout_s, join_timeout_s=s.join_timeout_s)
    return cfg.model_copy(update={"stall_timeout_s": s.stall_timeout_s})


def make_server(config, folder: Path):
    if isinstance(config, EndpointConfig):  # starts and stops nothing; <folder>/endpoint.log has its checks
        return WatchedServer(EndpointServer(config, log_path=folder / "endpoint.log", api_key=endpoint_api_key(config)))
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
        self.dtype: str | None = server.config.dtype  # the activation dtype it was started with


class WatchedServer:
    """A VLLMServer or MultiNodeServer whose start-up failure, or death under load, is raised as ServingFailure;
    everything else is the wrapped server's (attributes included)."""

    def __init__(self, server):
        self._server = server

    def __getattr__(self, name: str):
        return getattr(self._server, name)

    def __enter__(self) -> WatchedServer:
        try:
            self._server.start()
        except QuantgateError as exc:
            raise ServingFailure("start", exc, self._server) from None
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._server.stop(raising=exc_type is None)  # never hide the error already on its way out

    def raise_if_dead(self) -> None:
        """ServingFailure when the server has exited (waiting DEATH_GRACE_S for a dying one); else nothing."""
        deadline = time.monotonic() + getattr(self._server, "death_grace_s", DEATH_GRACE_S)
        while self._server.alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        try:
            self._server.raise_if_dead()
        except QuantgateError as exc:
            raise ServingFailure("measure", exc, self._server) from None


def failed_evidence(variant: Variant, folder: Path, cache: Path, exc: ServingFailure, log: Log = print, *,
                    baseline: bool = False) -> Evidence:
    """Record a candidate whose server could not start or died: <folder>/error.json (the error, the phase, the
    server log's tail) and evidence.json with `failure` set; the gate rejects it with this reason. For the
    baseline (`baseline`) the error is raised again: with nothing to compare with, the release cannot go on."""
    if baseline:
        raise exc
    what = "could not start" if exc.phase == "start" else "died while it was measured"
    if variant.endpoint is not None:
        what = "did not list the model" if exc.phase == "start" else "stopped answering while it was measured"
    first = exc.message.splitlines()[0].removesuffix("; last log lines:").removesuffix(" last log lines:")
    ep = variant.endpoint
    server = f"the endpoint of {variant.name} ({ep.endpoint}, model {ep.model})" if ep else f"the vLLM server of {variant.name}"
    reason = f"{server} {what}: {first}"
    path = CandidateError(candidate=variant.name, phase=exc.phase, error=reason, detail=exc.message,
                          server_log=str(exc.log_path), log_tail=log_tail(exc.log_path, 40).splitlines(),
                          root_cause=log_cause(exc.log_path) if exc.log_path else None).write(folder)
    log(f"{variant.name}: FAILED, recorded in {path}: {reason}")
    ev = Evidence(variant=variant, folder=folder, cache=cache, serve_command=exc.command, node_commands=exc.commands,
                  dtype=exc.dtype, served=True, failure=reason)
    ev.write()
    return ev


class SummaryRow(TypedDict, total=False):
    """A candidate's row of summary.json as the release makes it (quantgate.gate.summaryfile.CandidateRow): its
    figures (quantgate.release.steps), or, when its server failed, why (`failed_row`)."""
    scheme: str | None
    size_bytes: int | None
    size_ratio: float | None
    metrics: dict[str, PairedStat]
    regressions: int
    agreement: dict[str, float | None]
    failure: str
    error: str


def failed_row(ev: Evidence) -> SummaryRow | None:
    """summary.json's row for a candidate whose server failed (its scheme, why, the error file); None otherwise."""
    if ev.failure is None:
        return None
    return {"scheme": ev.variant.scheme, "failure": ev.failure, "error": str(ev.folder / CANDIDATE_ERROR)}
