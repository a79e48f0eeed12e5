"""The release's speed window (adapter): the baseline and every candidate probed side by side, in rounds, on one
slot, after the other measurements, with the baseline against itself as the A/A floor (quantgate.perf.rounds).

Why: a ratio of a baseline probed an hour ago (or cached from another release) to a candidate probed now measures
the load as much as the candidate. Here both sides of every ratio are measured in the same window, on the same
cores, taking turns; nothing else of the release runs then (its measurements are done). Every variant's server is
started once, on the window's slot, and stays up for the window: an idle vLLM server waits for requests without
using the cores, and each probe warms its server up first.

What it writes, beside the run's other files:
    <run>/perf-window/window.json              the order, the window's times, and per probe its load record
    <run>/perf-window/r<k>-<i>-<variant>/      each probe (quantgate.perf.probe: perf.json, raw runs)
    <run>/perf-window/<variant>/perf.json       a variant's probes pooled, one repeat per round (the report's curves)
    <run>/<candidate>/pay_off.json             paired ratios over the rounds, with the A/A floor (`floor`) and the
                                               window (`window`): what the gate's pay-off checks read
Per probe, the record holds the 1-minute load average before and after, the slot's mean CPU clock where
/proc/cpuinfo gives one, and the share of the slot's cores that was busy, and of that what other processes used
(everything but this release's servers and probe clients).
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import write_json
from quantgate.base.runfiles import PAY_OFF, PLAN
from quantgate.perf.compare import compare, level_medians
from quantgate.perf.machine import Span
from quantgate.perf.models import PerfResult, ProbeSettings
from quantgate.perf.client import BenchClient
from quantgate.perf.probe import load_result, run_probe
from quantgate.perf.rounds import FIRST, SECOND, PlannedProbe, as_rounds, geometric_baseline, plan
from quantgate.release.cachelayout import perf_settings
from quantgate.release.schedule import SlotPool, pinned
from quantgate.spec.schema import ReleaseSpec
from quantgate.release.variants import Evidence, Log, make_server, server_config

WINDOW = "perf-window"


@dataclass
class Probe:
    """One probe's record in window.json."""
    round: int
    index: int
    variant: str
    half: str | None
    folder: str
    started: str = ""
    seconds: float = 0.0
    load_before: float | None = None
    load_after: float | None = None
    cpu_mhz: float | None = None
    busy_share: float | None = None
    others_share: float | None = None
    status: str = "ok"
    error: str | None = None


@dataclass
class Window:
    rounds: int
    order: list[PlannedProbe] = field(default_factory=list)
    cores: list[int] = field(default_factory=list)
    started: str = ""
    ended: str = ""
    seconds: float = 0.0
    probes: list[Probe] = field(default_factory=list)


def perf_window(spec: ReleaseSpec, run: Path, pool: SlotPool, base: Evidence, cands: list[Evidence],
                log: Log = print) -> dict[str, Path]:
    """Probe `base` and the candidates that still need speed figures side by side (see the module doc); write
    each one's pay_off.json and each variant's pooled probe (variant -> that folder, returned). A candidate REJECTed early by fidelity, failed, or served elsewhere (an endpoint) is not
    probed: its evidence says why."""
    assert spec.perf is not None and spec.perf.rounds is not None
    probed = []
    for c in cands:
        why = _not_probed(c)
        if why is None:
            probed.append(c)
        elif c.decided:
            c.skipped["perf"] = f"decided early: REJECT by fidelity ({c.decided})"
            c.write()
    if not probed or base.failure or base.variant.endpoint is not None:
        log("speed window: nothing to probe side by side" + (f" ({', '.join(_not_probed(c) or '' for c in cands)})"
                                                              if cands else ""))
        if cands and all(c.decided for c in cands):  # the baseline's record says why it has no speed figures
            base.skipped["perf"] = ("every candidate's REJECT was decided by fidelity first "
                                    f"({', '.join(c.variant.name for c in cands)}): no speed window")
            base.write()
        return {}
    folder = run / WINDOW
    names = [c.variant.name for c in probed]
    order = plan(base.variant.name, names, spec.perf.rounds)
    settings = perf_settings(spec)
    one = settings.model_copy(update={"repeats": 1, "budget_s": (settings.budget_s / settings.repeats
                                                                 if settings.budget_s else None)})
    window = Window(rounds=spec.perf.rounds, order=order)
    log(f"speed window: {base.variant.name} and {', '.join(names)} side by side, {spec.perf.rounds} rounds of "
        f"{len(order) // spec.perf.rounds} probes ({settings.profile} profile, concurrency {settings.levels}; about "
        f"{_estimate(one, len(order)):.0f} s)")
    variants = {v.variant.name: v for v in (base, *probed)}
    t0 = time.perf_counter()
    try:
        results = _run(spec, pool, variants, _Probing(folder, one, base.variant.path, []), window, log)
    except QuantgateError as exc:  # a server that cannot start again: no speed figures; the gate says they are missing
        log(f"speed window: stopped, no speed ratios: {exc.message}")
        write_json(folder / "window.json", {**asdict(window), "error": exc.message})
        return {}
    window.ended, window.seconds = _now(), round(time.perf_counter() - t0, 1)
    write_json(folder / "window.json", asdict(window))
    return _write_ratios(run, base, probed, results, window, log)


def keep_window(evidence: list[Evidence], probed: Mapping[str, Path]) -> None:
    """Each variant's evidence points at its pooled probe of the speed window (`probed`), in memory and in its
    evidence.json; a variant measured again for more samples keeps the window's (speed does not depend on them)."""
    for e in evidence:
        if probed.get(e.variant.name) not in (None, e.perf):
            e.perf = probed[e.variant.name]
            e.write()


def _run(spec: ReleaseSpec, pool: SlotPool, variants: dict[str, Evidence], shared: _Probing, window: Window,
         log: Log) -> dict[tuple[str, str | None], list[PerfResult]]:
    """Every variant's server up on one slot, then the probes in `window.order`; each probe's record into `window`;
    (variant, half) -> its succeeded probes' results, in round order."""
    folder, order = shared.folder, window.order
    results: dict[tuple[str, str | None], list[PerfResult]] = {}
    with pool.take("speed window") as slot, pinned(slot), ExitStack() as servers, BenchClient() as client:
        window.cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        started = {}
        for name, ev in variants.items():  # every server up first, on the same slot: each probe then finds its own
            sub = folder / name
            sub.mkdir(parents=True, exist_ok=True)
            started[name] = servers.enter_context(make_server(server_config(spec, ev.variant, sub, slot), sub))
        # one benchmark client for every probe (started by the first, on this slot): vLLM's import once, not per probe
        window.started, shared = _now(), replace(shared, cores=window.cores, client=client)
        for k, s in enumerate(order, 1):
            rec = _probe(s, started[s.variant], variants[s.variant], shared)
            window.probes.append(rec)
            log(f"speed window: probe {k}/{len(order)} (round {s.round + 1}, {s.variant}"
                f"{'' if s.half is None else ' ' + ('first' if s.half == FIRST else 'second')}) "
                f"{rec.seconds:.0f} s, load {rec.load_before}, others' share {_pct(rec.others_share)}"
                + (f": {rec.error}" if rec.error else ""))
            if rec.status == "ok":
                results.setdefault((s.variant, s.half), []).append(load_result(folder / rec.folder))
    return results


def _not_probed(c: Evidence) -> str | None:
    if c.decided:
        return f"{c.variant.name}: REJECT decided early by fidelity"
    if c.failure:
        return f"{c.variant.name}: its server failed"
    if c.variant.endpoint is not None:
        return f"{c.variant.name}: an endpoint (not on this machine's slots)"
    return None


@dataclass(frozen=True)
class _Probing:
    """What every probe of a window shares: its folder, the one-repeat settings, the tokenizer, the slot's cores,
    the benchmark client."""
    folder: Path
    settings: ProbeSettings
    tokenizer: Path
    cores: list[int]
    client: BenchClient | None = None


def _probe(s: PlannedProbe, srv, ev: Evidence, p: _Probing) -> Probe:
    folder, settings, tokenizer = p.folder, p.settings, p.tokenizer
    name = f"r{s.round + 1}-{s.index}-{s.variant}" + (f"-{s.half}" if s.half else "")
    rec = Probe(round=s.round, index=s.index, variant=s.variant, half=s.half, folder=name, started=_now())
    span = Span(p.cores)
    try:
        run_probe(srv.endpoint, folder / name, settings, tokenizer=tokenizer,
                  checkpoint=ev.variant.path, server_log=srv.log_path, plan=ev.folder / PLAN, python=srv.config.python,
                  check=True, client=p.client)
    except QuantgateError as exc:
        rec.status, rec.error = "error", exc.message
    span.end()
    rec.seconds, rec.load_before, rec.load_after = span.seconds, span.load_before, span.load_after
    rec.cpu_mhz, rec.busy_share, rec.others_share = span.cpu_mhz, span.busy_share, span.others_share
    return rec


def _write_ratios(run: Path, base: Evidence, probed: list[Evidence],
                  results: dict[tuple[str, str | None], list[PerfResult]], window: Window, log: Log) -> dict[str, Path]:
    """Each variant's pooled probe, and each candidate's pay_off.json (paired ratios, A/A floor, window)."""
    folder = run / WINDOW
    first, second = results.get((base.variant.name, FIRST)), results.get((base.variant.name, SECOND))
    if not first or not second or len(first) != len(second):
        log("speed window: the baseline's probes did not all succeed: no speed ratios (the gate says so)")
        return {}
    a, b = as_rounds(first), as_rounds(second)
    pooled = {base.variant.name: _pool(folder, base.variant.name, as_rounds(first + second))}
    try:
        aa = compare(a, b, paired=True)
    except QuantgateError as exc:  # the baseline's two halves probed different levels: no floor, no ratio
        log(f"speed window: no A/A floor: {exc.message}")
        return pooled
    geo = geometric_baseline(a, b)
    summary = {"rounds": window.rounds, "started": window.started, "ended": window.ended, "seconds": window.seconds,
               "cores": window.cores, "file": str(folder / "window.json"),
               "order": "baseline, candidates, baseline again per round (candidates reversed every other round)",
               "load": _load_summary(window)}
    for c in probed:
        mine = results.get((c.variant.name, None))
        if not mine or len(mine) != len(first):
            log(f"speed window: {c.variant.name}: not every probe succeeded: no speed ratios")
            continue
        cand = as_rounds(mine)
        pooled[c.variant.name] = _pool(folder, c.variant.name, cand)
        try:
            ratios = compare(geo, cand, paired=True)
        except QuantgateError as exc:
            log(f"speed window: {c.variant.name}: {exc.message}")
            continue
        write_json(run / c.variant.name / PAY_OFF, {**ratios, "floor": aa["decide"], "window": summary,
                                                     "file": str(folder / c.variant.name / "perf.json")})
    return pooled


def _pool(folder: Path, name: str, result: PerfResult) -> Path:
    """<window>/<variant>/perf.json: the variant's probes as one result (the flow points its evidence there:
    quantgate.release.flow._keep_window)."""
    out = folder / name
    write_json(out / "perf.json", result.model_copy(update={"medians": level_medians(result.runs)}).model_dump(
        mode="json"))
    return out


def _estimate(settings, probes: int) -> float:
    return probes * (settings.budget_s or 30.0)


def _load_summary(window: Window) -> dict:
    loads = [p.load_before for p in window.probes if p.load_before is not None]
    others = [p.others_share for p in window.probes if p.others_share is not None]
    return {"load1_min": min(loads, default=None), "load1_max": max(loads, default=None),
            "others_share_max": max(others, default=None)}


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"
