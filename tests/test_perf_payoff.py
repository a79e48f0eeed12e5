"""Workload profiles, the probe's statistics and the gate's pay-off checks: pure parts, table-driven.

Intervals of speed ratios (t quantiles, Welch and paired log-ratio intervals), goodput within an SLO, when a sweep
stops (saturation, broken SLO, time budget), vLLM /metrics parsing, profile resolution, comparisons with intervals
and the pay-off checks (PASS / FAIL / INCONCLUSIVE, profile named). The real probe runs in tests/test_perf_real.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from quantgate.base.errors import ConfigError
from quantgate.cli.main import app
from quantgate.gate.checks import evaluate
from quantgate.gate.models import GateEvidence, Ratio
from quantgate.gate.payoff import pay_off_checks, speed
from quantgate.gate.policy import DEFAULT_POLICY, load_policy
from quantgate.perf.compare import compare, level_medians, slo_concurrency
from quantgate.perf.intervals import ratio_ci, t_cdf, t_quantile
from quantgate.perf.metrics import parse, summarize
from quantgate.perf.models import SLO, Decide, PayOffFigures, PerfResult, RunResult, Workload, good_requests, run_from_bench
from quantgate.perf.sweep import plan, stop_reason, to_skip
from quantgate.perf.workloads import PerfOverrides, load_workloads, settings
from quantgate.report import charts, sections
from quantgate.target.hardware import get_profile

METRICS_TEXT = (Path(__file__).parent / "data" / "perf" / "vllm_metrics.txt")


# --- t quantiles and ratio intervals ------------------------------------------------------------------------------------

@pytest.mark.parametrize("p, df, expected", [   # published t-table values
    (0.975, 1, 12.7062), (0.975, 2, 4.3027), (0.95, 2, 2.9200), (0.975, 10, 2.2281), (0.95, 4, 2.1318),
    (0.995, 30, 2.7500), (0.975, 1e7, 1.9600), (0.025, 5, -2.5706),
])
def test_t_quantile_matches_the_table(p, df, expected):
    assert t_quantile(p, df) == pytest.approx(expected, abs=1e-4)
    assert t_cdf(t_quantile(p, df), df) == pytest.approx(p, abs=1e-9)


def test_welch_log_interval_by_hand():
    base, cand = [10.0, 11.0, 12.0], [20.0, 21.0, 25.0]
    lb, lc = [math.log(x) for x in base], [math.log(x) for x in cand]

    def var(v):
        m = sum(v) / len(v)
        return sum((x - m) ** 2 for x in v) / (len(v) - 1)

    vb, vc = var(lb) / 3, var(lc) / 3
    df = (vb + vc) ** 2 / (vb ** 2 / 2 + vc ** 2 / 2)
    diff = sum(lc) / 3 - sum(lb) / 3
    q = t_quantile(0.95, df) * math.sqrt(vb + vc)
    ci = ratio_ci(base, cand, level=0.90)
    assert ci.method == "welch-log" and ci.df == pytest.approx(df, rel=1e-3)
    assert (ci.value, ci.low, ci.high) == pytest.approx((math.exp(diff), math.exp(diff - q), math.exp(diff + q)))
    assert ci.low < 2.0 < ci.high


def test_paired_interval_cancels_drift_that_hits_both_variants_of_a_round():
    base = [10.0, 20.0, 40.0]          # the machine got faster round by round
    cand = [5.0, 10.1, 19.9]           # the candidate is always about half
    paired, unpaired = ratio_ci(base, cand, paired=True), ratio_ci(base, cand)
    assert paired.method == "paired-log" and paired.high < 0.52 and paired.low > 0.48
    assert unpaired.high > 1.0          # without pairing the drift swamps the difference


@pytest.mark.parametrize("base, cand, value, has_ci", [
    ([10.0], [20.0], 2.0, False),                 # one run a side: the point, no interval
    ([10.0, None, 10.0], [20.0, 20.0], 2.0, True),  # a run with no figure is left out, never read as 0
    ([None], [1.0], None, False),
    ([5.0, 5.0], [5.0, 5.0], 1.0, True),          # identical runs: a zero-width interval
])
def test_ratio_ci_edges(base, cand, value, has_ci):
    ci = ratio_ci(base, cand)
    assert (ci.value if ci.value is None else round(ci.value, 9)) == value
    assert (ci.low is not None) == has_ci


# --- goodput within the SLO ---------------------------------------------------------------------------------------------

def detail(ttfts, latencies, outs, errors=None, duration=2.0) -> dict:
    n = len(ttfts)
    return {"completed": sum(1 for e in (errors or [""] * n) if not e), "failed": sum(1 for e in (errors or [""] * n) if e),
            "duration": duration, "ttfts": ttfts, "latencies": latencies, "output_lens": outs,
            "errors": errors or [""] * n, "output_throughput": 10.0, "request_throughput": 2.0}


def test_good_requests_count_ttft_and_tpot_like_vllm():
    slo = SLO(ttft_ms=200, tpot_ms=50)
    # TTFT ok / TPOT (1.0-0.1)/9 = 100 ms too slow / TTFT too slow / ok, one token (TPOT 0) / failed
    b = detail([0.1, 0.1, 0.3, 0.15, 0.0], [0.5, 1.0, 0.5, 0.15, 0.0], [10, 10, 10, 1, 0], ["", "", "", "", "boom"])
    assert good_requests(b, slo) == 2
    r = run_from_bench(b, repeat=0, concurrency=2, num_prompts=5, slo=slo)
    assert r.goodput_rps == pytest.approx(2 / 2.0) and r.slo_attainment == pytest.approx(2 / 5)
    assert run_from_bench(b, repeat=0, concurrency=2, num_prompts=5).goodput_rps is None  # no SLO: not measured
    assert good_requests({"completed": 1}, slo) is None  # no per-request lists (not --save-detailed)


# --- sweep: saturation, SLO, budget -------------------------------------------------------------------------------------

def rr(c: int, tok: float | None, att: float | None = 1.0, r: int = 0, failed: int = 0) -> RunResult:
    return RunResult(repeat=r, concurrency=c, num_prompts=10, completed=10 - failed, failed=failed, error_rate=failed / 10,
                     output_tok_s=tok, slo_attainment=att, goodput_rps=None if tok is None else tok / 10 * (att or 0))


SLO95 = SLO(ttft_ms=200, tpot_ms=50, attainment=0.95)


@pytest.mark.parametrize("prev, cur, words", [
    (rr(1, 100), rr(2, 180), None),
    (rr(1, 100), rr(2, 105), "saturated at concurrency 2: 105.0 output tokens/s, less than 1.1x the 100.0"),
    (rr(1, 100), rr(2, 300, att=0.5), "the SLO broke at concurrency 2: 50% of requests met it, 95% needed"),
    (None, rr(1, 50, att=0.9), "the SLO broke at concurrency 1"),
    (rr(1, 100), rr(2, 300, failed=1), "requests failed at concurrency 2"),
    (rr(1, 100), rr(2, 300, att=None), None),  # no SLO figures: only throughput decides
])
def test_stop_reason(prev, cur, words):
    why = stop_reason(prev, cur, SLO95, 1.1)
    assert (why is None) if words is None else (words in why), why


def test_sweep_skips_levels_above_saturation_in_every_repeat_and_budget_skips_the_rest():
    order = plan([1, 2, 4, 8], repeats=2)
    assert order[:4] == [(0, 1), (0, 2), (0, 4), (0, 8)]  # the first repeat sweeps first
    done = {(0, 1): rr(1, 100), (0, 2): rr(2, 190), (0, 4): rr(4, 200)}
    skip, stopped = to_skip(order, done, sweep=True, slo=SLO95, gain=1.1, elapsed_s=5, budget_s=60)
    assert "saturated at concurrency 4" in stopped
    assert set(skip) == {(0, 8), (1, 8)}
    skip, _ = to_skip(order, done, sweep=True, slo=SLO95, gain=1.1, elapsed_s=61, budget_s=60)
    assert set(skip) == {(0, 8), (1, 8), (1, 2), (1, 4)} and "time budget of 60 s" in skip[(1, 2)]
    skip, stopped = to_skip(order, done, sweep=False, slo=SLO95, gain=1.1, elapsed_s=5, budget_s=60)
    assert skip == {} and stopped is None  # no sweep (latency profile): every level is measured
    slow = {(0, 1): rr(1, 100).model_copy(update={"duration_s": 30.0})}
    skip, _ = to_skip(order, slow, sweep=False, slo=SLO95, gain=1.1, elapsed_s=40, budget_s=60)
    assert (1, 1) not in skip and (0, 2) not in skip  # the second run of the lowest level is kept
    slow[(0, 2)] = rr(2, 150).model_copy(update={"duration_s": 30.0})
    skip, _ = to_skip(order, slow, sweep=False, slo=SLO95, gain=1.1, elapsed_s=40, budget_s=60)
    assert "a run at concurrency 2 takes 30 s, more than the 20 s left" in skip[(1, 2)]
    skip, _ = to_skip(order, {}, sweep=False, slo=SLO95, gain=1.1, elapsed_s=100, budget_s=60)
    assert (0, 1) not in skip and (1, 1) not in skip and len(skip) == len(order) - 2  # 2 runs of the lowest level


# --- vLLM /metrics ------------------------------------------------------------------------------------------------------

def test_metrics_parse_sums_label_sets_and_ignores_others():
    text = ('# HELP vllm:kv_cache_usage_perc KV-cache usage.\n# TYPE vllm:kv_cache_usage_perc gauge\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="demo"} 0.25\n'
            'vllm:kv_cache_usage_perc{engine="1",model_name="a b} c"} 0.5\n'
            'vllm:num_preemptions_total{engine="0",model_name="demo"} 3.0\n'
            'vllm:num_requests_running 2\nvllm:generation_tokens_total{engine="0"} 99\nvllm:num_requests_waiting{x="1"} NaN\n')
    assert parse(text) == {"vllm:kv_cache_usage_perc": 0.75, "vllm:num_preemptions_total": 3.0,
                           "vllm:num_requests_running": 2.0}


def test_metrics_from_a_real_vllm_server():
    got = parse(METRICS_TEXT.read_text())
    assert set(got) == {"vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
                        "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"}
    assert got["vllm:prefix_cache_queries_total"] == 940.0 and got["vllm:num_preemptions_total"] == 0.0


def test_metrics_summary_counters_as_differences_and_per_level_peaks():
    def m(kv, pre, q, h, run):
        return {"vllm:kv_cache_usage_perc": kv, "vllm:num_preemptions_total": pre, "vllm:prefix_cache_queries_total": q,
                "vllm:prefix_cache_hits_total": h, "vllm:num_requests_running": run}
    s = summarize([(None, m(0.0, 2, 100, 10, 0)), (1, m(0.1, 2, 200, 30, 1)), (4, m(0.4, 5, 600, 110, 4)),
                   (None, m(0.0, 5, 600, 110, 0))])
    assert s.kv_usage_max == 0.4 and s.preemptions == 3 and s.prefix_cache_queries == 500
    assert s.prefix_hit_rate == pytest.approx(100 / 500) and s.by_level[4].running_max == 4
    assert summarize([], "unreachable").error == "unreachable"
    assert summarize([(1, {"vllm:num_requests_running": 1.0})]).preemptions is None  # not exported: None, not 0


# --- workload profiles --------------------------------------------------------------------------------------------------

def test_profiles_resolve_from_profile_budget_and_overrides():
    cat = load_workloads()
    cpu = get_profile("x86-cpu")
    lat = settings("latency", cpu, concurrency=8)
    assert lat.levels == [1] and not lat.sweep and lat.budget_s == cat.budgets["cpu"].seconds_per_variant
    assert [d.figure for d in lat.decide] == ["tpot_p50_ms", "ttft_p50_ms"] and lat.slo == cat.slo
    thr = settings("throughput", cpu)
    assert thr.sweep and thr.levels[0] == 1 and thr.decide == [Decide(figure="goodput_rps", at="best")]
    assert settings("fit", cpu, concurrency=8).levels == [8]  # fit probes the deployment's own concurrency
    gpu = settings("latency", get_profile("h100"))
    assert gpu.budget_s == cat.budgets["gpu"].seconds_per_variant and gpu.repeats >= 2
    own = settings("latency", cpu, PerfOverrides(concurrency=[1, 2], slo=SLO(ttft_ms=1000), repeats=5, budget_s=30))
    assert own.levels == [1, 2] and own.repeats == 5 and own.budget_s == 30
    assert own.slo.ttft_ms == 1000 and own.slo.tpot_ms == cat.slo.tpot_ms  # only the given SLO field is replaced


def test_unknown_workload_names_the_known_ones():
    with pytest.raises(ConfigError, match="latency, throughput, fit"):
        settings("batch", get_profile("x86-cpu"))


def test_cli_workload_needs_hardware_and_a_known_profile(tmp_path):
    base = ["perf", "--endpoint", "http://127.0.0.1:9", "--model", "m", "--out", str(tmp_path)]
    res = CliRunner().invoke(app, [*base, "--workload", "latency"])
    assert isinstance(res.exception, ConfigError) and res.exception.where == "--hardware"
    res = CliRunner().invoke(app, [*base, "--workload", "batch", "--hardware", "x86-cpu"])
    assert isinstance(res.exception, ConfigError) and res.exception.where == "--workload"


# --- comparisons with intervals -----------------------------------------------------------------------------------------

def probe_result(model: str, runs: list[RunResult], profile: str = "latency", decide=None) -> PerfResult:
    w = Workload(num_prompts=8, input_len=64, output_len=16, tokenizer="/tok", tokenizer_sha256="x", profile=profile,
                 slo=SLO95, decide=decide or [Decide(figure="tpot_p50_ms", at="lowest")])
    return PerfResult(client="t", endpoint="http://x", model=model, workload=w, concurrency=sorted({r.concurrency for r in runs}),
                      repeats=max(r.repeat for r in runs) + 1, runs=runs, medians=level_medians(runs), weights_bytes=1000,
                      status="ok", started="t", seconds=40.0)


def lat(c: int, r: int, tpot: float, good: float = 1.0, tok: float = 100.0) -> RunResult:
    return RunResult(repeat=r, concurrency=c, num_prompts=8, completed=8, failed=0, error_rate=0.0, output_tok_s=tok,
                     tpot_p50_ms=tpot, goodput_rps=good, slo_attainment=1.0 if good else 0.0)


def test_compare_gives_each_pay_off_figure_with_its_interval():
    base = probe_result("b", [lat(1, r, t) for r, t in enumerate([20.0, 21.0, 19.5])])
    cand = probe_result("c", [lat(1, r, t) for r, t in enumerate([45.0, 47.0, 44.0])])
    out = compare(base, cand)
    (d,) = out["decide"]
    assert d["figure"] == "tpot_p50_ms" and d["concurrency"] == 1 and d["lower_is_better"]
    assert d["ratio"]["low"] > 2.0 and d["ratio"]["high"] < 2.5 and d["ratio"]["n_base"] == 3
    assert out["workload"] == "latency" and out["intervals"]["method"] == "welch-log"
    assert out["ci"]["tpot_ratio"]["value"] == pytest.approx(d["ratio"]["value"])


def test_goodput_at_the_best_level_per_repeat_and_the_highest_level_within_the_slo():
    dec = [Decide(figure="goodput_rps", at="best")]
    base = probe_result("b", [lat(1, r, 20, good=2.0) for r in range(2)] + [lat(4, r, 40, good=5.0 + r) for r in range(2)], "throughput", dec)
    cand = probe_result("c", [lat(1, r, 20, good=1.0) for r in range(2)] + [lat(4, r, 90, good=0.0) for r in range(2)], "throughput", dec)
    (d,) = compare(base, cand)["decide"]
    assert d["concurrency"] is None and d["baseline"] == 5.5 and d["candidate"] == 1.0   # medians of the per-repeat best
    assert d["ratio"]["value"] == pytest.approx(1.0 / math.sqrt(5 * 6))
    assert slo_concurrency(base) == 4 and slo_concurrency(cand) == 1


def test_a_candidate_that_never_meets_the_slo_has_goodput_ratio_zero():
    dec = [Decide(figure="goodput_rps", at="best")]
    base = probe_result("b", [lat(1, r, 20, good=2.0) for r in range(2)], "throughput", dec)
    cand = probe_result("c", [lat(1, r, 90, good=0.0) for r in range(2)], "throughput", dec)
    assert compare(base, cand)["decide"][0]["ratio"]["value"] == 0.0


# --- pay-off checks -----------------------------------------------------------------------------------------------------

def figures(ratio: float, low: float | None, high: float | None, workload="latency", figure="tpot_p50_ms",
            lower=True) -> PayOffFigures:
    return PayOffFigures.model_validate({"workload": workload, "file": "w/pay_off.json", "decide": [
        {"figure": figure, "at": "lowest", "concurrency": 1, "lower_is_better": lower, "baseline": 20.0,
         "candidate": 20.0 * ratio, "ratio": {"value": ratio, "low": low, "high": high, "level": 0.9, "method": "welch-log",
                                              "n_base": 3, "n_cand": 3}}]})


def ev(pay: PayOffFigures | None, size: float = 0.5) -> GateEvidence:
    return GateEvidence(candidate="int8-w8a8", scheme="int8-w8a8", size_ratio=Ratio(value=size, file="e.json"), pay_off=pay)


POLICY = load_policy(DEFAULT_POLICY)


@pytest.mark.parametrize("pay, outcome, words", [
    # TPOT ratio 2.3 (the AVX2 EPYC's int8 ITL): 0.43x the speed, best end below 1: REJECT, figure and profile named
    (figures(2.3, 2.1, 2.5), "fail", ["latency profile: TPOT p50 at concurrency 1, candidate/baseline 2.300",
                                      "0.43x the baseline's speed", "slower than the latency profile demands"]),
    (figures(0.4, 0.38, 0.42), "pass", ["2.50x the baseline's speed", "it pays off"]),
    (figures(0.95, 0.85, 1.05), "inconclusive", ["straddles 1.00x", "more repeats would decide"]),
    (figures(0.9, None, None), "inconclusive", ["fewer than 2 runs a side give no interval"]),
    (figures(0.49, 0.45, 0.53, workload="throughput", figure="goodput_rps", lower=False), "fail",
     ["throughput profile: goodput", "0.49x"]),
    # fit accepts equal speed (down to 0.9x on the worst end) for the smaller checkpoint
    (figures(1.0, 0.95, 1.05, workload="fit", figure="output_tok_s", lower=False), "pass", ["fit profile"]),
    (figures(1.0, 0.8, 1.2, workload="fit", figure="output_tok_s", lower=False), "inconclusive", ["straddles 0.90x"]),
])
def test_speed_checks_of_the_default_policy(pay, outcome, words):
    checks = [c for c in pay_off_checks(POLICY, ev(pay)) if "/" in c.name]
    assert len(checks) == 1 and checks[0].outcome == outcome, checks
    assert checks[0].name == f"pay_off:{pay.workload}/{pay.decide[0].figure}" and checks[0].evidence_file == "w/pay_off.json"
    assert all(w in checks[0].reason for w in words), checks[0].reason


def test_a_slower_candidate_is_rejected_and_the_decision_names_the_profile():
    d = evaluate(POLICY, ev(figures(2.3, 2.1, 2.5)))
    assert d.decision == "REJECT" and d.workload == "latency"
    assert any(r.startswith("pay_off:latency/tpot_p50_ms: latency profile") for r in d.reasons)


def test_no_probe_figures_is_inconclusive_under_a_required_pay_off():
    (c,) = [c for c in pay_off_checks(POLICY, ev(None)) if c.name == "pay_off:speed"]
    assert c.outcome == "inconclusive" and "no performance probe figures" in c.reason
    legacy = PayOffFigures(throughput_ratio=1.3, file="p.json")  # a probe without a workload profile
    (c,) = [c for c in pay_off_checks(POLICY, ev(legacy)) if c.name == "pay_off:speed"]
    assert c.outcome == "inconclusive" and "--workload" in c.reason


def test_point_bound_judges_the_ratio_itself():
    policy = POLICY.model_copy(update={"pay_off": POLICY.pay_off.model_copy(update={"bound": "point"})})
    (c,) = [c for c in pay_off_checks(policy, ev(figures(0.95, 0.85, 1.05))) if "/" in c.name]
    assert c.outcome == "pass" and c.bound == "point"


@pytest.mark.parametrize("ratio, lower, expected", [(0.5, True, 2.0), (2.0, False, 2.0), (0.0, True, math.inf),
                                                     (None, True, None)])
def test_speed_is_the_inverse_ratio_for_latencies(ratio, lower, expected):
    assert speed(ratio, lower) == expected


# --- report: curves and the pay-off table -------------------------------------------------------------------------------

def test_report_sections_and_chart_of_the_probe():
    base = probe_result("b", [lat(1, r, 20, good=2.0) for r in range(2)] + [lat(4, r, 40, good=5.0) for r in range(2)])
    cand = probe_result("c", [lat(1, r, 45, good=1.0) for r in range(2)] + [lat(4, r, 90, good=0.0) for r in range(2)])
    curve = sections.perf_curve("baseline", base.model_dump(mode="json"))
    assert [lv["concurrency"] for lv in curve["levels"]] == [1, 4] and curve["levels"][1]["goodput_rps"] == 5.0
    assert curve["slo"]["ttft_ms"] == 200 and curve["profile"] == "latency"
    table = sections.pay_off(compare(base, cand))
    (row,) = table["rows"]
    assert row["figure"] == "tpot_p50_ms" and row["speed"] == pytest.approx(20 / 45, rel=1e-6)
    assert row["speed_low"] <= row["speed"] <= row["speed_high"] and table["slo_concurrency"] == {"baseline": 4, "candidate": 1}
    assert sections.pay_off({"throughput_ratio": 1.2}) is None  # an older pay_off.json: no profile table
    svg = charts.perf_curves([curve, sections.perf_curve("c", cand.model_dump(mode="json"))])
    assert svg.startswith("<svg") and "goodput vs concurrency" in svg and charts.perf_curves([]) is None
    with pytest.raises(TypeError):
        sections.perf_curve("x", {"medians": {"not": "a list"}})


# --- request lengths from an eval set -----------------------------------------------------------------------------------

def test_requests_from_an_eval_set_and_the_bench_arguments_that_send_them(tmp_path):
    from quantgate.evals.dataset import load_evalset
    from quantgate.perf.probe import bench_argv
    from quantgate.perf.workloads import write_requests

    evalset = Path(__file__).parents[1] / "eval_sets" / "default.jsonl"
    path = write_requests(evalset, tmp_path / "req.json", limit=12)
    rows = json.loads(path.read_text())
    prompts = {s.prompt_text() for s in load_evalset(evalset, with_dataset=False).samples}
    assert len(rows) == 12 and all(r["conversations"][0]["value"] in prompts for r in rows)
    assert len({r["id"].split("-")[0] for r in rows}) > 3  # round-robin over the categories, not the first 12 lines
    w = Workload(num_prompts=8, input_len=64, output_len=16, tokenizer="/tok", dataset="sharegpt", requests_sha256="h")
    argv = bench_argv("http://x", "m", w, 2, 8, tmp_path, "r.json", str(path))
    assert argv[argv.index("--dataset-name") + 1] == "sharegpt" and argv[argv.index("--dataset-path") + 1] == str(path)
    assert "--random-input-len" not in argv and argv[argv.index("--sharegpt-output-len") + 1] == "16"
    other = w.model_copy(update={"requests_sha256": "other"})
    assert w.identity() != other.identity()  # probes of different prompt files are not comparable


def test_a_probe_over_its_budget_says_why_and_one_within_it_says_nothing():
    from quantgate.perf.sweep import MIN_REPEATS, overrun

    why = overrun(226.0, 60.0, 41.0, 3)
    assert why is not None and why.startswith("226 s, over its budget of 60 s: its warm-up took 41 s")
    assert f"first {MIN_REPEATS} runs start whatever the budget" in why
    assert overrun(59.0, 60.0, 41.0, 3) is None and overrun(500.0, None, None, 9) is None
