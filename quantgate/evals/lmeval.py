"""Run an lm-evaluation-harness task against a served endpoint (adapter): lm-eval as a child process from its own
environment, its per-sample log turned into an eval run directory that quantgate.evals.run.compare_dirs and the
gate read like a JSONL set's.

    lm-eval run --model local-chat-completions --model_args model=NAME,base_url=.../v1/chat/completions,
        num_concurrent=C,max_retries=3,tokenized_requests=False,seed=0 --tasks TASK --include_path FOLDER
        --apply_chat_template --log_samples --output_path OUT/lm_eval --use_cache OUT/lm_eval_cache/responses

The environment: `.venv-lmeval` (requirements/lmeval.lock, `scripts/setup.sh lmeval`), built here on first use or
when the lock changed; $QUANTGATE_LMEVAL_PYTHON names another interpreter with lm-eval installed. The child runs
under the process guard (quantgate.base.procs), in the task file's folder (relative data files resolve there),
offline (HF_HUB_OFFLINE), with the server's API key in its environment (OPENAI_API_KEY), never on its command line.

Run directory (the layout of quantgate.evals.run, so compare, gate and report need nothing new):
  manifest.json   kind "lm_eval", the task (`evalset`: file, name, version, sha256 = quantgate.evals.lmeval_tasks.
                  task_digest), model, engine, decoding, status: complete / partial / failed / running
  results.jsonl   {id, output (the raw reply), filtered (what lm-eval's filter kept), error} per document
  scores.jsonl    {id, category (the task), scores, references} per answered document
  summary.json    counts, error rate and per-metric means, as quantgate.evals.run writes them
  lm_eval/        lm-eval's own results and samples files;  lm_eval.log: its output
  lm_eval_cache/  lm-eval's response cache: a run that failed half-way asks only the rest again
A run whose server answered some requests with no content is `partial` (those samples are failed; the next run
asks every request again); above `max_error_rate`, or when lm-eval fails, it is `failed` and raises.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from quantgate.base.runfiles import MANIFEST, RESULTS, SCORES, SUMMARY
from quantgate.base import progress
from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import child_env, lock, log_tail, write_json, write_text
from quantgate.base.http import Endpoint, api_base
from quantgate.base.paths import REPO, home
from quantgate.base.procs import guarded
from quantgate.evals.compare import RunSummary, cache_key, summarize
from quantgate.evals.manifestfile import LmEvalManifest, LmEvalTaskRef, read_manifest
from quantgate.evals.lmeval_tasks import (NO_ANSWER, LmEvalSpec, answered_in_log, convert, data_files, read_task,
                                          set_name, task_digest, task_of, task_problem)
from quantgate.evals.run import probe_server

LOCK_FILE = REPO / "requirements" / "lmeval.lock"
ENV_LINK = REPO / ".venv-lmeval"
SETUP = REPO / "scripts" / "setup.sh"
PYTHON_VAR = "QUANTGATE_LMEVAL_PYTHON"
MANIFEST_SCHEMA = 1

__all__ = ["lm_eval_python", "run_lm_eval", "run_spec_task", "settings", "task_of", "write_scored"]


def _lock_hash() -> str:
    return hashlib.sha256(LOCK_FILE.read_bytes()).hexdigest()[:12]


def lm_eval_python(log=print) -> Path:
    """The interpreter with lm-eval: $QUANTGATE_LMEVAL_PYTHON, else .venv-lmeval's, built by `scripts/setup.sh
    lmeval` when it is missing or was built from another lock file (once, under a lock: variants run in threads)."""
    given = os.environ.get(PYTHON_VAR)
    if given:
        if not Path(given).is_file():
            raise QuantgateError(f"{PYTHON_VAR}={given} is not a file", where=PYTHON_VAR,
                                 fix="point it at a python with lm-eval[api] installed, or unset it")
        return Path(given)
    python = ENV_LINK / "bin" / "python"
    want = f"lmeval-{_lock_hash()}"
    with lock(home() / "envs" / "lmeval-setup", timeout=None, what="build the lm-eval environment"):
        if not python.is_file() or ENV_LINK.resolve().name != want:
            log(f"lm-eval: building its environment ({want}, about a minute once): scripts/setup.sh lmeval")
            done = subprocess.run([str(SETUP), "lmeval"], capture_output=True, text=True)
            if done.returncode != 0:
                raise QuantgateError(f"scripts/setup.sh lmeval failed:\n{done.stderr[-3000:]}", where=str(LOCK_FILE),
                                     fix="run `scripts/setup.sh lmeval` and read its output (network to the package "
                                         f"index?), or set {PYTHON_VAR}")
    return python


def settings(limit: int | None, num_fewshot: int | None) -> dict[str, int | bool | str | None]:
    """What besides the task's files decides its answers: part of the task digest, hence of the cache folder."""
    return {"limit": limit, "num_fewshot": num_fewshot, "chat_template": True, "lm_eval_lock": _lock_hash()}


def lm_eval_argv(python: Path, task: str, include: Path, endpoint: str, model: str, out: Path, *, concurrency: int,
                 limit: int | None, num_fewshot: int | None) -> list[str]:
    """lm-eval's command line (no key on it: lm-eval reads OPENAI_API_KEY from its environment)."""
    if "," in model or "=" in model:
        raise QuantgateError(f"model name {model!r} has ',' or '=', which lm-eval's --model_args cannot carry",
                             fix="serve the model under a name without them")
    model_args = (f"model={model},base_url={api_base(endpoint)}/chat/completions,num_concurrent={concurrency},"
                  "max_retries=3,tokenized_requests=False,seed=0")
    return [str(python), "-m", "lm_eval", "run", "--model", "local-chat-completions", "--model_args", model_args,
            "--tasks", task, "--include_path", str(include), "--apply_chat_template", "--log_samples",
            "--output_path", str(out / "lm_eval"), "--use_cache", str(out / "lm_eval_cache" / "responses"),
            *(["--limit", str(limit)] if limit else []),
            *(["--num_fewshot", str(num_fewshot)] if num_fewshot is not None else [])]


def _child_env(api_key: str | None) -> dict[str, str]:
    return child_env({"OPENAI_API_KEY": api_key or "none", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                      "TOKENIZERS_PARALLELISM": "false", "LMEVAL_MODEL_NONE_ANSWER_PLACEHOLDER": NO_ANSWER})


def _doc_count(task_file: Path, config: dict, limit: int | None) -> int:
    """Documents the run will ask (for the progress display; 0 when unknown: no display)."""
    files = [f for f in data_files(task_file, config) if f.suffix == ".jsonl" and f.is_file()]
    n = sum(1 for line in files[0].read_text(encoding="utf-8").splitlines() if line.strip()) if len(files) == 1 else 0
    return min(n, limit) if n and limit else n


def _run_child(argv: list[str], cwd: Path, api_key: str | None, log_file: Path, total: int,
               timeout_s: float | None) -> int:
    """Run lm-eval under the guard, in its own session; its progress lines feed quantgate.base.progress."""
    def answered() -> int:
        return answered_in_log(log_file.read_text(errors="replace")[-20000:]) if log_file.is_file() else 0

    with open(log_file, "wb") as fh, progress.watch(total, answered):
        proc = subprocess.Popen(guarded(argv), stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=str(cwd), env=_child_env(api_key), start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except BaseException:  # a timeout, Ctrl-C, a cancelled flow: the child's whole group goes with us
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            raise


def _claim(out: Path, manifest: LmEvalManifest) -> Path:
    """Write the manifest into `out`; refuse a folder holding a run of something else. A partial run's response
    cache is dropped: it holds the empty answers, which must be asked again."""
    path = out / MANIFEST
    if path.is_file():
        prev = read_manifest(path)
        if prev.cache_key != manifest.cache_key:
            raise QuantgateError("this directory holds a run of something else", where=str(path),
                                 fix="use a new output folder, or delete this one")
        if prev.status == "partial":
            shutil.rmtree(out / "lm_eval_cache", ignore_errors=True)
    shutil.rmtree(out / "lm_eval", ignore_errors=True)  # lm-eval's files of an earlier attempt
    manifest.write(path)
    return path


def _fail(path: Path, manifest: LmEvalManifest, message: str, where: str, **extra: Any) -> QuantgateError:
    manifest.model_copy(update={"status": "failed", "error": message, **extra}).write(path)
    return QuantgateError(message, where=where, fix="read the log named here; a re-run asks only what is missing")


def write_scored(out: Path, task: str, metrics: list[str], samples: Path) -> tuple[RunSummary, str | None]:
    """results.jsonl, scores.jsonl and summary.json from lm-eval's samples file; (summary, filter used)."""
    lines = [json.loads(x) for x in samples.read_text(encoding="utf-8").splitlines() if x.strip()]
    results, scores, used = convert(lines, task, metrics, where=str(samples))
    write_text(out / RESULTS, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results))
    write_text(out / SCORES, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in scores))
    failed = len(results) - len(scores)
    summary: RunSummary = {"n_samples": len(results), "n_answered": len(scores), "n_failed": failed,
               "error_rate": failed / len(results) if results else 0.0, "metrics": summarize(scores, metrics)}
    write_json(out / SUMMARY, summary)
    return summary, used


def run_lm_eval(task_file: Path, task: str, endpoint: Endpoint, out: Path | str, *, model_hash: str | None = None,
                limit: int | None = None, num_fewshot: int | None = None, concurrency: int = 16,
                max_error_rate: float = 0.05, timeout_s: float | None = None, log=print) -> RunSummary:
    """Run one lm-eval task against a running server into `out` (module docstring); returns the summary."""
    out, task_file = Path(out).resolve(), Path(task_file).resolve()  # lm-eval runs in the task's folder
    config = read_task(task_file)
    if (why := task_problem(task, config)) is not None:
        raise QuantgateError(why, where=str(task_file), fix="choose a generate_until task scored by a known metric")
    server = probe_server(endpoint)
    python = lm_eval_python(log)
    model, api_key = endpoint.model, endpoint.api_key
    digest = task_digest(task_file, settings(limit, num_fewshot))
    decoding = {"generation_kwargs": config.get("generation_kwargs"), "num_fewshot": num_fewshot,
                "apply_chat_template": True, "seed": 0}
    manifest = LmEvalManifest(
        schema=MANIFEST_SCHEMA, kind="lm_eval", status="running",
        cache_key=cache_key(model_hash or f"name:{model}", digest, decoding, server["engine_version"]),
        evalset=LmEvalTaskRef(path=str(task_file), name=set_name(task), task=task, sha256=digest,
                              version=(config.get("metadata") or {}).get("version")),
        model=model, model_hash=model_hash, endpoint=endpoint.url, engine_version=server["engine_version"],
        decoding=decoding, limit=limit, started_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    out.mkdir(parents=True, exist_ok=True)
    path = _claim(out, manifest)
    argv = lm_eval_argv(python, task, task_file.parent, endpoint.url, model, out, concurrency=concurrency, limit=limit,
                        num_fewshot=num_fewshot)
    t0 = time.monotonic()
    code = _run_child(argv, task_file.parent, api_key, out / "lm_eval.log", _doc_count(task_file, config, limit), timeout_s)
    found = sorted((out / "lm_eval").rglob(f"samples_{task}_*.jsonl"))
    if code != 0 or not found:
        raise _fail(path, manifest, f"lm-eval exited with code {code}" + ("" if found else ", no samples file") +
                    f"\n--- last lines of {out / 'lm_eval.log'} ---\n{log_tail(out / 'lm_eval.log')}",
                    str(out / "lm_eval.log"))
    metrics = [m["metric"] for m in config.get("metric_list") or []]
    summary, used = write_scored(out, task, metrics, found[-1])
    done = manifest.model_copy(update={"n_samples": summary["n_samples"], "n_failed": summary["n_failed"],
                                       "filter": used, "samples_file": str(found[-1]),
                                       "elapsed_s": round(time.monotonic() - t0, 3)})
    if summary["error_rate"] > max_error_rate:
        raise _fail(path, done, f"{summary['n_failed']} of {summary['n_samples']} samples got no answer "
                    f"({summary['error_rate']:.1%} > max_error_rate {max_error_rate:.1%})", str(found[-1]),
                    error_rate=summary["error_rate"])
    done.model_copy(update={"status": "complete" if summary["n_failed"] == 0 else "partial",
                            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).write(path)
    return summary


def run_spec_task(lm: LmEvalSpec, task: str, endpoint: Endpoint, out: Path, *, model_hash: str | None, label: str,
                  log=print) -> RunSummary:
    """One task of a release spec's `lm_eval:` section against a variant's server (quantgate.release.steps), with
    a log line and progress lines under `label` (the variant)."""
    log(f"{label}: lm-eval task {task} ({lm.limit or 'all'} samples, concurrency {lm.concurrency})")
    with progress.reporting(f"{label}: lm-eval {task}", log):
        return run_lm_eval(lm.task_file(task), task, endpoint, out, model_hash=model_hash,
                           limit=lm.limit, num_fewshot=lm.num_fewshot, concurrency=lm.concurrency,
                           max_error_rate=lm.max_error_rate, log=log)

