"""Parallelism planner: the reference's worked cases, CPU specifics, multi-node commands, and bad input."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from quantgate.base.errors import ConfigError, QuantgateError
from quantgate.cli.main import user_error
from quantgate.plan.build import build_plan, load_planner_policy
from quantgate.plan.planner import PlanRequest, plan
from quantgate.target.hardware import HardwareProfile, get_profile
from quantgate.target.modelshape import load_model_spec

DATA = Path(__file__).parent / "data"
M8B = DATA / "model_shapes" / "dense-8b-fp8.yaml"
M70B = DATA / "model_shapes" / "dense-70b-fp8.yaml"
MOE = DATA / "model_shapes" / "moe-671b-fp8.yaml"
DEMO = DATA / "model_configs" / "smollm2-135m.json"
GIB = 1024**3


def run(model: Path, hw: str, **kw):
    return build_plan(model, hw, **kw)


def rejected(p, label: str):
    return next(d for d in p.decisions if d.topic == "layout" and not d.accepted and d.choice == label)


# ---- the reference's worked cases ------------------------------------------------------------------------

CASES = [
    # (id, model, hardware, options, tp, pp, dp, replicas)
    ("A: 8B FP8, 4 x L40S PCIe, 8k x 20", M8B, "l40s", dict(gpus=4, context=8192, concurrency=20), 1, 1, 1, 4),
    ("B: 70B FP8, 8 x H100, RAG 20k x 20, FP8 KV", M70B, "h100",
     dict(context=20000, concurrency=20, kv_dtype="fp8"), 2, 1, 1, 4),
    ("C: 671B MoE FP8, 2 x 8 x H200, 32k x 128", MOE, "h200", dict(nodes=2, context=32768, concurrency=128), 1, 1, 16, 1),
    ("6 GPUs, 32 heads, one replica", M8B, "h100", dict(gpus=6, context=8192, concurrency=20, replicas=1), 1, 6, 1, 1),
    ("demo, 9 heads, one replica on 2 CPU workers", DEMO, "x86-cpu", dict(context=4096, concurrency=8, replicas=1), 1, 2, 1, 1),
    ("demo, free to replicate", DEMO, "x86-cpu", dict(context=4096, concurrency=8), 1, 1, 1, 2),
]


@pytest.mark.parametrize("name,model,hw,opts,tp,pp,dp,replicas", CASES, ids=[c[0] for c in CASES])
def test_reference_cases(name, model, hw, opts, tp, pp, dp, replicas):
    p = run(model, hw, **opts)
    assert (p.layout.tp, p.layout.pp, p.layout.dp, p.replicas) == (tp, pp, dp, replicas)
    a = p.vllm_args
    assert a["--tensor-parallel-size"] == tp and a["--pipeline-parallel-size"] == pp
    assert a.get("--data-parallel-size", 1) == dp
    assert a["--max-model-len"] == opts["context"]
    assert p.capacity.fits and p.capacity.concurrency_per_replica >= opts["concurrency"]
    assert len(p.replica_plans) == replicas
    # every accepted layout decision carries the numbers it was decided on
    chosen = [d for d in p.decisions if d.topic == "layout" and d.accepted]
    assert len(chosen) == 1 and chosen[0].numbers["concurrency_per_replica"] >= opts["concurrency"]


def test_case_a_replicas_get_one_gpu_each_and_pcie_is_named():
    p = run(M8B, "l40s", gpus=4, context=8192, concurrency=20)
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in p.replica_plans] == ["0", "1", "2", "3"]
    assert any(d.topic == "interconnect" and "pcie" in d.reason for d in p.decisions)
    assert p.vllm_args["--gpu-memory-utilization"] == load_planner_policy().gpu_memory_utilization


def test_case_b_tp1_rejected_with_about_5_gb_for_kv():
    p = run(M70B, "h100", context=20000, concurrency=20, kv_dtype="fp8")
    d = rejected(p, "TP=1")
    # independent arithmetic: 79.6 GiB x 0.9 - 70e9 bytes - 2 GiB reserve
    expect_gib = 79.6 * 0.9 - 70e9 / GIB - load_planner_policy().reserve_gib["gpu"]
    assert d.numbers["kv_pool_gib_per_device"] == pytest.approx(expect_gib, abs=0.01)
    assert 3.5 < d.numbers["kv_pool_gb_per_device"] < 6.5  # the reference's "about 5 GB"
    assert f"{d.numbers['kv_pool_gb_per_device']:.2f} GB" in d.reason
    assert d.numbers["concurrency_per_replica"] < 20
    # TP=2 holds ~24 requests of 20k tokens with FP8 KV (reference: ~25)
    assert 20 <= p.capacity.concurrency_per_replica < 30
    assert p.vllm_args["--kv-cache-dtype"] == "fp8"


def test_case_b_without_fp8_kv_needs_more_tp():
    """BF16 KV doubles the bytes per token, so TP=2 no longer holds 20 x 20k and the planner goes to TP=4."""
    p = run(M70B, "h100", context=20000, concurrency=20, kv_dtype="auto")
    assert (p.layout.tp, p.replicas) == (4, 2)
    assert rejected(p, "TP=2").numbers["concurrency_per_replica"] < 20


def test_case_c_moe_dp16_ep_with_per_node_commands():
    p = run(MOE, "h200", nodes=2, context=32768, concurrency=128, master_addr="10.0.0.1")
    assert p.vllm_args["--enable-expert-parallel"] is True and p.layout.ep
    assert rejected(p, "DP=8+EP, TP=1").numbers["concurrency_per_replica"] < 128
    mn = p.replica_plans[0].multi_node
    assert mn is not None and mn.nodes == 2
    head, worker = (n.commands[0] for n in mn.native)
    assert "--headless" not in head and "--headless" in worker
    assert worker[worker.index("--data-parallel-start-rank") + 1] == "8"
    for argv in (head, worker):
        assert argv[argv.index("--data-parallel-size") + 1] == "16"
        assert argv[argv.index("--data-parallel-size-local") + 1] == "8"
        assert argv[argv.index("--data-parallel-address") + 1] == "10.0.0.1"
        assert "--enable-expert-parallel" in argv
    assert [n.env["CUDA_VISIBLE_DEVICES"] for n in mn.native] == ["0,1,2,3,4,5,6,7"] * 2
    ray_head = mn.ray[0].commands
    assert ray_head[0][:3] == ["ray", "start", "--head"] and "--data-parallel-backend" in ray_head[1]
    assert mn.ray[1].commands[0][2].startswith("--address=10.0.0.1:")
    assert "NET/IB" in mn.nccl_check.look_for and mn.nccl_check.env == {"NCCL_DEBUG": "INFO"}


def test_case_c_light_load_gives_one_replica_per_node():
    p = run(MOE, "h200", nodes=2, context=32768, concurrency=32)
    assert (p.layout.dp, p.replicas) == (8, 2)
    assert [r.nodes for r in p.replica_plans] == [[0], [1]]
    assert all(r.multi_node is None for r in p.replica_plans)


def test_case_c_mla_kv_is_the_latent_not_per_head():
    p = run(MOE, "h200", nodes=2, context=32768, concurrency=128)
    assert p.capacity.kv_bytes_per_token == 61 * (512 + 64) * 2


def test_six_gpus_reject_tp6_because_of_heads_and_eight_take_tp8():
    p = run(M8B, "h100", gpus=6, context=8192, concurrency=20, replicas=1)
    assert any("TP=6 cannot divide 32 attention heads" in d.reason for d in p.decisions)
    assert run(M8B, "h100", gpus=8, context=8192, concurrency=20, replicas=1).layout.tp == 8


def test_pcie_replica_spanning_two_devices_uses_pp():
    p = run(M8B, "l40s", gpus=2, context=8192, concurrency=20, replicas=1)
    assert (p.layout.tp, p.layout.pp) == (1, 2)
    assert any("no fast link" in d.reason for d in p.decisions)


# ---- CPU (docs/design.md, "Measured facts") -----------------------------------------------------------------------------------

def test_demo_pp2_on_cpu_env_and_args():
    p = run(DEMO, "x86-cpu", context=4096, concurrency=8, replicas=1)
    assert any("TP=2 cannot divide 9 attention heads" in d.reason for d in p.decisions)
    a, env = p.vllm_args, p.replica_plans[0].env
    assert a["--distributed-executor-backend"] == "mp" and "--enforce-eager" not in a
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    # KV space: 8 x 4096 tokens x (2 x 15 layers x 3 x 64 x 4 bytes, FP32) per worker -> 0.7 GiB -> 1 GiB
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and a["--dtype"] == "float32"
    assert p.capacity.kv_pool_gib_per_device == 1.0


def test_demo_replicas_bind_one_core_each_and_run_eager():
    p = run(DEMO, "x86-cpu", context=4096, concurrency=8)
    assert [r.env["VLLM_CPU_OMP_THREADS_BIND"] for r in p.replica_plans] == ["0", "1"]
    assert p.vllm_args["--enforce-eager"] is True and "--distributed-executor-backend" not in p.vllm_args


def test_cpu_kv_space_grows_with_the_workload_and_cores_per_worker_bind_groups():
    p = run(DEMO, "x86-cpu", context=8192, concurrency=32, replicas=1, cpu_cores_per_worker=4)
    need = 32 * 8192 * (2 * 15 * 3 * 64 * 4) / GIB
    assert int(p.replica_plans[0].env["VLLM_CPU_KVCACHE_SPACE"]) == -(-need // 1)
    assert p.replica_plans[0].env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3|4-7"


def test_cpu_two_nodes_native_only_with_disjoint_cores_on_one_host():
    p = run(DEMO, "x86-cpu", gpus=1, nodes=2, context=2048, concurrency=4, replicas=1,
            nodes_share_host=True, master_addr="127.0.0.1")
    mn = p.replica_plans[0].multi_node
    assert (p.layout.tp, p.layout.pp) == (1, 2) and mn.ray is None and mn.nccl_check is None
    assert [n.env["VLLM_CPU_OMP_THREADS_BIND"] for n in mn.native] == ["0", "1"]
    head, worker = (n.commands[0] for n in mn.native)
    assert head[head.index("--node-rank") + 1] == "0" and worker[worker.index("--node-rank") + 1] == "1"
    assert "--headless" in worker and worker[worker.index("--master-addr") + 1] == "127.0.0.1"


def test_dense_two_nodes_tp_inside_pp_across():
    p = run(M70B, "h100", nodes=2, context=20000, concurrency=20, replicas=1)
    assert (p.layout.tp, p.layout.pp) == (8, 2)
    mn = p.replica_plans[0].multi_node
    assert [c.commands[0][c.commands[0].index("--nnodes") + 1] for c in mn.native] == ["2", "2"]
    assert mn.ray[0].commands[1][-2:] == ["--distributed-executor-backend", "ray"]


# ---- bad input -------------------------------------------------------------------------------------------

def test_unknown_hardware():
    with pytest.raises(ConfigError, match="unknown hardware 'h900'"):
        run(M8B, "h900", context=8192, concurrency=1)


def test_model_too_big_says_by_how_much():
    # one RTX 4090: 23.6 GiB x 0.9 - 70e9 B - 2 GiB reserve, plus one 4096-token request of BF16 KV
    pool = 23.6 * 0.9 - 70e9 / GIB - 2.0
    need = 4096 * (2 * 80 * 8 * 128 * 2) / GIB
    with pytest.raises(QuantgateError, match="even at maximum parallelism") as exc:
        run(M70B, "rtx4090", context=4096, concurrency=1)
    short = float(re.search(r"short by (-?[\d.]+) GiB", str(exc.value)).group(1))
    assert short == pytest.approx(need - pool, abs=0.06)


def test_replicas_that_cannot_fit_name_the_setting():
    with pytest.raises(QuantgateError, match="with serving.replicas 8") as exc:
        run(M70B, "h100", context=20000, concurrency=20, kv_dtype="fp8", replicas=8)
    assert "fewer replicas" in str(exc.value)


def test_heads_no_layout_divides():
    # 32 CPU workers for a 9-head, 30-layer model: TP cannot divide 9 heads, PP=32 exceeds 30 layers
    with pytest.raises(ConfigError, match="no allowed layout"):
        run(DEMO, "x86-cpu", nodes=16, context=2048, concurrency=1, replicas=1)


@pytest.mark.parametrize("opts,field", [
    (dict(kv_dtype="fp8"), "--kv-cache-dtype"),      # A100 has no FP8 KV in its profile
    (dict(context=10**6), "--context"),
    (dict(gpus=16), "--gpus"),
    (dict(gpus=4, replicas=3), "--replicas"),
])
def test_bad_options(opts, field):
    kw = dict(context=4096, concurrency=1) | opts
    with pytest.raises(ConfigError) as exc:
        run(M8B, "a100", **kw)
    assert user_error(exc.value).where == field and exc.value.fix  # the flag, as `quantgate plan` shows it


def test_planner_with_a_profile_built_in_the_test():
    """The planner takes any HardwareProfile: a 2-device NVLink box with 38 GiB each."""
    hw = HardwareProfile(id="box", name="box", vendor="nvidia", arch="hopper", kind="gpu", memory_gib=38,
                         devices_per_node=2, interconnect="nvlink", schemes=[], kv_cache_dtypes=["auto"])
    req = PlanRequest(model=load_model_spec(M70B), hardware=hw, context=2048, concurrency=1)
    with pytest.raises(QuantgateError, match="short by"):
        plan(req, load_planner_policy())
    hw2 = hw.model_copy(update={"memory_gib": 60.0})
    p = plan(req.model_copy(update={"hardware": hw2}), load_planner_policy())
    assert (p.layout.tp, p.replicas) == (2, 1)


# ---- CLI -------------------------------------------------------------------------------------------------

def test_cli_json(capsys, monkeypatch):
    from quantgate.cli import main as cli

    monkeypatch.setattr(sys, "argv", ["quantgate", "plan", "--model", str(DEMO), "--hardware", "x86-cpu",
                                      "--context", "4096", "--concurrency", "8", "--replicas", "1", "--json"])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    assert exc.value.code in (0, None)
    data = json.loads(capsys.readouterr().out)
    assert data["replicas"] == 1 and data["vllm_args"]["--pipeline-parallel-size"] == 2


def test_cli_serving_knobs(capsys, monkeypatch):
    """`quantgate plan` takes the spec's serving knobs as flags; they reach the vLLM arguments and the KV math."""
    from quantgate.cli import main as cli

    base = ["quantgate", "plan", "--model", str(M8B), "--hardware", "h100", "--context", "8192", "--concurrency",
            "16", "--gpus", "1", "--json"]
    out = {}
    for name, extra in (("auto", []), ("knobs", ["--kv-cache-dtype", "fp8", "--max-num-seqs", "32",
                                                  "--max-num-batched-tokens", "4096", "--no-enable-prefix-caching",
                                                  "--no-enforce-eager", "--cudagraph-mode", "FULL"])):
        monkeypatch.setattr(sys, "argv", base + extra)
        with pytest.raises(SystemExit) as exc:
            cli.main()
        assert exc.value.code in (0, None)
        out[name] = json.loads(capsys.readouterr().out)
    a = out["knobs"]["vllm_args"]
    assert (a["--kv-cache-dtype"], a["--max-num-seqs"], a["--max-num-batched-tokens"]) == ("fp8", 32, 4096)
    assert a["--no-enable-prefix-caching"] is True and "FULL" in a["--compilation-config"]
    assert out["knobs"]["capacity"]["kv_bytes_per_token"] * 2 == out["auto"]["capacity"]["kv_bytes_per_token"]


def test_cli_error_is_one_message(capsys, monkeypatch):
    from quantgate.cli import main as cli

    monkeypatch.setattr(sys, "argv", ["quantgate", "plan", "--model", str(M8B), "--hardware", "nope",
                                      "--context", "4096", "--concurrency", "1"])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    assert exc.value.code == 2 and "unknown hardware 'nope'" in capsys.readouterr().err


def test_profile_ids_used_here_exist():
    for hw in ("l40s", "h100", "h200", "x86-cpu", "rtx4090", "a100"):
        assert get_profile(hw).id == hw
