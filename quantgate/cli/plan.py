"""`quantgate plan`: load the model, hardware profile and planner policy, run the planner, print or save the plan, and
for a plan whose replicas span nodes write a Kubernetes LeaderWorkerSet manifest (`--lws`, quantgate.plan.lws)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import cast, get_args

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from quantgate.base.errors import ConfigError, SettingError
from quantgate.base.fileio import write_text
from quantgate.plan.build import build_plan
from quantgate.plan.knobs import CudagraphMode
from quantgate.plan.lws import VLLM_IMAGE, LwsSpec, Metadata, k8s_name, manifest_yaml, render_lws
from quantgate.plan.models import Plan

# Placeholders a printed command keeps for the user's launcher to fill (quant_recipes/planner.yaml's master_addr is
# "$HEAD_IP"): these stay expandable; every other character of a printed command is quoted for the shell.
PLACEHOLDERS = ("HEAD_IP", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")
_NAMES = "|".join(PLACEHOLDERS)
_PLACEHOLDER = re.compile(rf"\$(?:\{{({_NAMES})\}}|({_NAMES})(?![A-Za-z0-9_]))")


def _word(t: str) -> str:
    """One shell word: the known placeholders ($HEAD_IP, ${HEAD_IP}, ...) as "$NAME", everything else in single
    quotes where needed (shlex.quote), so `$(...)`, backticks and other variables in a path are never expanded."""
    parts, pos = [], 0
    for m in _PLACEHOLDER.finditer(t):
        if m.start() > pos:
            parts.append(shlex.quote(t[pos:m.start()]))
        parts.append(f'"${m.group(1) or m.group(2)}"')
        pos = m.end()
    if pos < len(t) or not parts:
        parts.append(shlex.quote(t[pos:]))
    return "".join(parts)


def _sh(tokens: list[str]) -> str:
    """Shell words to paste: placeholders stay expandable, everything else is quoted safely."""
    return " ".join(_word(t) for t in tokens)


def _env(env: dict[str, str]) -> str:
    """NAME=value assignments before a command; the name stays bare (a quoted name is no assignment), the value is
    quoted like any word."""
    bad = [k for k in env if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)]
    if bad:
        raise ValueError(f"not environment variable names: {bad}")
    return " ".join(f"{k}={_word(v)}" for k, v in env.items())


def _show(p: Plan, console: Console) -> None:
    table = Table(title=f"plan: {p.model} on {p.hardware} ({p.devices_total} device(s))", show_lines=False)
    for col in ("topic", "choice", "", "reason"):
        table.add_column(col, overflow="fold")
    for d in p.decisions:
        table.add_row(escape(d.topic), escape(d.choice), "[green]yes[/]" if d.accepted else "[red]no[/]", escape(d.reason))
    console.print(table)
    c = p.capacity
    console.print(f"layout {p.layout.label} x {p.replicas} replica(s); KV {c.kv_pool_gib_per_replica:.1f} GiB per "
                  f"replica = {c.concurrency_per_replica:.1f} x {c.context:,}-token requests (target {c.target_concurrency})")
    for w in p.warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    for r in p.replica_plans:
        if r.multi_node is None:
            console.print(escape(f"replica {r.index}: {_env(r.env)} {_sh(p.argv())}"), soft_wrap=True)
            continue
        console.print(escape(f"replica {r.index} spans nodes {r.nodes}:"))
        for name, cmds in (("native", r.multi_node.native), ("ray", r.multi_node.ray or [])):
            for n in cmds:
                for argv in n.commands:
                    line = f"  [{name}] node {n.node_rank} ({n.role}): {_env(n.env)} {_sh(argv)}"
                    console.print(escape(line), soft_wrap=True)
        for note in r.multi_node.notes:
            console.print(escape(f"  note: {note}"))


def _lws_manifest(p: Plan, *, image: str, name: str | None, namespace: str | None, model_uri: str | None,
                  pvc: str | None, host_path: str | None) -> tuple[str, str]:
    """(manifest text, one line saying what it holds) for `--lws`; raises before anything is written or printed.
    The model in the pods: --model-uri, else the model folder's name inside the mounted volume (the plan's own path
    is one on this machine, which the pods do not have)."""
    uri = model_uri or (Path(p.model).name if pvc or host_path else None)
    if not uri:
        raise SettingError("no model for the pods: the plan's model is a path on this machine", setting="model_uri",
                           fix="give --model-uri (a path inside the pods or a Hugging Face id vLLM downloads), or "
                               "mount the weights with --model-pvc or --model-host-path")
    set_name = name or k8s_name(Path(p.model).stem)
    objects = render_lws(p, name=set_name, image=image, model_uri=uri, namespace=namespace, pvc=pvc,
                         host_path=host_path)
    spec, service = cast(LwsSpec, objects[0]["spec"]), cast(Metadata, objects[1]["metadata"])  # as render_lws makes
    what = (f"LeaderWorkerSet {set_name} ({spec['replicas']} group(s) x {spec['leaderWorkerTemplate']['size']} pods) "
            f"and Service {service['name']}")
    return manifest_yaml(objects), what


def _write_lws(path: Path, manifest: tuple[str, str], cpu_default_image: bool) -> None:
    """Write `--lws`'s manifest and say so on stderr (stdout may be --json), with a note when a CPU plan got the
    default (CUDA) image."""
    write_text(path, manifest[0])
    note = Console(stderr=True)
    note.print(escape(f"wrote {path}: {manifest[1]}; apply it with `kubectl apply -f {path}`"), soft_wrap=True)
    if cpu_default_image:
        note.print(escape(f"note: {VLLM_IMAGE} is vLLM's CUDA build; a CPU plan needs --image with a CPU build"),
                   soft_wrap=True)


def plan(
    model: Path = typer.Option(..., "--model", help="checkpoint folder, config.json, or hypothetical model YAML"),
    hardware: str = typer.Option(..., "--hardware", help="hardware profile id (quant_recipes/hardware.yaml)"),
    context: int = typer.Option(..., "--context", help="tokens per request; becomes --max-model-len"),
    concurrency: int = typer.Option(..., "--concurrency", help="concurrent requests each replica must hold"),
    gpus: int | None = typer.Option(None, "--gpus", help="devices per node (default: the profile's)"),
    nodes: int = typer.Option(1, "--nodes"),
    kv_dtype: str = typer.Option("auto", "--kv-dtype", "--kv-cache-dtype",
                                 help="auto, fp8, fp8_e4m3 or fp8_e5m2 (the profile's kv_cache_dtypes)"),
    replicas: int | None = typer.Option(None, "--replicas", help="required number of replicas"),
    gpu_memory_utilization: float | None = typer.Option(None, "--gpu-memory-utilization", help="GPU profiles only"),
    max_num_seqs: int | None = typer.Option(None, "--max-num-seqs", help="requests running at once per replica"),
    max_num_batched_tokens: int | None = typer.Option(None, "--max-num-batched-tokens", help="tokens per step"),
    enable_prefix_caching: bool | None = typer.Option(None, "--enable-prefix-caching/--no-enable-prefix-caching",
                                                      help="default: vLLM's (on)"),
    enforce_eager: bool | None = typer.Option(None, "--enforce-eager/--no-enforce-eager",
                                              help="default: the planner's (eager on CPU unless PP > 1)"),
    cudagraph_mode: str | None = typer.Option(None, "--cudagraph-mode", help="GPU: NONE, PIECEWISE, FULL, "
                                              "FULL_DECODE_ONLY or FULL_AND_PIECEWISE"),
    cpu_cores_per_worker: int = typer.Option(1, "--cpu-cores-per-worker", help="CPU targets: cores bound per rank"),
    master_addr: str | None = typer.Option(None, "--master-addr", help="multi-node head address"),
    master_port: int | None = typer.Option(None, "--master-port", help="multi-node head port (default: the policy's)"),
    nodes_share_host: bool = typer.Option(False, "--nodes-share-host", help="CPU: the nodes are process groups on one host"),
    as_json: bool = typer.Option(False, "--json", help="print the plan as JSON"),
    out: Path | None = typer.Option(None, "--out", help="also write the plan JSON to this file"),
    lws: Path | None = typer.Option(None, "--lws", help="also write a Kubernetes LeaderWorkerSet + Service manifest "
                                    "(YAML) to this file; the plan's replicas must span nodes (docs/kubernetes.md)"),
    image: str = typer.Option(VLLM_IMAGE, "--image", help="--lws: the pods' vLLM image (the default is the CUDA "
                              "build; CPU plans need a CPU build)"),
    lws_name: str | None = typer.Option(None, "--lws-name", help="--lws: the set's name (default: from the model's)"),
    namespace: str | None = typer.Option(None, "--namespace", help="--lws: Kubernetes namespace (default: kubectl's)"),
    model_uri: str | None = typer.Option(None, "--model-uri", help="--lws: the model as `vllm serve` gets it in the "
                                         "pods: a path (inside the mounted volume when relative) or a Hugging Face id"),
    model_pvc: str | None = typer.Option(None, "--model-pvc", help="--lws: PersistentVolumeClaim with the weights, "
                                         "mounted read-only at /models in every pod"),
    model_host_path: str | None = typer.Option(None, "--model-host-path", help="--lws: folder with the weights on "
                                               "every node, mounted read-only at /models"),
) -> None:
    """Choose TP/PP/DP/EP and the vLLM arguments for a model on a hardware target, with the reasons."""
    if cudagraph_mode is not None and cudagraph_mode not in get_args(CudagraphMode):
        raise ConfigError(f"unknown CUDA graph mode {cudagraph_mode!r}", where="--cudagraph-mode",
                          fix=f"use one of: {', '.join(get_args(CudagraphMode))}")
    p = build_plan(model, hardware, context=context, concurrency=concurrency, gpus=gpus, nodes=nodes, kv_dtype=kv_dtype,
                   replicas=replicas, gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
                   enforce_eager=enforce_eager, cudagraph_mode=cudagraph_mode,
                   cpu_cores_per_worker=cpu_cores_per_worker, master_addr=master_addr, master_port=master_port,
                   nodes_share_host=nodes_share_host)
    manifest = _lws_manifest(p, image=image, name=lws_name, namespace=namespace, model_uri=model_uri, pvc=model_pvc,
                             host_path=model_host_path) if lws else None
    text = json.dumps(p.model_dump(mode="json"), indent=2)
    if lws and manifest is not None:
        _write_lws(lws, manifest, cpu_default_image=p.kind == "cpu" and image == VLLM_IMAGE)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n", encoding="utf-8")
    if as_json:
        print(text)
    else:
        _show(p, Console())
