"""Complete release run folders for the store, report and dashboard tests: the gate fixtures' evidence (real
comparison, recall delta) plus what a finished release adds (gate decision, summary, heatmaps, judge report with
human review, perf ratios), under <results>/runs/<run-id>/."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from _gate_fixtures import make_run

from quantgate.base.paths import RELEASES
from quantgate.gate.evidence import gate_run
from quantgate.recall import score as recall_score
from quantgate.recall.run import heatmap

POLICY = RELEASES / "policies" / "default.yaml"
CAND = "w4a16-gptq"


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


def release_run(results: Path, run_id: str, *, lose: dict[str, int] | None = None, recall_lose: int = 0,
                model: str = "demo", hardware: str = "x86-cpu", throughput_ratio: float = 1.4, human: bool = True) -> Path:
    """A finished release run at <results>/runs/<run_id>, gated with the default policy."""
    work = results / "work" / run_id
    built = make_run(work, CAND, lose=lose, recall_lose=recall_lose, throughput_ratio=throughput_ratio)
    run = results / "runs" / run_id
    run.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(built), run)
    rdir = run / CAND / "recall"
    delta = json.loads((rdir / "delta.json").read_text())
    delta["baseline"] = str(run / "baseline" / "recall")
    _dump(rdir / "delta.json", delta)
    cand_records = [json.loads(ln) for ln in (rdir / "requests.jsonl").read_text().splitlines()]
    cells = recall_score.cells(cand_records)
    _dump(rdir / "cells.json", {"model": CAND, **cells})
    heatmap(cells["cells"], rdir / "heatmap.png", f"recall: {CAND}")
    heatmap(delta["cells"], rdir / "delta_heatmap.png", "recall delta", value="delta", delta=True)
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
    decisions, _ = gate_run(run, POLICY)
    cmp_ = json.loads((run / "compare" / f"{CAND}.json").read_text())
    metrics = {f"{s}/{m}": v["overall"] for s, r in cmp_.items() for m, v in r["metrics"].items()}
    d = decisions[0]
    _dump(run / "summary.json", {
        "release": "demo", "run": run_id, "model": model, "hardware": hardware,
        "baseline": {"size_bytes": 1000, "parity": {"verdict": "pass", "reason": "parity pass"}},
        "candidates": {CAND: {"scheme": CAND, "size_bytes": 400, "size_ratio": 0.4, "metrics": metrics,
                              "regressions": sum(len(r["regressions"]) for r in cmp_.values()),
                              "decision": d.decision, "reasons": d.reasons, "registry": None}},
        "decision": d.decision, "promoted": [CAND] if d.promoted else [], "policy": d.policy})
    return run
