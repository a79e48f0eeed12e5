"""An eval run's manifest.json through its models (quantgate.evals.manifestfile): a JSONL set's run and an lm-eval
task's run keep their keys in their writers' orders; readers pick the model by `kind`; the status check is lenient."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from quantgate.base.typedfile import RunFileError
from quantgate.evals import lmeval
from quantgate.evals import run as evrun
from quantgate.evals.client import ClientConfig
from quantgate.evals.manifestfile import (ClientStats, EvalManifest, LmEvalManifest, LmEvalTaskRef, parse_manifest,
                                          read_manifest, read_status)
from quantgate.gate.evidence import _eval_error_rate
from quantgate.base.http import Endpoint

RUNNING = ["schema", "status", "cache_key", "evalset", "model", "model_hash", "endpoint", "engine_version", "decoding",
           "default_max_tokens", "limit", "n_samples", "started_at"]


def _running(out: Path) -> EvalManifest:
    es = types.SimpleNamespace(path=Path("/s.jsonl"), sha256="ab" * 32,
                               meta=types.SimpleNamespace(name="s", version=2, default_max_tokens=32))
    m = evrun._manifest(es, ClientConfig(endpoint="http://h:1", model="m"), {"engine_version": None}, model_hash=None,
                        limit=None, n_samples=4)
    evrun._claim(out, m)
    return m


def _keys(out: Path) -> list[str]:
    return list(json.loads((out / "manifest.json").read_text(encoding="utf-8")))


def test_a_set_run_keeps_its_keys_in_order_through_its_states(tmp_path):
    m = _running(tmp_path)
    doc = json.loads((tmp_path / "manifest.json").read_text(encoding="utf-8"))
    assert list(doc) == RUNNING and doc["model_hash"] is None and list(doc["evalset"]) == ["path", "name", "version",
                                                                                            "sha256"]
    m.model_copy(update={"status": "failed", "error": "e", "error_rate": 0.5}).write(tmp_path / "manifest.json")
    assert _keys(tmp_path) == [*RUNNING, "error", "error_rate"]
    m.model_copy(update={"status": "complete", "finished_at": "t", "n_failed": 0,
                         "client": ClientStats(answered_now=4, failed_now=0, skipped=0, elapsed_s=1.0)}
                 ).write(tmp_path / "manifest.json")
    assert _keys(tmp_path) == [*RUNNING, "finished_at", "n_failed", "client"]
    assert evrun.is_complete(tmp_path) and evrun.is_scored(tmp_path)
    assert isinstance(read_manifest(tmp_path / "manifest.json"), EvalManifest)


def test_a_directory_of_another_run_is_refused_naming_what_differs(tmp_path):
    _running(tmp_path)
    es = types.SimpleNamespace(path=Path("/s.jsonl"), sha256="ab" * 32,
                               meta=types.SimpleNamespace(name="s", version=2, default_max_tokens=32))
    other = evrun._manifest(es, ClientConfig(endpoint="http://h:1", model="other"), {"engine_version": None},
                            model_hash=None, limit=None, n_samples=4)
    with pytest.raises(Exception, match="differs in: model"):
        evrun._claim(tmp_path, other)


def test_an_lm_eval_run_keeps_its_own_order(tmp_path):
    m = LmEvalManifest(schema=1, kind="lm_eval", status="running", cache_key="k",
                       evalset=LmEvalTaskRef(path="/t.yaml", name="lm_eval:t", task="t", sha256="d", version=1.0),
                       model="m", model_hash=None, endpoint="e", engine_version="v", decoding={"seed": 0}, limit=None,
                       started_at="s")
    lmeval._claim(tmp_path, m)
    start = ["schema", "kind", "status", "cache_key", "evalset", "model", "model_hash", "endpoint", "engine_version",
             "decoding", "limit", "started_at"]
    assert _keys(tmp_path) == start
    done = m.model_copy(update={"n_samples": 5, "n_failed": 1, "filter": "f", "samples_file": "x", "elapsed_s": 1.0})
    lmeval._fail(tmp_path / "manifest.json", done, "too many", "w", error_rate=0.2)
    assert _keys(tmp_path) == [*start, "n_samples", "n_failed", "filter", "samples_file", "elapsed_s", "error",
                               "error_rate"]
    back = read_manifest(tmp_path / "manifest.json")
    assert isinstance(back, LmEvalManifest) and back.status == "failed" and back.evalset.version == 1.0
    assert read_status(tmp_path) == "failed" and not evrun.is_scored(tmp_path)


@pytest.mark.parametrize("text", [None, "{torn", "[1]", '{"status": 3}'])
def test_the_status_check_is_lenient(tmp_path, text):
    if text is not None:
        (tmp_path / "manifest.json").write_text(text)
    assert read_status(tmp_path) is None and not evrun.is_complete(tmp_path)


def test_load_run_refuses_a_missing_manifest_naming_it(tmp_path):
    with pytest.raises(RunFileError, match="missing file"):
        evrun.load_run(tmp_path)


def test_the_gate_reads_a_failed_runs_error_rate_through_the_model(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"status": "failed", "error_rate": 0.25, "n_samples": 8,
                                                        "kind": "lm_eval"}))
    rate = _eval_error_rate("cand", "set", tmp_path)
    assert (rate.rate, rate.n) == (0.25, 8)
    assert parse_manifest({"status": "running"}).status == "running"


def test_a_run_that_fails_after_its_claim_leaves_its_manifest_failed_not_running(tmp_path, monkeypatch):
    """Anything that stops the run after the manifest is claimed (here scoring) is written into it, so that the
    run is not shown as running forever; the error still reaches the caller."""
    from _fake_openai import FakeServer

    def broken(*_args, **_kwargs):
        raise RuntimeError("scoring broke")

    monkeypatch.setattr(evrun, "_score", broken)
    out = tmp_path / "run"
    with FakeServer() as server, pytest.raises(RuntimeError, match="scoring broke"):
        evrun.run_eval(Path(__file__).parents[1] / "eval_sets" / "default.jsonl", Endpoint(server.url, "fake-model"),
                       out,
                       limit=3, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["error"] == "RuntimeError: scoring broke", manifest
