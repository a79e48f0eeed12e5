"""What each MLflow run of an export holds (adapter: it reads the report and fidelity files): params, metrics, tags
and artifacts of the parent run (the release) and of each variant's run, built from a run folder read by
release.mlflow_read. docs/mlflow.md lists every key.

MLflow's rules are kept here (mlflow/utils/validation.py of its server): keys hold only the characters it accepts,
param values at most 6000 characters and tag values 8000 (a longer one is cut and says where the whole text is),
metrics are finite numbers.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from quantgate.base.errors import QuantgateError
from quantgate.base.runfiles import DECISION, PAY_OFF, PLAN, QUANTIZATION, REPORT_HTML, REPORT_MD, RUN, SUMMARY
from quantgate.fidelity.record import load_fidelity_record
from quantgate.gate.fidelityevidence import fidelity_evidence
from quantgate.gate.models import Interval
from quantgate.perf.payofffile import load_pay_off
from quantgate.publishing.mlflow_read import BASELINE, DecisionView, Release, VariantView
from quantgate.report.sections import pay_off
from quantgate.serving.server import plan_args

MAX_PARAM_VALUE, MAX_TAG_VALUE, MAX_KEY = 6000, 8000, 250
_BAD_KEY_CHAR = re.compile(r"[^/\w.\- :]")  # the server's rule on POSIX hosts: alphanumerics, _ - . space / :
RUN_NOTE = "mlflow.note.content"  # the run's description in MLflow's UI
RECIPE = "recipe.yaml"


def mlflow_key(name: str) -> str:
    """`name` as a key MLflow accepts for a metric, param or tag: characters outside its set become '_', empty path
    segments go and '.' or '..' ones become '_' (the server refuses a key that normpath would change), and a key
    over 250 characters is cut and ends in a hash of the whole, so that two long keys stay apart."""
    key = _BAD_KEY_CHAR.sub("_", name)
    key = "/".join(("_" if p in (".", "..") else p) for p in key.split("/") if p) or "_"
    if len(key) > MAX_KEY:
        key = key[:MAX_KEY - 9] + "-" + hashlib.sha256(name.encode("utf-8")).hexdigest()[:8]
    return key


def cut(value: str, limit: int, where: str) -> str:
    """`value` within `limit` characters; a cut one ends saying so and where the full text is."""
    if len(value) <= limit:
        return value
    note = f" ... [cut at {limit} characters: the full text is {where}]"
    return value[:limit - len(note)] + note


def _number(x: Any) -> float | None:
    """A finite float, or None for a string, a bool, None, NaN or an infinity (MLflow metrics are finite doubles)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


class Content:
    """Params, metrics and tags of one MLflow run (keys made valid, values within the limits), and its artifacts
    (artifact path -> bytes)."""

    def __init__(self) -> None:
        self.params: dict[str, str] = {}
        self.metrics: dict[str, float] = {}
        self.tags: dict[str, str] = {}
        self.artifacts: dict[str, bytes] = {}

    def param(self, key: str, value: Any, *, full_text: str = "in the run folder") -> None:
        if value is None or value == "":
            return
        text = value if isinstance(value, str) else json.dumps(value)
        self.params[mlflow_key(key)] = cut(text, MAX_PARAM_VALUE, full_text)

    def metric(self, key: str, value: Any) -> None:
        if (v := _number(value)) is not None:
            self.metrics[mlflow_key(key)] = v

    def tag(self, key: str, value: Any) -> None:
        if value is not None and value != "":
            self.tags[mlflow_key(key)] = cut(str(value), MAX_TAG_VALUE, "in the run folder")

    def file(self, artifact: str, path: Path) -> None:
        if path.is_file():
            self.artifacts[artifact] = path.read_bytes()


def fidelity_bounds(folder: Path, d: DecisionView, log: Callable[[str], None]) -> dict[str, Interval]:
    """check name -> the interval the gate judged that fidelity check on: the candidate's fidelity file summarized
    again as the gate does, at the decision's level (1 - 2 alpha: the look's alpha, else the policy's fidelity
    alpha, which the decision states as false_promote_at_limit). {} without a fidelity file or a stated level (an
    older gate); a fidelity file that cannot be read is said in the log and its bounds are left out."""
    path = folder / "fidelity" / f"{d.candidate}.json"
    alpha = d.look.alpha if d.look else d.operating.false_promote_at_limit if d.operating else None
    if alpha is None or not path.is_file() or not any(c.name.startswith("fidelity:") for c in d.checks):
        return {}
    try:
        rec = load_fidelity_record(path)
        ev = fidelity_evidence(rec.samples, 1 - 2 * alpha, str(path), estimator=rec.kl_estimator)
    except (OSError, ValueError, KeyError, TypeError, QuantgateError) as exc:
        log(f"mlflow: {d.candidate}: fidelity bounds left out: cannot read {path}: {type(exc).__name__}: {exc}")
        return {}
    out = {"fidelity:kl": ev.kl, "fidelity:top1": ev.top1}
    for cat, sub in ev.by_category.items():
        out |= {f"fidelity:kl:{cat}": sub.kl, f"fidelity:top1:{cat}": sub.top1}
    return out


def _checks(c: Content, d: DecisionView, bounds: dict[str, Interval]) -> None:
    """Each check with a numeric figure: the figure, its limit, pass as 1 / 0 and the fidelity interval."""
    for check in d.checks:
        c.metric(f"check.{check.name}", check.measured)
        c.metric(f"check.{check.name}.limit", check.limit)
        outcome = check.outcome or (None if check.passed is None else "pass" if check.passed else "fail")
        if outcome is not None and outcome != "skipped":
            c.metric(f"check.{check.name}.passed", 1.0 if outcome == "pass" else 0.0)
        iv = bounds.get(check.name)
        # only the interval of this very figure: its mean is the measured value (rounded as the gate rounds it)
        if iv is not None and _number(check.measured) is not None and round(iv.mean, 6) == check.measured:
            c.metric(f"check.{check.name}.bound_low", iv.low)
            c.metric(f"check.{check.name}.bound_high", iv.high)


def _policy(c: Content, policy: dict[str, Any] | None) -> None:
    for key in ("name", "version", "file", "sha256"):
        c.param(f"policy.{key}", (policy or {}).get(key))


def _common(rel: Release, v: VariantView) -> Content:
    """What every variant run has: who it is, its files, where it ran and how it was served."""
    c = Content()
    spec = rel.spec
    c.tag("quantgate.release", rel.name)
    c.tag("quantgate.run", rel.run_id)
    c.tag("quantgate.run_path", str(rel.folder.resolve()))
    c.tag("quantgate.variant", v.name)
    c.tag("quantgate.role", BASELINE if v.name == BASELINE else "candidate")
    c.param("variant", v.name)
    c.param("model", spec.model)
    c.param("hardware", (v.plan.hardware if v.plan else None) or rel.summary.hardware or spec.hardware)
    if v.checkpoint is not None:
        c.param("checkpoint", v.checkpoint.path)
        c.param("checkpoint.sha256", v.checkpoint.content_hash)
    if v.plan is not None:
        lay = v.plan.layout
        for key, value in (("tp", lay.tp), ("pp", lay.pp), ("dp", lay.dp), ("devices", lay.devices), ("ep", lay.ep),
                           ("replicas", v.plan.replicas), ("kind", v.plan.kind)):
            c.param(f"layout.{key}", value)
        extra = spec.serving.extra_args if spec.serving else []
        c.param("vllm_args", shlex.join(plan_args(v.plan, v.evidence.dtype if v.evidence else None) + extra))
    _policy(c, v.decision.policy if v.decision else rel.decision.policy)
    for name in (REPORT_HTML, REPORT_MD):
        c.file(name, rel.folder / name)
    for name in (DECISION, PLAN, QUANTIZATION):
        c.file(name, rel.folder / v.name / name)
    return c


def baseline_content(rel: Release, v: VariantView) -> Content:
    """The baseline's run: its size, parity verdict and eval means (from the candidates' summary rows)."""
    c = _common(rel, v)
    base = rel.summary.baseline
    if base is not None:
        c.metric("size_bytes", base.size_bytes)
        c.tag("quantgate.parity", (base.parity or {}).get("verdict"))
    for row in rel.summary.candidates.values():
        for key, m in row.metrics.items():
            if mlflow_key(f"eval.{key}.mean") not in c.metrics:
                c.metric(f"eval.{key}.mean", m.base_mean)
    return c


def candidate_content(rel: Release, v: VariantView, log: Callable[[str], None]) -> Content:
    """A candidate's run: its decision (tag, reasons as the run's description, every check), scheme and recipe,
    and the summary's figures."""
    c = _common(rel, v)
    d, q, row = v.decision, v.quantization, v.row
    c.tag("quantgate.decision", (d.decision if d else None) or (row.decision if row else None))
    c.param("scheme", (d.scheme if d else None) or (row.scheme if row else None) or (q.scheme if q else None))
    if q is not None:
        c.param("recipe_file", q.recipe_file)
        c.param("recipe", q.recipe_applied, full_text=f"the artifact {RECIPE}")
        for key, value in (q.calibration.model_dump() if q.calibration else {}).items():
            c.param(f"calibration.{key}", value)
        if q.recipe_applied:
            c.artifacts[RECIPE] = q.recipe_applied.encode("utf-8")
    if d is not None:
        c.param("family", d.family)
        _checks(c, d, fidelity_bounds(rel.folder, d, log))
        note = [f"**{d.decision}**", "\n".join(f"- {r}" for r in d.reasons), f"needs: {d.needs}" if d.needs else ""]
        c.tag(RUN_NOTE, "\n\n".join(part for part in note if part))
        c.tag("quantgate.needs", d.needs)
    _speed(c, rel.folder / v.name / PAY_OFF)
    if row is not None:
        for key in ("size_bytes", "size_ratio", "regressions"):
            c.metric(key, getattr(row, key))
        for key, m in row.metrics.items():
            for field in ("base_mean", "cand_mean", "delta", "ci_low", "ci_high"):
                c.metric(f"eval.{key}.{field}", getattr(m, field))
        c.tag("quantgate.registry_entry", row.registry)
        c.tag("quantgate.failure", row.failure)
    return c


def _speed(c: Content, path: Path) -> None:
    """Each pay-off figure's speed with its interval and A/A floor (report.sections.pay_off), and how it was
    measured (the window's rounds and times, or probes taken apart); nothing without a readable pay_off.json."""
    try:
        p = pay_off(load_pay_off(path)) if path.is_file() else None
    except QuantgateError:
        p = None
    if p is None:
        return
    for r in p["rows"]:
        for field in ("speed", "speed_low", "speed_high", "floor_low", "floor_high"):
            c.metric(f"speed.{r['figure']}.{field}", r[field])
    c.param("speed.rounds", p["rows"][0]["n"] if p["rows"] else None)
    c.param("speed.measured", p["measured"])


def parent_content(rel: Release) -> Content:
    """The release's run: the overall decision, the spec's headline settings, and the run's own files."""
    c = Content()
    spec = rel.spec
    c.tag("quantgate.release", rel.name)
    c.tag("quantgate.run", rel.run_id)
    c.tag("quantgate.run_path", str(rel.folder.resolve()))
    c.tag("quantgate.role", "release")
    c.tag("quantgate.decision", rel.decision.decision)
    c.tag("quantgate.promoted", ", ".join(rel.summary.promoted))
    c.param("release", rel.name)
    for key in ("model", "hardware", "workload", "context", "concurrency"):
        c.param(key, getattr(spec, key))
    c.param("git.commit", rel.record.git.commit)
    c.param("git.dirty", rel.record.git.dirty)
    _policy(c, rel.decision.policy)
    for name in (REPORT_HTML, REPORT_MD, SUMMARY, DECISION, RUN):
        c.file(name, rel.folder / name)
    return c
