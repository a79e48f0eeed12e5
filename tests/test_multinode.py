"""Multi-node serving: the plan's per-node commands are what runs; local nodes are launched, watched and torn down
(real vLLM, slow); bad addresses and ports are refused with the node's name and nothing left running."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest
from typer.testing import CliRunner

from quantgate.base.errors import QuantgateError
from quantgate.cli.main import app, user_error
from quantgate.plan.build import build_plan
from quantgate.release import variants
from quantgate.serving.multinode import MultiNodeServer, master_of, multinode_config_from_plan, probe, set_flag
from quantgate.serving.server import free_port, port_is_free

MOE = Path(__file__).parent / "data" / "model_shapes" / "moe-671b-fp8.yaml"
ASK = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16, "temperature": 0}


@pytest.fixture
def demo_shape():
    """The demo model's shape without its weights (the plan needs only the shape)."""
    return Path(__file__).parent / "data" / "model_shapes" / "smollm2-135m-bf16.yaml"


def demo_plan(model, **kw):
    """The demo model as 2 nodes x 1 CPU worker each: PP=2 across the nodes (9 heads rule out TP=2)."""
    return build_plan(model, "x86-cpu", context=1024, concurrency=2, gpus=1, nodes=2, replicas=1,
                      nodes_share_host=True, master_addr="127.0.0.1", **kw)


def chat(srv) -> httpx.Response:
    return httpx.post(f"{srv.base_url}/chat/completions", json={"model": srv.config.name, **ASK}, timeout=300,
                      headers={"Authorization": f"Bearer {srv.api_key}"})


def node_pids(srv: MultiNodeServer) -> list[int]:
    out = []
    for proc in srv.procs.values():
        try:
            out += [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
        except psutil.NoSuchProcess:
            pass
    return out


def gone(pids: list[int]) -> bool:
    return not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


# --- pure: commands ---------------------------------------------------------------------------------------------

def test_flags_are_replaced_or_appended():
    argv = ["vllm", "serve", "m", "--master-port", "1", "--headless"]
    assert set_flag(argv, "--master-port", "2") == ["vllm", "serve", "m", "--master-port", "2", "--headless"]
    assert set_flag(argv, "--dtype", "float32")[-2:] == ["--dtype", "float32"]
    assert master_of(["--master-addr", "h", "--master-port", "9"]) == ("h", 9)
    assert master_of(["--data-parallel-address", "h", "--data-parallel-rpc-port", "7"]) == ("h", 7)


def test_local_config_runs_the_plans_node_commands(demo_shape):
    plan = build_plan(demo_shape, "x86-cpu", context=1024, concurrency=2, gpus=1, nodes=2, replicas=1, nodes_share_host=True)
    cfg = multinode_config_from_plan(plan, demo_shape, "m", dtype="float32", extra_args=["--seed", "1"], master_port=29999)
    planned = [n.commands[0] for n in plan.replica_plans[0].multi_node.native]
    head, worker = cfg.nodes
    assert (head.role, worker.role) == ("head", "worker") and "--headless" in worker.argv and "--headless" not in head.argv
    for node, argv in zip(cfg.nodes, planned):
        assert node.argv[2] == str(demo_shape)
        assert master_of(node.argv) == ("127.0.0.1", 29999)
        assert node.argv[node.argv.index("--node-rank") + 1] == str(node.rank)
        assert node.argv[-2:] == ["--seed", "1"]
        # apart from the local address/port, the dtype and the extra args, it is the planned line
        stripped = set_flag(set_flag(node.argv[:-2], "--master-addr", "x"), "--master-port", "y")
        assert stripped[3:] == set_flag(set_flag(argv, "--master-addr", "x"), "--master-port", "y")[3:]
    # one core per node on a shared host, as the working two-process run
    assert [n.env["VLLM_CPU_OMP_THREADS_BIND"] for n in cfg.nodes] == ["0", "1"]
    assert cfg.args and "--nnodes" not in cfg.args  # the shared engine flags: the cache key's part
    server = MultiNodeServer(cfg, log_dir=Path("/nonexistent"))
    assert server.command[-6:] == ["--host", "127.0.0.1", "--port", str(server.port), "--served-model-name", "m"]
    assert server.commands[1] == worker.argv  # workers run exactly their planned line


def test_single_node_plans_are_refused(demo_shape):
    plan = build_plan(demo_shape, "x86-cpu", context=1024, concurrency=2, replicas=1)
    with pytest.raises(QuantgateError, match="runs on one node"):
        multinode_config_from_plan(plan, demo_shape, "m")


def test_printed_moe_commands_are_what_the_manager_runs():
    """The reference's 2-node MoE example: `quantgate plan` prints per node an env and a `vllm serve` line; the
    manager, given the same plan, launches those very lines (the head adds only its API flags)."""
    out = CliRunner().invoke(app, ["plan", "--model", str(MOE), "--hardware", "h200", "--nodes", "2", "--context", "32768",
                                   "--concurrency", "128", "--master-addr", "10.0.0.1"], terminal_width=10_000)
    assert out.exit_code == 0, out.output
    printed = {}
    for line in out.output.splitlines():
        m = re.match(r"\s*\[native\] node (\d) \((head|worker)\): (.*)", line)
        if m:
            words = shlex.split(m.group(3))
            env = dict(w.split("=", 1) for w in words[: words.index("vllm")])
            printed[int(m.group(1))] = (env, words[words.index("vllm"):])
    plan = build_plan(MOE, "h200", nodes=2, context=32768, concurrency=128, master_addr="10.0.0.1")
    model = plan.replica_plans[0].multi_node.native[0].commands[0][2]
    cfg = multinode_config_from_plan(plan, model, "moe", master_addr="10.0.0.1", master_port=plan_port(plan))
    server = MultiNodeServer(cfg, log_dir=Path("/nonexistent"))
    assert sorted(printed) == [0, 1]
    for node, argv in zip(cfg.nodes, server.commands):
        env, line = printed[node.rank]
        assert env == node.env
        extra = argv[len(line):]
        assert argv[: len(line)] == line
        assert extra == ([] if node.role == "worker" else ["--host", "127.0.0.1", "--port", str(server.port), "--served-model-name", "moe"])
    assert "--data-parallel-address" in server.commands[1] and "--headless" in server.commands[1]


def plan_port(plan) -> int:
    return master_of(plan.replica_plans[0].multi_node.native[0].commands[0])[1]


# --- pre-flight and probes (no vLLM started) ------------------------------------------------------------------

def test_probe_tells_refused_from_listening():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert probe("127.0.0.1", s.getsockname()[1]) is None
    port = free_port()
    assert "nothing listens at 127.0.0.1:" in probe("127.0.0.1", port)


def _cfg(demo_shape, **kw):
    plan = build_plan(demo_shape, "x86-cpu", context=1024, concurrency=2, gpus=1, nodes=2, replicas=1, nodes_share_host=True)
    return multinode_config_from_plan(plan, demo_shape, "m", **kw)


def test_master_port_in_use_is_refused_naming_the_head(demo_shape, tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a node was started"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(QuantgateError) as err:
            MultiNodeServer(_cfg(demo_shape, master_port=port), log_dir=tmp_path).start()
    text = err.value.render()
    assert f"node 0 (head): master port {port} on 127.0.0.1 is in use by pid {os.getpid()}" in text
    assert err.value.where == "master_port" and user_error(err.value).where == "--master-port"  # spec / CLI terms


def test_master_address_of_another_host_is_refused(demo_shape, tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a node was started"))
    with pytest.raises(QuantgateError, match=r"node 0 \(head\): master address 192\.0\.2\.250 is not an address of this host"):
        MultiNodeServer(_cfg(demo_shape, master_addr="192.0.2.250", master_port=29999), log_dir=tmp_path).start()


def test_a_config_without_a_head_first_is_refused(demo_shape, tmp_path):
    cfg = _cfg(demo_shape)
    cfg.nodes.reverse()
    with pytest.raises(QuantgateError, match="exactly one head, listed first"):
        MultiNodeServer(cfg, log_dir=tmp_path)


# --- real vLLM: two node processes on this host ---------------------------------------------------------------
# The 2-node test puts the worker in its own network namespace behind a veth pair where this host permits it, so
# the ranks talk across a real interface (10.213.x.1 <-> .2); elsewhere both nodes use loopback. One start-up
# either way: CI time is spent once (the wrong-port test below runs on loopback).

def _netns(tag: str):
    """Create the worker's namespace and the veth pair; None (with why) where namespaces are not permitted."""
    if os.geteuid() != 0:
        return None, "network namespaces need root"
    ns, here, there = f"qg-{tag}", f"qgh{tag}", f"qgw{tag}"
    net = int(tag[:2], 16) % 250 + 1
    v = {"ns": ns, "head_if": here, "worker_if": there, "head_ip": f"10.213.{net}.1", "worker_ip": f"10.213.{net}.2"}
    steps = [["ip", "netns", "add", ns], ["ip", "link", "add", here, "type", "veth", "peer", "name", there],
             ["ip", "link", "set", there, "netns", ns], ["ip", "addr", "add", f"{v['head_ip']}/30", "dev", here],
             ["ip", "link", "set", here, "up"], ["ip", "-n", ns, "addr", "add", f"{v['worker_ip']}/30", "dev", there],
             ["ip", "-n", ns, "link", "set", there, "up"], ["ip", "-n", ns, "link", "set", "lo", "up"]]
    for step in steps:
        try:
            r = subprocess.run(step, capture_output=True, text=True)
        except OSError as exc:
            return v, f"{' '.join(step)}: {exc}"
        if r.returncode:
            return v, f"{' '.join(step)}: {r.stderr.strip()}"
    return v, None


@pytest.fixture
def transport():
    """('veth', details) with the worker in its own namespace, or ('loopback', None) where that is not permitted."""
    tag = uuid.uuid4().hex[:6]
    v, why = _netns(tag)
    try:
        if why is None:
            print(f"transport: veth pair {v['head_ip']} (head) <-> {v['worker_ip']} (worker, namespace {v['ns']})")
            yield "veth", v
        else:
            print(f"transport: loopback (network namespaces not permitted here: {why})")
            yield "loopback", None
    finally:
        if v is not None:
            subprocess.run(["ip", "link", "del", v["head_if"]], capture_output=True)
            subprocess.run(["ip", "netns", "del", v["ns"]], capture_output=True)


@pytest.mark.slow
def test_two_local_nodes_answer_and_a_killed_worker_is_reported(demo_model, tmp_path, transport):
    kind, v = transport
    addr = v["head_ip"] if v else "127.0.0.1"
    cfg = multinode_config_from_plan(demo_plan(demo_model), demo_model, "demo-2n", master_addr=addr)
    head, worker = cfg.nodes
    if v:  # each side names its own interface for gloo and for vLLM's messaging
        head.env |= {"GLOO_SOCKET_IFNAME": v["head_if"], "VLLM_HOST_IP": v["head_ip"]}
        worker.env |= {"GLOO_SOCKET_IFNAME": v["worker_if"], "VLLM_HOST_IP": v["worker_ip"]}
        worker.prefix = ["ip", "netns", "exec", v["ns"]]
        assert "connection refused" in probe(addr, 9, worker.prefix)  # the head's address answers from over there
    with MultiNodeServer(cfg, log_dir=tmp_path) as srv:
        assert all(srv.joined(n) for n in cfg.nodes)
        print(f"2-node start-up over {kind}: {srv.startup_s:.1f} s")
        resp = chat(srv)
        assert resp.status_code == 200, resp.text
        assert "Paris" in resp.json()["choices"][0]["message"]["content"]
        head_log = (tmp_path / "node0-head.log").read_text()
        worker_log = (tmp_path / "node1-worker.log").read_text()
        assert "world_size=2 rank=0" in head_log and "--node-rank 0" in head_log.splitlines()[0]
        assert "world_size=2 rank=1" in worker_log and f"tcp://{addr}:" in worker_log
        pids = node_pids(srv)
        os.killpg(srv.procs[1].pid, signal.SIGKILL)  # the worker's host goes away
        deadline = time.monotonic() + 60
        while srv.failure is None and time.monotonic() < deadline:
            time.sleep(0.5)
        with pytest.raises(QuantgateError) as err:
            srv.raise_if_dead()
        assert "node 1 (worker) exited with code -9 while serving; every other node was stopped" in err.value.render()
        assert "last lines of its log" in err.value.render()
        assert gone(pids), "the head was left running after its worker died"
        port = srv.port
    assert port_is_free("127.0.0.1", port)
    assert gone(pids)


@pytest.mark.slow
def test_a_worker_pointing_at_the_wrong_port_is_named_at_once(demo_model, tmp_path):
    cfg = multinode_config_from_plan(demo_plan(demo_model), demo_model, "demo-wrong", join_timeout_s=300)
    wrong = free_port()
    cfg.nodes[1].argv = set_flag(cfg.nodes[1].argv, "--master-port", str(wrong))
    srv = MultiNodeServer(cfg, log_dir=tmp_path)
    t = time.monotonic()
    with pytest.raises(QuantgateError) as err:
        srv.start()
    took = time.monotonic() - t
    text = err.value.render()
    assert f"node 1 (worker) did not join: nothing listens at 127.0.0.1:{wrong}" in text, text
    assert "cannot join the head" in text and "node 0 (head) did not join" not in text
    assert took < 200  # told once the head's store answers, not at join_timeout_s
    assert srv.procs == {} and port_is_free("127.0.0.1", srv.port)
    assert not [p for p in psutil.process_iter(["cmdline"]) if "demo-wrong" in " ".join(p.info["cmdline"] or [])]


# --- the release flow's serving step picks the multi-node manager for a multi-node plan --------------------------

def _spec(tmp_path, extra: str):
    from quantgate.spec.resolve import load_spec

    path = tmp_path / "spec.yaml"
    path.write_text("version: 1\nname: mn\nmodel: demo\nhardware: x86-cpu\ncontext: 1024\nconcurrency: 2\n"
                    "schemes: [w4a16-gptq]\ngpus: 1\nnodes: 2\nrecall: null\n" + extra)
    return load_spec(path)


def test_release_serves_a_multi_node_plan_with_the_multi_node_manager(tmp_path, demo_shape):
    from quantgate.release import cachelayout

    variant = variants.Variant(name="baseline", path=demo_shape, content_hash="x", size_bytes=1)
    spec = _spec(tmp_path, "serving: {local_nodes: true, join_timeout_s: 42, replicas: 1}\n")
    cfg = variants.server_config(spec, variant, tmp_path / "baseline")
    server = variants.make_server(cfg, tmp_path / "baseline")
    served = getattr(server, "_server", server)  # release.variants may wrap it (WatchedServer)
    assert isinstance(served, MultiNodeServer) and cfg.join_timeout_s == 42
    assert [n.role for n in cfg.nodes] == ["head", "worker"]
    assert all(master_of(n.argv)[0] == "127.0.0.1" for n in cfg.nodes)
    assert (tmp_path / "baseline" / "plan.json").is_file()
    # the cache key of the variant's results sees the engine flags, not the per-run master port
    again = variants.server_config(spec, variant, tmp_path / "baseline")
    assert cachelayout.cache_key(variant, cfg, "v") == cachelayout.cache_key(variant, again, "v")


def test_a_variants_plan_is_made_once_and_written_only_where_it_is_served(tmp_path, demo_shape, monkeypatch):
    """The cache-key look-ups before a variant runs (folder None) write no plan.json; the planner runs once per spec
    and variant, however often the release asks."""
    from quantgate.release import cachelayout

    built = []
    real = variants.build_plan
    monkeypatch.setattr(variants, "build_plan", lambda *a, **k: built.append(a) or real(*a, **k))  # counts real calls
    variant = variants.Variant(name="baseline", path=demo_shape, content_hash="x", size_bytes=1)
    spec = _spec(tmp_path, "serving: {local_nodes: true, join_timeout_s: 43, replicas: 1}\n")
    looked_up = variants.server_config(spec, variant, None)
    assert not (tmp_path / "baseline").exists()
    served = variants.server_config(spec, variant, tmp_path / "baseline")
    assert (tmp_path / "baseline" / "plan.json").is_file() and len(built) == 1
    assert cachelayout.cache_key(variant, looked_up, "v") == cachelayout.cache_key(variant, served, "v")
    other = _spec(tmp_path, "serving: {local_nodes: true, join_timeout_s: 44, replicas: 1}\n")
    variants.server_config(other, variant, None)
    assert len(built) == 2  # another spec: planned anew


def test_release_refuses_remote_nodes_it_cannot_launch(tmp_path, demo_shape):
    from quantgate.release import steps as rel
    from quantgate.base.errors import ConfigError

    variant = variants.Variant(name="baseline", path=demo_shape, content_hash="x", size_bytes=1)
    with pytest.raises(ConfigError) as err:
        variants.server_config(_spec(tmp_path, "serving: {replicas: 1}\n"), variant, tmp_path / "baseline")
    assert "serving.local_nodes" in err.value.render() and "quantgate plan" in err.value.render()
