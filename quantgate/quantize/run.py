"""Quantize a checkpoint with llmcompressor in a child process; write a compressed-tensors folder + manifest.

`plan()` resolves and checks everything that can be wrong with the inputs (scheme, hardware support, recipe,
pre-flight against the model's config and safetensors headers, calibration data) without loading the model.
`quantize()` then runs `python -m quantgate.quantize.runner` in a child of the same environment, so a crash or an
out-of-memory kill there cannot take the orchestrator down. The child writes into a hidden temporary folder that
is renamed into place only after the output is checked and its manifest written: a folder at `out` is always
finished. Same inputs (source hash, recipe as applied, calibration hash, library versions) -> reused. With
`name_by_key` (the release flow) the folder's name carries that key, so a checkpoint is never overwritten by one
made from other inputs.

Locks: the work for one output folder runs under its lock (`quantgate.base.fileio.lock`, the file
`<parent>/.locks/<name>.lock`): a second run for the same folder (another release, another host on shared storage)
waits, then reuses the finished output. Temporary folders (`.<name>.partial-*`, `.work-*`, `.old-*`) are only made
under that lock, so whoever holds it knows every one it finds is stale and removes it; no process id is consulted.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import child_env, is_locked, lock, lock_holder, log_tail, write_json
from quantgate.base.procs import guarded
from quantgate.base.paths import RECIPES, REPO, home
from quantgate.quantize import heartbeat, preflight
from quantgate.quantize.calibration import CalibrationSet, CalibrationSpec, build, write_jsonl
from quantgate.quantize.jobfile import RunnerJob, RunnerResult
from quantgate.quantize.manifest import MANIFEST, CalibrationRecord, QuantManifest, SourceRef
from quantgate.quantize.recipes import RecipeOverrides, apply_overrides, dump_recipe, load_recipe
from quantgate.quantize.runner import EXIT_REFUSED, LIBRARIES
from quantgate.quantize.schemes import SchemeInfo, load_schemes
from quantgate.target.hardware import get_profile, load_catalogue

LOCKS = ".locks"  # beside the output folders: one lock file per output folder
FORMAT = 2  # bump when the runner's output changes, so old artifacts are not reused (2: FP32 calibration on a CPU
# without native arithmetic for the checkpoint's 16-bit dtype)


class QuantizeRequest(BaseModel):
    """One quantization job. `recipe` replaces the scheme's recipe file; `overrides`/`calibration` tune it."""
    model_config = ConfigDict(extra="forbid")

    model: Path
    scheme: str
    out: Path
    hardware: str | None = None
    recipe: Path | None = None
    overrides: RecipeOverrides = Field(default_factory=RecipeOverrides)
    calibration: CalibrationSpec = Field(default_factory=CalibrationSpec)
    overwrite: bool = False
    name_by_key: bool = Field(False, description="`out` is a prefix: the folder is <out>-<key12> (keyed_folder), so "
                                                 "other inputs never land in, or replace, the same folder")


class QuantizePlan(BaseModel):
    request: QuantizeRequest
    scheme: SchemeInfo
    hardware: str | None
    recipe_file: str
    recipe_text: str
    preflight: preflight.PreflightResult
    calibration: CalibrationSet | None
    source_sha256: str
    versions: dict[str, str]
    key: str


class QuantizeResult(BaseModel):
    out: Path
    reused: bool
    manifest: QuantManifest


def plan(req: QuantizeRequest) -> QuantizePlan:
    """Check every input and resolve the recipe as it will be applied; loads no model."""
    catalogue = load_schemes()
    scheme = catalogue.get(req.scheme)
    hw_id = None
    if req.hardware:
        profile = get_profile(req.hardware)
        hw_id = profile.id
        if not profile.supports(scheme.id):
            runs_it = [p.id for p in load_catalogue().profiles if p.supports(scheme.id)]
            raise QuantgateError(
                f"{profile.id} ({profile.arch}) has no vLLM kernel for {scheme.id} ({scheme.label})",
                fix=f"on {profile.id} use one of: {', '.join(profile.schemes) or 'none'}; "
                    f"{scheme.id} runs on: {', '.join(runs_it) or 'none'}  (see `quantgate schemes --hardware {profile.id}`)",
            )
    recipe_path = Path(req.recipe) if req.recipe else RECIPES / scheme.recipe
    recipe = load_recipe(recipe_path)
    layout = preflight.read_layout(req.model)
    pre = preflight.check(layout, recipe, extra_ignore=req.overrides.ignore, requested_group_size=req.overrides.group_size)
    applied = apply_overrides(recipe, req.overrides, group_size=pre.group_size if pre.group_size != pre.requested_group_size else None,
                              extra_ignore=pre.ignore_added, where=str(recipe_path))
    calib = None
    if scheme.needs_calibration:
        defaults = scheme.calibration
        assert defaults is not None
        calib = build(req.calibration, req.calibration.samples or defaults.samples,
                      req.calibration.max_seq_length or defaults.max_seq_length)
        if calib.uses_chat and not layout.has_chat_template:
            raise QuantgateError("calibration has chat `messages` records but the model has no chat template",
                                 where=calib.source, fix="use `text` records, or a model folder with a chat template")
    elif req.calibration.path or req.calibration.dataset:
        raise QuantgateError(f"{scheme.id} is data-free: it takes no calibration data", fix="drop the calibration option")
    recipe_text = dump_recipe(applied)
    versions = {name: _version(name) for name in LIBRARIES}
    src = source_hash(Path(req.model))
    key = _sha({"format": FORMAT, "source": src, "scheme": scheme.id, "recipe": recipe_text,
                "calibration": calib.sha256 if calib else None, "seed": req.calibration.seed if calib else None,
                "versions": versions})
    return QuantizePlan(request=req, scheme=scheme, hardware=hw_id, recipe_file=str(recipe_path),
                        recipe_text=recipe_text, preflight=pre, calibration=calib, source_sha256=src, versions=versions,
                        key=key)


def quantize(req: QuantizeRequest, *, log: Callable[[str], None] = lambda s: None, timeout_s: float | None = None) -> QuantizeResult:
    """Plan, then reuse a finished artifact with the same key or produce one through the runner child."""
    t0 = time.perf_counter()
    p = plan(req)
    for note in p.preflight.notes:
        log(f"pre-flight: {note}")
    out = keyed_folder(req.out, p.key) if req.name_by_key else Path(req.out).resolve()
    lock_at = work_lock(out)
    if is_locked(lock_at):
        h = lock_holder(lock_at) or {}
        log(f"waiting for pid {h.get('pid')} on {h.get('host')} ({h.get('what')}), which is making {out}")
    with lock(lock_at, timeout=None, what=f"quantize {p.scheme.id} into {out.name}"):
        return _quantize_locked(req, p, out, log, timeout_s, t0)


def work_lock(out: Path) -> Path:
    """The path whose lock guards the making of `out`: <parent>/.locks/<name> (lock file: that plus `.lock`)."""
    return out.parent / LOCKS / out.name


def _quantize_locked(req: QuantizeRequest, p: QuantizePlan, out: Path, log: Callable[[str], None],
                     timeout_s: float | None, t0: float) -> QuantizeResult:
    """quantize()'s work under the output's lock: reuse a finished output, or make it through the runner child."""
    existing = reusable(out, p.key)
    if existing is not None:
        log(f"reusing {out} (same inputs, key {p.key[:12]})")
        return QuantizeResult(out=out, reused=True, manifest=existing)
    if out.exists() and req.name_by_key and not req.overwrite:
        raise QuantgateError("the checkpoint folder named by this quantization key exists but is not a finished output "
                             "of these inputs (files missing or changed since, or another key with the same prefix)",
                             where=str(out), fix="inspect it and delete it; the next run quantizes again")
    if out.exists() and not req.overwrite:
        raise QuantgateError("output folder exists and was made from other inputs (or not by quantgate)", where=str(out),
                             fix="choose another output folder, or set `overwrite` to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(out)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp, work = out.parent / f".{out.name}.partial-{tag}", out.parent / f".{out.name}.work-{tag}"
    tmp.mkdir()
    work.mkdir()
    try:
        runner = _run_child(p, tmp, work, log, timeout_s)
        shutil.copy(work / "quantize.log", tmp / "quantize.log")
        manifest = _manifest(p, tmp, runner, time.perf_counter() - t0)
        manifest.write(tmp)
        return QuantizeResult(out=out, reused=False, manifest=_publish(tmp, out, p.key, req.overwrite) or manifest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def keyed_folder(prefix: Path | str, key: str) -> Path:
    """The output folder named by the full quantization key: <prefix>-<key12> (e.g. <base hash12>-<scheme>-<key12>).
    The key covers source hash, scheme, recipe as applied (overrides included), calibration, seed, library versions
    and FORMAT, so a different key is a different folder and the same key finds the finished one to reuse."""
    prefix = Path(prefix).resolve()
    return prefix.parent / f"{prefix.name}-{key[:12]}"


def reusable(out: Path, key: str) -> QuantManifest | None:
    """The manifest of a finished output made from the same inputs, with all its files intact; else None."""
    manifest = QuantManifest.read(out / MANIFEST)
    if manifest is None or manifest.key != key:
        return None
    files = manifest.files or {}
    if not files or any(not (out / f).is_file() or (out / f).stat().st_size != n for f, n in files.items()):
        return None
    return manifest


def _run_child(p: QuantizePlan, tmp: Path, work: Path, log: Callable[[str], None],
               timeout_s: float | None) -> RunnerResult:
    recipe = work / "recipe_applied.yaml"
    recipe.write_text(p.recipe_text, encoding="utf-8")
    job = RunnerJob(model=str(Path(p.request.model).resolve()), recipe=str(recipe), out=str(tmp),
                    result=str(work / "result.json"), seed=p.request.calibration.seed)
    if p.calibration is not None:
        write_jsonl(p.calibration.records, work / "calibration.jsonl")
        job.calibration, job.max_seq_length = str(work / "calibration.jsonl"), p.calibration.max_seq_length
    job.write(work / "job.json")
    log(f"quantizing {p.request.model} -> {p.scheme.id} in a child process (log: {work / 'quantize.log'})")
    with open(work / "quantize.log", "wb") as logf:
        proc = subprocess.Popen(guarded([sys.executable, "-m", "quantgate.quantize.runner", str(work / "job.json")]),
                                stdout=logf, stderr=subprocess.STDOUT, cwd=str(REPO), env=runner_env(),
                                start_new_session=True)
        try:
            code = heartbeat.wait(proc, work / "quantize.log", f"quantizing {p.scheme.id}", log, timeout_s)
        except subprocess.TimeoutExpired:
            _kill(proc)
            raise QuantgateError(f"quantization ran past {timeout_s:.0f} s and was stopped", fix="raise the timeout or use fewer calibration samples") from None
        except BaseException:  # interrupted (Ctrl-C, a test timeout, a Prefect cancel): take the child down with us
            _kill(proc)
            raise
    result = RunnerResult.read(work / "result.json")
    tail = log_tail(work / "quantize.log")
    if code == EXIT_REFUSED:
        raise QuantgateError(f"llmcompressor refused the {result.refused or 'input'} before loading the model: {result.message}",
                             where=p.recipe_file, fix="correct the recipe/calibration named above")
    if code != 0:
        why = "killed by signal 9 (out of memory?)" if code in (-9, 137) else f"exit code {code}"
        raise QuantgateError(f"quantization child failed: {why}\n--- last lines of the log ---\n{tail}",
                             fix="read the log above; a memory kill needs a machine with more RAM or a smaller model")
    cfg = json.loads((tmp / "config.json").read_text(encoding="utf-8")) if (tmp / "config.json").is_file() else {}
    if "quantization_config" not in cfg or not list(tmp.glob("*.safetensors")):
        raise QuantgateError(f"quantization child exited 0 but wrote no compressed-tensors checkpoint\n{tail}", fix="report this with the log")
    # recipe.yaml next to the weights is the recipe as applied (plain YAML, loadable by llmcompressor); the one
    # llmcompressor serializes holds every default it filled in but also Python-object tags, so it is kept aside
    if (tmp / "recipe.yaml").is_file():
        os.replace(tmp / "recipe.yaml", tmp / "recipe_resolved.yaml")
    (tmp / "recipe.yaml").write_text(p.recipe_text, encoding="utf-8")
    return result


def runner_env() -> dict[str, str]:
    """The quantization child's environment: child_env (paths, locale, HF_/TRANSFORMERS_/TORCH_/OMP_ ...) plus
    llmcompressor's own settings, quantgate on PYTHONPATH, and no tokenizer threads. The runner imports neither
    Prefect nor anything that reads a credential (the model is a local folder), so no key is passed."""
    return child_env({"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                      "TOKENIZERS_PARALLELISM": "false"}, keep=("LLMCOMPRESSOR_*", "LLM_COMPRESSOR_*"))


def _manifest(p: QuantizePlan, tmp: Path, runner: RunnerResult, wall_s: float) -> QuantManifest:
    runner = RunnerResult.model_validate(runner)  # a stand-in child (tests) may hand back a dict
    files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
    src_weights = sum(f.stat().st_size for f in Path(p.request.model).glob("*.safetensors"))
    out_weights = sum(n for f, n in files.items() if f.endswith(".safetensors"))
    cfg = json.loads((tmp / "config.json").read_text(encoding="utf-8"))
    calib = p.calibration
    return QuantManifest(
        format=FORMAT,
        key=p.key,
        source=SourceRef(path=str(Path(p.request.model).resolve()), sha256=p.source_sha256, weights_bytes=src_weights),
        scheme=p.scheme.id,
        hardware=p.hardware,
        recipe_file=p.recipe_file,
        recipe_applied=p.recipe_text,
        overrides=p.request.overrides.model_dump(),
        family=p.preflight.family,
        kept=p.preflight.kept,
        preflight=p.preflight.model_dump(exclude={"targeted"}) | {"targeted_count": len(p.preflight.targeted)},
        calibration=None if calib is None else CalibrationRecord(
            source=calib.source, sha256=calib.sha256, samples=len(calib.records), available=calib.available,
            max_seq_length=calib.max_seq_length, seed=calib.seed, tokens=runner.calibration_tokens),
        quantization_config=cfg.get("quantization_config"),
        versions={**p.versions, "quantgate": _version("quantgate")},
        workarounds=runner.workarounds,
        device=runner.device,  # where oneshot calibrated (quantize.devices, runner.device_record)
        timings_s={k: getattr(runner, k) for k in ("prepare_s", "load_s", "oneshot_s", "save_s", "total_s")}
        | {"wall": round(wall_s, 2)},
        size_on_disk_bytes=sum(files.values()),
        weights_bytes=out_weights,
        compression_ratio=round(src_weights / out_weights, 3) if out_weights else None,
        files=files,
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )


def _publish(tmp: Path, out: Path, key: str, overwrite: bool) -> QuantManifest | None:
    """Rename the finished folder into place (atomic on one filesystem). Returns the manifest if another run won."""
    old = None
    if out.exists():
        other = reusable(out, key)
        if other is not None:  # a concurrent run with the same inputs finished first: keep it
            return other
        if not overwrite:
            raise QuantgateError("output folder appeared while quantizing", where=str(out), fix="run again")
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return None


def _kill(proc: subprocess.Popen) -> None:
    """Kill the child's whole process group (it runs in its own session) and reap it."""
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass
    proc.wait()


def _clean_stale(out: Path) -> list[str]:
    """Remove the temporary folders of `out` left by runs that ended or died. Call it only while holding
    work_lock(out): temporary folders are made under that lock, so none of them belongs to a live run."""
    removed = []
    for kind in ("partial", "work", "old"):
        for d in sorted(out.parent.glob(f".{glob.escape(out.name)}.{kind}-*")):
            if d.is_dir():
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d.name)
    return removed


def source_hash(model_dir: Path) -> str:
    """sha256 over (relative path, file sha256) of the checkpoint's files; per-file hashes cached by size+mtime."""
    cache_path = home() / "cache" / "file-sha256.json"
    try:
        cache = json.loads(cache_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        cache = {}
    entries, changed, fresh = [], False, set()
    for f in sorted(Path(model_dir).resolve().rglob("*")):
        if not f.is_file() or f.name.startswith((".", "quantgate-")):
            continue
        st = f.stat()
        stamp = f"{st.st_size}:{st.st_mtime_ns}"
        hit = cache.get(str(f))
        if not hit or hit[0] != stamp:
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            cache[str(f)], changed = [stamp, h.hexdigest()], True
            fresh.add(str(f))
        entries.append([str(f.relative_to(Path(model_dir).resolve())), cache[str(f)][1]])
    if changed:
        _save_hashes(cache_path, {k: v for k, v in cache.items() if k in fresh})
    return _sha(entries)


def _save_hashes(cache_path: Path, new: dict[str, list]) -> None:
    """Merge `new` into the per-file hash cache under its lock (re-read inside it, so concurrent hashers lose
    nothing) and replace the file atomically."""
    with lock(cache_path, what="source hash cache"):
        try:
            cache = json.loads(cache_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            cache = {}
        write_json(cache_path, (cache if isinstance(cache, dict) else {}) | new)


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"
