"""Read a release run folder for people and the results store (adapter): every file tolerated, never an exception.

A file that is missing, unreadable or of the wrong shape leaves its slot None and adds a `ReportGap` saying which file
and why; evidence a spec did not ask for (no judge, no recall) is `absent` rather than a gap, and so is a step the
release skipped on purpose (a variant's evidence.json `skipped`, quantgate.release.early: decided early by fidelity):
that file is not missing, it was never to be written, and the report says so in grey instead. Files read (see
quantgate/release/steps.py and quantgate/gate/evidence.py for who writes them):

    run.json, summary.json, decision.json, compare/<cand>.json, fidelity/<cand>.json, fidelity/floor.json
    <variant>/evidence.json, <variant>/quantization.json, <perf folder>/perf.json
    <cand>/recall/{cells.json, delta.json, heatmap.png, delta_heatmap.png}, <cand>/pay_off.json
    <cand>/judge/{report.json, human.json, review_key.json}
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from collections.abc import Callable

from quantgate.base.runinfo import RunRecord, load_run_record
from quantgate.base.runfiles import (CELLS, COMPARE_DIR, DECISION, DELTA, EVIDENCE, FIDELITY_FLOOR, HUMAN_REVIEW,
                                     JUDGE_DIR, JUDGE_REPORT, PAY_OFF, PERF, QUANTIZATION, REVIEW_KEY, RUN, STATUS,
                                     SUMMARY)
from quantgate.base.runstatus import RunStatus, load_status
from quantgate.base.typedfile import RunFileError
from quantgate.base.stats import num as _num
from quantgate.base.errors import QuantgateError
from quantgate.gate.sizeratio import size_ratio as size_ratio_of
from quantgate.judge.reportfile import JudgeReport, load_judge_report
from quantgate.perf.payofffile import PayOff, load_pay_off
from quantgate.quantize.manifest import read_quantization
from quantgate.recall.resultfile import RecallCells, RecallDelta, load_recall_cells, load_recall_delta

BASELINE = "baseline"
M = TypeVar("M")
_STAMP = re.compile(r"(\d{8}T\d{6}Z)(?:-[0-9a-f]{6}(?:[0-9a-f]{2})?)?$")  # 8 hex digits, 6 before 2026-12-07


@dataclass
class ReportGap:
    what: str                     # e.g. "decision", "w4a16-gptq: recall"
    file: str | None
    reason: str


@dataclass
class VariantFiles:
    name: str
    evidence: dict | None = None
    quantization: dict | None = None
    perf: dict | None = None
    perf_file: Path | None = None


@dataclass
class Candidate:
    name: str
    summary: dict | None = None   # summary.json's row
    decision: dict | None = None  # decision.json's candidates[name]
    compare: dict | None = None   # {eval set: compare_dirs output}
    recall_cells: RecallCells | None = None
    recall_delta: RecallDelta | None = None
    heatmaps: dict[str, Path] = field(default_factory=dict)  # "heatmap" / "delta_heatmap" -> png
    pay_off: PayOff | None = None
    judge: JudgeReport | None = None
    judge_dir: Path | None = None
    human: dict | None = None
    review_key: dict | None = None
    fidelity: dict | None = None  # fidelity/<name>.json: teacher-forced fidelity against the baseline
    skipped: dict[str, str] = field(default_factory=dict)  # step -> why it did not run (evidence.json `skipped`)
    decided: str | None = None    # the early decision's failed checks (evidence.json `decided`), None when none


@dataclass
class RunView:
    folder: Path
    run_id: str
    started: str                  # ISO time: from the run id, decision.json, or the folder's mtime
    run: RunRecord | None = None  # run.json
    summary: dict | None = None
    decision: dict | None = None
    floor: dict | None = None     # fidelity/floor.json: the baseline against itself (the noise floor)
    status: RunStatus | None = None  # status.json: completed, failed (step, root cause, log) or interrupted
    variants: dict[str, VariantFiles] = field(default_factory=dict)
    candidates: dict[str, Candidate] = field(default_factory=dict)
    gaps: list[ReportGap] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)  # every evidence file read (for the fingerprint)

    @property
    def spec(self) -> dict:
        return self.run.spec if self.run is not None else {}

    def get(self, *keys: str, default: Any = None) -> Any:
        """spec/summary fields: the first of summary[key] or spec[key] that is set."""
        for k in keys:
            for src in (self.summary or {}, self.spec):
                if isinstance(src, dict) and src.get(k) is not None:
                    return src[k]
        return default


def size_ratio(view: RunView, name: str) -> float | None:
    """Candidate / baseline checkpoint size, by the gate's precedence (quantgate.gate.sizeratio): both evidence.json
    sizes, then a stated ratio (summary.json, else the flow's pay-off figures), then 1 / the compression ratio."""
    c = view.candidates.get(name)
    row = (c.summary if c and isinstance(c.summary, dict) else None) or {}
    pay_ratio = c.pay_off.size_ratio if c and c.pay_off else None

    def size(v: str) -> Any:
        ev = view.variants[v].evidence if v in view.variants else None
        var = (ev or {}).get("variant")
        return var.get("size_bytes") if isinstance(var, dict) else None

    q = view.variants[name].quantization if name in view.variants else None
    stated = row.get("size_ratio") if _num(row.get("size_ratio")) else pay_ratio
    found = size_ratio_of(size(name), size(BASELINE), stated, (q if isinstance(q, dict) else {}).get("compression_ratio"))
    return found[0] if found else None


def _present(view: RunView, path: Path, what: str, required: bool) -> bool:
    """Whether the file is there to read (then it is listed among the view's files); a gap when a required one is not."""
    if not path.is_file():
        if required:
            view.gaps.append(ReportGap(what, str(path), "missing file"))
        return False
    view.files.append(path)
    return True


def _read(view: RunView, path: Path, what: str, *, required: bool = True, kind: type = dict) -> Any:
    if not _present(view, path, what, required):
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        view.gaps.append(ReportGap(what, str(path), f"unreadable: {exc}"))
        return None
    except json.JSONDecodeError as exc:
        view.gaps.append(ReportGap(what, str(path), f"corrupt JSON: {exc.msg} at line {exc.lineno}"))
        return None
    if not isinstance(data, kind):
        view.gaps.append(ReportGap(what, str(path), f"expected a JSON {kind.__name__}, found {type(data).__name__}"))
        return None
    return data


def _read_typed(view: RunView, path: Path, what: str, load: Callable[[Path], M], *, required: bool = True) -> M | None:
    """A typed run-folder file through its loader (quantgate.base.typedfile); a gap with the loader's reason when
    it is missing or does not fit its model."""
    if not _present(view, path, what, required):
        return None
    try:
        return load(path)
    except QuantgateError as exc:
        view.gaps.append(ReportGap(what, str(path), exc.message))
        return None


def _started(folder: Path, run_id: str, decision: dict | None) -> str:
    m = _STAMP.search(run_id)
    if m:
        return dt.datetime.strptime(m.group(1), "%Y%m%dT%H%M%SZ").replace(tzinfo=dt.UTC).isoformat()
    if decision and isinstance(decision.get("created"), str):
        return decision["created"]
    return dt.datetime.fromtimestamp(folder.stat().st_mtime, dt.UTC).isoformat(timespec="seconds")


def _rows(doc: dict | None) -> dict:
    """summary.json's or decision.json's "candidates" object; {} when it is missing or not an object."""
    rows = (doc or {}).get("candidates")
    return rows if isinstance(rows, dict) else {}


def _row(view: RunView, doc: dict | None, name: str, what: str, none: str) -> dict | None:
    """The candidate's object in summary.json or decision.json; a gap when the file was read but has none."""
    row = _rows(doc).get(name)
    if doc is not None and not isinstance(row, dict):
        why = none if row is None else f"expected a JSON object for this candidate, found {type(row).__name__}"
        view.gaps.append(ReportGap(f"{name}: {what}", str(view.folder / f"{what}.json"), why))
    return row if isinstance(row, dict) else None


def _candidate_names(view: RunView) -> list[str]:
    order = [str(s) for s in view.spec.get("schemes") or []]
    found = {p.stem for p in (view.folder / COMPARE_DIR).glob("*.json")}
    found |= {s for s in order if (view.folder / s).is_dir()}
    if view.status is not None and view.status.status != "completed":  # ended early: what it set out to release
        order += [str(c["name"]) for c in view.spec.get("candidates") or [] if isinstance(c, dict) and c.get("name")]
        found |= set(order)
    found |= set(_rows(view.summary))
    found |= set(_rows(view.decision))
    return sorted(found, key=lambda c: (order.index(c) if c in order else len(order), c))


def _variant(view: RunView, name: str) -> VariantFiles:
    v = VariantFiles(name)
    folder = view.folder / name
    v.evidence = _read(view, folder / EVIDENCE, f"{name}: evidence")
    quant = _read_typed(view, folder / QUANTIZATION, f"{name}: quantization manifest", read_quantization,
                        required=name != BASELINE)
    v.quantization = quant.dump() if quant else None  # the page and the results store read it as a dict
    perf_dir = (v.evidence or {}).get("perf")
    if perf_dir:
        v.perf_file = Path(perf_dir) / PERF
        v.perf = _read(view, v.perf_file, f"{name}: performance probe")
    return v


def _optional(view: RunView, spec_key: str) -> bool:
    """Whether the spec asked for this evidence (an old run.json without the key: treat as not asked)."""
    return view.spec.get(spec_key) is not None


def _want_fidelity(view: RunView) -> bool:
    return _optional(view, "fidelity") or (view.folder / "fidelity").is_dir()


def skipped_steps(evidence: dict | None) -> dict[str, str]:
    """A variant's steps skipped on purpose (evidence.json `skipped`: step -> why); {} for anything else."""
    steps = (evidence or {}).get("skipped")
    return {str(k): str(v) for k, v in steps.items()} if isinstance(steps, dict) else {}


def _candidate(view: RunView, name: str) -> Candidate:
    c = Candidate(name)
    folder = view.folder / name
    ev = view.variants[name].evidence or {}
    c.skipped = skipped_steps(ev)
    c.decided = ev["decided"] if isinstance(ev.get("decided"), str) else None
    c.summary = _row(view, view.summary, name, "summary", "no row for this candidate")
    c.decision = _row(view, view.decision, name, "decision", "no decision for this candidate")
    c.compare = _read(view, view.folder / COMPARE_DIR / f"{name}.json", f"{name}: comparison")
    c.fidelity = _read(view, view.folder / "fidelity" / f"{name}.json", f"{name}: fidelity", required=_want_fidelity(view))
    recall = folder / "recall"
    want_recall = (_optional(view, "recall") or recall.is_dir()) and "recall" not in c.skipped
    c.recall_cells = _read_typed(view, recall / CELLS, f"{name}: recall cells", load_recall_cells, required=want_recall)
    c.recall_delta = _read_typed(view, recall / DELTA, f"{name}: recall delta", load_recall_delta, required=want_recall)
    for key in ("heatmap", "delta_heatmap"):
        if (recall / f"{key}.png").is_file():
            c.heatmaps[key] = recall / f"{key}.png"
        elif want_recall:
            view.gaps.append(ReportGap(f"{name}: recall {key.replace('_', ' ')}", str(recall / f"{key}.png"),
                                       "missing file"))
    c.pay_off = _read_typed(view, folder / PAY_OFF, f"{name}: perf ratios", load_pay_off,
                            required=_optional(view, "perf") and "perf" not in c.skipped)
    judge = folder / JUDGE_DIR
    c.judge_dir = judge if judge.is_dir() else None
    c.judge = _read_typed(view, judge / JUDGE_REPORT, f"{name}: judge report", load_judge_report,
                          required=(_optional(view, "judge") or judge.is_dir()) and "judge" not in c.skipped)
    c.human = _read(view, judge / HUMAN_REVIEW, f"{name}: human review", required=False)
    c.review_key = _read(view, judge / REVIEW_KEY, f"{name}: review key", required=False)
    return c


def load_run(folder: Path | str) -> RunView:
    """Everything a run folder holds, with gaps for what is missing or corrupt."""
    folder = Path(folder)
    view = RunView(folder=folder, run_id=folder.name, started="")
    view.run = _read_typed(view, folder / RUN, "run record", lambda path: load_run_record(path.parent))
    view.status = _status(view, folder)
    ended = view.status is None or view.status.status == "completed"  # a failed or stopped run has no summary
    view.summary = _read(view, folder / SUMMARY, "summary", required=ended)
    view.decision = _read(view, folder / DECISION, "decision", required=ended)
    view.started = _started(folder, view.run_id, view.decision)
    view.floor = _read(view, folder / FIDELITY_FLOOR, "fidelity noise floor", required=_want_fidelity(view))
    view.variants[BASELINE] = _variant(view, BASELINE)
    for name in _candidate_names(view):
        view.variants[name] = _variant(view, name)
        view.candidates[name] = _candidate(view, name)
    if not view.candidates:
        view.gaps.append(ReportGap("candidates", str(folder),
                                   "no candidate found (no compare/, summary or spec schemes)"))
    return view


def _status(view: RunView, folder: Path) -> RunStatus | None:
    """status.json, or None (older runs, runs still going); a damaged one is a gap."""
    if (folder / STATUS).is_file():
        view.files.append(folder / STATUS)  # in the fingerprint: a run that ends later is ingested again
    try:
        return load_status(folder)
    except RunFileError as exc:
        view.gaps.append(ReportGap("run status", str(folder / STATUS), exc.message))
        return None


ENDED = ("FAILED", "INTERRUPTED")  # what outcome_of says of a run that ended without a decision


def outcome_of(view: RunView) -> str | None:
    """The run's decision, else how it ended without one: FAILED or INTERRUPTED (status.json); None when unknown."""
    decided = (view.decision or {}).get("decision") or (view.summary or {}).get("decision")
    if decided:
        return str(decided)
    if view.status is not None and view.status.status != "completed":
        return view.status.status.upper()
    return None


def shorten(view: RunView, text: str) -> str:
    """Text (a rendered report, a line of `show`) with every absolute path into the run made relative to the run
    folder: its own files by their names in it (int8/evidence.json), the rest of the results folder (the cache)
    as ../../cache/... The run folder is known by where it is now and where decision.json says it was written
    (a copied or moved run still names its old place in its files)."""
    runs = {view.folder.resolve()}
    written = (view.decision or {}).get("run")
    if isinstance(written, str) and os.path.isabs(written):
        runs.add(Path(written))
    for run in sorted(runs, key=lambda r: -len(str(r))):
        results = run.parent.parent if run.parent.name == "runs" else run.parent
        text = text.replace(f"{run}/", "").replace(str(run), ".")
        text = text.replace(f"{results}/", os.path.relpath(results, run) + "/")
    return text


def is_run(folder: Path) -> bool:
    return folder.is_dir() and (folder / RUN).is_file()


def run_folders(results: Path) -> list[Path]:
    runs = results / "runs"
    return sorted(p for p in runs.iterdir() if is_run(p)) if runs.is_dir() else []
