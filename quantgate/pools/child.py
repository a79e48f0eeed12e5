"""One variant of a release, measured on a work pool's worker (the child flow run of quantgate.pools.executor).

    spec (as the parent resolved it), run id, variant name, store URL
      -> this host's model (its own QUANTGATE_HOME) -> this host's slot (the worker's cores, or the plan's number of
         free GPUs, each held by a lock file while served) inside the host's Prefect global concurrency limit
      -> the variant: the baseline, a scheme quantized here (its checkpoint pushed to the store), or a `candidates`
         checkpoint
      -> the baseline shares where its answers will be (<run>/_reference); a candidate serves and measures beside
         it, and before fidelity waits for the baseline's evidence on the store and pulls the answers it scores
      -> what the store already has for the variant's cache key is pulled (complete, or the answers a lost host had
         shared): only the rest is asked
      -> serve and measure as a one-host release does, sharing unfinished work every `executor.sync_s`
      -> push the cache folder and <run>/<variant>/ (evidence.json names this host's paths; readers rebase them)

The host's name is $QUANTGATE_HOST (default: the machine's name): its limit is `quantgate-host-<name>`, created on
first use with the host's devices (the worker's cores, or its visible GPUs) as capacity.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.runtime import flow_run

from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import write_json
from quantgate.base.objstore import ResultStore, StoreManifest
from quantgate.base.paths import home, results_dir
from quantgate.base.runfiles import EVIDENCE
from quantgate.plan.build import build_plan
from quantgate.plan.slots import BIND, Slot, cpu_bind, slots
from quantgate.quantize.run import keyed_folder
from quantgate.quantize.run import plan as quantize_plan
from quantgate.release import steps as rel
from quantgate.release.cachelayout import engine_of, eval_dirs, variant_cache
from quantgate.release.schedule import pinned
from quantgate.spec.schema import ReleaseSpec
from quantgate.release.variants import Evidence, Log, load_evidence, quantize_request, server_config

BASELINE = "baseline"
REFERENCE = "_reference"  # runs/<run>/_reference/ on the store: where the baseline's answers will be
ALIVE = "_alive"  # runs/<run>/_alive/<flow run id>/ on the store: a child's sign of life, every executor.sync_s


def host_name() -> str:
    return os.environ.get("QUANTGATE_HOST") or socket.gethostname()


def rel_key(path: Path) -> str:
    """A path under this host's results root as the store names it."""
    try:
        return path.resolve().relative_to(results_dir().resolve()).as_posix()
    except ValueError:
        raise QuantgateError(f"{path} is not under the results folder {results_dir()}: it cannot be shared",
                             where="quantgate.pools.child", fix="a bug: every shared folder lives under "
                             "the results root") from None


def rebased(data: Any, old: str, new: str) -> Any:
    """`data` (JSON) with every string that is a path under `old` moved under `new`: the writer's results root
    replaced by this host's."""
    if isinstance(data, str):
        return new + data[len(old):] if data == old or data.startswith(old.rstrip("/") + "/") else data
    if isinstance(data, list):
        return [rebased(x, old, new) for x in data]
    if isinstance(data, dict):
        return {k: rebased(v, old, new) for k, v in data.items()}
    return data


def pull_evidence(store: ResultStore, run: Path, name: str, *, timeout_s: float = 0.0) -> Evidence | None:
    """<run>/<name>/ from the store (waiting up to `timeout_s` for it) with its evidence.json rebased onto this host,
    and the cache folder it points at; None when the store has no complete folder for it."""
    folder = run / name
    if timeout_s > 0:
        manifest: StoreManifest | None = store.wait(rel_key(folder), timeout_s=timeout_s, what=f"{name}'s evidence")
    else:
        manifest = store.pull(rel_key(folder))
    if manifest is None or not (folder / EVIDENCE).is_file():
        return None
    written = load_evidence(folder / EVIDENCE).model_dump(mode="json")  # as the writer's host had it
    ev = Evidence.model_validate(rebased(written, manifest["root"], str(results_dir())))
    ev.write()
    store.pull(rel_key(ev.cache), partial=ev.failure is not None)
    return ev


@contextmanager
def device_locks(devices: list[int], need: int, *, poll_s: float = 2.0) -> Iterator[list[int]]:
    """Hold `need` of this host's `devices` (lock files under $QUANTGATE_HOME/slots/<host>/) for the block: two
    children on one host never serve on one device, whatever the limits say."""
    folder = home() / "slots" / host_name()
    folder.mkdir(parents=True, exist_ok=True)
    while True:
        held: list[tuple[int, int]] = []
        for d in devices:
            fd = os.open(folder / f"{d}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held.append((d, fd))
            except BlockingIOError:
                os.close(fd)
            if len(held) == need:
                break
        if len(held) == need:
            break
        for _, fd in held:
            os.close(fd)
        time.sleep(poll_s)
    try:
        yield [d for d, _ in held]
    finally:
        for _, fd in held:
            os.close(fd)  # closing drops the lock


def host_devices(kind: str) -> list[int]:
    """The devices this worker may use: its CPU affinity, or the GPUs it sees (CUDA_VISIBLE_DEVICES, else all)."""
    if kind == "cpu":
        return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [int(x) for x in visible.split(",") if x.strip().isdigit()]
    import torch  # a GPU host: the pipeline environment's CUDA build

    return list(range(torch.cuda.device_count()))


@contextmanager
def host_slot(spec: ReleaseSpec, model_dir: Path, log: Log) -> Iterator[Slot | None]:
    """This host's slot for one variant, inside the host's global concurrency limit: on a CPU every core of the
    worker (a lone variant gets every core, as on one host); on GPUs the plan's devices per replica, the first
    free ones. None: a multi-node plan (its nodes are the plan's, not this host's)."""
    s = spec.serving
    plan = build_plan(model_dir, spec.hardware, context=spec.context, concurrency=spec.concurrency, gpus=spec.gpus,
                      nodes=spec.nodes, replicas=s.replicas, nodes_share_host=s.local_nodes or None,
                      **s.plan_options(candidate=False))
    first = slots(plan, 1)
    if not first:
        yield None
        return
    devices = host_devices(plan.kind)
    need = len(devices) if plan.kind == "cpu" else len(first[0].devices)
    if need > len(devices):
        raise QuantgateError(f"the plan needs {need} devices and this host ({host_name()}) has {devices}",
                             where="executor.pools", fix="send this variant to a pool whose hosts are big enough")
    name = f"quantgate-host-{host_name()}"
    with ExitStack() as stack:
        stack.enter_context(host_limit(name, (len(devices), need), spec.executor.lost_after_s, log))
        mine = stack.enter_context(device_locks(devices, need))
        env = {BIND: cpu_bind(mine, plan.layout.devices)} if plan.kind == "cpu" else _gpu_env(first[0], mine)
        slot = Slot(index=0, kind=plan.kind, devices=mine, env=env)
        log(f"{host_name()}: {slot.label}")
        yield slot


def _gpu_env(planned: Slot, mine: list[int]) -> dict[str, str]:
    """The planned slot's placement variables with this host's free devices in them."""
    ids = ",".join(map(str, mine))
    return {k: ids for k in planned.env}


@contextmanager
def host_limit(name: str, slots: tuple[int, int], lost_after_s: float, log: Log) -> Iterator[None]:
    """Prefect's global concurrency limit `name`, created with `slots[0]` slots when missing, `slots[1]` of them held.
    The hold is a lease this process renews: a host lost with it frees the slots when the lease runs out, about
    `lost_after_s` later (Prefect's shortest lease is 60 s), when its child is submitted again."""
    capacity, occupy = slots
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=capacity))
                log(f"created the global concurrency limit {name} ({capacity})")
            except ObjectAlreadyExists:
                pass  # another child on this host made it first
    with concurrency(name, occupy=occupy, strict=True, lease_duration=max(60.0, lost_after_s)):
        yield


@contextmanager
def periodic(every_s: float, fn: Callable[[], None], name: str, *, at_start: bool = False) -> Iterator[None]:
    """`fn` every `every_s` seconds in a thread while the block runs (and once at once, `at_start`)."""
    stop = threading.Event()

    def loop() -> None:
        if at_start:
            fn()
        while not stop.wait(every_s):
            fn()

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def share_unfinished(store: ResultStore, folder: Path, log: Log) -> None:
    """A snapshot of a cache folder being filled, pushed as unfinished: a host lost mid-variant loses at most the
    answers given since the last one. A store error is said and left to the next one (the final push raises)."""
    if not folder.is_dir():
        return
    with tempfile.TemporaryDirectory(prefix="quantgate-sync-") as tmp:
        snap = Path(tmp) / "snap"
        shutil.copytree(folder, snap, ignore=shutil.ignore_patterns("*.lock"))
        try:
            store.push(rel_key(folder), complete=False, source=snap)
        except Exception as exc:  # noqa: BLE001 - any store error: the next interval tries again, the final push raises
            log(f"sharing unfinished work of {folder.name} failed ({exc}); trying again later")


@contextmanager
def alive(store: ResultStore, run: Path, every_s: float, log: Log) -> Iterator[None]:
    """This child's sign of life on the store (<run>/_alive/<flow run id>) every `every_s` while the block runs: the
    parent takes a child silent for `executor.lost_after_s` as lost with its host."""
    folder = run / ALIVE / str(flow_run.id)

    def beat() -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "beat").write_text(f"{time.time()}\n")
        try:
            store.push(rel_key(folder))
        except Exception as exc:  # noqa: BLE001 - any store error: the next beat tries again (the parent waits)
            log(f"sign of life not shared ({exc}); trying again in {every_s:g} s")

    with periodic(every_s, beat, "quantgate-alive", at_start=True):
        yield


def share_reference(store: ResultStore, run: Path, evals: dict[str, Path]) -> None:
    """The baseline's eval folders (where its answers and fidelity samples will be), as <run>/_reference on the
    store: a candidate serves and measures beside the baseline and waits for them only before fidelity."""
    folder = run / REFERENCE
    write_json(folder / "reference.json", {"evals": {k: rel_key(p) for k, p in evals.items()}})
    store.push(rel_key(folder))


def _reference(spec: ReleaseSpec, run: Path, store: ResultStore, log: Log
               ) -> tuple[dict[str, Path], Callable[..., bool]]:
    """The baseline's eval folders on this host, and the wait (before fidelity) that pulls what the baseline
    measured into them once its child has shared it."""
    store.wait(rel_key(run / REFERENCE), timeout_s=spec.executor.timeout_s, what="the baseline's reference")
    shared = json.loads((run / REFERENCE / "reference.json").read_text())
    reference = {k: results_dir() / p for k, p in shared["evals"].items()}
    pulled: list[Evidence] = []

    def ready(dumps: bool = False, block: bool = True) -> bool:
        if not block:  # what the store has is pulled whole, so a candidate here scores nothing ahead of it
            return bool(pulled)
        if not pulled:
            log("waiting for the baseline's answers on the store (fidelity scores them)")
            ev = pull_evidence(store, run, BASELINE, timeout_s=spec.executor.timeout_s)
            assert ev is not None
            pulled.append(ev)
        return True

    # The baseline measured already, in this run or (its cache folder complete on the store) an earlier one, whose
    # answers this run's baseline child only pulls and shares again, soon: waited for and pulled now, so that the
    # candidate's cached fidelity counts as done before anything is served (not raced against that child)
    base_cache = next(iter(reference.values())).parents[1] if reference else None
    if store.complete(rel_key(run / BASELINE)) or (base_cache is not None and store.complete(rel_key(base_cache))):
        ready()
    return reference, ready


def _variant(spec: ReleaseSpec, name: str, model_dir: Path, run: Path, store: ResultStore, log: Log):
    """The Variant this child measures; a scheme is quantized here and its checkpoint shared (once: its folder is
    named by its quantization key)."""
    if name == BASELINE:
        return rel.baseline_for(spec, model_dir)
    if name in spec.schemes:
        req = quantize_request(spec, model_dir, name)
        shared = keyed_folder(req.out, quantize_plan(req).key)
        if store.pull(rel_key(shared)) is not None:  # quantized on another host (or by an attempt lost with its host)
            log(f"{name}: its checkpoint {shared.name} pulled from the store")
        v = rel.quantize_variant(spec, model_dir, name, run, log=log)
        if not store.complete(rel_key(v.path)):
            store.push(rel_key(v.path))
        return v
    return rel.external_variant(spec, name, model_dir, run)


@flow(name="measure-variant", log_prints=False)
def measure_variant(spec: dict[str, Any], run_id: str, variant: str, store: str) -> str:
    """Measure one variant of the parent's release on this worker's host; returns its evidence.json's store key."""
    s = ReleaseSpec.model_validate(spec)
    log = get_run_logger().info
    st = ResultStore(store, results_dir())
    run = results_dir() / "runs" / run_id
    run.mkdir(parents=True, exist_ok=True)
    model_dir = rel.resolve_model(s.model)
    baseline = variant == BASELINE
    with alive(st, run, s.executor.sync_s, log), host_slot(s, model_dir, log) as slot, pinned(slot):
        v = _variant(s, variant, model_dir, run, st, log)
        config = server_config(s, v, run / v.name, slot)
        cache = variant_cache(v, config, engine_of(config), run)
        reference, ready = (None, None) if baseline else _reference(s, run, st, log)
        if baseline:  # where the candidates find the answers they score, before any is given
            share_reference(st, run, eval_dirs(cache, s))
        if st.pull(rel_key(cache), partial=True) is not None:
            log(f"{variant}: pulled what the store has for {cache.name}")
        with periodic(s.executor.sync_s, lambda: share_unfinished(st, cache, log), "quantgate-partial-sync"):
            req = rel.MeasureRequest(s, v, run, parity=baseline, tokenizer=None if baseline else model_dir,
                                     reference=reference)
            ev = rel.serve_and_evaluate(req, log=log, slot=slot, reference_ready=ready)
        st.push(rel_key(ev.cache), complete=ev.failure is None)
        st.push(rel_key(run / v.name))
    log(f"{variant}: shared on {store}: {rel_key(ev.cache)} and {rel_key(run / v.name)}")
    return rel_key(run / v.name / EVIDENCE)
