"""Where a variant's cached evidence lives (results/cache/variants/<key>/...) and when it counts as done.

The key is the checkpoint's content hash, the exact serving arguments and environment (placement-free: the slot
counts by size) and the engine version. Under it: evals/<set>-<digest>-<limit>/ (an lm-eval task:
evals/lm_eval-<task>-<digest>-<limit>/), recall/<digest>/, perf/<digest>/.
A folder counts as done only when its own status says complete (evals), ok (perf), or recall's `is_complete`.

An endpoint (quantgate.serving.endpoint) is measured for one run only: its folder is <run>/endpoints/<model>-<key>,
keyed by its URL, model name and the fingerprint of what its `/v1/models` reports, not by the variant's name: one
endpoint that a run names twice (the baseline, and a candidate at the same URL) is measured once, under the folder's
lock, and the second reads what the first measured. Within the run the baseline's
answers stay the one reference every candidate scores, and an adaptive round reuses them; across runs they are never
reused, because a redeployment under the same URL and name (new weights, new engine flags) can report the same
`/v1/models` entry (vLLM reports the served path and context length, not a weights hash or its version).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from quantgate.base.runfiles import PERF
from quantgate.base.errors import QuantgateError
from quantgate.base.paths import results_dir
from quantgate.evals.dataset import file_sha256
from quantgate.evals.setsource import meta_path_for, set_names
from quantgate.evals.lmeval import settings as lmeval_settings
from quantgate.evals.lmeval_tasks import LmEvalSpec, set_name, task_digest
from quantgate.evals.manifestfile import read_status
from quantgate.perf.models import ProbeSettings
from quantgate.perf.probe import load_result
from quantgate.perf.workloads import write_requests
from quantgate.plan.build import load_planner_policy
from quantgate.plan.slots import placement_free
from quantgate.release.secrets import endpoint_api_key
from quantgate.spec.schema import ReleaseSpec, in_window
from quantgate.release.variants import Variant
from quantgate.serving.endpoint import EndpointConfig, describe
from quantgate.serving.env import serve_python, vllm_version

def cache_key(variant: Variant, config, engine: str) -> str:
    """Checkpoint, serving arguments, environment and engine; the slot counts by its size, not by which devices or
    cores it is (quantgate.plan.slots.placement_free): a variant measured on slot 1 is reused on slot 0."""
    env = placement_free(config.env, list(load_planner_policy().visible_devices_env.values()))
    blob = {"model": variant.content_hash, "args": config.args, "env": env, "engine": engine}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:20]


def engine_of(config) -> str:
    """What a cache key calls the engine: vLLM's version in the serving environment; for an endpoint, the
    fingerprint of what its /v1/models reports now (asked with its key)."""
    if isinstance(config, EndpointConfig):
        return describe(config, endpoint_api_key(config))["fingerprint"]
    return vllm_version(serve_python(config.python))


def variant_cache(variant: Variant, config, engine: str, run: Path) -> Path:
    """Where a variant's measurements live: results/cache/variants/<cache_key> for what quantgate serves, and
    <run>/endpoints/<model>-<key> for an endpoint (this run only, shared by every variant of the run that is this
    endpoint: see the module docstring)."""
    if variant.endpoint is None:
        return results_dir() / "cache" / "variants" / cache_key(variant, config, engine)
    blob = {"url": variant.endpoint.endpoint, "model": variant.endpoint.model, "reported": engine}
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", variant.endpoint.model)[:40]
    return run / "endpoints" / f"{readable}-{hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]}"


def eval_dir(cache: Path, evalset: Path, limit: int | None) -> Path:
    """An eval set's folder, keyed by its samples and sidecar (every file of a datasets folder; the sidecar's
    column mapping decides what the samples are) and the eval limit (`draw<N>`: the seeded random subset of
    quantgate.base.subsets; a folder of an older prefix subset is never reused for it)."""
    digest = file_sha256(evalset, meta_path_for(evalset))[:12]
    return cache / "evals" / f"{evalset.stem}-{digest}-{_subset(limit)}"


def _subset(limit: int | None) -> str:
    return f"draw{limit}" if limit else "all"


def lmeval_dir(cache: Path, lm: LmEvalSpec, task: str) -> Path:
    """An lm-eval task's folder: evals/lm_eval-<task>-<digest>-<limit>, the digest over its files and lm-eval settings."""
    digest = task_digest(lm.task_file(task), lmeval_settings(lm.limit, lm.num_fewshot))[:12]
    return cache / "evals" / f"lm_eval-{task}-{digest}-{lm.limit or 'all'}"


def eval_sets_by_name(spec: ReleaseSpec) -> dict[str, Path]:
    """Eval set name -> its file, in the spec's order: the stem, or where two sets share one, the folders that tell
    them apart (quantgate.evals.setsource.set_names): every set is evaluated and gated under its own name."""
    return dict(zip(set_names(spec.eval_sets), spec.eval_sets))


def eval_dirs(cache: Path, spec: ReleaseSpec) -> dict[str, Path]:
    """Eval set name -> run folder: each set by its name (eval_sets_by_name), each `lm_eval` task as
    `lm_eval:<task>`."""
    dirs = {name: eval_dir(cache, p, spec.eval.limit) for name, p in eval_sets_by_name(spec).items()}
    if spec.lm_eval is not None:
        dirs.update({set_name(t): lmeval_dir(cache, spec.lm_eval, t) for t in spec.lm_eval.tasks})
    return dirs


def recall_dir(cache: Path, spec: ReleaseSpec) -> Path | None:
    if spec.recall is None:
        return None
    digest = hashlib.sha256(spec.recall.model_dump_json().encode()).hexdigest()[:12]
    return cache / "recall" / digest


def perf_settings(spec: ReleaseSpec) -> ProbeSettings:
    """The probe of the spec's workload profile on its hardware, with the spec's `perf` overrides; with `lengths:
    eval_sets`, the first eval set's prompts and max_tokens (a file named by the set's content: the cache key)."""
    s = spec.perf.settings(spec.workload, spec.hardware, spec.concurrency)  # type: ignore[union-attr]
    if spec.perf.lengths == "eval_sets":  # type: ignore[union-attr]
        if not spec.eval_sets:
            raise QuantgateError("perf.lengths is eval_sets but the spec lists no eval set", where="perf.lengths",
                                 fix="list an eval set in `eval_sets`, or use `lengths: given`")
        es = spec.eval_sets[0]
        name = f"{es.stem}-{file_sha256(es, meta_path_for(es))[:12]}-{_subset(spec.eval.limit)}.json"
        s = s.model_copy(update={"requests": str(write_requests(es, results_dir() / "cache" / "perf-requests" / name,
                                                                spec.eval.limit))})
    return s




def perf_dir(cache: Path, spec: ReleaseSpec) -> Path | None:
    """The variant's own probe's folder in its cache; None: no probe in the spec, or the window probes it."""
    if spec.perf is None or in_window(spec):
        return None
    return cache / "perf" / hashlib.sha256(perf_settings(spec).model_dump_json().encode()).hexdigest()[:12]


def perf_runs_done(folder: Path) -> int:
    """Benchmark runs the probe has finished, failed or skipped so far (its raw/ files), for the progress display."""
    raw = folder / "raw"
    names = {f.name.removesuffix(".error") for f in raw.glob("c*-r*.json*") if not f.name.endswith(".go")} \
        if raw.is_dir() else set()
    return len(names)


def perf_ok(folder: Path) -> bool:
    """The probe's perf.json (quantgate.perf.models.PerfResult) says ok; a missing, unreadable or unfit one: not."""
    try:
        return load_result(folder / PERF).status == "ok"
    except (QuantgateError, ValueError):
        return False


def eval_complete(eval_dir: Path) -> bool:
    """The eval run's manifest (quantgate.evals.manifestfile) says complete; a missing or unreadable one: not."""
    return read_status(eval_dir) == "complete"
