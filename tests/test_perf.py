"""Serving performance probe: medians and ratios (pure), vLLM log parsing, bad input, and real probes (slow)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web
from typer.testing import CliRunner

from quantgate.base.errors import ConfigError, QuantgateError
from quantgate.cli.main import app, user_error
from quantgate.perf.compare import compare, first_error, level_medians, ratio
from quantgate.perf.models import EngineMemory, PerfResult, RunResult, Workload, parse_engine_log, run_from_bench
from quantgate.perf.probe import check_endpoint, load_result, planner_kv, probe, weights_bytes
from quantgate.base.http import Endpoint

from _fake_openai import FakeServer

DATA = Path(__file__).parent / "data" / "perf"


def run(c: int, r: int = 0, tok: float | None = 100.0, ttft: float | None = 50.0, failed: int = 0, n: int = 10, **kw) -> RunResult:
    ok = n - failed
    return RunResult(repeat=r, concurrency=c, num_prompts=n, completed=ok, failed=failed, error_rate=failed / n,
                     output_tok_s=tok, requests_s=None if tok is None else tok / 10, ttft_p50_ms=ttft,
                     ttft_p95_ms=None if ttft is None else ttft * 2, itl_p50_ms=kw.get("itl", 20.0), itl_p95_ms=kw.get("itl", 20.0) * 1.5,
                     errors=kw.get("errors", []))


def result(model: str, runs: list[RunResult], *, size: int | None = 1000, status: str = "ok", kv: int | None = None,
           wl: dict | None = None, sha: str = "abc") -> PerfResult:
    w = Workload(**{"num_prompts": 10, "input_len": 64, "output_len": 16, "tokenizer": "/tok", "tokenizer_sha256": sha, **(wl or {})})
    return PerfResult(client="test", endpoint="http://x", model=model, workload=w, concurrency=sorted({r.concurrency for r in runs}),
                      repeats=max(r.repeat for r in runs) + 1, runs=runs, medians=level_medians(runs), weights_bytes=size,
                      engine=EngineMemory(kv_cache_tokens=kv) if kv else None, status=status,
                      error=None if status == "ok" else "boom", started="t", seconds=1.0)


# --- medians over repeats -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("toks, expected", [
    ([100.0], 100.0),
    ([100.0, 300.0, 200.0], 200.0),          # odd count: the middle one, not the mean
    ([100.0, 900.0, 200.0, 300.0], 250.0),   # even count: mean of the two middle ones; the outlier does not pull it
    ([None, 120.0, 80.0], 100.0),            # a missing figure is skipped, never read as 0
    ([None, None], None),
])
def test_level_median_of_throughput(toks, expected):
    runs = [run(4, r=i, tok=t) for i, t in enumerate(toks)]
    (m,) = level_medians(runs)
    assert m.concurrency == 4 and m.repeats == len(toks)
    assert m.output_tok_s == expected


def test_medians_are_per_level_and_error_rate_pools_requests():
    runs = [run(1, 0, tok=10.0), run(8, 0, tok=50.0, failed=2), run(1, 1, tok=12.0), run(8, 1, tok=70.0, failed=0, n=30)]
    by = {m.concurrency: m for m in level_medians(runs)}
    assert by[1].output_tok_s == 11.0 and by[8].output_tok_s == 60.0
    assert by[1].error_rate == 0.0
    assert by[8].error_rate == pytest.approx(2 / 40)  # 2 failed of 10 + 30 sent, not the mean of 0.2 and 0.0


# --- ratios -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cand, base, expected", [(50, 100, 0.5), (150.0, 100.0, 1.5), (None, 100, None), (5, None, None), (5, 0, None)])
def test_ratio(cand, base, expected):
    assert ratio(cand, base) == expected


def test_compare_gives_candidate_over_baseline_at_the_highest_common_level():
    base = result("base", [run(1, r, tok=10.0, ttft=100.0) for r in range(3)] + [run(8, r, tok=40.0, ttft=400.0) for r in range(3)],
                  size=1000, kv=20000)
    cand = result("w4a16", [run(1, r, tok=t, ttft=80.0) for r, t in enumerate([12.0, 99.0, 14.0])] +
                  [run(8, r, tok=60.0, ttft=200.0, itl=10.0) for r in range(3)] + [run(32, 0)], size=420, kv=30000)
    out = compare(base, cand)
    assert out["concurrency"] == 8                          # 32 was probed on one side only
    assert out["size_ratio"] == 0.42
    assert out["throughput_ratio"] == 1.5 and out["ttft_ratio"] == 0.5 and out["itl_ratio"] == 0.5
    assert out["kv_tokens_ratio"] == 1.5
    assert [r["concurrency"] for r in out["by_concurrency"]] == [1, 8]
    assert out["by_concurrency"][0]["throughput_ratio"] == 1.4  # median 14 of (12, 99, 14) over 10
    assert compare(base, cand, at=1)["throughput_ratio"] == 1.4
    assert out["higher_is_better"]["throughput_ratio"] and not out["higher_is_better"]["size_ratio"]


def test_compare_leaves_missing_figures_none():
    out = compare(result("b", [run(1)], size=None), result("c", [run(1, tok=None)]))
    assert out["size_ratio"] is None and out["throughput_ratio"] is None and out["kv_tokens_ratio"] is None


@pytest.mark.parametrize("make, words", [
    (lambda: (result("b", [run(1)]), result("c", [run(1)], wl={"output_len": 32})), ["different workloads", "output_len: 16 vs 32"]),
    (lambda: (result("b", [run(1)]), result("c", [run(1)], status="error")), ["candidate probe did not succeed", "boom"]),
    (lambda: (result("b", [run(1)]), result("c", [run(4)])), ["no common concurrency level"]),
])
def test_compare_refuses_what_cannot_be_compared(make, words):
    with pytest.raises(QuantgateError) as err:
        compare(*make())
    assert all(w in err.value.message for w in words), err.value.message


def test_compare_at_a_level_not_probed_names_the_common_levels():
    with pytest.raises(QuantgateError, match=r"common levels: \[1\]"):
        compare(result("b", [run(1)]), result("c", [run(1)]), at=8)


def test_compare_notes_a_different_tokenizer():
    assert any("tokenizer" in n for n in compare(result("b", [run(1)]), result("c", [run(1)], sha="zzz"))["notes"])


# --- vLLM bench results -> runs ---------------------------------------------------------------------------------------

def test_bench_result_with_failures_keeps_error_rate_and_messages():
    bench = {"completed": 6, "failed": 2, "duration": 3.0, "output_throughput": 32.0, "request_throughput": 2.0,
             "p50_ttft_ms": 40.0, "p95_ttft_ms": 90.0, "p50_itl_ms": 11.0, "p95_itl_ms": 19.0, "total_output_tokens": 96,
             "errors": ["", "HTTP 500: boom", "", "HTTP 500:   boom", "Bad Request"]}
    r = run_from_bench(bench, repeat=0, concurrency=4, num_prompts=8)
    assert (r.completed, r.failed, r.error_rate) == (6, 2, 0.25)
    assert r.errors == ["HTTP 500: boom", "Bad Request"]
    assert (r.output_tok_s, r.ttft_p95_ms, r.itl_p50_ms) == (32.0, 90.0, 11.0)
    assert "2 of 8 requests failed at concurrency 4 (error rate 25.0%)" in first_error([r])


def test_bench_result_with_nothing_completed_has_no_throughput_not_zero():
    r = run_from_bench({"completed": 0, "failed": 8, "output_throughput": 0.0, "p50_ttft_ms": 0.0, "errors": ["refused"] * 8},
                       repeat=0, concurrency=1, num_prompts=8)
    assert r.error_rate == 1.0 and r.output_tok_s is None and r.ttft_p50_ms is None and r.errors == ["refused"]


# --- server log -------------------------------------------------------------------------------------------------------

def test_engine_memory_from_a_real_vllm_cpu_log():
    mem = parse_engine_log((DATA / "vllm_cpu_server.log").read_text())
    assert mem.device == "CPU" and mem.kv_cache_tokens == 23296 and mem.max_model_len == 2048
    assert mem.kv_cache_gib == 1.0 and mem.kv_max_concurrency == 11.38 and mem.checkpoint_gib == 0.25
    assert mem.weights_gib is None  # vLLM's CPU runner does not log weight memory: left unknown, not 0
    assert len(mem.lines) == 3


def test_engine_memory_gpu_wording_two_workers_and_only_the_last_start():
    # lines in the wording of vLLM 0.32's GPU worker/runner log calls; an earlier start in the same file is ignored
    log = "\n".join([
        "$ vllm serve /m --port 1",
        "(Worker pid=1) INFO [gpu_model_runner.py] Model loading took 9.99 GiB memory and 1.0 seconds",
        "$ vllm serve /m --port 2",
        "(Worker_TP0 pid=11) INFO [gpu_model_runner.py:5150] Model loading took 7.5 GiB memory and 12.3 seconds",
        "(Worker_TP1 pid=12) INFO [gpu_model_runner.py:5150] Model loading took 7.5 GiB memory and 12.1 seconds",
        "(Worker_TP0 pid=11) INFO [gpu_worker.py:760] Available KV cache memory: 52.25 GiB",
        "(Worker_TP1 pid=12) INFO [gpu_worker.py:760] Available KV cache memory: 52.25 GiB",
        "(EngineCore pid=10) INFO [kv_cache_utils.py:2327] GPU KV cache size: 1,712,384 tokens, "
        "Maximum concurrency for 32,768 tokens per request: 52.26x",
    ])
    mem = parse_engine_log(log)
    assert mem.weights_gib == 15.0 and mem.kv_cache_gib == 104.5
    assert (mem.device, mem.kv_cache_tokens, mem.max_model_len) == ("GPU", 1712384, 32768)


# --- bad input --------------------------------------------------------------------------------------------------------

def test_unreachable_endpoint_is_an_error_naming_it(tmp_path):
    with pytest.raises(QuantgateError) as err:
        probe(Endpoint("http://127.0.0.1:9/v1", "demo"), tmp_path, concurrency=[1])
    assert "cannot reach the endpoint http://127.0.0.1:9/v1/models" in err.value.message and "error rate 100%" in err.value.message
    assert not (tmp_path / "perf.json").exists()


def test_cli_unreachable_endpoint_exits_with_the_message(tmp_path):
    res = CliRunner().invoke(app, ["perf", "--endpoint", "http://127.0.0.1:9", "--model", "m", "--out", str(tmp_path)])
    assert res.exit_code != 0 and "127.0.0.1:9" in str(res.exception)


def test_endpoint_that_does_not_serve_the_model_lists_what_it_serves():
    with FakeServer(model="demo") as srv, pytest.raises(QuantgateError, match=r"does not serve 'other'.*\['demo'\]"):
        check_endpoint(Endpoint(srv.url, "other"))


@pytest.mark.parametrize("args, where", [
    (["--concurrency", "1,x"], "--concurrency"),
    (["--concurrency", "0"], "--concurrency"),
    (["--api-key-env", "QG_PERF_UNSET_VAR"], "--api-key-env"),
])
def test_cli_bad_options_name_the_option(tmp_path, args, where):
    res = CliRunner().invoke(app, ["perf", "--endpoint", "http://127.0.0.1:9", "--model", "m", "--out", str(tmp_path), *args])
    assert isinstance(res.exception, ConfigError) and user_error(res.exception).where == where


def test_checkpoint_without_safetensors_and_bad_plan_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        weights_bytes(tmp_path)
    (tmp_path / "a.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "b.safetensors").write_bytes(b"x" * 5)
    assert weights_bytes(tmp_path) == 15
    bad = tmp_path / "plan.json"
    bad.write_text('{"model": "m"}')
    with pytest.raises(ConfigError) as err:
        planner_kv(bad)
    assert err.value.where == str(bad) and "quantgate plan" in err.value.fix


def test_load_result_of_a_missing_folder_says_how_to_make_it(tmp_path):
    with pytest.raises(ConfigError, match="no probe result"):
        load_result(tmp_path)


# --- real probes (slow) -----------------------------------------------------------------------------------------------

class HalfFailingServer(FakeServer):
    """Streams chat completions like vLLM, but answers every other request with HTTP 500."""

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        if len(self.requests) % 2 == 0:
            return web.json_response({"error": {"message": "scripted overload"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body.get("max_completion_tokens") or body.get("max_tokens") or 4
        for i in range(n):
            chunk = {"choices": [{"index": 0, "delta": {"content": f" t{i}"}}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.001)
        usage = {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": n}}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return resp


@pytest.mark.slow
def test_server_erroring_under_load_is_an_error_with_its_rate(tmp_path, demo_model):
    with HalfFailingServer(model="demo") as srv:
        with pytest.raises(QuantgateError) as err:
            probe(Endpoint(srv.url, "demo"), tmp_path, concurrency=[2], num_prompts=8, input_len=16, output_len=4,
                  repeats=1,
                  warmups=0, tokenizer=demo_model)
    assert "4 of 8 requests failed at concurrency 2 (error rate 50.0%)" in err.value.message
    assert "Internal Server Error" in err.value.message  # vLLM's client keeps the HTTP reason; it comes along
    saved = load_result(tmp_path)
    assert saved.status == "error" and saved.runs[0].failed == 4 and saved.medians[0].error_rate == 0.5


@pytest.mark.slow
def test_real_probe_of_the_demo_model(tmp_path, demo_model, demo_server):
    srv = demo_server
    res = probe(srv.endpoint, tmp_path / "perf", concurrency=[1, 4], num_prompts=16, input_len=64, output_len=16,
                repeats=1, checkpoint=demo_model, server_log=srv.log_path)
    assert res.status == "ok" and res.error is None
    assert {m.concurrency for m in res.medians} == {1, 4}
    for r in res.runs:
        assert (r.completed, r.failed) == (16, 0)
        assert r.output_tokens == 16 * 16  # ignore-eos: exactly output_len tokens per request
        assert all(getattr(r, f) > 0 for f in ("output_tok_s", "requests_s", "ttft_p50_ms", "itl_p50_ms", "tpot_p50_ms"))
        assert r.ttft_p95_ms >= r.ttft_p50_ms and r.itl_p95_ms >= r.itl_p50_ms
        assert r.output_tok_s == pytest.approx(r.requests_s * 16, rel=0.01)  # tokens/s = requests/s x tokens per request
    assert res.weights_bytes == sum(f.stat().st_size for f in demo_model.glob("*.safetensors")) > 100e6
    assert res.engine.kv_cache_tokens > 0 and res.engine.kv_cache_gib == 1.0 and res.engine.max_model_len == 2048
    saved = json.loads((tmp_path / "perf" / "perf.json").read_text())
    assert saved["medians"][0]["output_tok_s"] > 0 and "vllm bench serve" in saved["commands"][0]
    self_cmp = compare(load_result(tmp_path / "perf"), load_result(tmp_path / "perf"))
    assert self_cmp["size_ratio"] == 1.0 and self_cmp["throughput_ratio"] == 1.0 and self_cmp["concurrency"] == 4


def test_planner_kv_from_a_plan_json_agrees_with_the_real_engine_log(tmp_path):
    from quantgate.plan.build import build_plan

    plan = build_plan(Path(__file__).parent / "data" / "model_configs" / "smollm2-135m.json", "x86-cpu", context=2048, concurrency=4)
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    kv = planner_kv(path)
    assert kv.context == 2048 and kv.kv_pool_gib_per_replica == 1.0
    engine = parse_engine_log((DATA / "vllm_cpu_server.log").read_text())  # same model, 1 GiB of KV on the CPU
    assert kv.kv_tokens_per_replica == pytest.approx(engine.kv_cache_tokens, rel=0.01)
    assert kv.concurrency_per_replica == pytest.approx(engine.kv_max_concurrency, rel=0.01)


def test_benchmark_client_that_crashes_counts_every_request_as_failed(tmp_path, monkeypatch):
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\necho 'ImportError: no vllm here'\nexit 3\n")
    fake_python.chmod(0o755)
    monkeypatch.setenv("QUANTGATE_SERVE_PYTHON", str(fake_python))
    with FakeServer(model="demo") as srv, pytest.raises(QuantgateError) as err:
        probe(Endpoint(srv.url, "demo"), tmp_path / "out", concurrency=[1, 4], num_prompts=5, repeats=2,
              tokenizer=tmp_path)
    assert "10 of 10 requests failed at concurrency 1 (error rate 100.0%)" in err.value.message  # both repeats pooled
    assert "exited with code 3" in err.value.message and "no vllm here" in err.value.message
    saved = load_result(tmp_path / "out")
    assert saved.status == "error" and all(m.output_tok_s is None and m.error_rate == 1.0 for m in saved.medians)


def test_cli_perf_compare_prints_and_writes_the_gate_view(tmp_path):
    for name, tok, size in (("base", 40.0, 1000), ("cand", 50.0, 400)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "perf.json").write_text(result(name, [run(1, tok=tok), run(8, tok=tok * 4)], size=size).model_dump_json())
    res = CliRunner().invoke(app, ["perf-compare", str(tmp_path / "base"), str(tmp_path / "cand"), "--at", "1",
                                   "--out", str(tmp_path / "cmp.json"), "--json"])
    assert res.exit_code == 0, res.output
    shown, saved = json.loads(res.output), json.loads((tmp_path / "cmp.json").read_text())
    assert shown == saved
    assert (saved["concurrency"], saved["size_ratio"], saved["throughput_ratio"]) == (1, 0.4, 1.25)
