"""`quantgate release SPEC`: run the release flow locally (Prefect's embedded engine; no server needed: the temporary
API server it uses is started and stopped by quantgate.release.stopping.run_flow)."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import typer
from pydantic import ValidationError

from quantgate.base.errors import SettingError
from quantgate.base.objstore import ResultStore
from quantgate.base.paths import results_dir
from quantgate.base.runfiles import DECISION
from quantgate.cli.check import Checked, Kind, validate
from quantgate.gate.models import EXIT_CODES
from quantgate.gate.summaryfile import Summary
from quantgate.release.outcome import summary_of
from quantgate.publishing.publish import env_notes, exit_code, failures
from quantgate.release.runrecord import check_new_run_id, timings
from quantgate.spec.resolve import load_spec
from quantgate.spec.schema import load_written_spec
from quantgate.spec.warn import sizing_warnings
from quantgate.release.stopping import run_flow


# a step's `served` in timings.json (absent: no note)
_SERVED_NOTE: dict[Any, str] = {True: "  (served)", False: "  (from cache)"}


def load_flow():
    """The release flow (quantgate.release.flow), imported when a release runs: Prefect loads only then, so the
    other commands start quickly. The work-pools executor is loaded with it (it registers `executor: pools`)."""
    importlib.import_module("quantgate.pools")
    return importlib.import_module("quantgate.release.flow").release


def executor_overrides(spec: Path, kind: str | None, store: str | None) -> dict[str, str] | None:
    """--executor and --store as the flow's `executor` parameter, checked with the spec's own `executor:` first (a
    pools release without a store, with a store whose filesystem is not installed, or without a Prefect server the
    workers share, is refused before any work)."""
    overrides = {k: v for k, v in (("kind", kind), ("store", store)) if v is not None}
    try:
        merged = load_written_spec(spec).executor.with_fields(overrides)
    except ValidationError as exc:
        raise SettingError(exc.errors()[0]["msg"].removeprefix("Value error, "), setting="executor",
                           fix="pass --executor local, or --store s3://bucket/prefix (a path every host mounts)") from None
    if merged.kind == "pools":
        assert merged.store is not None  # ExecutorSpec refuses pools without one
        ResultStore(merged.store, results_dir())  # an fsspec URL whose filesystem is missing is refused here
        if not os.environ.get("PREFECT_API_URL"):
            raise SettingError("a release on work pools needs the Prefect server its workers poll", setting="executor",
                               fix="export PREFECT_API_URL=http://<server>:4200/api (docs/scale-out.md)")
    return overrides or None


def _check_only(spec: Path) -> None:
    """`--check`: the spec, every eval set it names and its policy, validated without serving or quantizing
    anything; then the sample-size warnings. Exit 0 when all are good, 2 when any is bad, 6 when the spec cannot
    PROMOTE as written (a required check unfed)."""
    seen = validate([spec], Kind.spec, Checked())
    seen.exit(unpromotable=False)  # bad input: exit 2 before the warnings
    loaded = load_spec(spec)
    for warning in sizing_warnings(loaded):
        print(f"sample size: {warning}")
    for note in env_notes(loaded.publish, loaded.notify):  # credentials are read at run time: said now, not fatal
        print(f"note: {note}")
    seen.exit()
    raise typer.Exit(0)


def release(
    spec: Path = typer.Argument(..., help="release spec YAML (e.g. releases/demo.yaml)"),
    run_id: str | None = typer.Option(None, "--run-id", help="name of a new run folder under results/runs "
                                          "(letters, digits, _ . -; default: <name>-<UTC time>-<random>)"),
    check_only: bool = typer.Option(False, "--check", help="validate the spec, its eval sets and its policy, then "
                                    "stop: nothing is served or quantized. Exit 0: good; 2: bad input; 6: good "
                                    "files, but the spec cannot PROMOTE as written (a required check unfed)"),
    executor: str | None = typer.Option(None, "--executor", help="local (this host) or pools (each variant on the "
                                        "Prefect work pool named for it; needs PREFECT_API_URL and a store); "
                                        "default: the spec's `executor.kind`"),
    store: str | None = typer.Option(None, "--store", help="with pools: where every host shares its results, an "
                                     "fsspec URL (s3://bucket/prefix) or a path every host mounts; default: the "
                                     "spec's `executor.store`"),
) -> None:
    """Run a release to a decision: quantize, serve and evaluate every variant, compare, gate, promote.

    Exit code 0: a candidate was promoted; 3: REJECT (harm detected in every candidate); 4: INCONCLUSIVE (no candidate
    promoted, at least one for lack of evidence); 5: promoted, but a `publish:` target or a `notify:` webhook failed
    (the entry stays promoted; <run>/publish.json, notify.json); 2: bad input; 1: a step failed. With --check: 0
    good, 2 bad input, 6 the spec cannot PROMOTE as written (a release still runs such a spec: its evidence may
    be wanted; it warns at its start)."""

    if check_only:
        _check_only(spec)
    # refuse bad input before Prefect starts anything: what `--check` checks (the spec, its eval sets, its policy,
    # model and checkpoint folders), in seconds; nothing is written yet
    validate([spec], Kind.spec, Checked()).exit(unpromotable=False)
    check_new_run_id(run_id)  # and a run id that is no folder name or whose folder exists
    overrides = executor_overrides(spec, executor, store)
    # SIGTERM/SIGHUP/SIGINT stop every server and child of the release, Prefect's API server (guarded: it dies with
    # this process, even a SIGKILLed one) last, then exit 143/129/130
    state = run_flow(load_flow(), spec=str(spec), run_id=run_id, executor=overrides, return_state=True)
    try:
        summary = summary_of(state.result(raise_on_failure=False))  # Completed: the summary; Failed: NotPromoted
    except Exception:  # noqa: BLE001 - the flow itself crashed; Prefect logged the cause above
        summary = None
    if summary is None:
        print(f"error: the release flow ended {state.type.value}: {state.message}", file=sys.stderr)
        raise typer.Exit(1)
    typed = Summary.model_validate(summary)
    print(json.dumps({k: summary[k] for k in ("release", "run", "decision", "promoted")}, indent=2))
    looks = _streaming_looks(str(summary["run"]))
    for name, row in typed.candidates.items():
        print(f"{name}: {row.decision}" + "".join(f"\n  - {r}" for r in row.reasons) + looks.get(name, ""))
    _print_timings(str(summary["run"]))
    for r in typed.publish or []:
        print(f"publish {r.candidate} to {r.target}: {r.status}" + (f" ({r.where})" if r.where else ""))
    for n in typed.notify or []:
        print(f"notify {n.url}: {n.status}")
    for line in failures(typed):  # publishing and webhooks: reported, never swallowed
        print(f"error: {line}", file=sys.stderr)
    raise typer.Exit(exit_code(typed, EXIT_CODES[str(summary["decision"])]))


def _streaming_looks(run_id: str) -> dict[str, str]:
    """Candidate -> a line saying at which streaming look its REJECT was decided (decision.json's `stream`)."""
    try:
        doc = json.loads((results_dir() / "runs" / run_id / DECISION).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    out = {}
    for name, d in (doc.get("candidates") or {}).items():
        if isinstance(d, dict) and (s := d.get("stream")):
            out[name] = (f"\n  decided at streaming look {s['index']} of {s['of']} of {s['scope']}: {s['n']} of "
                         f"{s['total']} prompts, {s['elapsed_s']:g} s after the first step (alpha {s['alpha']:.4g})")
    return out


def _print_timings(run_id: str) -> None:
    """Wall time per flow step (<run>/timings.json), with when each started (steps run side by side on slots), so a
    slow step shows at the end of every release; the release's wall time is the critical path, not the sum."""
    rows = timings(results_dir() / "runs" / run_id)
    if rows:
        t0 = min(r.start for r in rows)
        print("wall time per step: start (seconds after the first step began), seconds, step")
        for r in rows:
            note = _SERVED_NOTE.get(r.served, "")
            print(f"  {r.start - t0:>7.1f}  {r.seconds:>8.1f} s  {r.step}{note}" + ("" if r.status == "ok" else f"  ({r.status})"))
        print(f"  {sum(r.seconds for r in rows):>17.1f} s  sum of the steps")
        print(f"  {max(r.end for r in rows) - t0:>17.1f} s  wall, first step to last")
