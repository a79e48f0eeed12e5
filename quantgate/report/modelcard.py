"""The model card of a promoted registry entry: `README.md` in the entry, rendered from the release's run folder.

`render_card(CardInputs)` is pure: typed inputs in, Markdown out. `card_inputs(run, candidate, ...)` is the thin
reader that fills CardInputs from the run folder's files:
    <run>/<candidate>/decision.json     the gate's decision: checks (measured, limit, verdict), reasons
    <run>/summary.json                  the candidate's key scores (when the summary is written already; a
                                        promotion happens before it, so then <run>/compare/<candidate>.json,
                                        the same figures from the comparison the summary is made of)
    <run>/<candidate>/quantization.json the quantize manifest: scheme, recipe text and file, calibration, versions
    <run>/<candidate>/plan.json         the planned layout and vLLM arguments; evidence.json its served dtype;
    <run>/run.json                      the spec (hardware, workload, serving.extra_args)
A file that is missing (a run made before, or a promotion outside a release) leaves its section saying so; the
card is never refused for it.

The serving section gives the exact `vllm serve` line of the planned layout and dtype, as quantgate served the
candidate (serving.server.plan_args, plus the spec's extra_args), without the arguments quantgate manages
(host, port, API key), pointed at `checkpoint`: the folder next to the card in the entry and in its published copies.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.errors import QuantgateError
from quantgate.base.runfiles import COMPARE_DIR, DECISION, EVIDENCE, PLAN, QUANTIZATION, RUN, SUMMARY
from quantgate.evals.comparefile import load_comparison
from quantgate.gate.summaryfile import load_summary
from quantgate.serving.server import plan_args

CARD = "README.md"
QUANT_MANIFEST = "quantgate-quant.json"  # quantgate.quantize.run.MANIFEST, inside the checkpoint folder


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CardCheck(_Model):
    name: str
    outcome: str                       # pass | fail | inconclusive | skipped
    measured: float | str | None = None
    limit: float | str | None = None
    bound: str | None = None
    required: bool | None = None
    reason: str = ""


class CardScore(_Model):
    n: int | None = None
    base_mean: float | None = None
    cand_mean: float | None = None
    delta: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None


class Serving(_Model):
    argv: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)


class CardInputs(_Model):
    model: str
    version: str
    candidate: str
    scheme: str | None = None
    family: str | None = None
    decision: str
    reasons: list[str] = Field(default_factory=list)
    needs: str | None = None
    policy: str | None = None
    checks: list[CardCheck] = Field(default_factory=list)
    scores: dict[str, CardScore] = Field(default_factory=dict)
    size_ratio: float | None = None
    recipe_file: str | None = None
    recipe_text: str | None = None
    calibration: dict[str, Any] | None = None
    versions: dict[str, Any] = Field(default_factory=dict)
    serving: Serving
    hardware: str | None = None
    workload: str | None = None
    run: str | None = None
    sha256: str | None = None


# --- pure ---------------------------------------------------------------------------------------------------------

def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def command_line(serving: Serving) -> str:
    """`ENV=... vllm serve checkpoint --flag value ...`, quoted for a POSIX shell."""
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(serving.env.items())]
    return " ".join([*env, shlex.join(serving.argv)])


def _evidence(c: CardInputs) -> list[str]:
    verdict = {"pass": "pass", "fail": "FAIL", "inconclusive": "inconclusive", "skipped": "not applicable"}
    rows = ["| check | measured | limit | bound | required | verdict | reason |", "|---|---|---|---|---|---|---|"]
    rows += [f"| {_cell(k.name)} | {_cell(k.measured)} | {_cell(k.limit)} | {_cell(k.bound)} | {_cell(k.required)} | "
             f"{verdict.get(k.outcome, k.outcome)} | {_cell(k.reason)} |" for k in c.checks]
    return rows if c.checks else ["No gate checks were recorded for this entry."]


def _scores(c: CardInputs) -> list[str]:
    if not c.scores:
        return ["No paired scores were recorded for this entry."]
    rows = ["| metric | n | baseline | candidate | delta | 95% CI of the delta |", "|---|---|---|---|---|---|"]
    for name, s in c.scores.items():
        ci = f"[{_cell(s.ci_low)}, {_cell(s.ci_high)}]" if s.ci_low is not None else "-"
        rows.append(f"| {_cell(name)} | {_cell(s.n)} | {_cell(s.base_mean)} | {_cell(s.cand_mean)} | {_cell(s.delta)} | {ci} |")
    return rows


def _quantization(c: CardInputs) -> list[str]:
    out = [f"- scheme: `{c.scheme or 'unknown'}`" + (f" (family {c.family})" if c.family else "")]
    if c.size_ratio is not None:
        out.append(f"- weights: {c.size_ratio:.3g}x the baseline's size on disk")
    cal = c.calibration
    out.append("- calibration: " + (f"{cal.get('samples')} samples x {cal.get('max_seq_length')} tokens from "
                                    f"`{cal.get('source')}` (seed {cal.get('seed')}, sha256 {str(cal.get('sha256'))[:12]})"
                                    if cal else "none recorded (data-free scheme, or no quantize manifest)"))
    if c.versions:
        out.append("- versions: " + ", ".join(f"{k} {v}" for k, v in sorted(c.versions.items())))
    out.append(f"- recipe: `{c.recipe_file or 'not recorded'}`; the whole quantize manifest, recipe included, is "
               f"`checkpoint/{QUANT_MANIFEST}`")
    if c.recipe_text:
        out += ["", "```yaml", c.recipe_text.rstrip(), "```"]
    return out


def render_card(c: CardInputs) -> str:
    """The card's Markdown (with YAML front matter the Hugging Face Hub reads as metadata)."""
    tags = ["quantgate", "compressed-tensors", *([c.scheme] if c.scheme else [])]
    reasons = [f"- {r}" for r in c.reasons] or ["- every required check passed"]
    lines = ["---", f"tags: [{', '.join(tags)}]", "---", "", f"# {c.model} {c.version}", "",
             f"`{c.candidate}` quantized by quantgate and gated against the unquantized baseline"
             + (f" for `{c.hardware}`" if c.hardware else "") + (f", workload `{c.workload}`" if c.workload else "")
             + (f" (run `{c.run}`)." if c.run else "."), "",
             "## Decision", "", f"**{c.decision}**" + (f" under policy {c.policy}" if c.policy else ""), "", *reasons]
    if c.needs:
        lines += [f"- needs: {c.needs}"]
    lines += ["", "## Evidence", "", "Every check of the gate: the measured value, its limit and the verdict.", "",
              *_evidence(c), "", "## Key scores", "", "Candidate against baseline on the release's eval sets (paired).", "",
              *_scores(c), "", "## Quantization", "", *_quantization(c), "",
              "## Serving with vLLM", "", "From the folder that holds this card (the registry entry or a copy of it):",
              "", "```bash", command_line(c.serving), "```", ""]
    lines += [f"- {n}" for n in c.serving.notes] + ([""] if c.serving.notes else [])
    if c.sha256:
        lines += ["## Provenance", "", f"- content sha256 of `checkpoint/`: `{c.sha256}` (what the gate evaluated)", ""]
    return "\n".join(lines)


def checks_of(decision: Mapping[str, Any]) -> list[CardCheck]:
    """A decision's checks as card rows; a check without `outcome` (an older decision) gets one from `passed`."""
    out = []
    for k in decision.get("checks") or []:
        outcome = k.get("outcome") or {True: "pass", False: "fail", None: "skipped"}.get(k.get("passed"), "skipped")
        out.append(CardCheck(name=str(k.get("name")), outcome=outcome, measured=k.get("measured"), limit=k.get("limit"),
                             bound=k.get("bound"), required=k.get("required"), reason=str(k.get("reason") or "")))
    return out


def serving_of(plan: Mapping | None, dtype: str | None, extra_args: list[str], name: str,
               served: list[str] | None = None) -> Serving:
    """The `vllm serve` line of the planned layout at the served dtype, on `checkpoint`; without a plan, the command
    the run served with (`served`), host and port left out."""
    if plan and plan.get("vllm_args") is not None:
        args = plan_args(SimpleNamespace(vllm_args=plan["vllm_args"]), dtype)
        reps = plan.get("replica_plans") or [{}]
        lay, n = plan.get("layout") or {}, plan.get("replicas", 1)
        notes = [f"planned for {plan.get('hardware')}: TP={lay.get('tp', 1)}, PP={lay.get('pp', 1)}, {n} replica(s)"
                 + ("; this is the first replica's line, the others differ in their devices or cores (the run's "
                    "plan.json)" if n and n > 1 else "")]
        if reps[0].get("multi_node"):
            notes.append("the plan spans nodes: each node's command is in the run's plan.json (`quantgate plan` prints them)")
        return Serving(argv=["vllm", "serve", "checkpoint", "--served-model-name", name, *args, *extra_args],
                       env=dict(reps[0].get("env") or {}), notes=notes)
    if served:
        rest, skip = [], {"--host", "--port", "--served-model-name"}
        it = iter(served[3:])
        for a in it:
            if a in skip:
                next(it, None)
            else:
                rest.append(a)
        return Serving(argv=["vllm", "serve", "checkpoint", "--served-model-name", name, *rest],
                       notes=["no plan was recorded: the arguments the release served with"])
    return Serving(argv=["vllm", "serve", "checkpoint", "--served-model-name", name],
                   notes=["no plan was recorded: `quantgate plan --model checkpoint --hardware H` gives the layout"])


# --- the reader ---------------------------------------------------------------------------------------------------

def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _typed(load: Callable[[Path], Any], path: Path) -> Any:
    """A typed run-folder file through its loader, or None when it is missing or does not fit its model."""
    try:
        return load(path)
    except QuantgateError:
        return None


def _scores_from(run: Path, candidate: str) -> dict[str, CardScore]:
    summary = _typed(load_summary, run / SUMMARY)
    row = summary.candidates.get(candidate) if summary else None
    if row is not None and row.metrics:
        return {k: CardScore(**{f: getattr(v, f) for f in CardScore.model_fields}) for k, v in row.metrics.items()}
    cmp_ = _typed(load_comparison, run / COMPARE_DIR / f"{candidate}.json")
    return {f"{set_name}/{metric}": CardScore(**{f: getattr(m.overall, f) for f in CardScore.model_fields})
            for set_name, report in (cmp_.root if cmp_ else {}).items() for metric, m in report.metrics.items()}


def card_inputs(run: Path | str | None, candidate: str, *, model: str, version: str,
                decision: Mapping[str, Any] | None = None, sha256: str | None = None) -> CardInputs:
    """CardInputs from a run folder (see the module docstring); `decision` wins over <run>/<candidate>/decision.json."""
    run = Path(run) if run is not None and Path(run).is_dir() else None
    folder = run / candidate if run else None
    d = dict(decision or (folder and _json(folder / DECISION)) or {})
    quant = (folder and _json(folder / QUANTIZATION)) or {}
    spec = ((run and _json(run / RUN)) or {}).get("spec") or {}
    evidence = (folder and _json(folder / EVIDENCE)) or {}
    policy = d.get("policy") or {}
    name = f"{model}-{candidate}"
    serving = serving_of((folder and _json(folder / PLAN)) or None, evidence.get("dtype"),
                         list((spec.get("serving") or {}).get("extra_args") or []), name, evidence.get("serve_command"))
    versions = {k: v for k, v in (quant.get("versions") or {}).items() if isinstance(v, (str, int, float))}
    ratio = quant.get("compression_ratio")
    return CardInputs(model=model, version=version, candidate=candidate, scheme=d.get("scheme") or quant.get("scheme"),
                      family=d.get("family"), decision=str(d.get("decision") or "unknown"),
                      reasons=[str(r) for r in d.get("reasons") or []], needs=d.get("needs"),
                      policy=f"{policy.get('name')} v{policy.get('version')}" if policy.get("name") else None,
                      checks=checks_of(d), scores=_scores_from(run, candidate) if run else {},
                      size_ratio=round(1 / ratio, 4) if isinstance(ratio, (int, float)) and ratio else None,
                      recipe_file=quant.get("recipe_file"), recipe_text=quant.get("recipe_applied"),
                      calibration=quant.get("calibration"), versions=versions, serving=serving,
                      hardware=spec.get("hardware"), workload=spec.get("workload"), run=run.name if run else None,
                      sha256=sha256)
