"""Complete release run folders for the store, report and dashboard tests: the gate fixtures' evidence (real
comparison, recall delta) plus what a finished release adds (gate decision, summary, heatmaps, judge report with
human review, perf ratios, optionally fidelity files), under <results>/runs/<run-id>/.

The gate decision is written here in the gate's schema 2 (quantgate.gate.models validates it: a shape change there
fails these fixtures) from the comparison's figures by a few fixed rules, rather than by the gate itself, so the
report tests see known outcomes: a check fails when its drop is beyond the limit with significant harm, and is
inconclusive when the drop is beyond a limit that lies below the minimum detectable drop without significant harm.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import shutil
from pathlib import Path
from statistics import NormalDist

from _gate_fixtures import make_run, records

from quantgate.base.paths import RELEASES
from quantgate.evals.compare import compare_runs
from quantgate.evals.metrics import load_table
from quantgate.fidelity.core import SampleFidelity, summarize
from quantgate.gate.early import early_fidelity_checks
from quantgate.gate.evidence import decide_run
from quantgate.gate.models import Check, Decision, OperatingCharacteristics, Power
from quantgate.recall import score as recall_score
from quantgate.recall.run import heatmap

POLICY = RELEASES / "policies" / "default.yaml"
CAND = "w4a16-gptq"
HOSTILE = '<img src=x onerror="alert(1)"> | [click](http://evil.example) & `code`'
PRIMARY = {"exact_match": 0.03, "numeric_match": 0.03, "choice_accuracy": 0.03}      # max relative drop (w4a16)
CATEGORIES = {"proper_nouns": ("exact_match", 0.08), "arithmetic_numbers": ("numeric_match", 0.08),
              "multilingual": ("chrf", 0.08)}
ALPHA, POWER = 0.05, 0.8
OPERATING = OperatingCharacteristics(
    false_reject_bound=0.05, false_promote_at_limit=0.05, power=POWER,
    note="Harm tests are Holm-corrected; a check whose limit lies below its MDD only detects harm.")


def _dump(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return path


def judge_report(net: float = 0.02) -> dict:
    rate = lambda r: {"count": int(r * 100), "rate": r, "ci_low": max(r - 0.05, 0), "ci_high": min(r + 0.05, 1)}  # noqa: E731
    return {"schema": 1, "counts_as_evidence": True, "judge_not_stronger": None,
            "calibration": {"n": 60, "correct": 54, "accuracy": 0.9, "ci_low": 0.8, "ci_high": 0.95, "bar": 0.8,
                            "reliable": True, "reason": None,
                            "by_type": {"number_swap": {"n": 30, "correct": 28, "accuracy": 28 / 30, "invalid": 0},
                                        "entity_swap": {"n": 30, "correct": 26, "accuracy": 26 / 30, "invalid": 1}}},
            "comparison": {"n_pairs": 300, "position_consistency": 0.93, "invalid_rate": 0.0,
                           "overall": {"n": 300, "win": rate(0.3), "tie": rate(0.42), "loss": rate(0.28),
                                       "non_inferiority": {"n": 300, "net": net, "lower_bound": net - 0.06, "margin": 0.05,
                                                           "p_value": 0.01, "alpha": 0.05, "non_inferior": net - 0.06 > -0.05}},
                           "worst_losses": []}}


# --- the comparison, with gains and untrusted outputs -------------------------------------------------------------

def recompare(run: Path, lose: dict[str, int] | None, gain: dict[str, int], hostile: bool) -> None:
    """Rewrite compare/<CAND>.json from records where the candidate also gets right `gain[category]` samples the
    baseline had wrong; `hostile` puts HTML and Markdown syntax into the first lost sample's output."""
    base, cand = records(lose=lose)
    for cat, k in gain.items():
        wrong = [(b, c) for b, c in zip(base, cand) if b["category"] == cat and not any(b["scores"].values())]
        for b, c in wrong[:k]:
            c["scores"] = {m: 0.8 if m in ("chrf", "rouge_l") else 1.0 for m in b["scores"]}
            c["output"] = f"gained {b['id']}"
    if hostile:
        lost = next(c for b, c in zip(base, cand) if b["output"] != c["output"] and not c["output"].startswith("gained"))
        lost["output"] = HOSTILE
    table = load_table()
    refs = {r["id"]: [f"reference of {r['id']}"] for r in base}
    cmp_ = compare_runs(base, cand, {m: table[m] for m in sorted({m for r in base for m in r["scores"]})}, n_boot=500,
                        references=refs)
    _dump(run / "compare" / f"{CAND}.json", {"default": cmp_})


# --- the gate decision (schema 2) ---------------------------------------------------------------------------------

def _power(s: dict, limit: float) -> Power:
    n, base = s["n"], s["base_mean"] or 1.0
    z = NormalDist().inv_cdf(1 - ALPHA) + NormalDist().inv_cdf(POWER)
    spread = math.sqrt(max(s["discordance"], 1 / n)) if s.get("discordance") is not None else (s.get("sd_diff") or 0.0)
    mdd = z * spread / math.sqrt(n) / base
    below = limit < mdd
    return Power(n=n, alpha=ALPHA, mdd=mdd, power=POWER, discordance=s.get("discordance"), p_harm=s.get("p_harm"),
                 role="harm" if below else "non-inferiority", limit_below_mdd=below,
                 needs_samples=math.ceil(n * (mdd / limit) ** 2) if below else None)


def _stat_check(name: str, s: dict, limit: float, file: Path) -> Check:
    drop = -s["ci_low"] / s["base_mean"] + 0.0
    p = _power(s, limit)
    harm = (s.get("p_harm") or 1.0) <= ALPHA
    outcome = "pass" if drop <= limit else ("inconclusive" if p.limit_below_mdd and not harm else "fail")
    reason = {"pass": f"relative drop {drop:.4f} at the CI's worst end is within the limit {limit}",
              "fail": f"relative drop {drop:.4f} is beyond the limit {limit} and the harm test is significant "
                      f"(p={s.get('p_harm', 0):.3g})",
              "inconclusive": f"relative drop {drop:.4f} is beyond the limit {limit}, but the limit lies below the "
                              f"minimum detectable drop {p.mdd:.4f} at n={p.n} and no harm is significant"}[outcome]
    return Check(name=name, measured=round(drop, 6), limit=limit, bound="ci", required=True, outcome=outcome,
                 evidence_file=str(file), reason=reason, power=p)


def _fixed_checks(run: Path, fidelity: bool) -> list[Check]:
    delta = json.loads((run / CAND / "recall" / "delta.json").read_text())["overall"]["delta"]
    rdrop = round(-delta, 9) + 0.0
    out = [Check(name="recall:recall", measured=rdrop, limit=0.05, bound="point", required=True,
                 outcome="pass" if rdrop <= 0.05 else "fail", evidence_file=str(run / CAND / "recall" / "delta.json"),
                 reason=f"recall drop {rdrop:.3f} against the limit 0.05"),
           Check(name="engine_parity", measured="pass", limit="pass", required=True, outcome="pass",
                 evidence_file=str(run / "baseline" / "evidence.json"), reason="the baseline reproduces the reference"),
           Check(name="error_rate", measured=0.0, limit=0.02, required=True, outcome="pass", reason="no failed request"),
           Check(name="pay_off:size_ratio", measured=0.4, limit=0.8, required=True, outcome="pass",
                 evidence_file=str(run / CAND / "evidence.json"), reason="the checkpoint is 0.4 of the baseline's size"),
           Check(name="judge:non_inferiority", measured=-0.04, limit=-0.05, bound="ci", required=False, outcome="pass",
                 evidence_file=str(run / CAND / "judge" / "report.json"), reason="the judge finds it non-inferior")]
    if fidelity:
        f = run / "fidelity" / f"{CAND}.json"
        kl, top1 = (json.loads(f.read_text())["summary"][k] for k in ("kl", "top1"))
        out += [Check(name="fidelity:kl", measured=kl["high"], limit=0.02, required=True, outcome="pass",
                      evidence_file=str(f), reason=f"KL upper bound {kl['high']:.4f} is within 0.02"),
                Check(name="fidelity:top1", measured=top1["low"], limit=0.95, required=True, outcome="pass",
                      evidence_file=str(f), reason=f"top-1 agreement lower bound {top1['low']:.1%} is within 95%")]
    return out


def decide(run: Path, *, fidelity: bool = False) -> Decision:
    """The candidate's schema-2 decision from the run's comparison and recall files (see the module docstring)."""
    file = run / "compare" / f"{CAND}.json"
    rep = json.loads(file.read_text())["default"]
    checks = [_stat_check(f"primary:default/{m}", rep["metrics"][m]["overall"], lim, file)
              for m, lim in PRIMARY.items() if m in rep["metrics"]]
    checks += [_stat_check(f"category:default/{cat}/{m}", rep["metrics"][m]["by_category"][cat], lim, file)
               for cat, (m, lim) in CATEGORIES.items()]
    checks += _fixed_checks(run, fidelity)
    return _verdict(checks)


def _verdict(checks: list[Check]) -> Decision:
    failed = [c for c in checks if c.outcome == "fail"]
    undecided = [c for c in checks if c.outcome == "inconclusive"]
    verdict = "REJECT" if failed else "INCONCLUSIVE" if undecided else "PROMOTE"
    needs = max((c.power.needs_samples or 0 for c in undecided if c.power), default=0)
    digest = hashlib.sha256(POLICY.read_bytes()).hexdigest()
    return Decision(decision=verdict, candidate=CAND, scheme=CAND, family="w4a16",
                    policy={"name": "default", "version": 1, "file": str(POLICY), "sha256": digest},
                    checks=checks, reasons=[c.reason for c in failed or undecided],
                    needs=f"about {needs} paired samples" if verdict == "INCONCLUSIVE" and needs else None,
                    operating=OPERATING)


def write_decision(run: Path, d: Decision) -> None:
    """decision.json as quantgate.gate.evidence.write_decision lays it out, and the candidate's own copy."""
    _dump(run / "decision.json", {
        "schema_version": d.schema_version, "decision": d.decision, "promoted": CAND if d.promoted else None,
        "run": str(run), "policy": d.policy, "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "candidates": {CAND: d.model_dump(mode="json")}})
    _dump(run / CAND / "decision.json", d.model_dump(mode="json"))


def as_schema1(run: Path) -> None:
    """Rewrite decision.json as an old (schema 1) gate wrote it: checks with `passed` only, PROMOTE or REJECT."""
    doc = json.loads((run / "decision.json").read_text())
    for d in doc["candidates"].values():
        d["checks"] = [{k: c[k] for k in ("name", "measured", "limit", "required", "passed", "evidence_file", "reason")}
                       for c in d["checks"]]
        d.pop("needs", None), d.pop("operating", None), d.pop("schema_version", None)
        d["decision"] = "PROMOTE" if d["decision"] == "PROMOTE" else "REJECT"
    doc["schema_version"] = 1
    doc["decision"] = "PROMOTE" if doc["decision"] == "PROMOTE" else "REJECT"
    (run / "decision.json").write_text(json.dumps(doc))


# --- fidelity -----------------------------------------------------------------------------------------------------

FIDELITY_CATEGORIES = ("arithmetic_numbers", "factual_qa", "multilingual", "proper_nouns")
CONTEXT_SLICES = ("context:512", "context:1024")  # the fidelity slices at long context, as the release names them


def fidelity_doc(scale: float, top1: float, *, n: int = 10, tokens: int = 40,
                 categories: tuple[str, ...] = FIDELITY_CATEGORIES) -> dict:
    """A fidelity file as the release's fidelity step writes it ({"summary", "samples"}, quantgate.fidelity.core):
    `n` samples per category with a per-token KL about `scale` (arithmetic_numbers about three times that) and
    top-1 agreement about `top1`."""
    samples = []
    for k, cat in enumerate(categories):
        for i in range(n):
            kl = scale * (3.0 if cat == "arithmetic_numbers" else 0.6 + 0.1 * k) * (0.5 + i / n)
            agree = min(tokens, round(tokens * top1) + (i % 3) - 1)
            samples.append(SampleFidelity(id=f"{cat}-{i:03d}", category=cat, n_tokens=tokens, kl_sum=kl * tokens,
                                          top1_agree=agree, dnll_sum=kl / 3 * tokens, kl_max=kl * 4))
    return {"summary": summarize(samples, n_boot=200).model_dump(mode="json"),
            "samples": [s.model_dump(mode="json") for s in samples]}


# --- the run -------------------------------------------------------------------------------------------------------

def _recall_extras(run: Path) -> None:
    rdir = run / CAND / "recall"
    delta = json.loads((rdir / "delta.json").read_text())
    delta["baseline"] = str(run / "baseline" / "recall")
    _dump(rdir / "delta.json", delta)
    cand_records = [json.loads(ln) for ln in (rdir / "requests.jsonl").read_text().splitlines()]
    cells = recall_score.cells(cand_records)
    _dump(rdir / "cells.json", {"model": CAND, **cells})
    heatmap(cells["cells"], rdir / "heatmap.png", f"recall: {CAND}")
    heatmap(delta["cells"], rdir / "delta_heatmap.png", "recall delta", value="delta", delta=True)


def _summary(run: Path, run_id: str, model: str, hardware: str, d: Decision) -> None:
    cmp_ = json.loads((run / "compare" / f"{CAND}.json").read_text())
    metrics = {f"{s}/{m}": v["overall"] for s, r in cmp_.items() for m, v in r["metrics"].items()}
    _dump(run / "summary.json", {
        "release": "demo", "run": run_id, "model": model, "hardware": hardware,
        "baseline": {"size_bytes": 1000, "parity": {"verdict": "pass", "reason": "parity pass"}},
        "candidates": {CAND: {"scheme": CAND, "size_bytes": 400, "size_ratio": 0.4, "metrics": metrics,
                              "regressions": sum(len(r["regressions"]) for r in cmp_.values()),
                              "decision": d.decision, "reasons": d.reasons, "registry": None}},
        "decision": d.decision, "promoted": [CAND] if d.promoted else [], "policy": d.policy})


def release_run(results: Path, run_id: str, *, lose: dict[str, int] | None = None, recall_lose: int = 0,
                model: str = "demo", hardware: str = "x86-cpu", throughput_ratio: float = 1.4, human: bool = True,
                gain: dict[str, int] | None = None, hostile: bool = False, fidelity: bool = False) -> Path:
    """A finished release run at <results>/runs/<run_id> with its gate decision. `gain`: samples the candidate gets
    right that the baseline had wrong, per category; `hostile`: HTML in a lost sample's output; `fidelity`:
    fidelity/<CAND>.json and fidelity/floor.json."""
    work = results / "work" / run_id
    built = make_run(work, CAND, lose=lose, recall_lose=recall_lose, throughput_ratio=throughput_ratio)
    run = results / "runs" / run_id
    run.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(built), run)
    if gain or hostile:
        recompare(run, lose, gain or {}, hostile)
    _recall_extras(run)
    _dump(run / "run.json", {"spec": {"name": "demo", "model": model, "hardware": hardware, "schemes": [CAND],
                                      "recall": {"lengths": [1024]}, "perf": {"concurrency": [8]}, "judge": "judges/pairwise.md"},
                             "git": {"commit": "0123456789abcdef0123", "dirty": False},
                             "packages": {"quantgate": "0.1.0", "torch": "2.13.0+cpu"}})
    _dump(run / CAND / "quantization.json", {"reused": False, "scheme": CAND, "compression_ratio": 2.5,
                                              "weights_bytes": 400, "timings_s": {"wall": 85.2},
                                              "source": {"sha256": "ab" * 32}})
    _dump(run / CAND / "judge" / "report.json", judge_report())
    if human:
        _dump(run / CAND / "judge" / "human.json", {
            "n_exported": 50, "n_reviewed": 48, "n_blank": 2,
            "rates": {"win": {"count": 14, "rate": 14 / 48, "ci_low": 0.18, "ci_high": 0.43}},
            "agreement": {"n": 48, "agree": 40, "rate": 40 / 48, "ci_low": 0.7, "ci_high": 0.91}})
    if fidelity:
        _dump(run / "fidelity" / f"{CAND}.json", fidelity_doc(0.0123, 0.985))
        _dump(run / "fidelity" / "floor.json", fidelity_doc(0.00045, 0.998))
    d = decide(run, fidelity=fidelity)
    write_decision(run, d)
    _summary(run, run_id, model, hardware, d)
    return run


def inconclusive_run(results: Path, run_id: str, **kw) -> Path:
    """Schema 2 at full stretch: one check inconclusive with its power (the limit below the MDD), fidelity with its
    noise floor, regressions and gains, and a model output full of HTML."""
    return release_run(results, run_id, lose={"arithmetic_numbers": 1}, gain={"factual_qa": 2, "arithmetic_numbers": 1},
                       hostile=True, fidelity=True, **kw)


# --- the gate's own fidelity checks, and the demo's early REJECT ---------------------------------------------------

def _slices_doc(run: Path, scale: float, top1: float) -> None:
    _dump(run / "fidelity" / f"{CAND}.json", fidelity_doc(scale, top1, categories=FIDELITY_CATEGORIES + CONTEXT_SLICES))


def promote_run(results: Path, run_id: str, **kw) -> Path:
    """A PROMOTE whose fidelity checks are the gate's own (quantgate.gate.early: its wording, a check per category
    and context length), over fidelity close to the baseline; the other checks by this module's fixed rules."""
    run = release_run(results, run_id, fidelity=True, **kw)
    _slices_doc(run, 0.004, 0.985)
    doc = json.loads((run / CAND / "decision.json").read_text())
    kept = [Check.model_validate(c) for c in doc["checks"] if not c["name"].startswith("fidelity")]
    _window_pay_off(run)
    d = _verdict(kept + early_fidelity_checks(run, POLICY, CAND, CAND))
    assert d.decision == "PROMOTE", [c.reason for c in d.checks if c.outcome != "pass"]
    write_decision(run, d)
    _summary(run, run_id, kw.get("model", "demo"), kw.get("hardware", "x86-cpu"), d)
    return run


def _window_pay_off(run: Path) -> None:
    """The candidate's pay_off.json as a release's speed window writes it (quantgate.release.perf_window): the
    latency profile's figures paired over 3 rounds, the A/A floor and the window's conditions, beside the ratios."""
    doc = json.loads((run / CAND / "pay_off.json").read_text())
    fig = {"figure": "tpot_p50_ms", "at": "lowest", "concurrency": 1, "lower_is_better": True, "baseline": 58.2,
           "candidate": 31.4, "ratio": {"value": 0.5395, "low": 0.4852, "high": 0.5999, "level": 0.9,
                                        "method": "paired-log", "n_base": 3, "n_cand": 3, "df": 2.0}}
    floor = {**fig, "candidate": 58.9, "ratio": {**fig["ratio"], "value": 1.012, "low": 0.951, "high": 1.077}}
    doc.update(workload="latency", decide=[fig], floor=[floor], intervals={"level": 0.9, "method": "paired-log"},
               window={"rounds": 3, "started": "2026-12-06T05:41:34+00:00", "ended": "2026-12-06T05:43:43+00:00",
                       "seconds": 196.9, "cores": [0], "load": {"load1_min": 1.63, "load1_max": 2.84,
                                                               "others_share_max": 0.001}})
    _dump(run / CAND / "pay_off.json", doc)


def early_reject_run(results: Path, run_id: str, evals: bool = True, **kw) -> Path:
    """The demo's REJECT: fidelity fails pooled and in most slices, so the release skipped the recall grid and the
    perf probe on purpose (evidence.json `skipped` and `decided`, worded as quantgate.release.early records them),
    and the real gate decides over what is there (its checks of the skipped evidence say "not measured: <why>").
    evals=False: decided before the eval sets ran (a streaming look), so they were skipped on both sides too."""
    run = release_run(results, run_id, fidelity=True, **kw)
    skipped = ("recall", "perf") if evals else ("evals", "recall", "perf")
    if not evals:  # what the release writes then: no eval folder in evidence.json, an empty comparison
        _dump(run / "compare" / f"{CAND}.json", {})
        for variant in ("baseline", CAND):
            _dump(run / variant / "evidence.json", {**json.loads((run / variant / "evidence.json").read_text()),
                                                     "evals": {}})
    _slices_doc(run, 0.09, 0.86)
    shutil.rmtree(run / CAND / "recall")
    (run / CAND / "pay_off.json").unlink()
    failed = [c for c in early_fidelity_checks(run, POLICY, CAND, CAND) if c.outcome == "fail"]
    decided = "; ".join(f"{c.name}: {c.reason}" for c in failed[:3]) + f" (and {len(failed) - 3} more)"
    why = {CAND: f"decided early: REJECT by fidelity ({decided})",
           "baseline": f"every candidate's REJECT was decided by fidelity first ({CAND}): no decision of this release "
                       "compares with it"}
    for variant, reason in why.items():
        ev = json.loads((run / variant / "evidence.json").read_text())
        ev.update(skipped=dict.fromkeys(skipped, reason), decided=decided if variant == CAND else None)
        _dump(run / variant / "evidence.json", ev)
    (d,) = decide_run(run, POLICY)
    assert d.decision == "REJECT", d.reasons
    write_decision(run, d)
    _summary(run, run_id, kw.get("model", "demo"), kw.get("hardware", "x86-cpu"), d)
    return run
