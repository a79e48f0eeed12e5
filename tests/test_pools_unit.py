"""The pure parts of a release on work pools (quantgate.pools.executor, pools_child) on a store that is a local path:
the executor section, paths moved between hosts' results roots, how an unfinished child is recorded, when a silent
child counts as lost, and the checkpoint and registry entry that a promotion moves through the store."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from quantgate.base.errors import QuantgateError
from quantgate.base.objstore import ResultStore
from quantgate.gate.failurefile import serving_failure
from quantgate.pools import executor as pools
from quantgate.pools.child import ALIVE, rebased
from quantgate.spec.sections import ExecutorSpec
from quantgate.release.variants import Variant


def _spec(tmp_path: Path, **executor):
    from quantgate.spec.schema import ReleaseSpec

    return ReleaseSpec.model_validate({"version": 1, "name": "u", "model": "demo", "hardware": "x86-cpu",
                                       "schemes": ["int8-w8a8"], "executor": {"kind": "pools", **executor}})


def test_the_executor_section_needs_a_store_for_pools_and_names_pools_per_variant():
    with pytest.raises(ValidationError, match="needs `store`"):
        ExecutorSpec(kind="pools")
    e = ExecutorSpec(kind="pools", store="s3://b/p", pools={"baseline": "big", "default": "small"})
    assert (e.pool_for("baseline", "x86-cpu"), e.pool_for("int8-w8a8", "x86-cpu")) == ("big", "small")
    assert ExecutorSpec().kind == "local" and ExecutorSpec().pool_for("int8-w8a8", "x86-cpu") == "x86-cpu"


def test_paths_under_the_writers_results_root_move_under_the_readers():
    ev = {"folder": "/w/results/runs/r/baseline", "evals": {"d": "/w/results/cache/variants/k/evals/d-1"},
          "serve_command": ["vllm", "serve", "/w/results-old/x", "/w/results"], "n": 3}
    out = rebased(ev, "/w/results", "/me/res")
    assert out == {"folder": "/me/res/runs/r/baseline", "evals": {"d": "/me/res/cache/variants/k/evals/d-1"},
                   "serve_command": ["vllm", "serve", "/w/results-old/x", "/me/res"], "n": 3}


def test_an_unfinished_candidate_is_a_recorded_failure_and_an_unfinished_baseline_stops_the_release(tmp_path,
                                                                                                     monkeypatch):
    monkeypatch.setenv("QUANTGATE_RESULTS", str(tmp_path / "results"))
    run = tmp_path / "results" / "runs" / "r1"
    store = ResultStore(str(tmp_path / "store"), tmp_path / "results")
    child = pools.Child("int8-w8a8", "cpu-b", attempt=1, flow_run_id="f1", ended="its host was lost (no sign of life)",
                        history=["its host was lost (Crashed)", "its host was lost (no sign of life)"])
    ev = pools._collect(store, run, child)
    assert ev.failure is not None and "cpu-b" in ev.failure and "its host was lost" in ev.failure
    error = json.loads((run / "int8-w8a8" / "error.json").read_text())
    assert error["flow_run"] == "f1" and error["detail"].count("its host was lost") == 2
    assert json.loads((run / "int8-w8a8" / "evidence.json").read_text())["failure"] == ev.failure
    check = serving_failure(run, "int8-w8a8")  # as the gate reads it
    assert check is not None and (check.outcome, check.measured, check.reason) == ("fail", "measure", ev.failure)
    with pytest.raises(QuantgateError, match="the baseline's flow run on pool cpu-a did not measure it"):
        pools._collect(store, run, pools.Child("baseline", "cpu-a", flow_run_id="f0", ended="its flow run ended Failed"))


def test_a_running_child_is_lost_when_its_last_sign_of_life_is_too_old(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTGATE_RESULTS", str(tmp_path / "results"))
    run = tmp_path / "results" / "runs" / "r1"
    store = ResultStore(str(tmp_path / "store"), tmp_path / "results")
    child = pools.Child("baseline", "cpu-a", flow_run_id="f9")
    started = time.time()
    assert not pools._lost(store, run, child, started, after_s=30)  # no beat yet: counted from its start
    assert pools._lost(store, run, child, started - 31, after_s=30)
    beat = run / ALIVE / "f9"
    beat.mkdir(parents=True)
    (beat / "beat").write_text("now")
    store.push(f"runs/r1/{ALIVE}/f9")
    assert not pools._lost(store, run, child, started - 3600, after_s=30)  # a fresh beat keeps it alive


def test_a_promoted_checkpoint_and_its_registry_entry_go_through_the_store(tmp_path, monkeypatch):
    url = str(tmp_path / "store")
    monkeypatch.setenv("QUANTGATE_RESULTS", str(tmp_path / "host"))
    ckpt = tmp_path / "host" / "checkpoints" / "abc-int8-w8a8-key"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"weights")
    ResultStore(url, tmp_path / "host").push("checkpoints/abc-int8-w8a8-key")
    spec = _spec(tmp_path, store=url)
    monkeypatch.setenv("QUANTGATE_RESULTS", str(tmp_path / "parent"))
    variant = Variant(name="int8-w8a8", path=tmp_path / "parent" / "checkpoints" / "abc-int8-w8a8-key",
                      scheme="int8-w8a8", content_hash="h", size_bytes=7, origin="quantized")
    pools.pull_checkpoint(spec, variant)
    assert (variant.path / "model.safetensors").read_bytes() == b"weights"
    missing = variant.model_copy(update={"path": tmp_path / "parent" / "checkpoints" / "other"})
    with pytest.raises(QuantgateError, match="checkpoint is not on the store"):
        pools.pull_checkpoint(spec, missing)
    entry = tmp_path / "parent" / "registry" / "demo" / "v1"
    entry.mkdir(parents=True)
    (entry / "manifest.json").write_text("{}")
    pools.share_entry(spec, Path(entry))
    assert ResultStore(url, tmp_path / "third").pull("registry/demo/v1") is not None


def test_a_pools_release_is_refused_before_any_work_without_what_it_needs(tmp_path, monkeypatch):
    from quantgate.base.errors import SettingError
    from quantgate.base.paths import REPO
    from quantgate.cli.release import executor_overrides

    spec = tmp_path / "spec.yaml"
    spec.write_text(f"version: 1\nname: u\nmodel: demo\nhardware: x86-cpu\nschemes: [int8-w8a8]\nrecall: null\n"
                    f"eval_sets: [{REPO / 'eval_sets' / 'default.jsonl'}]\n")
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert executor_overrides(spec, None, None) is None  # local: nothing to check
    with pytest.raises(SettingError, match="needs `store`"):
        executor_overrides(spec, "pools", None)
    with pytest.raises(QuantgateError, match="cannot open the results store nosuchfs://b/p"):
        executor_overrides(spec, "pools", "nosuchfs://b/p")
    with pytest.raises(SettingError, match="needs the Prefect server"):
        executor_overrides(spec, "pools", str(tmp_path / "store"))
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    assert executor_overrides(spec, "pools", str(tmp_path / "store")) == {"kind": "pools", "store": str(tmp_path / "store")}
