"""A release's variants on Prefect work pools (`executor: {kind: pools}`): one child flow run per variant, on the
pool named for it, results shared through the store.

    the release flow (this host: model, plan, gate, report) --run_deployment--> measure-variant/<pool>, one child
    flow run per variant (quantgate.pools.child), idempotency key (run, variant, spec digest, attempt)
      -> wait for every child: Completed: pull its evidence and cache folders from the store (rebased onto this
         host); Failed or Cancelled: a candidate's recorded failure (the gate rejects it), the baseline's an error
         that stops the release and cancels the candidates; lost (Crashed, or no sign of life on the store for
         `executor.lost_after_s`): submitted again up to `executor.retries` times, then a recorded failure
      -> compare, judge, gate, promote and report here, as a one-host release does; the run folder is pushed back

Deployments: `measure-variant/<pool>` for each pool (`quantgate pools setup`), run from this checkout's path on each
worker: every host has the repository (and its eval sets) at the same path, as the release's own deployment assumes.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.states import Cancelling, Crashed
from prefect.utilities.callables import parameter_schema
from prefect.workers.process import ProcessWorker

from quantgate.base.errors import QuantgateError
from quantgate.base.runfiles import EVIDENCE
from quantgate.base.objstore import ResultStore
from quantgate.base.paths import results_dir
from quantgate.gate.failurefile import CandidateError
from quantgate.pools.child import ALIVE, BASELINE, measure_variant, pull_evidence, rel_key
from quantgate.spec.schema import ReleaseSpec
from quantgate.release.variants import Evidence, Log, Variant

FLOW = "measure-variant"
ENTRYPOINT = "flows/measure_variant.py:measure_variant"
POLL_S = 3.0
NO_WORKER_S = 120.0  # a child Scheduled this long: the log asks whether its pool has a worker


def store_of(spec: ReleaseSpec) -> ResultStore:
    """The release's store, mirrored into this host's results folder."""
    assert spec.executor.store is not None  # ExecutorSpec refuses pools without a store
    return ResultStore(spec.executor.store, results_dir())


def deployment(pool: str) -> str:
    return f"{FLOW}/{pool}"


def spec_digest(spec: ReleaseSpec) -> str:
    return hashlib.sha256(json.dumps(spec.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class Child:
    """One variant's child flow run: which pool, which attempt, its flow run id and how it ended."""
    variant: str
    pool: str
    attempt: int = 0
    flow_run_id: Any = None
    ended: str | None = None      # "completed", or why it did not
    history: list[str] = field(default_factory=list)
    waiting_since: float | None = None  # first seen Scheduled (no worker has taken it yet)
    told: bool = False            # the user was told that no worker takes it

    def key(self, spec: ReleaseSpec, run: Path) -> str:
        return f"quantgate:{run.name}:{self.variant}:{spec_digest(spec)}:{self.attempt}"


def submit(spec: ReleaseSpec, run: Path, child: Child) -> None:
    """A flow run of measure-variant on the child's pool (the same one again for the same key: a re-run of this
    flow run, or Prefect retrying it, does not measure twice)."""
    try:
        fr = run_deployment(deployment(child.pool), timeout=0, idempotency_key=child.key(spec, run),
                            flow_run_name=f"{run.name}-{child.variant}-{child.attempt}",
                            parameters={"spec": spec.model_dump(mode="json"), "run_id": run.name,
                                        "variant": child.variant, "store": spec.executor.store})
    except ObjectNotFound:
        raise QuantgateError(f"no deployment {deployment(child.pool)} on the Prefect server for {child.variant}",
                             where="executor.pools", fix=f"run `quantgate pools setup {child.pool}` once (with the "
                             "same PREFECT_API_URL), or send the variant to a pool that has one") from None
    child.flow_run_id = fr.id  # type: ignore[union-attr]  # called from sync code: a FlowRun, not a coroutine


def _lost(store: ResultStore, run: Path, child: Child, running_since: float, after_s: float) -> bool:
    """Running, but its last sign of life on the store (or its start, before the first) is older than `after_s`:
    its host is gone."""
    m = store.manifest(f"{rel_key(run)}/{ALIVE}/{child.flow_run_id}")
    last = float(m["written"]) if m is not None else running_since
    return time.time() - last > after_s


@dataclass
class Watch:
    """What the parent needs while it waits for its children: the spec, run folder, store, Prefect client, log."""
    spec: ReleaseSpec
    run: Path
    store: ResultStore
    client: Any
    log: Log


def wait(spec: ReleaseSpec, run: Path, children: list[Child], store: ResultStore, log: Log) -> None:
    """Until every child has ended (Completed, Failed, Cancelled, or lost with no retries left)."""
    deadline = time.monotonic() + spec.executor.timeout_s
    with get_client(sync_client=True) as client:
        watch = Watch(spec, run, store, client, log)
        while pending := [c for c in children if c.ended is None]:
            for c in pending:
                _observe(watch, c)
            if any(c.variant == BASELINE and c.ended not in (None, "completed") for c in children):
                _cancel(client, [c for c in children if c.ended is None], log)
                return
            if time.monotonic() > deadline:
                _cancel(client, pending, log)
                for c in pending:
                    c.ended = f"not finished within executor.timeout_s = {spec.executor.timeout_s:g} s"
                return
            time.sleep(POLL_S)


def _observe(w: Watch, c: Child) -> None:
    """One look at a child's flow run: ended, lost (submitted again), or still waiting for a worker."""
    state = w.client.read_flow_run(c.flow_run_id).state
    assert state is not None
    if state.is_completed():
        c.ended = "completed"
    elif state.is_crashed() or (state.is_running() and _lost(w.store, w.run, c, state.timestamp.timestamp(),
                                                             w.spec.executor.lost_after_s)):
        _lost_child(w, c, f"its host was lost ({state.name}: {state.message or 'no sign of life'})")
    elif state.is_final():
        c.ended = f"its flow run ended {state.name}: {state.message or ''}".strip()
    elif state.is_scheduled():
        c.waiting_since = c.waiting_since or time.monotonic()
        if time.monotonic() - c.waiting_since > NO_WORKER_S and not c.told:
            c.told = True
            w.log(f"{c.variant}: no worker of pool {c.pool} has taken its flow run for {NO_WORKER_S:g} s: is one "
                  f"running (`prefect worker start --pool {c.pool} --type process`)?")


def _lost_child(w: Watch, c: Child, why: str) -> None:
    """A child whose host was lost: marked Crashed in Prefect, then submitted again while retries last."""
    c.history.append(why)
    w.client.set_flow_run_state(c.flow_run_id, Crashed(message=why), force=True)
    if c.attempt < w.spec.executor.retries:
        c.attempt += 1
        w.log(f"{c.variant}: {why}; submitting it again to pool {c.pool} (attempt {c.attempt + 1})")
        submit(w.spec, w.run, c)
    else:
        c.ended = why


def _cancel(client, children: list[Child], log: Log) -> None:
    """Cancel the children still running (the worker stops their processes); each is recorded as cancelled."""
    for c in children:
        log(f"{c.variant}: cancelling its flow run (the baseline failed or time ran out)")
        client.set_flow_run_state(c.flow_run_id, Cancelling(message="the release stopped waiting for it"), force=True)
        c.ended = c.ended or "cancelled: the baseline failed"


def _name(candidate: str | Variant) -> str:
    return candidate if isinstance(candidate, str) else candidate.name


def measure(spec: ReleaseSpec, run: Path, candidates: list, log: Log, baseline: bool = True
            ) -> tuple[Evidence | None, list[Evidence]]:
    """flow.measure on work pools: the baseline (unless measured already) and the candidates, one child flow run
    each; their evidence pulled from the store."""
    store = store_of(spec)
    names = ([BASELINE] if baseline else []) + [_name(c) for c in candidates]
    children = [Child(n, spec.executor.pool_for(n, spec.hardware)) for n in names]
    for c in children:
        submit(spec, run, c)
        log(f"{c.variant}: flow run {c.flow_run_id} on pool {c.pool}")
    wait(spec, run, children, store, log)
    ended = {c.variant: c for c in children}
    base_ev = None
    if baseline:
        base_ev = _collect(store, run, ended[BASELINE])
    return base_ev, [_collect(store, run, ended[_name(c)]) for c in candidates]


def _collect(store: ResultStore, run: Path, child: Child) -> Evidence:
    """The child's evidence from the store; a child that did not complete: the baseline's error, a candidate's
    recorded failure (what it shared before is kept on the store, and a re-run starts from it)."""
    ev = pull_evidence(store, run, child.variant) if child.ended == "completed" else None
    if ev is not None:
        return ev
    why = child.ended if child.ended != "completed" else "it completed without sharing its evidence"
    if child.variant == BASELINE:
        raise QuantgateError(f"the baseline's flow run on pool {child.pool} did not measure it: {why}",
                             where=f"flow run {child.flow_run_id}", fix="see that flow run's logs in Prefect "
                             "(its worker's host); with nothing to compare with, the release cannot go on")
    folder = run / child.variant
    reason = f"the flow run measuring {child.variant} on pool {child.pool} did not finish: {why}"
    CandidateError(candidate=child.variant, phase="measure", error=reason, detail="; ".join(child.history) or why,
                   flow_run=str(child.flow_run_id)).write(folder)
    variant = Variant(name=child.variant, path=folder, scheme=child.variant, content_hash="", size_bytes=None)
    ev = Evidence(variant=variant, folder=folder, cache=folder, serve_command=[], dtype=None, served=True,
                  failure=reason)
    ev.write()
    return ev


def share_run(spec: ReleaseSpec, run: Path) -> None:
    """The parent's run folder (decision, summary, report, every variant's evidence as this host rebased it) onto
    the store, under the same relative name the children used. The variant folders first: their manifests, which
    the children wrote, then list this host's files (its rebased evidence.json, what compare added) and root, so
    that a folder and the run around it never disagree about a file."""
    store = store_of(spec)
    for folder in sorted(p.parent for p in run.glob(f"*/{EVIDENCE}")):
        store.push(rel_key(folder))
    store.push(rel_key(run))


def pull_checkpoint(spec: ReleaseSpec, variant: Variant) -> None:
    """A candidate quantized on another host, pulled from the store (by its quantization key's folder) so that the
    registry can copy and re-hash it; a checkpoint from elsewhere (`candidates:`) is where the spec names it."""
    if variant.origin == "quantized" and store_of(spec).pull(rel_key(variant.path)) is None:
        raise QuantgateError(f"{variant.name}'s checkpoint is not on the store", where=rel_key(variant.path),
                             fix="its host did not share it (see its flow run's log); run the release again")


def share_entry(spec: ReleaseSpec, entry: Path) -> None:
    """A registry entry this release made (its folder), onto the store beside the results it was promoted from."""
    store_of(spec).push(rel_key(entry))


def setup_pools(pools: list[str], log: Log) -> list[str]:
    """Each pool (a process work pool, made when missing) and its `measure-variant/<pool>` deployment, which runs
    flows/measure_variant.py from $QUANTGATE_REPO on the worker (the checkout's path on that host). Idempotent:
    returns the deployments' names."""
    template = ProcessWorker.get_default_base_job_template()
    schema = parameter_schema(measure_variant.fn).model_dump_for_openapi()
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name(FLOW)
        for pool in pools:
            try:
                client.create_work_pool(WorkPoolCreate(name=pool, type="process", base_job_template=template))
                log(f"created work pool {pool} (process)")
            except ObjectAlreadyExists:
                log(f"work pool {pool} exists")
            client.create_deployment(flow_id=flow_id, name=pool, work_pool_name=pool, entrypoint=ENTRYPOINT,
                                     pull_steps=[{"prefect.deployments.steps.set_working_directory":
                                                  {"directory": "{{ $QUANTGATE_REPO }}"}}],
                                     parameter_openapi_schema=schema, enforce_parameter_schema=False,
                                     description="one variant of a quantgate release on this pool's hosts")
            log(f"deployment {deployment(pool)} -> {ENTRYPOINT} (from $QUANTGATE_REPO on the worker)")
    return [deployment(p) for p in pools]
