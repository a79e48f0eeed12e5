"""The model card of a promoted registry entry: `README.md` in the entry, rendered from the release's run folder.

`render_card(CardInputs)` is pure: typed inputs in, Markdown out. `card_inputs(run, candidate, ...)` is the thin
reader that fills CardInputs from the run folder's files:
    <run>/<candidate>/decision.json     the gate's decision: checks (measured, limit, verdict), reasons
    <run>/summary.json                  the candidate's key scores (when the summary is written already; a
                                        promotion happens before it, so then <run>/compare/<candidate>.json,
                                        the same figures from the comparison the summary is made of)
    <run>/<candidate>/quantization.json the quantize manifest: scheme, recipe text and file, calibration, versions
    <run>/<candidate>/plan.json         the planned layout and vLLM arguments; evidence.json its served dtype;
    <run>/run.json                      the spec (hardware, workload, serving.extra_args, model)
    the baseline                        what it is, its Hub id and license: the model catalogue's entry
                                        (releases/models.yaml), the spec's `license`, else config.json and
                                        README.md of the folder the candidate was quantized from (the quantize
                                        manifest's source, else <run>/baseline/evidence.json): cardbaseline
A file that is missing (a run made before, or a promotion outside a release) leaves its section saying so; the
card is never refused for it. A card is published: the recipe and calibration files it names are shown relative to
the project or the run, else by file name (shown_path), never as this machine's absolute paths.

The YAML front matter is the metadata the Hugging Face Hub reads: the base model and `base_model_relation: quantized`
(only when the baseline's Hub id is known), the license (only when the spec, the catalogue or the baseline states one),
`library_name`, `pipeline_tag`, the tags, the gate's decision under `quantgate:`, and a `model-index` with the
candidate's mean on each eval set and metric. It has the keys, order and shapes huggingface_hub's ModelCardData and
EvalResult write (tests/test_modelcard.py builds both and compares), but is written with PyYAML: a promotion must
not import huggingface_hub, which is imported only to publish to the Hub (quantgate.publishing.targets).

The serving section gives the exact `vllm serve` line of the planned layout and dtype, as quantgate served the
candidate (serving.server.plan_args, plus the spec's extra_args), without the arguments quantgate manages
(host, port, API key), pointed at `checkpoint`: the folder next to the card in the entry and in its published copies.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.errors import QuantgateError
from quantgate.base.pairedstat import PairedStat
from quantgate.base.paths import REPO
from quantgate.base.runfiles import COMPARE_DIR, DECISION, EVIDENCE, PAY_OFF, PLAN, QUANTIZATION, SUMMARY
from quantgate.evals.comparefile import load_comparison
from quantgate.base.runinfo import load_run_record
from quantgate.gate.models import RepairNote
from quantgate.gate.summaryfile import load_summary
from quantgate.quantize.manifest import QuantManifest, read_quantization
from quantgate.perf.payofffile import load_pay_off
from quantgate.report.cardbaseline import baseline_facts, baseline_folder
from quantgate.report.sections import pay_off
from quantgate.serving.server import plan_args

CARD = "README.md"
QUANT_MANIFEST = "quantgate-quant.json"  # quantgate.quantize.run.MANIFEST, inside the checkpoint folder
TASK = "text-generation"  # the Hub's pipeline tag, and the task of every model-index row
LIBRARY = "transformers"  # see card_metadata for why not "vllm"
_DATASET = re.compile(r"datasets:(.*)\[([^\]]*)\]", re.S)  # a calibration source read with `datasets`


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
    scores: dict[str, PairedStat] = Field(default_factory=dict)  # `<eval set>/<metric>`: its headline()
    size_ratio: float | None = None
    recipe_file: str | None = None
    recipe_text: str | None = None
    calibration: dict[str, object] | None = None
    versions: dict[str, object] = Field(default_factory=dict)
    serving: Serving
    hardware: str | None = None
    workload: str | None = None
    run: str | None = None
    sha256: str | None = None
    baseline: str | None = None       # what the baseline is, in words (cardbaseline); None when the run does not say
    base_model: str | None = None     # the baseline's Hub id (org/name); None when the run does not know one
    license: str | None = None        # as the spec, the catalogue or the baseline states it; never a default
    license_name: str | None = None   # with `license: other`, the name and link the baseline's card gives
    license_link: str | None = None
    speed: dict[str, Any] | None = None  # report.sections.pay_off of the candidate's pay_off.json
    repair: RepairNote | None = None  # a repaired candidate: the layers it keeps at 16 bits (its decision's)


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


def _speed(c: CardInputs) -> list[str]:
    """The workload's pay-off figures: each speed with its interval and the A/A floor, and how they were measured
    (report.sections.pay_off); nothing when the release probed no speed."""
    p = c.speed
    if not p:
        return []
    out = ["## Speed", "", f"Pay-off figures of the `{p['workload']}` profile: how many times as fast as the baseline.",
           "", "| figure | at concurrency | speed | 90% interval | A/A floor | rounds |", "|---|---|---|---|---|---|"]
    for r in p["rows"]:
        floor = f"{r['floor_low']:.2f}x-{r['floor_high']:.2f}x" if r["floor_low"] is not None else "none"
        ends = f"{r['speed_low']:.2f}x-{r['speed_high']:.2f}x" if r["speed_low"] is not None else "none"
        speed = f"{r['speed']:.2f}x" if r["speed"] is not None else "-"
        out.append(f"| {r['figure']} | {_cell(r['concurrency'] or 'best')} | {speed} | {ends} | {floor} | {r['n']} |")
    return [*out, "", p["measured"], ""]


def _quantization(c: CardInputs) -> list[str]:
    out = [f"- scheme: `{c.scheme or 'unknown'}`" + (f" (family {c.family})" if c.family else "")]
    if c.size_ratio is not None:
        out.append(f"- weights: {c.size_ratio:.3g}x the baseline's size on disk")
    if c.repair is not None:
        r = c.repair
        out.append(f"- kept at 16 bits: decoder layers {', '.join(str(k.layer) for k in r.kept)} (+{r.added_size:.1%} "
                   f"bytes), a repair of `{r.repairs}` after the gate rejected it by fidelity; each removed the most KL "
                   "from the failing slices on the baseline's own sampled answers: "
                   + ", ".join(f"`{k.modules}`" for k in r.kept))
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


def model_index(c: CardInputs) -> list[dict[str, Any]] | None:
    """The Hub's `model-index`: one result per eval set, one metric row per `<set>/<metric>` key score, its value
    the candidate's mean (a row holds one value; the baseline's stays in the Markdown table), `verified: false` (the
    Hub's evaluation service did not compute it). Scores without a finite candidate mean, or whose name has no set
    part, are left out; None when no row is left, so a card without scores has no model-index. The shape is what
    huggingface_hub's eval_results_to_model_index makes of the same EvalResult rows."""
    sets: dict[str, list[dict[str, object]]] = {}
    for key, s in c.scores.items():
        set_name, _, metric = key.partition("/")
        if set_name and metric and s.cand_mean is not None and math.isfinite(s.cand_mean):
            sets.setdefault(set_name, []).append({"type": metric, "value": s.cand_mean, "verified": False})
    if not sets:
        return None
    return [{"name": f"{c.model}-{c.candidate}",
             "results": [{"task": {"type": TASK}, "dataset": {"name": name, "type": name}, "metrics": rows}
                         for name, rows in sets.items()]}]


def card_metadata(c: CardInputs) -> dict[str, Any]:
    """The front matter as a mapping, keys in the order ModelCardData.to_dict() gives them; a field the run does not
    know is left out, never guessed.

    `library_name` is `transformers`, not `vllm`: the checkpoint is a transformers folder (config.json with its
    compressed-tensors quantization_config, safetensors) that transformers loads with compressed-tensors installed,
    and the Hub has no `vllm` library: it offers its "Use this model: vLLM" snippet for text-generation models tagged
    `transformers`. How quantgate itself serves it is the body's `vllm serve` line. `base_model_relation` is only
    written with a `base_model`, the model it relates to."""
    decision = {"decision": c.decision, "policy": c.policy, "run": c.run}
    meta: dict[str, object] = {
        "base_model": c.base_model, "library_name": LIBRARY, "license": c.license, "license_name": c.license_name,
        "license_link": c.license_link, "pipeline_tag": TASK,
        "tags": ["quantgate", "compressed-tensors", *([c.scheme] if c.scheme else [])],
        "base_model_relation": "quantized" if c.base_model else None,
        "quantgate": {k: v for k, v in decision.items() if v is not None},
        "model-index": model_index(c)}
    return {k: v for k, v in meta.items() if v is not None}


def front_matter(c: CardInputs) -> str:
    """card_metadata as YAML, dumped the way ModelCardData.to_yaml() dumps (block style, keys unsorted, unicode
    kept), without the `---` lines."""
    return yaml.safe_dump(card_metadata(c), sort_keys=False, allow_unicode=True).strip()


def render_card(c: CardInputs) -> str:
    """The card's Markdown, after its YAML front matter (the metadata the Hugging Face Hub reads: card_metadata)."""
    reasons = [f"- {r}" for r in c.reasons] or ["- every required check passed"]
    lines = ["", f"# {c.model} {c.version}", "",
             f"`{c.candidate}` quantized by quantgate and gated against its baseline"
             + (f" for `{c.hardware}`" if c.hardware else "") + (f", workload `{c.workload}`" if c.workload else "")
             + (f" (run `{c.run}`)." if c.run else "."), "",
             f"Baseline: {c.baseline or 'not recorded (the run names no baseline checkpoint on this machine)'}.", "",
             "## Decision", "", f"**{c.decision}**" + (f" under policy {c.policy}" if c.policy else ""), "", *reasons]
    if c.needs:
        lines += [f"- needs: {c.needs}"]
    lines += ["", "## Evidence", "", "Every check of the gate: the measured value, its limit and the verdict.", "",
              *_evidence(c), "", "## Key scores", "", "Candidate against baseline on the release's eval sets (paired).", "",
              *_scores(c), "", *_speed(c), "## Quantization", "", *_quantization(c), "",
              "## Serving with vLLM", "", "From the folder that holds this card (the registry entry or a copy of it):",
              "", "```bash", command_line(c.serving), "```", ""]
    lines += [f"- {n}" for n in c.serving.notes] + ([""] if c.serving.notes else [])
    if c.sha256:
        lines += ["## Provenance", "", f"- content sha256 of `checkpoint/`: `{c.sha256}` (what the gate evaluated)", ""]
    return "---\n" + front_matter(c) + "\n---\n" + "\n".join(lines)


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


def shown_path(path: str | None, run: Path | None) -> str | None:
    """A file as a published card names it: relative to the run when it is inside it (a run folder may lie inside
    the project), else to the project (`quant_recipes/w4a16-gptq.yaml`), else its file name; a relative path as it
    is. `datasets:<folder>[split]` shows its folder so. An absolute path would only tell the reader where one
    machine keeps its files."""
    if not path:
        return path
    if found := _DATASET.fullmatch(path):
        return f"datasets:{shown_path(found.group(1), run)}[{found.group(2)}]"
    p = Path(path)
    if not p.is_absolute():
        return path
    inside = [root for root in (run.resolve() if run else None, REPO) if root is not None and p.is_relative_to(root)]
    return p.relative_to(inside[0]).as_posix() if inside else p.name


def _typed(load: Callable[[Path], Any], path: Path) -> Any:
    """A typed run-folder file through its loader, or None when it is missing or does not fit its model."""
    try:
        return load(path)
    except QuantgateError:
        return None


def _scores_from(run: Path, candidate: str) -> dict[str, PairedStat]:
    summary = _typed(load_summary, run / SUMMARY)
    row = summary.candidates.get(candidate) if summary else None
    if row is not None and row.metrics:
        return {k: v.headline() for k, v in row.metrics.items()}
    cmp_ = _typed(load_comparison, run / COMPARE_DIR / f"{candidate}.json")
    return {f"{set_name}/{metric}": m.overall.headline()
            for set_name, report in (cmp_.root if cmp_ else {}).items() for metric, m in report.metrics.items()}


def card_inputs(run: Path | str | None, candidate: str, *, model: str, version: str,
                decision: Mapping[str, Any] | None = None, sha256: str | None = None) -> CardInputs:
    """CardInputs from a run folder (see the module docstring); `decision` wins over <run>/<candidate>/decision.json."""
    run = Path(run) if run is not None and Path(run).is_dir() else None
    folder = run / candidate if run else None
    d = dict(decision or (folder and _json(folder / DECISION)) or {})
    quant: QuantManifest = (_typed(read_quantization, folder / QUANTIZATION) if folder else None) or QuantManifest()
    record = _typed(load_run_record, run) if run else None
    spec = record.spec if record is not None else {}
    evidence = (folder and _json(folder / EVIDENCE)) or {}
    policy = d.get("policy") or {}
    name = f"{model}-{candidate}"
    serving = serving_of((folder and _json(folder / PLAN)) or None, evidence.get("dtype"),
                         list((spec.get("serving") or {}).get("extra_args") or []), name, evidence.get("serve_command"))
    versions = dict(quant.versions or {})
    ratio = quant.compression_ratio
    base = baseline_folder(run, quant) if run else None
    calibration = quant.calibration.model_dump(exclude_unset=True) if quant.calibration else None
    if calibration and isinstance(calibration.get("source"), str):
        calibration["source"] = shown_path(calibration["source"], run)
    return CardInputs(model=model, version=version, candidate=candidate, scheme=d.get("scheme") or quant.scheme,
                      family=d.get("family"), decision=str(d.get("decision") or "unknown"),
                      reasons=[str(r) for r in d.get("reasons") or []], needs=d.get("needs"),
                      policy=f"{policy.get('name')} v{policy.get('version')}" if policy.get("name") else None,
                      checks=checks_of(d), scores=_scores_from(run, candidate) if run else {},
                      size_ratio=round(1 / ratio, 4) if isinstance(ratio, (int, float)) and ratio else None,
                      recipe_file=shown_path(quant.recipe_file, run), recipe_text=quant.recipe_applied,
                      calibration=calibration,
                      versions=versions, serving=serving,
                      hardware=spec.get("hardware"), workload=spec.get("workload"), run=run.name if run else None,
                      sha256=sha256, speed=pay_off(_typed(load_pay_off, folder / PAY_OFF) if folder else None),
                      repair=RepairNote.model_validate(d["repair"]) if d.get("repair") else None,
                      **baseline_facts(base, spec))
