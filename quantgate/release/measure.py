"""What one variant's servers run (adapter): an eval set (or lm-evaluation-harness task), the recall grid and the
perf probe on a running server, engine parity, and extra servers on lent slots.

The measurement kinds (quantgate.release.measurements) make their steps of these; quantgate.release.steps decides
what is still to be measured (the cache) and runs the steps on the variant's servers.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from quantgate.base.runfiles import PLAN
from quantgate.base import progress
from quantgate.evals.lmeval import run_spec_task, task_of as lmeval_task
from quantgate.evals.run import run_eval
from quantgate.parity.engine import Reference, reference_placement, reference_run, run_parity
from quantgate.perf.probe import run_probe
from quantgate.plan.slots import Slot
from quantgate.recall.run import build_checked_grid, run_recall
from quantgate.release.cachelayout import eval_sets_by_name, perf_settings
from quantgate.spec.schema import ReleaseSpec
from quantgate.release.variants import Log, Variant, make_server, server_config


def measure_recall(spec: ReleaseSpec, variant: Variant, srv, out: Path) -> None:
    r = spec.recall
    assert r is not None  # a recall step exists only with spec.recall (cachelayout.recall_dir)
    prompts, grid = build_checked_grid(variant.path, r.lengths, r.depths, r.kinds, r.samples, seed=r.seed, ask=r.ask,
                                       max_model_len=spec.context, max_answer_tokens=r.max_answer_tokens, source="spec context")
    run_recall(prompts, out, endpoint=srv.endpoint, grid=grid, concurrency=spec.eval.concurrency, deadline_s=r.deadline_s,
               max_error_rate=spec.eval.max_error_rate)


def measure_perf(spec: ReleaseSpec, variant: Variant, srv, out: Path, folder: Path, tokenizer: Path) -> None:
    local = variant.endpoint is None  # an endpoint has no weights, engine log or plan here
    run_probe(srv.endpoint, out, perf_settings(spec), tokenizer=tokenizer,
              checkpoint=variant.path if local else None, server_log=srv.log_path if local else None,
              plan=folder / PLAN if local else None, python=srv.config.python)


def measure_eval(spec: ReleaseSpec, variant: Variant, srv, name: str, out: Path, log: Log) -> None:
    if (task := lmeval_task(name)) is not None:  # an lm-evaluation-harness task (quantgate.evals.lmeval)
        assert spec.lm_eval is not None  # its tasks are the only lm-eval names (cachelayout.eval_dirs)
        run_spec_task(spec.lm_eval, task, srv.endpoint, out, model_hash=variant.content_hash, label=variant.name, log=log)
        return
    log(f"{variant.name}: eval set {name} ({spec.eval.limit or 'all'} samples)")
    with progress.reporting(f"{variant.name}: eval {name}", log):  # counts, rate, ETA (quantgate.base.progress)
        run_eval(eval_sets_by_name(spec)[name], srv.endpoint, out, concurrency=spec.eval.concurrency,
                 limit=spec.eval.limit, model_hash=variant.content_hash, max_error_rate=spec.eval.max_error_rate,
                 progress=False)


def parity_reference(variant: Variant, dtype: str | None, gpus: str | None) -> Future[Reference] | None:
    """The engine parity's transformers side, started now in a thread when it runs on the CPU: it needs no server,
    so it runs while the server starts (7 s for the demo model; the start takes 26 s), on any core (_unpinned).
    None on a GPU: a model loaded there while vLLM starts would upset vLLM's measurement of the free GPU memory, so
    it runs afterwards."""
    if reference_placement(variant.path, dtype, gpus).device != "cpu":
        return None
    pool = ThreadPoolExecutor(1, thread_name_prefix=f"parity-{variant.name}")
    future = pool.submit(_unpinned, reference_run, variant.path, dtype, gpus=gpus)
    pool.shutdown(wait=False)  # the thread ends with its one job; nobody waits for it but the future's reader
    return future


def _unpinned(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn` on every core of the release (the main thread's), not on the caller's slot: a thread starts with the
    affinity of the thread that started it (quantgate.release.schedule.pinned), and the baseline's slot is busy
    starting its server. Where another slot quantizes meanwhile, that work yields (quantize.runner.NICE)."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, os.sched_getaffinity(os.getpid()))
    return fn(*args, **kwargs)


def check_parity(variant: Variant, srv, cache: Path, dtype: str | None, log: Log,
                 reference: Future[Reference] | None = None) -> None:
    with progress.reporting(f"{variant.name}: engine parity", log):
        report = run_parity(variant.path, srv.base_url, srv.api_key, variant.name, cache, dtype=dtype,
                            gpus=gpus_of(srv.config), reference=reference.result() if reference is not None else None)
    log(f"{variant.name}: engine parity {report.verdict}: {report.reason}")


def gpus_of(config) -> str | None:
    """A server config's GPUs (its slot's CUDA_VISIBLE_DEVICES), where the parity reference runs; None: not set."""
    return getattr(config, "env", {}).get("CUDA_VISIBLE_DEVICES")


def replica_starter(spec: ReleaseSpec, variant: Variant, folder: Path) -> Callable[[Slot], Any]:
    """`start(slot)` for quantgate.release.replicas: one more server of the variant on `slot` (its plan and log
    in <folder>/replica-<slot>/)."""
    def start(slot: Slot):
        sub = folder / f"replica-{slot.index}"
        sub.mkdir(parents=True, exist_ok=True)
        return make_server(server_config(spec, variant, sub, slot), sub)
    return start
