"""The MLflow export (quantgate.publishing.mlflow_export, `quantgate export mlflow`) against a real MLflow tracking
server: `mlflow server` from .venv-mlflow (requirements/mlflow.lock; `make test` builds it) on a SQLite backend with
proxied artifacts, one server for the module.

The run folder is made by the project's own code on synthetic evidence: two candidates gated by the real gate under
the default policy (w4a16-gptq promoted, with its real serving plan, quantize manifest and local registry entry;
int8-w8a8 rejected, its recipe text longer than MLflow's 6000-character param limit), the release report written
by the real report code. What the export wrote is read back through MLflow's REST API and, for the registered
version, through MLflow's own client (a child process in .venv-mlflow)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from _gate_fixtures import make_run
from _publish_fixtures import CAND, gated_run
from typer.testing import CliRunner

from quantgate.base.errors import QuantgateError, SettingError
from quantgate.base.http import Retry
from quantgate.base.paths import REPO
from quantgate.cli.main import app
from quantgate.gate.evidence import gate_run
from quantgate.gate.policy import DEFAULT_POLICY
from quantgate.quantize.manifest import CalibrationRecord, QuantManifest
from quantgate.publishing import mlflow_export, registry
from quantgate.publishing.mlflow_client import Api
from quantgate.publishing.mlflow_content import MAX_PARAM_VALUE, Content, candidate_content, mlflow_key
from quantgate.publishing.mlflow_export import MlflowError, MlflowTarget, export_run, log_content, start_run
from quantgate.publishing.mlflow_read import read_release
from quantgate.report.page import write_report
from quantgate.serving.server import free_port, kill_tree

MLFLOW = REPO / ".venv-mlflow" / "bin" / "mlflow"
REJECTED = "int8-w8a8"
MODEL = "demo-model"
FAST = Retry(timeout_s=10.0, max_attempts=2, backoff_s=0.05, backoff_max_s=0.1)
run_cli = CliRunner().invoke


# --- the server and the run folder ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The URL of a real MLflow server on loopback; stopped (SIGTERM, then SIGKILL) when the module is done."""
    if not MLFLOW.exists():
        pytest.skip(".venv-mlflow is missing: `scripts/setup.sh mlflow` builds it (`make test` does)")
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    # no job runners (huey consumers, a temporary folder in /dev/shm): the export needs none, and they slow the stop
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true",
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    env = {k: v for k, v in env.items() if not k.startswith("MLFLOW_TRACKING_")}
    with (root / "server.log").open("wb") as log:
        proc = subprocess.Popen([str(MLFLOW), "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                                 "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1",
                                 "--port", str(port), "--workers", "1"],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            tail = (root / "server.log").read_text(errors="replace")[-2000:]
            assert proc.poll() is None, f"mlflow server exited {proc.returncode}:\n{tail}"
            assert time.monotonic() < deadline, f"mlflow server not healthy within 120 s:\n{tail}"
            time.sleep(0.3)
        yield url
    finally:
        kill_tree(proc.pid, grace_s=10)


def _dump(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    """A finished two-candidate run folder: gated, the promoted candidate in a local registry, summary and report."""
    root = tmp_path_factory.mktemp("release")
    run, ckpt, _ = gated_run(root / "promote")
    other = make_run(root / "reject", REJECTED, lose={"proper_nouns": 10})
    shutil.copytree(other / REJECTED, run / REJECTED)
    for rel in (f"compare/{REJECTED}.json", f"fidelity/{REJECTED}.json"):
        shutil.copy(other / rel, run / rel)
    recipe = (REPO / "quant_recipes" / f"{REJECTED}.yaml").read_text(encoding="utf-8")
    long_recipe = recipe + "".join(f"# calibration note {i}: {'x' * 60}\n" for i in range(120))
    _dump(run / REJECTED / "quantization.json", {"scheme": REJECTED, "recipe_file": f"quant_recipes/{REJECTED}.yaml",
                                                 "recipe_applied": long_recipe, "compression_ratio": 1.9})
    record = json.loads((run / "run.json").read_text(encoding="utf-8"))
    record["spec"] |= {"name": "demo", "model": "demo", "schemes": [CAND, REJECTED]}
    _dump(run / "run.json", record)
    decisions, _ = gate_run(run, DEFAULT_POLICY)
    by_name = {d.candidate: d for d in decisions}
    assert by_name[CAND].decision == "PROMOTE" and by_name[REJECTED].decision == "REJECT", \
        {d.candidate: d.reasons for d in decisions}
    entry = registry.promote(registry.Promotion(by_name[CAND], model="demo", version="v1", checkpoint=ckpt, run=run),
                             root=root / "registry")
    rows = {}
    for d in decisions:
        cmp_ = json.loads((run / "compare" / f"{d.candidate}.json").read_text(encoding="utf-8"))
        metrics = {f"{s}/{m}": v["overall"] for s, r in cmp_.items() for m, v in r["metrics"].items()}
        rows[d.candidate] = {"scheme": d.scheme, "size_bytes": 400, "size_ratio": 0.4, "decision": d.decision,
                             "metrics": metrics,
                             "regressions": sum(len(r["regressions"]) for r in cmp_.values()), "reasons": d.reasons,
                             "registry": entry.path if d.promoted else None}
    _dump(run / "summary.json", {"release": "demo", "run": "r-mlflow", "model": "demo", "hardware": "x86-cpu",
                                 "baseline": {"size_bytes": 1000, "parity": {"verdict": "pass", "reason": "ok"}},
                                 "candidates": rows, "decision": "PROMOTE", "promoted": [CAND],
                                 "policy": decisions[0].policy})
    write_report(run)
    return run


@pytest.fixture(scope="module")
def exported(server, release):
    """The first export of the run folder, and the lines it logged."""
    lines: list[str] = []
    return export_run(release, MlflowTarget(server, experiment="qg-test", model_name=MODEL), log=lines.append), lines


# --- reading MLflow back -------------------------------------------------------------------------------------------

def _api(url: str, method: str, endpoint: str, **kw) -> dict:
    resp = httpx.request(method, f"{url}/api/2.0/mlflow/{endpoint}", timeout=30, **kw)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _run(url: str, run_id: str) -> dict:
    """A run as MLflow holds it: info, and params, metrics and tags as dicts."""
    r = _api(url, "GET", "runs/get", params={"run_id": run_id})["run"]
    data = r.get("data") or {}
    return {"info": r["info"], "params": {p["key"]: p["value"] for p in data.get("params", [])},
            "metrics": {m["key"]: m["value"] for m in data.get("metrics", [])},
            "tags": {t["key"]: t["value"] for t in data.get("tags", [])}}


def _experiment_runs(url: str, experiment_id: str) -> list[dict]:
    body = {"experiment_ids": [experiment_id], "max_results": 1000}
    return _api(url, "POST", "runs/search", json=body).get("runs", [])


def _artifacts(url: str, run_id: str) -> dict[str, int]:
    files = _api(url, "GET", "artifacts/list", params={"run_id": run_id}).get("files", [])
    return {f["path"]: int(f.get("file_size", 0)) for f in files if not f.get("is_dir")}


def _artifact_bytes(url: str, run_id: str, path: str) -> bytes:
    """The artifact's bytes through the server's run-artifact download (not the upload's route)."""
    resp = httpx.get(f"{url}/get-artifact", params={"path": path, "run_uuid": run_id}, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.content


def _versions(url: str, run_id: str) -> list[dict]:
    found = _api(url, "GET", "model-versions/search", params={"filter": f"run_id = '{run_id}'"})
    return found.get("model_versions", [])


def _decision(release: Path, cand: str) -> dict:
    return json.loads((release / cand / "decision.json").read_text(encoding="utf-8"))


# --- the tests -----------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_run_per_variant_with_params_metrics_and_the_report(server, release, exported):
    result, lines = exported
    exp = _api(server, "GET", "experiments/get-by-name", params={"experiment_name": "qg-test"})["experiment"]
    assert exp["experiment_id"] == result.experiment_id and not result.reused
    assert set(result.runs) == {"baseline", CAND, REJECTED}
    in_experiment = {r["info"]["run_id"] for r in _experiment_runs(server, result.experiment_id)}
    assert in_experiment == {result.parent_run_id, *result.runs.values()}  # nothing else written
    assert any(CAND in ln and "registered" in ln for ln in lines)

    parent = _run(server, result.parent_run_id)
    assert parent["info"]["status"] == "FINISHED" and parent["info"]["run_name"] == "r-mlflow"
    assert parent["tags"]["quantgate.decision"] == "PROMOTE" and parent["tags"]["quantgate.promoted"] == CAND
    assert parent["params"]["policy.name"] == "default"
    for name, run_id in result.runs.items():
        r = _run(server, run_id)
        assert r["info"]["status"] == "FINISHED" and r["info"]["run_name"] == name
        assert r["tags"]["mlflow.parentRunId"] == result.parent_run_id
        assert (r["tags"]["quantgate.release"], r["tags"]["quantgate.run"]) == ("demo", "r-mlflow")
        assert r["tags"]["quantgate.run_path"] == str(release.resolve())
        files = _artifacts(server, run_id)
        for report in ("report.html", "report.md"):
            assert files[report] == (release / report).stat().st_size
        assert _artifact_bytes(server, run_id, "report.html") == (release / "report.html").read_bytes()

    for cand, verdict in ((CAND, "PROMOTE"), (REJECTED, "REJECT")):
        r = _run(server, result.runs[cand])
        decision = _decision(release, cand)
        assert r["tags"]["quantgate.decision"] == verdict == decision["decision"]
        assert r["params"]["scheme"] == cand and r["params"]["policy.sha256"] == decision["policy"]["sha256"]
        numeric = [c for c in decision["checks"] if isinstance(c["measured"], (int, float))
                   and not isinstance(c["measured"], bool)]
        assert len(numeric) >= 5
        for c in numeric:  # every gated figure, its limit and its outcome, under the check's own name
            key = mlflow_key(f"check.{c['name']}")
            assert r["metrics"][key] == c["measured"], key
            if isinstance(c["limit"], (int, float)):
                assert r["metrics"][f"{key}.limit"] == c["limit"]
            if c["outcome"] != "skipped":
                assert r["metrics"][f"{key}.passed"] == (1.0 if c["outcome"] == "pass" else 0.0)
        kl = r["metrics"]["check.fidelity:kl"]  # the interval the gate judged, around the figure it states
        assert r["metrics"]["check.fidelity:kl.bound_low"] <= kl <= r["metrics"]["check.fidelity:kl.bound_high"]
        assert _artifact_bytes(server, result.runs[cand], "decision.json") == \
            (release / cand / "decision.json").read_bytes()
        assert "quantization.json" in _artifacts(server, result.runs[cand])
    promoted = _run(server, result.runs[CAND])
    assert promoted["params"]["layout.tp"] == "1" and "--max-num-seqs 4" in promoted["params"]["vllm_args"]
    assert promoted["params"]["recipe_file"].endswith(f"{CAND}.yaml")
    assert "plan.json" in _artifacts(server, result.runs[CAND])
    summary = json.loads((release / "summary.json").read_text(encoding="utf-8"))
    row = summary["candidates"][CAND]["metrics"]["default/exact_match"]
    assert promoted["metrics"]["eval.default/exact_match.delta"] == row["delta"]
    base = _run(server, result.runs["baseline"])
    assert base["metrics"]["eval.default/exact_match.mean"] == row["base_mean"]
    assert base["tags"]["quantgate.role"] == "baseline" and "quantgate.decision" not in base["tags"]


@pytest.mark.slow
def test_promote_is_a_registered_version_tagged_with_the_decision_and_reject_is_none(server, release, exported):
    result, _ = exported
    assert [(v.name, v.version, v.candidate) for v in result.registered] == [(MODEL, "1", CAND)]
    (version,) = _versions(server, result.runs[CAND])
    tags = {t["key"]: t["value"] for t in version.get("tags", [])}
    assert version["name"] == MODEL and tags["quantgate.decision"] == "PROMOTE"
    assert tags["quantgate.run"] == str(release.resolve()) and tags["quantgate.candidate"] == CAND
    entry = json.loads((release / "summary.json").read_text(encoding="utf-8"))["candidates"][CAND]["registry"]
    assert tags["quantgate.registry_entry"] == entry and tags["quantgate.checkpoint"] == str(Path(entry) / "checkpoint")
    assert _versions(server, result.runs[REJECTED]) == [] and _versions(server, result.runs["baseline"]) == []
    # MLflow's own client resolves the version to its source: the pointer to the checkpoint
    script = ("import json, sys, mlflow\n"
              "mlflow.set_tracking_uri(sys.argv[1])\n"
              "path = mlflow.artifacts.download_artifacts(f'models:/{sys.argv[2]}/1', dst_path=sys.argv[3])\n"
              "print(open(path.rstrip('/') + '/quantgate-checkpoint.json').read())\n")
    out = subprocess.run([str(MLFLOW.parent / "python"), "-c", script, server, MODEL, str(release.parent / "dl")],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"})
    assert out.returncode == 0, out.stderr[-2000:]
    pointer = json.loads(out.stdout)
    assert pointer["candidate"] == CAND and pointer["registry_entry"] == entry and pointer["checkpoint_sha256"]


@pytest.mark.slow
def test_exporting_again_writes_nothing_and_a_cut_export_is_marked_failed(server, release, exported):
    result, _ = exported
    before = {r["info"]["run_id"] for r in _experiment_runs(server, result.experiment_id)}
    again = export_run(release, MlflowTarget(server, experiment="qg-test", model_name=MODEL), log=lambda _: None)
    assert again.reused and again.parent_run_id == result.parent_run_id and again.runs == result.runs
    assert [(v.name, v.version) for v in again.registered] == [(MODEL, "1")]
    assert {r["info"]["run_id"] for r in _experiment_runs(server, result.experiment_id)} == before
    res = run_cli(app, ["export", "mlflow", str(release), "--tracking-uri", server, "--experiment", "qg-test",
                        "--model-name", MODEL])
    assert res.exit_code == 0 and "(exported before)" in res.output, res.output

    class Cut(Exception):
        pass

    def cut(line: str) -> None:
        if "baseline" in line:
            raise Cut(line)

    with pytest.raises(Cut):  # stopped after the baseline's run: the parent is left RUNNING
        export_run(release, MlflowTarget(server, experiment="qg-cut"), log=cut)
    exp = _api(server, "GET", "experiments/get-by-name", params={"experiment_name": "qg-cut"})["experiment"]
    exp_id = exp["experiment_id"]
    cut_runs = {r["info"]["run_id"]: r["info"]["status"] for r in _experiment_runs(server, exp_id)}
    assert sorted(cut_runs.values()) == ["FINISHED", "RUNNING"]
    whole = export_run(release, MlflowTarget(server, experiment="qg-cut"), log=lambda _: None)
    assert not whole.reused and whole.registered[0].name == "demo"  # the release's name by default
    statuses = {r["info"]["run_id"]: r["info"]["status"] for r in _experiment_runs(server, exp_id)}
    assert all(statuses[rid] == "FAILED" for rid, s in cut_runs.items() if s == "RUNNING")
    assert all(statuses[rid] == "FINISHED" for rid in (whole.parent_run_id, *whole.runs.values()))


@pytest.mark.slow
def test_long_values_and_many_figures_fit_mlflows_limits(server, release, exported):
    result, _ = exported
    r = _run(server, result.runs[REJECTED])
    full = json.loads((release / REJECTED / "quantization.json").read_text(encoding="utf-8"))["recipe_applied"]
    assert len(full) > MAX_PARAM_VALUE and len(r["params"]["recipe"]) == MAX_PARAM_VALUE
    assert "recipe.yaml" in r["params"]["recipe"]  # the cut param says where the full text is
    assert _artifact_bytes(server, result.runs[REJECTED], "recipe.yaml").decode("utf-8") == full
    # more than one log-batch call holds: 1500 metrics, 250 params, 250 tags, keys MLflow would refuse as given
    c = Content()
    for i in range(1500):
        c.metric(f"m/{i}", i / 7)
    for i in range(250):
        c.param(f"p.{i}", "v" * 100)
        c.tag(f"t {i}", i)
    c.metric("bad|key//./x/", 1.5)
    api = Api(server, None, FAST)
    try:
        run_id, _ = start_run(api, result.experiment_id, "limits", {})
        log_content(api, run_id, c)
    finally:
        api.close()
    got = _run(server, run_id)
    assert len(got["params"]) == 250 and got["metrics"]["m/1499"] == 1499 / 7
    assert got["metrics"]["bad_key/_/x"] == 1.5 and sum(k.startswith("t ") for k in got["tags"]) == 250


def test_an_unreachable_server_raises_naming_the_url_and_bad_input_is_refused(tmp_path, release, monkeypatch):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(MlflowError) as err:
        export_run(release, MlflowTarget(url, retry=FAST), log=lambda _: None)
    assert url in err.value.render() and "experiments/get-by-name" in err.value.call
    assert "ConnectError" in err.value.detail and "after 2 attempts" in err.value.detail
    monkeypatch.setattr(mlflow_export, "RETRY", FAST)
    res = run_cli(app, ["export", "mlflow", str(release), "--tracking-uri", url])
    assert res.exit_code == 1 and url in res.output  # the server failed: 1
    res = run_cli(app, ["export", "mlflow", str(tmp_path / "nope"), "--tracking-uri", url])
    assert res.exit_code == 2 and "no run folder" in res.output  # bad input: 2 (main() turns the errors below into 2)
    with pytest.raises(SettingError, match="not an MLflow server URL"):
        export_run(release, MlflowTarget("file:///tmp/mlruns"), log=lambda _: None)
    with pytest.raises(SettingError, match="no '/' or ':'"):
        export_run(release, MlflowTarget(url, model_name="team/model"), log=lambda _: None)
    unfinished = tmp_path / "unfinished"
    shutil.copytree(release, unfinished)
    (unfinished / "summary.json").unlink()
    with pytest.raises(QuantgateError, match="did not finish") as err:
        export_run(unfinished, MlflowTarget(url), log=lambda _: None)
    assert not isinstance(err.value, MlflowError)


def test_quantization_json_is_read_through_the_quantize_manifest_and_logs_the_same_params(tmp_path, release):
    """quantization.json as the release writes it (quantize.manifest.QuantManifest): the export logs scheme, recipe
    and the calibration's source, samples, max_seq_length and seed, not its hash or counts (as before the model)."""
    run = tmp_path / "run"
    shutil.copytree(release, run)
    QuantManifest(format=1, key="k", scheme=REJECTED, recipe_file="r.yaml", recipe_applied="x: 1\n",
                  calibration=CalibrationRecord(source="cal.jsonl", sha256="abc", samples=4, available=9,
                                                max_seq_length=256, seed=0, tokens=77),
                  compression_ratio=1.9).write_run_copy(run / REJECTED / "quantization.json", reused=False)
    rel = read_release(run)
    v = next(v for v in rel.variants if v.name == REJECTED)
    assert isinstance(v.quantization, QuantManifest) and v.quantization.compression_ratio == 1.9
    params = candidate_content(rel, v, log=lambda _: None).params
    assert {k: p for k, p in params.items() if k.startswith("calibration.")} == {
        "calibration.source": "cal.jsonl", "calibration.samples": "4", "calibration.max_seq_length": "256",
        "calibration.seed": "0"}
    assert params["recipe_file"] == "r.yaml" and params["recipe"] == "x: 1\n"
