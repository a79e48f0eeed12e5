"""Device slots: allocation for the reference cases (pure), the width rule, cache keys free of placement, and the
release's slot pool on real threads. Two real variants serving at once, each bound to its own core, is asserted on
the real release in tests/test_release_e2e.py (overlapping serve steps, the core each server's log says it bound)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from quantgate.base.errors import QuantgateError
from quantgate.plan.build import build_plan, load_planner_policy
from quantgate.plan.models import SlotRule
from quantgate.plan.slots import Slot, cores_of, cpu_bind, placement_free, release_width, slots, span
from quantgate.base.paths import EVAL_SETS
from quantgate.release.schedule import SlotPool, pinned, wait_for_reference
from quantgate.spec.resolve import load_spec
from quantgate.release.variants import baseline_variant, server_config

DATA = Path(__file__).parent / "data"
M8B = DATA / "model_shapes" / "dense-8b-fp8.yaml"
M70B = DATA / "model_shapes" / "dense-70b-fp8.yaml"
DEMO = DATA / "model_configs" / "smollm2-135m.json"
SPLIT = SlotRule(cpu_split_gain=1.3)


def test_8b_on_8_h100_gives_eight_one_gpu_slots():
    p = build_plan(M8B, "h100", context=8192, concurrency=20)
    got = slots(p, 8)
    assert [s.devices for s in got] == [[i] for i in range(8)]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in got] == [str(i) for i in range(8)]
    assert len(slots(p, 3)) == 3 and slots(p, 1)[0].devices == [0]  # never more than asked


def test_70b_fp8_on_8_h100_gives_four_disjoint_tp2_slots():
    p = build_plan(M70B, "h100", context=20000, concurrency=20, kv_dtype="fp8")
    assert p.layout.tp == 2
    got = slots(p, 8)  # 8 asked, 4 replicas: a TP=2 replica's two GPUs are never split or merged
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in got] == ["0,1", "2,3", "4,5", "6,7"]
    seen = [d for s in got for d in s.devices]
    assert len(seen) == len(set(seen)) == 8


def test_demo_on_two_cores_lone_variant_binds_both_and_two_variants_one_core_each():
    p = build_plan(DEMO, "x86-cpu", context=4608, concurrency=8)
    assert p.replicas == 2 and p.replica_plans[0].env["VLLM_CPU_OMP_THREADS_BIND"] == "0"  # the plan: a core per replica
    (lone,) = slots(p, 1)
    assert lone.devices == [0, 1] and lone.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert set(lone.env) == {"VLLM_CPU_OMP_THREADS_BIND"}  # placement only: each variant keeps its own KV space
    pair = slots(p, 2)
    assert [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in pair] == ["0", "1"]
    assert len(slots(p, 5)) == 2  # at most one slot per core


def test_cpu_pipeline_replica_splits_its_slot_between_ranks():
    p = build_plan(DEMO, "x86-cpu", context=4096, concurrency=8, replicas=1, cpu_cores_per_worker=4)
    assert p.layout.pp == 2
    (s,) = slots(p, 2)  # one replica: one slot, with all 8 cores, 4 per PP rank
    assert s.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3|4-7" and s.devices == list(range(8))


def test_multi_node_replicas_are_no_slots():
    p = build_plan(DEMO, "x86-cpu", gpus=1, nodes=2, context=2048, concurrency=4, replicas=1, nodes_share_host=True)
    assert slots(p, 2) == []


@pytest.mark.parametrize("cores,ranks,expect", [
    ([0, 1], 1, "0-1"), ([0, 1], 2, "0|1"), ([0, 1, 2], 2, "0-1|2"), ([4, 5, 6, 7], 2, "4-5|6-7"), ([3], 1, "3"),
    ([0, 2, 4], 1, "0,2,4"),
])
def test_cpu_bind_uses_every_core(cores, ranks, expect):
    assert cpu_bind(cores, ranks) == expect
    assert sorted(cores_of(expect)) == sorted(cores)


def test_cpu_bind_refuses_fewer_cores_than_ranks():
    with pytest.raises(QuantgateError, match="cannot give each of 2 worker"):
        cpu_bind([0], 2)


def test_width_rule():
    assert release_width("gpu", 3, 8, None) == 3
    assert release_width("gpu", 3, 2, None) == 2
    assert release_width("cpu", 2, 2, SPLIT) == 2
    assert release_width("cpu", 3, 2, SPLIT) == 2
    assert release_width("cpu", 1, 2, SPLIT) == 1
    assert release_width("cpu", 2, 2, SlotRule(cpu_split_gain=1.0)) == 1  # splitting measured as no gain: in turn
    assert release_width("cpu", 2, 2, None) == 1  # not measured: one at a time


def test_shipped_rule_is_a_measurement():
    rule = load_planner_policy().slots
    assert rule is not None and rule.measured and "slot_split" in rule.measured


def test_placement_free_keeps_size_not_place():
    vars_ = ["CUDA_VISIBLE_DEVICES"]
    a = placement_free({"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}, vars_)
    b = placement_free({"VLLM_CPU_OMP_THREADS_BIND": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}, vars_)
    c = placement_free({"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "2"}, vars_)
    assert a == b != c and c["VLLM_CPU_OMP_THREADS_BIND"] == "cores:2"
    assert placement_free({"CUDA_VISIBLE_DEVICES": "2,3"}, vars_) == placement_free({"CUDA_VISIBLE_DEVICES": "0,1"}, vars_)
    assert span([3, 1, 2]) == "1-3" and span([0, 2]) == "0,2"


# ---- the release's slot pool (real threads, real affinity) ---------------------------------------------------

def _cpu_slots(n: int) -> list[Slot]:
    return [Slot(index=i, kind="cpu", devices=[i], env={"VLLM_CPU_OMP_THREADS_BIND": str(i)}) for i in range(n)]



def test_pool_never_hands_one_slot_to_two_jobs_and_runs_width_at_once():
    pool = SlotPool(_cpu_slots(2), log=lambda _: None)
    holding: list[int] = []
    most = [0]
    lock = threading.Lock()

    def job(i: int) -> None:
        with pool.take(f"job {i}") as slot:
            with lock:
                assert slot.index not in holding
                holding.append(slot.index)
                most[0] = max(most[0], len(holding))
            time.sleep(0.05)
            with lock:
                holding.remove(slot.index)

    threads = [threading.Thread(target=job, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 2 and holding == []


def test_pool_without_slots_runs_one_job_at_a_time_on_the_planned_devices():
    pool = SlotPool([], log=lambda _: None)
    assert pool.width == 1 and pool.sample is None
    with pool.take("only") as slot:
        assert slot is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_pinned_thread_starts_processes_on_the_slot_cores_only():
    core = sorted(os.sched_getaffinity(0))[-1]
    slot = Slot(index=1, kind="cpu", devices=[core], env={})
    before = os.sched_getaffinity(0)
    with pinned(slot):
        child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True, check=True)
    assert child.stdout.strip() == f"[{core}]"
    assert os.sched_getaffinity(0) == before  # the thread is free again


def test_wait_for_reference_returns_when_final_and_raises_when_the_baseline_failed(tmp_path):
    ref = {"default": tmp_path / "evals"}
    done = threading.Event()
    threading.Timer(0.3, done.set).start()
    t0 = time.monotonic()
    wait_for_reference(ref, lambda: False, log=lambda _: None, poll_s=0.05, final=lambda _: done.is_set())
    assert time.monotonic() - t0 >= 0.25
    with pytest.raises(QuantgateError, match="baseline's measurement failed"):
        wait_for_reference(ref, lambda: True, log=lambda _: None, poll_s=0.01, final=lambda _: False)


def test_release_server_binds_every_core_alone_and_its_slot_beside_another(demo_model, tmp_path):
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(f"version: 1\nname: s\nmodel: {demo_model}\nhardware: x86-cpu\ncontext: 2048\nconcurrency: 2\n"
                         f"schemes: [w4a16-gptq]\neval_sets: [{EVAL_SETS / 'default.jsonl'}]\nrecall: null\n")
    spec = load_spec(spec_file)
    variant = baseline_variant(demo_model)
    alone = server_config(spec, variant, tmp_path / "a")
    assert alone.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and "VLLM_CPU_KVCACHE_SPACE" in alone.env
    plan = build_plan(demo_model, "x86-cpu", context=2048, concurrency=2)
    beside = server_config(spec, variant, tmp_path / "b", slots(plan, 2)[1])
    assert beside.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert beside.env["VLLM_CPU_KVCACHE_SPACE"] == alone.env["VLLM_CPU_KVCACHE_SPACE"]  # its own plan's KV space


def test_a_freed_slot_goes_to_the_lowest_rank_waiting():
    pool = SlotPool(_cpu_slots(1), log=lambda _: None)
    order: list[str] = []
    with pool.take("first"):
        threads = [threading.Thread(target=lambda n=n, r=r: _run_ranked(pool, n, r, order))
                   for n, r in (("candidate", 2), ("quantize", 1), ("baseline", 0))]
        for t in threads:
            t.start()
            time.sleep(0.05)  # arrive in this order: candidate, quantize, baseline
    for t in threads:
        t.join()
    assert order == ["baseline", "quantize", "candidate"]


def _run_ranked(pool: SlotPool, name: str, rank: int, order: list[str]) -> None:
    with pool.take(name, rank):
        order.append(name)
