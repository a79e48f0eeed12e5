"""When a cached measurement counts as done (quantgate.release.cachelayout): perf.json read through
quantgate.perf.models.PerfResult (status ok), an eval run's manifest.json through quantgate.evals.manifestfile (status
complete); a missing, corrupt or unfit file is not done, and never an error."""

from __future__ import annotations

import json

import pytest

from quantgate.evals.manifestfile import EvalManifest
from quantgate.perf.models import PerfResult, Workload
from quantgate.release.cachelayout import eval_complete, perf_ok


def _perf(status: str) -> PerfResult:
    return PerfResult(client="vllm bench serve", endpoint="http://127.0.0.1:8000", model="m",
                      workload=Workload(num_prompts=4, input_len=8, output_len=4, tokenizer="t"), concurrency=[1],
                      repeats=1, runs=[], medians=[], status=status, started="2026-01-01T00:00:00", seconds=1.0)


@pytest.mark.parametrize("status, done", [("ok", True), ("error", False)])
def test_perf_ok_reads_the_probe_result(tmp_path, status, done):
    (tmp_path / "perf.json").write_text(_perf(status).model_dump_json(indent=2))
    assert perf_ok(tmp_path) is done


@pytest.mark.parametrize("content", [None, "{", b"\xff\xfe", "[1]", '{"status": "ok"}'])
def test_a_missing_corrupt_or_unfit_perf_json_is_not_done(tmp_path, content):
    if content is not None:
        (tmp_path / "perf.json").write_bytes(content if isinstance(content, bytes) else content.encode())
    assert perf_ok(tmp_path) is False


@pytest.mark.parametrize("status, done", [("complete", True), ("partial", False), ("running", False),
                                          ("failed", False)])
def test_eval_complete_reads_the_manifest(tmp_path, status, done):
    EvalManifest(schema=1, status=status, cache_key="k").write(tmp_path / "manifest.json")
    assert eval_complete(tmp_path) is done


@pytest.mark.parametrize("content", [None, "{", b"\xff\xfe", "[1]", '{"status": 3}', '{"kind": "lm_eval"}'])
def test_a_missing_corrupt_or_unfit_manifest_is_not_complete(tmp_path, content):
    if content is not None:
        (tmp_path / "manifest.json").write_bytes(content if isinstance(content, bytes) else content.encode())
    assert eval_complete(tmp_path) is False


def test_an_lm_eval_run_and_a_newer_writers_keys_count(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"kind": "lm_eval", "status": "complete", "new": [1]}))
    assert eval_complete(tmp_path) is True
