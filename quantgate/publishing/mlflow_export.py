"""Export a finished release run to an MLflow tracking server (adapter): a run per variant under a parent run for
the release, and for each PROMOTE candidate a version in MLflow's model registry (docs/mlflow.md).

    experiment     `experiment`, default `quantgate-<release>`: found by name, created when missing
    parent run     named after the run id: the overall decision, the report, summary, decision and run record
    variant runs   the baseline and each candidate, nested under the parent (tag mlflow.parentRunId): params,
                   metrics, tags and artifacts of release.mlflow_content (scheme, recipe, plan; every gated figure
                   with its limit and bound; the report, the decision)
    registry       a PROMOTE candidate: the registered model `model_name` (default: the release's name), created
                   when missing, gets a version whose source is the candidate run's `model` artifact folder, which
                   holds a pointer to the checkpoint (the server accepts no local path outside a run's artifacts;
                   the weights stay where the release put them), tagged quantgate.decision=PROMOTE, the run's path,
                   the checkpoint and the local registry entry

The calls are release.mlflow_client's (httpx, retries, MlflowError naming URL, call and the server's message),
within MLflow's per-call limits: at most 1000 metrics, 100 params and 100 tags per log-batch.

Re-exporting is idempotent: every run carries `quantgate.export_key`, a hash of the run's decision.json and the
model name. When the experiment holds a FINISHED parent run with that key (the parent is finished last), the
export returns its runs and versions and writes nothing. An export cut short leaves its parent RUNNING: the next
one marks the RUNNING runs of that key FAILED and exports afresh. A run gated again is a new export.
"""

from __future__ import annotations

import hashlib
import json
import mimetypes
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from quantgate.base.errors import QuantgateError, SettingError
from quantgate.base.http import Retry
from quantgate.base.runfiles import DECISION
from quantgate.publishing.mlflow_client import RETRY, Api, MlflowError, artifact_url, base_url, shown
from quantgate.publishing.mlflow_content import (MAX_TAG_VALUE, Content, baseline_content, candidate_content, cut,
                                              parent_content)
from quantgate.publishing.mlflow_read import BASELINE, Release, VariantView, read_release

__all__ = ["ExportResult", "MlflowError", "RegisteredVersion", "export_run"]

MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100  # per log-batch call (mlflow/utils/validation.py)
EXPORT_KEY = "quantgate.export_key"
PARENT_RUN = "mlflow.parentRunId"
FIRST_TAGS = (EXPORT_KEY, PARENT_RUN, "quantgate.role", "quantgate.variant")  # set when a run is created
MODEL_DIR = "model"
POINTER = "quantgate-checkpoint.json"


class RegisteredVersion(BaseModel):
    name: str
    version: str
    candidate: str
    run_id: str
    source: str


class ExportResult(BaseModel):
    """Where a run went: the experiment, the parent run, a run id per variant, the registered versions; `reused`:
    an earlier export of the same decision was found and nothing was written."""
    tracking_uri: str
    experiment: str
    experiment_id: str
    parent_run_id: str
    runs: dict[str, str]
    registered: list[RegisteredVersion] = Field(default_factory=list)
    reused: bool = False


def _chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def _now_ms() -> int:
    return int(time.time() * 1000)


def _experiment_id(api: Api, name: str) -> str:
    found = api.get("experiments/get-by-name", {"experiment_name": name}, allow=("RESOURCE_DOES_NOT_EXIST",))
    if found is None:
        made = api.post("experiments/create", {"name": name}, allow=("RESOURCE_ALREADY_EXISTS",))
        if made is not None:
            return str(api.must("experiments/create", made, "experiment_id"))
        found = api.get("experiments/get-by-name", {"experiment_name": name})  # made meanwhile by another export
    exp = api.must("experiments/get-by-name", found, "experiment")
    if exp.get("lifecycle_stage") == "deleted":
        raise QuantgateError(f"the MLflow experiment {name!r} is deleted", where=shown(api.base),
                             fix="restore it (`mlflow experiments restore`), or export to another experiment")
    return str(exp["experiment_id"])


def log_content(api: Api, run_id: str, c: Content) -> None:
    """Params, tags, then metrics, in log-batch calls within MLflow's per-call limits (params and tags apart: a
    hundred long values of each would pass the server's 1 MB request limit together)."""
    stamp = _now_ms()
    for part in _chunks([{"key": k, "value": v} for k, v in c.params.items()], MAX_PARAMS):
        api.post("runs/log-batch", {"run_id": run_id, "params": part})
    for part in _chunks([{"key": k, "value": v} for k, v in c.tags.items()], MAX_TAGS):
        api.post("runs/log-batch", {"run_id": run_id, "tags": part})
    metrics = [{"key": k, "value": v, "timestamp": stamp, "step": 0} for k, v in c.metrics.items()]
    for part in _chunks(metrics, MAX_METRICS):
        api.post("runs/log-batch", {"run_id": run_id, "metrics": part})


def _upload(api: Api, artifact_uri: str, c: Content) -> None:
    for path, data in c.artifacts.items():
        kind = mimetypes.guess_type(path)[0] or "application/octet-stream"
        api.request("PUT", artifact_url(api.base, artifact_uri, path), upload=(data, kind))


def start_run(api: Api, exp_id: str, name: str, tags: dict[str, str]) -> tuple[str, str]:
    """A new run (its id and artifact URI) with the tags that find it again from its first moment (export key,
    parent, role, variant); the other tags follow in log-batch calls."""
    first = [{"key": k, "value": tags[k]} for k in FIRST_TAGS if k in tags]
    made = api.post("runs/create", {"experiment_id": exp_id, "run_name": name, "start_time": _now_ms(), "tags": first})
    info = api.must("runs/create", made, "run", "info")
    return str(info["run_id"]), str(info.get("artifact_uri") or "")


def _finish(api: Api, run_id: str, status: str = "FINISHED") -> None:
    api.post("runs/update", {"run_id": run_id, "status": status, "end_time": _now_ms()})


def _search(api: Api, exp_id: str, where: str) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    token = None
    while True:
        body: dict[str, Any] = {"experiment_ids": [exp_id], "filter": where, "max_results": 1000}
        if token:
            body["page_token"] = token
        page = api.post("runs/search", body) or {}
        runs += page.get("runs") or []
        token = page.get("next_page_token")
        if not token:
            return runs


def _tags(run: dict[str, Any]) -> dict[str, str]:
    return {t["key"]: t.get("value", "") for t in (run.get("data") or {}).get("tags") or []}


def _earlier(api: Api, exp_id: str, key: str, log: Callable[[str], None]) -> tuple[str, dict[str, str]] | None:
    """The parent run id and the variant run ids of a finished export with this key; the RUNNING runs of an
    export with this key that was cut short are marked FAILED (they stay in the experiment, out of the way)."""
    runs = _search(api, exp_id, f"tags.`{EXPORT_KEY}` = '{key}'")
    done = [r["info"]["run_id"] for r in runs
            if _tags(r).get("quantgate.role") == "release" and r["info"].get("status") == "FINISHED"]
    if done:
        return done[0], {_tags(r).get("quantgate.variant", ""): r["info"]["run_id"] for r in runs
                         if _tags(r).get(PARENT_RUN) == done[0]}
    for r in runs:
        if r["info"].get("status") == "RUNNING":
            log(f"mlflow: marking run {r['info']['run_id']} of an earlier export that was cut short FAILED")
            _finish(api, r["info"]["run_id"], "FAILED")
    return None


def _registered(api: Api, runs: dict[str, str]) -> list[RegisteredVersion]:
    """The model versions registered from these runs (variant -> run id)."""
    out = []
    for variant, run_id in runs.items():
        found = api.get("model-versions/search", {"filter": f"run_id = '{run_id}'"}) or {}
        out += [RegisteredVersion(name=mv["name"], version=str(mv["version"]), candidate=variant, run_id=run_id,
                                  source=mv.get("source", "")) for mv in found.get("model_versions") or []]
    return out


def _export_key(rel: Release, model_name: str) -> str:
    """What makes two exports the same: the run's decision (a run gated again is another) and the model name."""
    h = hashlib.sha256((rel.folder / DECISION).read_bytes())
    h.update(b"\0" + model_name.encode("utf-8"))
    return h.hexdigest()[:24]


def _register(api: Api, model: str, rel: Release, v: VariantView, run_id: str, artifact_uri: str) -> RegisteredVersion:
    """A version of `model` for a promoted candidate, its source the candidate run's `model` folder: a pointer to
    the checkpoint (the local registry entry's copy when the release promoted it there, else the evaluated one)."""
    entry = v.row.registry if v.row else None
    ref = v.checkpoint
    checkpoint = str(Path(entry) / "checkpoint") if entry else (ref.path if ref else None)
    pointer = {"release": rel.name, "run": rel.run_id, "run_path": str(rel.folder.resolve()), "candidate": v.name,
               "checkpoint": checkpoint, "checkpoint_sha256": ref.content_hash if ref else None,
               "registry_entry": entry}
    files = Content()
    files.artifacts[f"{MODEL_DIR}/{POINTER}"] = (json.dumps(pointer, indent=2) + "\n").encode("utf-8")
    _upload(api, artifact_uri, files)
    api.post("registered-models/create", {"name": model, "tags": [{"key": "quantgate.release", "value": rel.name}]},
             allow=("RESOURCE_ALREADY_EXISTS",))
    source = artifact_uri.rstrip("/") + "/" + MODEL_DIR
    policy = (v.decision.policy if v.decision else {}) or {}
    tags = {"quantgate.decision": "PROMOTE", "quantgate.run": str(rel.folder.resolve()), "quantgate.run_id": rel.run_id,
            "quantgate.candidate": v.name, "quantgate.scheme": v.decision.scheme if v.decision else None,
            "quantgate.policy": f"{policy.get('name')} v{policy.get('version')}" if policy else None,
            "quantgate.checkpoint": checkpoint, "quantgate.registry_entry": entry}
    made = api.post("model-versions/create", {
        "name": model, "source": source, "run_id": run_id,
        "description": f"{v.name}: PROMOTE by quantgate in run {rel.run_id} of release {rel.name}",
        "tags": [{"key": k, "value": cut(str(t), MAX_TAG_VALUE, "in the run folder")} for k, t in tags.items() if t]})
    version = str(api.must("model-versions/create", made, "model_version", "version"))
    return RegisteredVersion(name=model, version=version, candidate=v.name, run_id=run_id, source=source)


def _write(api: Api, exp_id: str, rel: Release, model: str, key: str,
           log: Callable[[str], None]) -> tuple[str, dict[str, str], list[RegisteredVersion]]:
    """The parent run, a finished run per variant (registering the promoted ones), then the parent finished."""
    parent = parent_content(rel)
    parent.tag(EXPORT_KEY, key)
    parent_id, parent_uri = start_run(api, exp_id, rel.run_id, parent.tags)
    runs: dict[str, str] = {}
    registered: list[RegisteredVersion] = []
    for v in rel.variants:
        c = baseline_content(rel, v) if v.name == BASELINE else candidate_content(rel, v, log)
        c.tag(PARENT_RUN, parent_id)
        c.tag(EXPORT_KEY, key)
        run_id, uri = start_run(api, exp_id, v.name, c.tags)
        log_content(api, run_id, c)
        _upload(api, uri, c)
        runs[v.name] = run_id
        note = ""
        if v.decision is not None and v.decision.decision == "PROMOTE":
            registered.append(_register(api, model, rel, v, run_id, uri))
            note = f"; registered {model} version {registered[-1].version}"
        _finish(api, run_id)
        log(f"mlflow: {v.name}: run {run_id}: {len(c.params)} params, {len(c.metrics)} metrics, "
            f"{len(c.artifacts)} artifacts{note}")
    log_content(api, parent_id, parent)
    _upload(api, parent_uri, parent)
    _finish(api, parent_id)  # last: a FINISHED parent is what makes a later export of the same key a no-op
    return parent_id, runs, registered


@dataclass(frozen=True)
class MlflowTarget:
    """Where a run is exported and under what names: the tracking server (`tracking_uri`, a bearer `token`, the
    `retry` of its calls), the experiment (default quantgate-<release>) and the registered model name for PROMOTE
    candidates (default: the release's name)."""
    tracking_uri: str
    experiment: str | None = None
    model_name: str | None = None
    token: str | None = None
    retry: Retry = RETRY


def export_run(run: Path | str, target: MlflowTarget, log: Callable[[str], None] = print) -> ExportResult:
    """Export a finished run folder to the MLflow server `target` names (module docstring). QuantgateError
    (SettingError) for a run folder that is not a finished run or a bad URL or model name; MlflowError when the
    server cannot be reached or refuses a call."""
    base = base_url(target.tracking_uri)
    rel = read_release(run)
    model = (target.model_name or rel.name).strip()
    if not model or "/" in model or ":" in model or model in (".", ".."):
        raise SettingError(f"not a name MLflow's model registry accepts: {model!r} (no '/' or ':')",
                           setting="model_name", fix="give another registered model name")
    name = target.experiment or f"quantgate-{rel.name}"
    key = _export_key(rel, model)
    api = Api(base, target.token, target.retry)
    try:
        exp_id = _experiment_id(api, name)
        earlier = _earlier(api, exp_id, key, log)
        if earlier is not None:
            parent_id, runs = earlier
            log(f"mlflow: run {rel.run_id} was exported before (parent run {parent_id} in experiment {name!r}): "
                "nothing new to write")
            return ExportResult(tracking_uri=base, experiment=name, experiment_id=exp_id, parent_run_id=parent_id,
                                runs=runs, registered=_registered(api, runs), reused=True)
        parent_id, runs, registered = _write(api, exp_id, rel, model, key, log)
    finally:
        api.close()
    log(f"mlflow: run {rel.run_id} exported to experiment {name!r} ({exp_id}) at {shown(base)}: parent run {parent_id}")
    return ExportResult(tracking_uri=base, experiment=name, experiment_id=exp_id, parent_run_id=parent_id, runs=runs,
                        registered=registered)
