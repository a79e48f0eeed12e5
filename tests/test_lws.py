"""The LeaderWorkerSet manifest of a multi-node plan (quantgate.plan.lws, `quantgate plan --lws`), checked statically:
every rendered object validates against the published schemas vendored in tests/data/k8s-schemas (core Kubernetes
1.37 strict JSON schemas for Service, PodTemplateSpec and ObjectMeta; the LWS v0.10.0 CRD's openAPIV3Schema, with
unknown fields refused as `kubectl apply`'s strict field validation does), and the pods' commands are the plan's
per-node lines once the kubelet and the LWS controller have filled in the leader's address and the worker index."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft202012Validator

from quantgate.base.errors import SettingError
from quantgate.plan.build import build_plan
from quantgate.plan.lws import LEADER_ADDRESS, VLLM_IMAGE, WORKER_INDEX, manifest_yaml, render_lws

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data"
SCHEMAS = DATA / "k8s-schemas"
DEMO = DATA / "model_configs" / "smollm2-135m.json"  # the demo checkpoint's config.json
M70B = DATA / "model_shapes" / "dense-70b-fp8.yaml"
MOE = DATA / "model_shapes" / "moe-671b-fp8.yaml"
ADDR = "demo-0.demo.default"  # what LWS_LEADER_ADDRESS holds in group 0 of a set named demo


def bench_two_node_plan(model: Path = DEMO):
    """The 2-node plan of bench/multinode.py, built by the same call (the bench passes the demo checkpoint folder;
    its config.json gives the same layout: PP=2 over two one-core CPU nodes)."""
    return build_plan(model, "x86-cpu", context=1024, concurrency=4, gpus=1, nodes=2, replicas=1,
                      nodes_share_host=True, master_addr="127.0.0.1")


# ---- the schemas ---------------------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def _core() -> dict[str, Any]:
    return json.loads((SCHEMAS / "k8s-v1.37.0-strict.json").read_text())


def _core_validator(name: str) -> Draft202012Validator:
    """A validator for one of the vendored core schemas (service-v1, podtemplatespec-v1 or a definition)."""
    return Draft202012Validator({"$defs": _core()["$defs"], "$ref": f"#/$defs/{name}"})


def _closed(schema: Any) -> Any:
    """The CRD schema with unknown fields refused wherever it lists an object's fields, as the API server's strict
    field validation does (kubectl apply's default); objects that keep unknown fields stay open."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: ({n: _closed(s) for n, s in v.items()} if k == "properties" else _closed(v)) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@lru_cache(maxsize=1)
def _lws_validator() -> Draft202012Validator:
    return Draft202012Validator(_closed(json.loads((SCHEMAS / "lws-v0.10.0-openapiv3.json").read_text())))


def problems(obj: dict[str, Any]) -> list[str]:
    """Every schema error of one rendered object, as 'path: message'."""
    checks: list[tuple[str, Draft202012Validator, Any]] = []
    if obj.get("kind") == "Service":
        checks.append(("", _core_validator("service-v1"), obj))
    elif obj.get("kind") == "LeaderWorkerSet":
        checks.append(("", _lws_validator(), obj))
        # the CRD leaves metadata and the pod templates' insides to the core schemas: check them there, strictly
        checks.append(("metadata", _core_validator("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"), obj["metadata"]))
        tpl = obj["spec"]["leaderWorkerTemplate"]
        for key in ("leaderTemplate", "workerTemplate"):
            if key in tpl:
                checks.append((f"spec.leaderWorkerTemplate.{key}", _core_validator("podtemplatespec-v1"), tpl[key]))
    else:
        return [f"no schema here for kind {obj.get('kind')!r}"]
    return [f"{where}{'.' if where and e.path else ''}{'.'.join(map(str, e.path))}: {e.message}"
            for where, validator, doc in checks for e in validator.iter_errors(doc)]


def _containers(lws: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    tpl = lws["spec"]["leaderWorkerTemplate"]
    return tpl["leaderTemplate"]["spec"]["containers"][0], tpl["workerTemplate"]["spec"]["containers"][0]


# ---- what the kubelet does with a command, and a stand-in vllm ---------------------------------------------

def kubelet_expand(word: str, env: dict[str, str]) -> str:
    """The kubelet's expansion of a command word: `$(NAME)` -> the container's variable NAME (left as written when
    there is none), `$$` -> `$`, any other `$` kept."""
    out, i = [], 0
    while i < len(word):
        if word[i] != "$" or i + 1 == len(word):
            out.append(word[i])
            i += 1
        elif word[i + 1] == "$":
            out.append("$")
            i += 2
        elif word[i + 1] == "(" and (end := word.find(")", i + 2)) != -1:
            name = word[i + 2:end]
            out.append(env.get(name, word[i:end + 1]))
            i = end + 1
        else:
            out.append(word[i:i + 2])
            i += 2
    return "".join(out)


def run_in_pod(command: list[str], env: dict[str, str], tmp_path: Path) -> list[str]:
    """The argv that `vllm` receives when the pod's command runs (after the kubelet's expansion): a stand-in vllm
    on PATH prints its arguments NUL-separated."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "vllm"
    fake.write_text("#!/bin/sh\nprintf '%s\\0' vllm \"$@\"\n")
    fake.chmod(0o755)
    argv = [kubelet_expand(w, env) for w in command]
    out = subprocess.run(argv, capture_output=True, cwd=tmp_path, timeout=30, check=True,
                         env={"PATH": f"{bin_dir}:{os.environ['PATH']}", **env})
    return out.stdout.decode().split("\0")[:-1]


def planned(plan, rank: int, model: str) -> list[str]:
    """Node `rank`'s planned `vllm serve` line with the pods' model and the leader's LWS address."""
    argv = list(plan.replica_plans[0].multi_node.native[rank].commands[-1])
    argv[2] = model
    for flag in ("--master-addr", "--data-parallel-address"):
        if flag in argv:
            argv[argv.index(flag) + 1] = ADDR
    return argv


# ---- the bench's 2-node plan -----------------------------------------------------------------------------------

def test_the_bench_two_node_plan_renders_and_validates_against_lws_and_core_schemas():
    p = bench_two_node_plan()
    assert (p.layout.tp, p.layout.pp, p.replicas) == (1, 2, 1)
    objects = render_lws(p, name="demo", image=VLLM_IMAGE, model_uri="demo", pvc="models")
    assert [(o["apiVersion"], o["kind"]) for o in objects] == [("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
                                                                 ("v1", "Service")]
    for obj in objects:
        assert problems(obj) == [], obj["kind"]
    assert list(yaml.safe_load_all(manifest_yaml(objects))) == objects  # the file holds exactly these objects
    lws, svc = objects
    assert lws["spec"]["replicas"] == 1 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert svc["metadata"]["name"] == "demo-api"  # LWS itself makes a headless Service named like the set
    assert svc["spec"]["selector"] == {"leaderworkerset.sigs.k8s.io/name": "demo",
                                       "app.kubernetes.io/component": "leader"}
    assert lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"]["app.kubernetes.io/component"] \
        == "leader"


def test_leader_is_node_rank_0_and_workers_are_headless_with_their_lws_index(tmp_path):
    p = bench_two_node_plan()
    lws, _ = render_lws(p, name="demo", image=VLLM_IMAGE, model_uri="demo", pvc="models")
    leader, worker = _containers(lws)
    lc, wc = leader["command"], worker["command"]
    assert lc[lc.index("--node-rank") + 1] == "0" and "--headless" not in lc
    assert wc[wc.index("--node-rank") + 1] == f"$({WORKER_INDEX})" and "--headless" in wc
    assert lc[lc.index("--master-addr") + 1] == wc[wc.index("--master-addr") + 1] == f"$({LEADER_ADDRESS})"
    # run as the pods would: the plan's own lines, the leader serving the API on the Service's port
    got = run_in_pod(lc, {LEADER_ADDRESS: ADDR, WORKER_INDEX: "0"}, tmp_path)
    assert got == planned(p, 0, "/models/demo") + ["--host", "0.0.0.0", "--port", "8000"]
    assert run_in_pod(wc, {LEADER_ADDRESS: ADDR, WORKER_INDEX: "1"}, tmp_path) == planned(p, 1, "/models/demo")
    assert leader["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert leader["ports"][0]["containerPort"] == 8000 and "readinessProbe" not in worker
    envs = [{e["name"]: e["value"] for e in c["env"]} for c in (leader, worker)]
    assert envs == [n.env for n in p.replica_plans[0].multi_node.native]
    for c in (leader, worker):  # CPU plan: the bound cores, no accelerator, no RDMA
        assert c["resources"]["requests"] == c["resources"]["limits"] == {"cpu": "1"}
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    volumes = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["volumes"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in volumes
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in volumes


# ---- GPU plans: accelerators, RDMA, data parallel --------------------------------------------------------------

def test_gpu_requests_equal_devices_per_node_and_rdma_where_the_plan_expects_infiniband():
    p = build_plan(M70B, "h100", nodes=2, context=20000, concurrency=20, replicas=1)
    lws, svc = render_lws(p, name="llama-70b", image=VLLM_IMAGE, model_uri="meta-llama/Llama-3.1-70B", namespace="llm")
    assert problems(lws) == [] and problems(svc) == []
    assert "NET/IB" in p.replica_plans[0].multi_node.nccl_check.look_for
    per_node = len(p.replica_plans[0].devices)
    assert per_node == 8
    for c in _containers(lws):
        assert c["resources"]["limits"] == c["resources"]["requests"] == {"nvidia.com/gpu": "8", "rdma/ib": "1"}
        assert c["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
        assert {"name": "NCCL_DEBUG", "value": "INFO"} in c["env"]
        assert c["command"][2] == "meta-llama/Llama-3.1-70B"  # no volume: vLLM fetches the id itself
    assert lws["metadata"]["namespace"] == svc["metadata"]["namespace"] == "llm"
    lws, _ = render_lws(p, name="llama-70b", image=VLLM_IMAGE, model_uri="m", rdma_resource=None,
                        gpu_resource="nvidia.com/h100")
    assert _containers(lws)[0]["resources"]["limits"] == {"nvidia.com/h100": "8"}
    assert "securityContext" not in _containers(lws)[0]


@pytest.mark.parametrize("nodes, replicas", [(2, None), (4, 2)])
def test_data_parallel_workers_get_their_start_rank_from_the_lws_index(tmp_path, nodes, replicas):
    p = build_plan(MOE, "h200", nodes=nodes, context=32768, concurrency=128, replicas=replicas)
    assert p.layout.dp == 16
    lws, svc = render_lws(p, name="moe", image=VLLM_IMAGE, model_uri="ds", host_path="/data/models")
    assert problems(lws) == [] and problems(svc) == []
    assert lws["spec"]["replicas"] == p.replicas == (replicas or 1)
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    leader, worker = _containers(lws)
    assert worker["command"][:2] == ["sh", "-c"]  # the start rank is the index times 8: shell arithmetic
    assert run_in_pod(leader["command"], {LEADER_ADDRESS: ADDR, WORKER_INDEX: "0"}, tmp_path) \
        == planned(p, 0, "/models/ds") + ["--host", "0.0.0.0", "--port", "8000"]
    got = run_in_pod(worker["command"], {LEADER_ADDRESS: ADDR, WORKER_INDEX: "1"}, tmp_path)
    assert got == planned(p, 1, "/models/ds")
    assert got[got.index("--data-parallel-start-rank") + 1] == "8" and "--headless" in got
    volumes = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["volumes"]
    assert {"name": "model", "hostPath": {"path": "/data/models", "type": "Directory"}} in volumes


def test_words_of_the_plan_stay_literal_in_the_pods(tmp_path):
    """A `$(...)` or `$NAME` in the model's name is text: neither the kubelet nor the worker's shell expands it."""
    hostile = "/m/$(LWS_GROUP_SIZE) $(touch pwned) `touch pwned2` it's $HOME"
    for model, hw, kw in ((DEMO, "x86-cpu", {}), (MOE, "h200", {})):
        p = (bench_two_node_plan() if hw == "x86-cpu"
             else build_plan(model, hw, nodes=2, context=32768, concurrency=128, **kw))
        lws, _ = render_lws(p, name="x", image=VLLM_IMAGE, model_uri=hostile)
        env = {LEADER_ADDRESS: ADDR, WORKER_INDEX: "1", "LWS_GROUP_SIZE": "2", "HOME": "/root"}
        for c, rank in zip(_containers(lws), (0, 1)):
            assert run_in_pod(c["command"], env, tmp_path)[:len(planned(p, rank, hostile))] == planned(p, rank, hostile)
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()


# ---- the schemas bite, and refusals ---------------------------------------------------------------------------

def test_the_schemas_catch_what_kubectl_would_refuse():
    lws, svc = render_lws(bench_two_node_plan(), name="demo", image=VLLM_IMAGE, model_uri="demo")
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["size"] = "2"
    bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    bad["spec"]["replica"] = 1
    _containers(bad)[1]["comand"] = ["x"]
    _containers(bad)[0]["resources"]["limits"]["cpu"] = {"cores": 1}
    found = "\n".join(problems(bad))
    for what in ("'2' is not of type 'integer'", "'Always' is not one of", "'replica' was unexpected",
                 "workerTemplate.spec.containers.0: Additional properties are not allowed ('comand'",
                 "leaderTemplate.spec.containers.0.resources.limits.cpu"):
        assert what in found, found
    bad_svc = copy.deepcopy(svc)
    bad_svc["spec"]["ports"][0]["port"] = "http"
    bad_svc["spec"]["type"] = 3
    assert len(problems(bad_svc)) == 2


def test_a_plan_whose_replicas_fit_one_node_is_refused():
    for p in (build_plan(DEMO, "x86-cpu", context=1024, concurrency=4, replicas=1),
              build_plan(DEMO, "x86-cpu", context=1024, concurrency=4, gpus=1, nodes=2)):  # a replica per node
        assert all(r.multi_node is None for r in p.replica_plans)
        with pytest.raises(SettingError, match="span nodes") as exc:
            render_lws(p, name="demo", image=VLLM_IMAGE, model_uri="demo")
        assert exc.value.setting == "nodes" and "--nodes 2" in (exc.value.fix or "")


def test_workers_that_need_different_settings_are_refused():
    """Four nodes planned as process groups on one host bind different cores: one worker template cannot."""
    p = build_plan(DEMO, "x86-cpu", context=1024, concurrency=4, gpus=1, nodes=4, replicas=1, nodes_share_host=True,
                   master_addr="127.0.0.1")
    with pytest.raises(SettingError, match="VLLM_CPU_OMP_THREADS_BIND"):
        render_lws(p, name="demo", image=VLLM_IMAGE, model_uri="demo")
    p = build_plan(DEMO, "x86-cpu", context=1024, concurrency=4, gpus=1, nodes=4, replicas=1)
    lws, _ = render_lws(p, name="demo", image=VLLM_IMAGE, model_uri="demo")  # separate hosts: one template
    assert problems(lws) == [] and lws["spec"]["leaderWorkerTemplate"]["size"] == 4


@pytest.mark.parametrize("kw, setting", [
    ({"name": "Demo_1"}, "lws_name"), ({"name": "x" * 41}, "lws_name"), ({"namespace": "A"}, "namespace"),
    ({"image": " "}, "image"), ({"model_uri": ""}, "model_uri"), ({"port": 0}, "port"),
    ({"pvc": "models", "host_path": "/m"}, "model_pvc / model_host_path"),
])
def test_bad_settings_name_themselves(kw, setting):
    args = {"name": "demo", "image": VLLM_IMAGE, "model_uri": "demo", **kw}
    with pytest.raises(SettingError) as exc:
        render_lws(bench_two_node_plan(), **args)
    assert exc.value.setting == setting


# ---- the command line -----------------------------------------------------------------------------------------

def _cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    from quantgate.cli import main as cli

    monkeypatch.setattr(sys, "argv", ["quantgate", "plan", *args])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    out = capsys.readouterr()
    return exc.value.code or 0, out.out, out.err


BENCH_ARGS = ("--model", str(DEMO), "--hardware", "x86-cpu", "--context", "1024", "--concurrency", "4", "--gpus", "1",
              "--nodes", "2", "--replicas", "1", "--nodes-share-host", "--master-addr", "127.0.0.1")


def test_cli_writes_the_manifest(tmp_path, monkeypatch, capsys):
    out = tmp_path / "k8s" / "demo.yaml"
    code, stdout, err = _cli(monkeypatch, capsys, *BENCH_ARGS, "--json", "--lws", str(out), "--model-pvc", "models",
                             "--lws-name", "demo")
    assert code == 0, err
    assert json.loads(stdout)["replicas"] == 1  # --json output stays JSON: the notes go to stderr
    assert "kubectl apply -f" in err and "CUDA build" in err
    objects = list(yaml.safe_load_all(out.read_text()))
    assert [o["kind"] for o in objects] == ["LeaderWorkerSet", "Service"]
    assert all(problems(o) == [] for o in objects)
    leader, _ = _containers(objects[0])
    assert leader["image"] == VLLM_IMAGE and leader["command"][2] == "/models/smollm2-135m.json"


def test_cli_refuses_a_single_node_plan_and_a_model_the_pods_cannot_reach(tmp_path, monkeypatch, capsys):
    out = tmp_path / "x.yaml"
    code, _, err = _cli(monkeypatch, capsys, "--model", str(DEMO), "--hardware", "x86-cpu", "--context", "1024",
                        "--concurrency", "4", "--lws", str(out), "--model-uri", "demo")
    assert code == 2 and "--nodes:" in err and "span nodes" in err and "fix:" in err and not out.exists()
    code, _, err = _cli(monkeypatch, capsys, *BENCH_ARGS, "--lws", str(out))
    assert code == 2 and "--model-uri:" in err and not out.exists()
    code, _, err = _cli(monkeypatch, capsys, *BENCH_ARGS, "--lws", str(out), "--model-uri", "demo", "--lws-name", "A")
    assert code == 2 and "--lws-name:" in err


def test_the_default_image_is_the_serve_environments_vllm():
    pin = re.search(r"^vllm==(\S+)$", (REPO / "requirements" / "serve-gpu.in").read_text(), re.M)
    assert pin and VLLM_IMAGE == f"vllm/vllm-openai:v{pin.group(1)}"
