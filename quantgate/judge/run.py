"""One judge run in a directory: calibrate the judge, judge baseline vs candidate in both orders, write the report.

Layout of the output directory:
  manifest.json     judge (file hash, model, endpoint), eval set, the two runs' cache keys, settings, status
                    (quantgate.judge.manifestfile.JudgeManifest)
  pairs.jsonl       the comparison pairs (id, category, question, reference, baseline, candidate)
  judgements.jsonl  one record per judge request (quantgate.judge.client); resumable, never re-judged
  report.json       calibration, comparison statistics, flags; report.md the same for people
  human.json        added by `quantgate review import`
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.runfiles import JUDGE_REPORT, MANIFEST
from quantgate.base.errors import ConfigError, QuantgateError
from quantgate.base.fileio import write_json
from quantgate.base.http import Endpoint, read_results
from quantgate.base.paths import JUDGES
from quantgate.base.yamlconfig import load_model
from quantgate.evals.dataset import file_sha256, load_evalset
from quantgate.evals.run import load_run, probe_server
from quantgate.judge.client import JudgeClientConfig, JudgeJob, judge_all
from quantgate.judge.core import (Judge, JudgeSidecar, PairItem, SLOTS, outcomes, parse_verdict, render,
                                  summarize_calibration, summarize_comparison, template_problems)
from quantgate.judge.corrupt import CalibrationConfig, calibration_pairs
from quantgate.judge.manifestfile import (CalibrationUsed, EvalsetRef, JudgedRun, JudgeManifest, JudgeRef, JudgeRunKey,
                                          read_judge_manifest)
from quantgate.judge.report import render_markdown
from quantgate.judge.reportfile import JudgeReport

SCHEMA = 1


class JudgeEndpoint(BaseModel):
    """Who judges: an OpenAI-compatible server and the model it serves (a remote one, or one quantgate serves)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(description="base URL, e.g. http://127.0.0.1:8000/v1")
    model: str = Field(description="the model name the server answers to")
    api_key: str | None = Field(None, repr=False)
    model_hash: str | None = Field(None, description="the judge's checkpoint hash, to spot a judge that is a judged model")

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.url, self.model, self.api_key)


class JudgeSettings(BaseModel):
    """How to judge: the release spec's `judge:` section (quantgate.spec.sections.JudgeSpec.settings) and
    `quantgate judge`'s options both become one of these."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    template: Path = JUDGES / "pairwise.md"
    calibration_bar: float | None = Field(None, description="None: judges/calibration.yaml")
    calibration_per_type: int | None = Field(None, description="None: judges/calibration.yaml")
    margin: float = Field(0.05, description="non-inferiority margin on win rate - loss rate")
    not_stronger: bool = Field(False, description="declared: the judge is not stronger than the judged models")
    concurrency: int = 8
    timeout_s: float = 120.0
    limit: int | None = Field(None, description="judge the first N pairs; None: all")
    seed: int = 0
    worst: int = 10
    client: dict[str, Any] = Field(default_factory=dict, description="JudgeClientConfig fields to override")


def load_judge(path: Path | str) -> Judge:
    """A prompt template `<name>.md` and its sidecar `<name>.yaml`, checked together."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("judge template not found", where=str(path),
                          fix=f"give a judges/*.md file, e.g. {JUDGES / 'pairwise.md'}")
    sidecar = path.with_suffix(".yaml")
    spec = load_model(sidecar, JudgeSidecar)
    template = path.read_text(encoding="utf-8")
    problems = template_problems(spec, template)
    if problems:
        raise ConfigError("; ".join(problems), where=str(path),
                          fix=f"use only the placeholders listed for kind '{spec.kind}' in judges/README.md")
    return Judge(spec, template, file_sha256(path, sidecar))


def load_calibration_config(path: Path | str = JUDGES / "calibration.yaml") -> CalibrationConfig:
    return load_model(path, CalibrationConfig)


def comparison_items(samples, base: list[dict], cand: list[dict]) -> tuple[list[PairItem], dict[str, float], list[str]]:
    """Pairs for the ids answered in both runs (eval-set order), each pair's mean metric drop, and skipped ids."""
    b = {r["id"]: r for r in base if r.get("output") is not None}
    c = {r["id"]: r for r in cand if r.get("output") is not None}
    items, drop, skipped = [], {}, []
    for s in samples:
        if s.id not in b or s.id not in c:
            if s.id in b or s.id in c:
                skipped.append(s.id)
            continue
        items.append(PairItem(pair_id=s.id, category=s.category, question=s.prompt_text(), first=b[s.id]["output"],
                              second=c[s.id]["output"], reference=s.references[0], criteria=s.criteria))
        shared = set(b[s.id].get("scores", {})) & set(c[s.id].get("scores", {}))
        if shared:
            drop[s.id] = sum(b[s.id]["scores"][m] - c[s.id]["scores"][m] for m in shared) / len(shared)
    return items, drop, skipped


def not_stronger(judge_model: str, judge_hash: str | None, runs: dict[str, dict], declared: bool) -> str | None:
    """Why the judge is not known to be stronger than the judged models, or None."""
    if declared:
        return "declared with --judge-not-stronger"
    for role, m in runs.items():
        if judge_model == m.get("model") or (judge_hash and judge_hash == m.get("model_hash")):
            return f"the judge model is the {role} model ({judge_model})"
    return None


def _load_runs(es, baseline: Path | str, candidate: Path | str) -> tuple[tuple[dict, list[dict]], tuple[dict, list[dict]]]:
    """(manifest, records) of the baseline and candidate runs; both must have been made with eval set `es`."""
    runs = load_run(baseline), load_run(candidate)
    for role, (m, _), d in zip(("baseline", "candidate"), runs, (baseline, candidate)):
        if m["evalset"]["sha256"] != es.sha256:
            raise QuantgateError(f"the {role} run used another eval set (sha256 differs from {es.path})",
                                 where=str(Path(d) / MANIFEST), fix="give the eval set both runs were made with")
    return runs


def _claim(out: Path, key: JudgeRunKey) -> Path:
    """The manifest path in `out`; a directory that holds a judge run of something else is refused (and one whose
    manifest cannot be read, naming the file and field)."""
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / MANIFEST
    if manifest_path.is_file():
        prev, now = (read_judge_manifest(manifest_path).key or JudgeRunKey()).model_dump(), key.model_dump()
        diff = [k for k in now if prev.get(k) != now[k]]
        if diff:
            raise QuantgateError(f"this directory holds a judge run of something else (differs in: {', '.join(diff)})",
                                 where=str(manifest_path), fix="use a new output folder, or delete this one")
    return manifest_path


def _write_pairs(path: Path, items: list[PairItem]) -> None:
    path.write_text("".join(json.dumps(
        {"id": it.pair_id, "category": it.category, "question": it.question, "reference": it.reference,
         "baseline": it.first, "candidate": it.second}, ensure_ascii=False) + "\n" for it in items), encoding="utf-8")


def _jobs(judge: Judge, items: list[PairItem]) -> list[JudgeJob]:
    """One job per pair and slot (both orders for pairwise); identical answers need no judge."""
    return [JudgeJob(f"{it.pair_id}#{slot}", it.pair_id, slot,
                     render(judge, it, slot, show_reference=judge.spec.calibration_shows_reference
                            if it.kind == "calibration" else judge.spec.use_reference))
            for it in items if not it.identical for slot in SLOTS[judge.spec.kind]]


def run_judge(judge_at: JudgeEndpoint, settings: JudgeSettings, *, evalset: Path | str, baseline: Path | str,
              candidate: Path | str, out: Path | str) -> dict:
    """Calibrate, judge, report (see the module docstring)."""
    st = settings
    judge_path, limit, margin = st.template, st.limit, st.margin
    judge = load_judge(judge_path)
    cal_cfg = load_calibration_config()
    if st.calibration_per_type is not None:
        cal_cfg = cal_cfg.model_copy(update={"per_type": st.calibration_per_type})
    bar = cal_cfg.bar if st.calibration_bar is None else st.calibration_bar
    es = load_evalset(evalset)
    (bm, base), (cm, cand) = _load_runs(es, baseline, candidate)
    items, drop, skipped = comparison_items(es.samples, base, cand)
    items = items[:limit] if limit else items
    cal_items = calibration_pairs(es.samples, cal_cfg)
    if not items:
        raise QuantgateError("no sample was answered in both runs", where=f"{baseline} vs {candidate}",
                             fix="finish both `quantgate eval` runs first")

    out = Path(out)
    key = JudgeRunKey(judge_sha256=judge.sha256, judge_model=judge_at.model, evalset_sha256=es.sha256,
                      baseline=bm.get("cache_key"), candidate=cm.get("cache_key"), seed=st.seed)
    manifest_path = _claim(out, key)
    # unreachable judge or unknown model: a clear error before any work
    probe_server(judge_at.endpoint)
    manifest = JudgeManifest(
        schema=SCHEMA, status="running", key=key, endpoint=judge_at.url,
        judge=JudgeRef(path=str(judge_path), name=judge.spec.name, version=judge.spec.version, kind=judge.spec.kind,
                       sha256=judge.sha256),
        evalset=EvalsetRef(path=str(es.path), name=es.meta.name, version=es.meta.version),
        baseline=JudgedRun(dir=str(baseline), model=bm.get("model")),
        candidate=JudgedRun(dir=str(candidate), model=cm.get("model")),
        calibration=CalibrationUsed(**(cal_cfg.model_dump() | {"bar": bar})), margin=margin, limit=limit)
    manifest.write(manifest_path)
    _write_pairs(out / "pairs.jsonl", items)

    cfg = JudgeClientConfig(endpoint=judge_at.url, model=judge_at.model, api_key=judge_at.api_key,
                            concurrency=st.concurrency, timeout_s=st.timeout_s, max_tokens=judge.spec.max_tokens,
                            seed=st.seed, **st.client)
    path = out / "judgements.jsonl"
    try:
        stats = judge_all(_jobs(judge, [*cal_items, *items]), path, cfg, lambda t: parse_verdict(judge, t),
                          judge.spec.retry)
    except QuantgateError as exc:
        manifest.model_copy(update={"status": "failed", "error": exc.message}).write(manifest_path)
        raise
    report = build_report(judge, cal_items, items, path, bar=bar, margin=margin, drop=drop, worst=st.worst)
    report["judge_not_stronger"] = not_stronger(judge_at.model, judge_at.model_hash, {"baseline": bm, "candidate": cm},
                                                st.not_stronger)
    report["skipped_ids"] = skipped
    written = manifest.dump()
    report["meta"] = {k: written[k] for k in ("judge", "evalset", "baseline", "candidate", "endpoint")} | {
        "judge_model": judge_at.model, "client": stats}
    write_json(out / JUDGE_REPORT, report)
    (out / "report.md").write_text(render_markdown(JudgeReport.model_validate(report)), encoding="utf-8")
    manifest.model_copy(update={"status": "complete"}).write(manifest_path)
    return report


def read_labels(path: Path) -> tuple[dict[str, dict[str, str | None]], dict[str, int]]:
    """labels[pair_id][slot] from a judgements file, and parse counts (strict/tolerant/invalid/retried)."""
    labels: dict[str, dict[str, str | None]] = {}
    counts = {"strict": 0, "tolerant": 0, "invalid": 0, "retried": 0}
    for rec in read_results(path).values():
        if rec.get("error") is not None:
            continue
        labels.setdefault(rec["pair_id"], {})[rec["slot"]] = rec["label"]
        counts[rec["parsed"]] += 1
        counts["retried"] += bool(rec.get("verdict_retry"))
    return labels, counts


def build_report(judge: Judge, cal_items: list[PairItem], items: list[PairItem], path: Path, *, bar: float,
                 margin: float, drop: dict[str, float], worst: int) -> dict:
    labels, counts = read_labels(path)
    wanted = {it.pair_id for it in [*cal_items, *items]}
    counts = counts | {"judgements": sum(len(v) for k, v in labels.items() if k in wanted)}
    cal = summarize_calibration(outcomes(judge.spec.kind, cal_items, labels), bar)
    cmp_ = summarize_comparison(outcomes(judge.spec.kind, items, labels), margin=margin, score_drop=drop, worst=worst)
    return {"schema": SCHEMA, "calibration": cal, "comparison": cmp_, "parse": counts,
            "counts_as_evidence": cal["reliable"]}
