"""The eval client against a fake OpenAI-compatible server: retries, resume, kill-and-resume, error-rate stop."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
from _fake_openai import FakeServer

from quantgate.evals.client import ClientConfig, ErrorRateExceeded, Request, read_results, run


def reqs(n: int, max_tokens: int = 8) -> list[Request]:
    return [Request(f"id{k:03d}", [{"role": "user", "content": f"p{k}"}], max_tokens) for k in range(n)]


def cfg(server: FakeServer, **kw) -> ClientConfig:
    base = dict(endpoint=server.url, model="fake-model", backoff_s=0.005, backoff_max_s=0.02, progress=False,
                concurrency=4, max_error_rate=0.5)
    return ClientConfig(**{**base, **kw})


@pytest.fixture
def server():
    with FakeServer() as s:
        yield s


# (scripted actions for prompt p0, attempts expected, error expected (substring) or None)
RETRY_CASES = [
    (["500", "429", "ok"], 3, None),
    (["drop", "ok"], 2, None),
    (["429", "drop", "500", "ok"], 4, None),
    (["400"], 1, "HTTP 400"),  # other 4xx: no retry
    (["500"] * 5, 5, "HTTP 500"),  # gives up after max_attempts
    (["drop"] * 5, 5, "Error"),
    (["slow", "ok"], 2, None),  # the per-request timeout (0.3 s here) counts as a retryable failure
    (["slow", "slow"], 2, "no answer within 0.3 s"),
]


@pytest.mark.parametrize("script,attempts,error", RETRY_CASES)
def test_retries(server, tmp_path, script, attempts, error):
    server.script = {"p0": script}
    attempts_allowed = 2 if "slow" in script else 5
    run(reqs(1), tmp_path / "r.jsonl", cfg(server, max_error_rate=1.0, timeout_s=0.3, max_attempts=attempts_allowed))
    rec = read_results(tmp_path / "r.jsonl")["id000"]
    assert rec["attempts"] == attempts == server.calls["p0"]
    if error is None:
        assert rec["error"] is None and rec["output"] == "echo: p0" and rec["finish_reason"] == "stop"
    else:
        assert error in rec["error"] and rec["output"] is None


def test_record_fields_and_deterministic_decoding(server, tmp_path):
    run(reqs(3, max_tokens=7), tmp_path / "r.jsonl", cfg(server, seed=11))
    recs = read_results(tmp_path / "r.jsonl")
    assert set(recs) == {"id000", "id001", "id002"}
    assert set(recs["id001"]) == {"id", "output", "finish_reason", "usage", "latency_s", "elapsed_s", "attempts", "error"}
    assert recs["id001"]["usage"]["completion_tokens"] == 2
    for body in server.requests:
        assert (body["temperature"], body["top_p"], body["seed"], body["max_tokens"]) == (0.0, 1.0, 11, 7)


def test_rerun_skips_answered_and_retries_failed(server, tmp_path):
    server.script = {"p1": ["400"], "p3": ["400"]}
    path = tmp_path / "r.jsonl"
    first = run(reqs(6), path, cfg(server))
    assert (first.answered, first.failed) == (4, 2)
    second = run(reqs(6), path, cfg(server))
    assert (second.skipped, second.answered, second.failed) == (4, 2, 0)
    assert all(server.calls[f"p{k}"] == (2 if k in (1, 3) else 1) for k in range(6))
    assert all(r["error"] is None for r in read_results(path).values())
    third = run(reqs(6), path, cfg(server))
    assert (third.skipped, third.answered) == (6, 0)


def test_torn_last_line_is_repaired(server, tmp_path):
    path = tmp_path / "r.jsonl"
    run(reqs(2), path, cfg(server))
    with path.open("a") as fh:
        fh.write('{"id": "id002", "outp')  # a write cut by a kill
    run(reqs(4), path, cfg(server))
    lines = path.read_text().splitlines()
    assert [json.loads(l)["id"] for l in lines[2:]] and all(json.loads(l) for l in lines)
    assert Counter(json.loads(l)["id"] for l in lines) == {f"id{k:03d}": 1 for k in range(4)}


CHILD = """
import json, sys
from quantgate.evals.client import ClientConfig, Request, run
url, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
reqs = [Request(f"id{k:03d}", [{"role": "user", "content": f"p{k}"}], 8) for k in range(n)]
run(reqs, path, ClientConfig(endpoint=url, model="fake-model", concurrency=4, progress=False))
"""


def test_kill_half_way_then_resume_answers_every_id_exactly_once(tmp_path):
    n, path = 80, tmp_path / "r.jsonl"
    with FakeServer(delay_s=0.05) as server:
        child = subprocess.Popen([sys.executable, "-c", CHILD, server.url, str(path), str(n)])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (not path.exists() or path.read_text().count("\n") < n // 3):
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        before = read_results(path)
        assert n // 3 <= len(before) < n, "the kill must land half-way"
        calls_at_kill = dict(server.calls)
        stats = run(reqs(n), path, ClientConfig(endpoint=server.url, model="fake-model", concurrency=4, progress=False))
    ids = Counter(json.loads(l)["id"] for l in path.read_text().splitlines())
    assert ids == {f"id{k:03d}": 1 for k in range(n)}  # every id once, nothing lost, nothing doubled
    assert stats.skipped == len(before)
    for rid in before:  # what was answered before the kill is not asked again
        prompt = f"p{int(rid[2:])}"
        assert server.calls[prompt] == calls_at_kill[prompt] == 1


def test_error_rate_above_limit_stops_the_run(server, tmp_path):
    server.default_action = "500"
    with pytest.raises(ErrorRateExceeded) as err:
        run(reqs(60), tmp_path / "r.jsonl", cfg(server, max_attempts=2, max_error_rate=0.2, min_for_rate=10))
    assert err.value.share == 1.0 and "above the limit of 20.0%" in err.value.render()
    assert 10 <= err.value.finished < 60  # stopped early
    assert len(read_results(tmp_path / "r.jsonl")) == err.value.finished  # and wrote what it had


@pytest.mark.parametrize("n,failing,limit,stops", [
    (30, 1, 0.05, False),  # 3.3 % failed
    (30, 2, 0.05, True),  # 6.7 % failed
    (3, 1, 0.05, True),  # fewer samples than min_for_rate: judged at the end
    (3, 1, 0.5, False),
])
def test_error_rate_limit_table(server, tmp_path, n, failing, limit, stops):
    server.script = {f"p{k}": ["400"] for k in range(n - failing, n)}  # the last ones: judged at the end
    job = lambda: run(reqs(n), tmp_path / "r.jsonl", cfg(server, max_error_rate=limit))  # noqa: E731
    if stops:
        with pytest.raises(ErrorRateExceeded, match=f"{failing} of {n} requests failed"):
            job()
    else:
        assert job().failed == failing


def test_progress_bar_runs(server, tmp_path, capsys):
    run(reqs(5), tmp_path / "r.jsonl", cfg(server, progress=True))
    assert len(read_results(tmp_path / "r.jsonl")) == 5
