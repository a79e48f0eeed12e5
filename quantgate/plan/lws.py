"""Kubernetes objects for a plan whose replicas span nodes (pure): a LeaderWorkerSet running the plan's native
per-node `vllm serve` lines, and a Service in front of the leaders' OpenAI API.

    objects = render_lws(plan, name="demo", image=VLLM_IMAGE, model_uri="demo", pvc="models")
    text = manifest_yaml(objects)                      # multi-document YAML for `kubectl apply -f`

One LWS group is one replica of the plan: `spec.replicas` is the plan's replica count, `leaderWorkerTemplate.size`
its nodes per replica; the leader runs node 0's line (it serves the API), the workers the line of nodes 1..N-1
(`--headless`). What the LWS controller provides, as kubernetes-sigs/lws v0.10.0 defines it
(api/leaderworkerset/v1/leaderworkerset_types.go, the constants LwsLeaderAddress, LwsWorkerIndex, SetNameLabelKey):
  - every container gets LWS_LEADER_ADDRESS (the leader pod's DNS name in the group) and LWS_WORKER_INDEX (0 on
    the leader, 1..size-1 on the workers); the plan's head address (`--master-addr`, `--data-parallel-address`) is
    replaced by the first, a worker's `--node-rank` by the second;
  - every pod is labelled `leaderworkerset.sigs.k8s.io/name: <set name>`, which the Service selects with the
    leader's own component label;
  - the controller makes a headless Service named like the set for the pods' DNS, so the API Service is
    `<name>-api`.
How the variables reach the command: the kubelet expands `$(NAME)` in a container's command from its environment,
and `$$` stands for a literal `$`, so every `$` of the plan's own words is doubled and stays literal. Where the
value needs arithmetic (a data-parallel worker's `--data-parallel-start-rank` is its index times the ranks per node)
the worker runs `sh -c 'exec vllm serve ...'`, its words quoted for the shell.

Pod settings: the plan's per-node environment; GPUs per pod = the plan's devices per node (`nvidia.com/gpu`, or
`amd.com/gpu` where the plan selects devices with HIP_VISIBLE_DEVICES); one RDMA device (`rdma_resource`) and the
IPC_LOCK capability only where the plan expects NCCL on InfiniBand/RDMA (its NCCL check looks for NET/IB or
GDRDMA), with that check's NCCL_DEBUG setting; on CPU plans the cores the node binds. `/dev/shm` is a
memory-backed emptyDir (vLLM's workers share tensors through it); the leader is ready when `/health` answers.
Weights: `model_uri` is what `vllm serve` gets. With `pvc` (a PersistentVolumeClaim every node can mount
read-only: ReadOnlyMany or ReadWriteMany) or `host_path` (a folder present on every node) the volume is mounted
read-only at `mount_path` in every pod and a relative `model_uri` is taken inside it; without either, `model_uri`
is used as given (a Hugging Face id that vLLM downloads at start, or a path baked into the image).
"""

from __future__ import annotations

import copy
import re
import shlex
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

import yaml

from quantgate.base.errors import SettingError
from quantgate.plan.models import MultiNode, NodeCommand, Plan, Replica
from quantgate.plan.slots import BIND, cores_of

LWS_API = "leaderworkerset.x-k8s.io/v1"
LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
WORKER_INDEX = "LWS_WORKER_INDEX"
SET_LABEL = "leaderworkerset.sigs.k8s.io/name"
COMPONENT = "app.kubernetes.io/component"
# vllm/vllm-openai is the CUDA build; requirements/serve-gpu.in pins vllm==0.32.0 (tests/test_lws.py keeps them equal)
VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
ADDR_FLAGS = ("--master-addr", "--data-parallel-address")
RDMA_TRANSPORTS = {"NET/IB", "GDRDMA"}  # NCCL's log names of its InfiniBand/RoCE and GPUDirect RDMA transports
MAX_NAME = 40  # leaves room for what LWS appends (group and worker indices, revision hashes) within 63 characters
_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


@dataclass(frozen=True)
class _Var:
    """A word of a pod's command that an LWS variable fills in: its value times `times` (a rank per node)."""
    name: str
    times: int = 1


Word = str | _Var


def k8s_literal(word: str) -> str:
    """`word` as the kubelet leaves it: every `$` doubled, so no `$(NAME)` inside it is expanded."""
    return word.replace("$", "$$")


def _exec_form(argv: list[Word]) -> list[str]:
    """A command the kubelet runs as is: plain words literal, LWS values as `$(NAME)` (no arithmetic here)."""
    out = []
    for w in argv:
        if isinstance(w, _Var):
            if w.times != 1:
                raise ValueError(f"{w} needs a shell")
            out.append(f"$({w.name})")
        else:
            out.append(k8s_literal(w))
    return out


def _shell_form(argv: list[Word]) -> list[str]:
    """`sh -c 'exec ...'`: plain words quoted for the shell, LWS values read (and multiplied) by the shell; the
    script's every `$` doubled for the kubelet."""
    words = [(f'"$(({w.name} * {w.times}))"' if w.times != 1 else f'"${w.name}"') if isinstance(w, _Var)
             else shlex.quote(w) for w in argv]
    return ["sh", "-c", k8s_literal("exec " + " ".join(words))]


def _command(argv: list[Word]) -> list[str]:
    return _shell_form(argv) if any(isinstance(w, _Var) and w.times != 1 for w in argv) else _exec_form(argv)


def _value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


def _replace(argv: list[Word], flag: str, value: Word) -> list[Word]:
    """argv with the value after `flag` replaced (unchanged when the flag is absent)."""
    if flag not in argv[:-1]:
        return argv
    i = argv.index(flag)
    return [*argv[: i + 1], value, *argv[i + 2:]]


def _node_argv(node: NodeCommand, model: str) -> list[Word]:
    """The node's `vllm serve` line with the model as the pods see it and the head address from LWS."""
    argv = node.commands[-1]
    if argv[:2] != ["vllm", "serve"] or len(argv) < 3:
        raise ValueError(f"node {node.node_rank}: not a `vllm serve` line: {argv[:3]}")
    out: list[Word] = ["vllm", "serve", model, *argv[3:]]
    for flag in ADDR_FLAGS:
        out = _replace(out, flag, _Var(LEADER_ADDRESS))
    return out


def _worker_argv(worker: NodeCommand, model: str) -> list[Word]:
    """One line for every worker: its node rank, and with data parallel its first rank, from LWS_WORKER_INDEX."""
    argv = _replace(_node_argv(worker, model), "--node-rank", _Var(WORKER_INDEX))
    local = _value(worker.commands[-1], "--data-parallel-size-local")
    if local is not None:
        argv = _replace(argv, "--data-parallel-start-rank", _Var(WORKER_INDEX, int(local)))
    return argv


def at_index(argv: list[Word], index: int, leader_address: str) -> list[str]:
    """The words a pod of worker index `index` runs (the LWS values filled in), to compare with the plan."""
    def fill(w: Word) -> str:
        if isinstance(w, str):
            return w
        return leader_address if w.name == LEADER_ADDRESS else str(index * w.times)
    return [fill(w) for w in argv]


def _check_workers(mn: MultiNode, template: list[Word], model: str) -> None:
    """Every worker node must be the template at its own index: one workerTemplate serves them all."""
    workers = mn.native[1:]
    for w in workers:
        want = at_index(_node_argv(w, model), 0, "ADDR")
        if at_index(template, w.node_rank, "ADDR") != want:
            raise ValueError(f"node {w.node_rank}'s command differs from the other workers' by more than its rank")
    envs = {tuple(sorted(w.env.items())) for w in workers}
    if len(envs) > 1:
        diff = sorted({k for w in workers for k, v in w.env.items() if v != workers[0].env.get(k)})
        raise SettingError(f"the plan's worker nodes need different settings ({', '.join(diff)}): a LeaderWorkerSet "
                           "gives every worker pod one template", setting="nodes_share_host",
                           fix="plan the nodes as separate hosts (without --nodes-share-host): each pod is a node")


def _multi_node_replicas(plan: Plan) -> list[Replica]:
    reps = [r for r in plan.replica_plans if r.multi_node is not None]
    if not reps or len(reps) != len(plan.replica_plans):
        raise SettingError(f"the plan serves each of its {plan.replicas} replica(s) ({plan.layout.label}) on one node: "
                           "a LeaderWorkerSet is for replicas that span nodes", setting="nodes",
                           fix="plan more nodes than one replica fits in (e.g. --nodes 2 --replicas 1), or run "
                               "single-node replicas as an ordinary Deployment")
    return reps


def _check_inputs(name: str, namespace: str | None, image: str, model_uri: str, port: int, pvc: str | None,
                  host_path: str | None, mount_path: str) -> None:
    if len(name) > MAX_NAME or not _DNS_LABEL.fullmatch(name):
        raise SettingError(f"{name!r} is no Kubernetes name for the set", setting="lws_name",
                           fix=f"use lower-case letters, digits and '-', starting with a letter, at most {MAX_NAME} "
                               "characters")
    if namespace is not None and (len(namespace) > 63 or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", namespace)):
        raise SettingError(f"{namespace!r} is no Kubernetes namespace", setting="namespace",
                           fix="use lower-case letters, digits and '-', at most 63 characters")
    if not image.strip():
        raise SettingError("no container image", setting="image", fix="name the vLLM image the pods run")
    if not model_uri.strip():
        raise SettingError("no model for the pods", setting="model_uri",
                           fix="give a path inside the pods or a Hugging Face id that vLLM downloads")
    if not 1 <= port <= 65535:
        raise SettingError(f"port {port} is out of range", setting="port", fix="use 1-65535")
    if pvc and host_path:
        raise SettingError("both a PersistentVolumeClaim and a host folder for the weights",
                           setting="model_pvc / model_host_path", fix="give one of them")
    if (pvc or host_path) and not mount_path.startswith("/"):
        raise SettingError(f"mount path {mount_path!r} is not absolute", setting="mount_path",
                           fix="give an absolute path such as /models")


class Metadata(TypedDict):
    """An object's `metadata` as render_lws writes it."""
    name: str
    labels: dict[str, str]
    namespace: NotRequired[str]
    annotations: NotRequired[dict[str, str]]


class GroupTemplate(TypedDict):
    """The LeaderWorkerSet's `spec.leaderWorkerTemplate`: nodes per group, restart policy, the pod templates."""
    size: int
    restartPolicy: str
    leaderTemplate: dict[str, object]
    workerTemplate: dict[str, object]


class LwsSpec(TypedDict):
    """The LeaderWorkerSet's `spec`."""
    replicas: int
    startupPolicy: str
    leaderWorkerTemplate: GroupTemplate


@dataclass(frozen=True)
class _Pods:
    """What the leader's and the workers' pod templates share."""
    plan: Plan
    mn: MultiNode
    devices: int
    labels: dict[str, str]
    image: str
    port: int
    volume: dict[str, object] | None
    mount_path: str
    gpu_resource: str | None
    rdma_resource: str | None
    shm_size: str
    memory: str | None

    def resources(self, env: dict[str, str]) -> dict[str, str]:
        """Accelerators per pod (the plan's devices per node), RDMA where the plan expects it, CPU plans' bound
        cores; adds the NCCL check's variables to `env` on GPU plans."""
        out: dict[str, str] = {}
        if self.plan.kind == "gpu":
            vendor = "amd.com/gpu" if "HIP_VISIBLE_DEVICES" in env else "nvidia.com/gpu"
            out[self.gpu_resource or vendor] = str(self.devices)
            env.update(self.mn.nccl_check.env if self.mn.nccl_check else {})
        elif cores := cores_of(env.get(BIND, "")):
            out["cpu"] = str(len(cores))
        if self.rdma_resource and self.rdma:
            out[self.rdma_resource] = "1"
        if self.memory:
            out["memory"] = self.memory
        return out

    @property
    def rdma(self) -> bool:
        check = self.mn.nccl_check
        return bool(self.rdma_resource and check and RDMA_TRANSPORTS & set(check.look_for))

    def template(self, node: NodeCommand, command: list[str], *, leader: bool) -> dict[str, object]:
        """One PodTemplateSpec: the container running `command` with the node's environment and resources."""
        env = dict(node.env)
        resources = self.resources(env)
        mounts: list[dict[str, object]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
        volumes: list[dict[str, object]] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": self.shm_size}}]
        if self.volume is not None:
            mounts.append({"name": "model", "mountPath": self.mount_path, "readOnly": True})
            volumes.append({"name": "model", **copy.deepcopy(self.volume)})
        container: dict[str, object] = {
            "name": "vllm", "image": self.image, "imagePullPolicy": "IfNotPresent", "command": command,
            "env": [{"name": k, "value": v} for k, v in env.items()],
            "resources": {"requests": dict(resources), "limits": dict(resources)} if resources else {},
            "volumeMounts": mounts,
        }
        if self.rdma:  # verbs register (pin) memory, which needs the memory-lock capability
            container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
        if leader:
            container["ports"] = [{"name": "http", "containerPort": self.port, "protocol": "TCP"}]
            container["readinessProbe"] = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10,
                                           "failureThreshold": 3}
        labels = {**self.labels, COMPONENT: "leader" if leader else "worker"}
        return {"metadata": {"labels": labels}, "spec": {"containers": [container], "volumes": volumes}}


def render_lws(plan: Plan, *, name: str, image: str, model_uri: str, namespace: str | None = None, port: int = 8000,
               served_model_name: str | None = None, pvc: str | None = None, host_path: str | None = None,
               mount_path: str = "/models", gpu_resource: str | None = None, rdma_resource: str | None = "rdma/ib",
               shm_size: str = "16Gi", memory: str | None = None) -> list[dict[str, object]]:
    """[LeaderWorkerSet, Service] for a plan whose replicas span nodes (see the module's docstring).

    Raises SettingError for a plan whose replicas each fit one node, or whose worker nodes need different
    settings (nodes planned as process groups on one host, beyond two), and for names Kubernetes refuses.
    `rdma_resource`: the cluster's RDMA device-plugin resource, requested where the plan expects RDMA (None:
    never); `memory`: each pod's memory request and limit (None: none set)."""
    _check_inputs(name, namespace, image, model_uri, port, pvc, host_path, mount_path)
    reps = _multi_node_replicas(plan)
    rep = reps[0]
    mn = rep.multi_node
    assert mn is not None  # _multi_node_replicas keeps those only
    volume: dict[str, object] | None = None
    if pvc:
        volume = {"persistentVolumeClaim": {"claimName": pvc, "readOnly": True}}
    elif host_path:
        volume = {"hostPath": {"path": host_path, "type": "Directory"}}
    model = model_uri if volume is None or model_uri.startswith("/") else f"{mount_path.rstrip('/')}/{model_uri}"
    head, workers = mn.native[0], mn.native[1:]
    leader_argv = _node_argv(head, model) + ["--host", "0.0.0.0", "--port", str(port)]
    if served_model_name:
        leader_argv += ["--served-model-name", served_model_name]
    worker_argv = _worker_argv(workers[0], model)
    _check_workers(mn, worker_argv, model)
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/managed-by": "quantgate"}
    pods = _Pods(plan=plan, mn=mn, devices=len(rep.devices), labels=labels, image=image, port=port, volume=volume,
                 mount_path=mount_path, gpu_resource=gpu_resource, rdma_resource=rdma_resource, shm_size=shm_size,
                 memory=memory)

    def meta(obj_name: str) -> dict[str, object]:
        return {"name": obj_name, **({"namespace": namespace} if namespace else {}), "labels": dict(labels)}

    spec: LwsSpec = {
        "replicas": len(reps),
        # workers start with the leader: it is ready only once every node joined (LeaderReady would wait forever)
        "startupPolicy": "LeaderCreated",
        "leaderWorkerTemplate": {
            "size": len(mn.native),
            # a lost node hangs the whole replica: restart the group together
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": pods.template(head, _command(leader_argv), leader=True),
            "workerTemplate": pods.template(workers[0], _command(worker_argv), leader=False),
        },
    }
    lws: dict[str, object] = {
        "apiVersion": LWS_API, "kind": "LeaderWorkerSet",
        "metadata": {**meta(name), "annotations": {"quantgate/hardware": plan.hardware,
                                                   "quantgate/layout": plan.layout.label}},
        "spec": spec,
    }
    service: dict[str, object] = {
        "apiVersion": "v1", "kind": "Service", "metadata": meta(f"{name}-api"),
        "spec": {"type": "ClusterIP", "selector": {SET_LABEL: name, COMPONENT: "leader"},
                 "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]},
    }
    return [lws, service]


class _PlainDumper(yaml.SafeDumper):
    """SafeDumper that writes a repeated value out again instead of as a YAML alias (`&id001` / `*id001`)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def manifest_yaml(objects: list[dict[str, object]]) -> str:
    """The objects as one multi-document YAML text for `kubectl apply -f`."""
    head = ("# Rendered by `quantgate plan --lws`: a LeaderWorkerSet (needs the LWS controller in the cluster)\n"
            "# and the Service of its leaders' OpenAI API. See docs/kubernetes.md.\n")
    return head + yaml.dump_all(objects, Dumper=_PlainDumper, sort_keys=False, explicit_start=True, width=120)


def k8s_name(text: str) -> str:
    """A set name made of `text` (a model folder's name): lower case, runs of other characters as '-', starting
    with a letter, at most MAX_NAME characters; 'vllm' when nothing is left."""
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    s = re.sub(r"^[^a-z]+", "", s)[:MAX_NAME].rstrip("-")
    return s or "vllm"
