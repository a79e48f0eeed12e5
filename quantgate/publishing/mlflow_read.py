"""A finished run folder as the MLflow export reads it (adapter): run.json, summary.json (gate.summaryfile),
decision.json, and per variant its plan.json, quantization.json, evidence.json.

Files without a typed reader of their own are read through base.typedfile.read_model into small models that hold
only what the export uses and ignore the rest, so that a field added to a file later does not break an export; a
file that does not fit raises RunFileError naming the file and the field. quantization.json is read through its own
model (quantize.manifest.QuantManifest), its calibration cut to the fields the export logs (`CALIBRATION_PARAMS`).
The loose models are named `...View` (DecisionView, PlanView, EvidenceView, VariantView): read-only views of what the
writers' own models (gate.models.Decision, plan.models.Plan, release.variants.Evidence and Variant) wrote.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from quantgate.base.errors import QuantgateError
from quantgate.base.runfiles import DECISION, EVIDENCE, PLAN, QUANTIZATION, RUN, SUMMARY
from quantgate.base.runinfo import RunRecord, load_run_record
from quantgate.base.typedfile import RunFileError, field_path, read_model
from quantgate.gate.summaryfile import CandidateRow, Summary, load_summary
from quantgate.quantize.manifest import CalibrationRecord, QuantManifest

BASELINE = "baseline"
M = TypeVar("M", bound=BaseModel)
_FIX = "re-run the release with the same --run-id (its last steps rewrite the run's files)"


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Spec(_Loose):
    """The parts of run.json's spec an export reads."""

    class Serving(_Loose):
        extra_args: list[str] = Field(default_factory=list)

    name: str | None = None
    model: str | None = None
    hardware: str | None = None
    workload: str | None = None
    context: int | None = None
    concurrency: int | None = None
    serving: Serving | None = None




class DecisionCheck(_Loose):
    name: str
    measured: float | str | None = None
    limit: float | str | None = None
    bound: str | None = None
    outcome: str | None = None  # schema 2; an older decision has `passed` only
    passed: bool | None = None


class DecisionView(_Loose):
    """One candidate's decision (gate.models.Decision, read loosely: older schemas and added fields pass)."""

    class Look(_Loose):
        alpha: float

    class Operating(_Loose):
        false_promote_at_limit: float

    decision: str
    candidate: str
    scheme: str | None = None
    family: str | None = None
    policy: dict[str, Any] = Field(default_factory=dict)
    checks: list[DecisionCheck] = Field(default_factory=list)
    reasons: list[str] = Field(default_factory=list)
    needs: str | None = None
    look: Look | None = None
    operating: Operating | None = None


class DecisionDoc(_Loose):
    decision: str
    promoted: str | None = None
    policy: dict[str, Any] | None = None
    candidates: dict[str, DecisionView] = Field(default_factory=dict)


class PlanView(_Loose):
    class Layout(_Loose):
        devices: int | None = None
        tp: int | None = None
        pp: int | None = None
        dp: int | None = None
        ep: bool | None = None

    hardware: str | None = None
    kind: str | None = None
    layout: Layout = Field(default_factory=Layout)
    replicas: int | None = None
    vllm_args: dict[str, int | float | str | bool] = Field(default_factory=dict)


class EvidenceView(_Loose):
    class Ref(_Loose):
        path: str | None = None
        content_hash: str | None = None

    variant: Ref | None = None
    dtype: str | None = None


class VariantView(BaseModel):
    """One variant of the run: its decision and summary row (a candidate), and its folder's files."""
    name: str
    decision: DecisionView | None = None
    row: CandidateRow | None = None
    plan: PlanView | None = None
    quantization: QuantManifest | None = None
    evidence: EvidenceView | None = None

    @property
    def checkpoint(self) -> EvidenceView.Ref | None:
        return self.evidence.variant if self.evidence else None


class Release(BaseModel):
    """A finished run folder: its record, summary, decision and variants (the baseline first)."""
    folder: Path
    record: RunRecord
    spec: Spec
    summary: Summary
    decision: DecisionDoc
    variants: list[VariantView]

    @property
    def run_id(self) -> str:
        return self.summary.run or self.folder.name

    @property
    def name(self) -> str:
        return self.summary.release or self.spec.name or "release"


def _optional(path: Path, model: type[M], what: str) -> M | None:
    """The file read as `model`, or None when the run has none (an endpoint variant has no plan)."""
    return read_model(path, model, what, _FIX) if path.is_file() else None


CALIBRATION_PARAMS = ("source", "dataset", "samples", "max_seq_length", "seed")  # logged as calibration.<field>


def _quantization(path: Path, what: str) -> QuantManifest | None:
    """The variant's quantization.json (None when it has none), its calibration holding only `CALIBRATION_PARAMS`
    (the hash, record and token counts are not logged)."""
    q = _optional(path, QuantManifest, what)
    if q is None or q.calibration is None:
        return q
    kept = q.calibration.model_dump(include=set(CALIBRATION_PARAMS))
    return q.model_copy(update={"calibration": CalibrationRecord.model_validate(kept)})


def read_release(run: Path | str) -> Release:
    """The run folder read for an export; QuantgateError when it is not a finished, gated run."""
    folder = Path(run)
    if not (folder / RUN).is_file():
        raise QuantgateError("not a run folder (no run.json)", where=str(folder),
                             fix="give a results/runs/<run-id> folder written by `quantgate release`")
    for name in (SUMMARY, DECISION):
        if not (folder / name).is_file():
            raise QuantgateError(f"the run has no {name}: it did not finish", where=str(folder),
                                 fix="export a finished run (`quantgate runs` lists them with their decisions)")
    record = load_run_record(folder)
    try:
        spec = Spec.model_validate(record.spec)
    except ValidationError as exc:
        raise RunFileError(f"run record: unexpected content in field spec.{field_path(exc.errors()[0]['loc'])}: "
                           f"{exc.errors()[0]['msg']}", path=folder / RUN, fix=_FIX) from None
    summary = load_summary(folder / SUMMARY)
    decision = read_model(folder / DECISION, DecisionDoc, "gate decision", _FIX)
    names = list(summary.candidates) + [c for c in decision.candidates if c not in summary.candidates]
    variants = [VariantView(name=name, decision=decision.candidates.get(name), row=summary.candidates.get(name),
                        plan=_optional(folder / name / PLAN, PlanView, f"{name}: serving plan"),
                        quantization=_quantization(folder / name / QUANTIZATION, f"{name}: quantization manifest"),
                        evidence=_optional(folder / name / EVIDENCE, EvidenceView, f"{name}: evidence"))
                for name in [BASELINE, *names]]
    return Release(folder=folder, record=record, spec=spec, summary=summary, decision=decision, variants=variants)
