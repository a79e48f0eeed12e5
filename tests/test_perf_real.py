"""The workload probe against real vLLM servers of the demo model, and the gate rejecting a slower candidate (slow).

No quantized candidate is slower than the FP32 baseline on this project's AVX-512 CPU (they are faster), so the
slower candidate here is the baseline's own checkpoint served with a real handicap: no batching (`--max-num-seqs 1`).
At concurrency 4 its requests queue behind each other, so its goodput under the throughput profile is a fraction of
the baseline's. (The latency profile's figures and verdicts are the same code over other fields: tests/test_perf_payoff.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantgate.gate.evidence import gate_run
from quantgate.gate.policy import DEFAULT_POLICY
from quantgate.perf.compare import compare
from quantgate.perf.models import SLO
from quantgate.perf.probe import load_result, run_probe
from quantgate.perf.workloads import PerfOverrides, settings, write_requests
from quantgate.target.hardware import get_profile

from conftest import CPU_TEST_ARGS

pytestmark = pytest.mark.slow
CPU = get_profile("x86-cpu")
LENIENT = SLO(ttft_ms=60_000, tpot_ms=10_000)  # every completed request meets it, whatever the machine's load


def tiny(workload: str, **kw) -> object:
    over = {"num_prompts": 4, "input_len": 32, "output_len": 8, "repeats": 2, "budget_s": 900, **kw}
    return settings(workload, CPU, PerfOverrides(**over))


def test_latency_probe_of_the_demo_server_with_goodput_metrics_and_cost(tmp_path, demo_model, demo_server):
    srv = demo_server
    # an SLO that a loaded CI machine still meets: a level where no request meets the SLO ends the sweep (test below)
    s = tiny("latency", slo=SLO(ttft_ms=30_000, tpot_ms=5_000))
    res = run_probe(srv.endpoint, tmp_path, s, tokenizer=demo_model)
    assert res.status == "ok" and res.workload.profile == "latency" and [r.concurrency for r in res.runs] == [1, 1]
    for r in res.runs:
        raw = json.loads((tmp_path / "raw" / f"c1-r{r.repeat}.json").read_text())
        # our goodput (per-request lists against the SLO) is vLLM's own --goodput figure
        assert r.goodput_rps == pytest.approx(raw["request_goodput"], rel=1e-6)
        assert 0 <= r.slo_attainment <= 1 and r.tpot_p95_ms >= r.tpot_p50_ms > 0
    assert (tmp_path / "raw" / "warmup.json").is_file() and res.sweep.warmup_s > 0  # warm-up first, not counted
    assert res.sweep.budget_s == 900 and res.seconds > 0 and not res.sweep.skipped
    em = res.engine_metrics
    assert em.error is None and em.samples >= 2 and em.preemptions == 0 and em.prefix_cache_queries > 0
    assert em.kv_usage_max is not None and 1 in em.by_level


def test_budget_and_saturation_stop_runs_before_they_start(tmp_path, demo_model, demo_server):
    srv = demo_server
    # a budget spent before the first run: only the two runs of the lowest level that an interval needs are run
    s = tiny("throughput", concurrency=[1, 2], sweep=False, slo=LENIENT, budget_s=1)
    res = run_probe(srv.endpoint, tmp_path / "budget", s, tokenizer=demo_model)
    assert [(r.repeat, r.concurrency) for r in res.runs] == [(0, 1), (1, 1)]
    assert {(k.repeat, k.concurrency) for k in res.sweep.skipped} == {(0, 2), (1, 2)}
    assert res.sweep.over_budget and not (tmp_path / "budget" / "raw" / "c2-r0.json").exists()
    # an SLO nobody meets breaks at the first level: the sweep stops there
    s = tiny("throughput", concurrency=[1, 2, 4], slo=SLO(ttft_ms=0.001), repeats=1)
    res = run_probe(srv.endpoint, tmp_path / "slo", s, tokenizer=demo_model)
    assert [r.concurrency for r in res.runs] == [1] and "the SLO broke at concurrency 1" in res.sweep.stopped


def test_probe_sends_the_eval_sets_prompts_with_their_output_lengths(tmp_path, demo_model, demo_server):
    evalset = Path(__file__).parents[1] / "eval_sets" / "default.jsonl"
    req = write_requests(evalset, tmp_path / "requests.json", limit=12)
    s = tiny("latency", slo=LENIENT).model_copy(update={"requests": str(req)})
    res = run_probe(demo_server.endpoint, tmp_path / "p", s, tokenizer=demo_model)
    assert res.workload.dataset == "sharegpt" and res.workload.requests_sha256 and res.status == "ok"
    assert [r.output_tokens for r in res.runs] == [4 * 8, 4 * 8]  # 4 prompts of the set, output_len 8 each (ignore-eos)
    raw = json.loads((tmp_path / "p" / "raw" / "c1-r0.json").read_text())
    assert len(set(raw["input_lens"])) > 1  # the eval set's own prompt lengths, not one fixed length


def _gate(tmp_path, name: str, base_dir, cand_dir) -> dict:
    run = tmp_path / name
    (run / "cand").mkdir(parents=True)
    cmp_ = compare(load_result(base_dir), load_result(cand_dir))
    (run / "cand" / "pay_off.json").write_text(json.dumps({**cmp_, "file": str(cand_dir / "perf.json")}))
    gate_run(run, DEFAULT_POLICY, ["cand"])
    return json.loads((run / "decision.json").read_text())["candidates"]["cand"]


def test_a_slower_candidate_is_rejected_for_pay_off_under_the_throughput_profile(tmp_path, demo_model, demo_server,
                                                                              vllm_server):
    probe = tiny("throughput", concurrency=[4], sweep=False, slo=LENIENT, repeats=3)
    run_probe(demo_server.endpoint, tmp_path / "base", probe, tokenizer=demo_model)
    with vllm_server(demo_model, name="slow", args=[*CPU_TEST_ARGS, "--max-num-seqs", "1"]) as slow:
        run_probe(slow.endpoint, tmp_path / "cand", probe, tokenizer=demo_model)
    d = _gate(tmp_path, "gate", tmp_path / "base", tmp_path / "cand")
    assert d["decision"] == "REJECT" and d["workload"] == "throughput", [c["reason"] for c in d["checks"] if "/" in c["name"]]
    c = next(c for c in d["checks"] if c["name"] == "pay_off:throughput/goodput_rps")
    assert c["outcome"] == "fail" and c["measured"] < 1.0 and "CI" in c["reason"], c
    assert "slower than the throughput profile demands" in c["reason"]
    assert any(r.startswith("pay_off:throughput/goodput_rps") for r in d["reasons"])
