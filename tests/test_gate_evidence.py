"""Evidence from a run folder (quantgate.gate.evidence): real file shapes; missing or corrupt files never crash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _gate_fixtures import make_run, pay_off_doc

from quantgate.base.paths import RELEASES
from quantgate.gate.evidence import candidates, collect, gate_run

DEFAULT = RELEASES / "policies" / "default.yaml"
STRICT = RELEASES / "policies" / "strict.yaml"
CAND = "w4a16-gptq"


def test_good_run_is_promoted_and_decision_files_written(tmp_path):
    run = make_run(tmp_path)
    decisions, path = gate_run(run, DEFAULT)
    assert path == run / "decision.json" and [d.decision for d in decisions] == ["PROMOTE"]
    doc = json.loads(path.read_text())
    assert doc["decision"] == "PROMOTE" and doc["promoted"] == CAND
    assert doc["policy"]["name"] == "default" and len(doc["policy"]["sha256"]) == 64
    own = json.loads((run / CAND / "decision.json").read_text())
    assert own["decision"] == "PROMOTE" and own["checks"] == doc["candidates"][CAND]["checks"]
    for c in own["checks"]:
        assert set(c) >= {"name", "measured", "limit", "bound", "passed", "evidence_file", "reason"}


def test_collect_reads_every_kind_of_evidence(tmp_path):
    ev = collect(make_run(tmp_path, recall_lose=2), CAND)
    assert ev.scheme == CAND and ev.size_ratio.value == pytest.approx(0.4) and ev.throughput_ratio.value == 1.4
    assert ev.parity.verdict == "pass" and ev.judge.counts_as_evidence and ev.judge.n == 300
    assert set(ev.metrics["default"]) == {"exact_match", "numeric_match", "chrf", "choice_accuracy", "rouge_l"}
    assert ev.categories["default"]["proper_nouns"]["exact_match"].n == 50
    r = ev.recall["recall"]
    assert r.n == 40 and r.delta == pytest.approx(-2 / 40) and r.ci_low < r.delta <= r.ci_high <= 0
    assert {e.name for e in ev.error_rates} == {"baseline/default", f"{CAND}/default", "recall"}
    assert ev.gaps == {}


def test_damage_is_rejected_with_its_reason(tmp_path):
    decisions, _ = gate_run(make_run(tmp_path, lose={"proper_nouns": 10}), DEFAULT)
    d = decisions[0]
    assert d.decision == "REJECT"
    assert any(r.startswith("category:default/proper_nouns/exact_match") for r in d.reasons)
    assert any(r.startswith("pooled:default") and "harm detected" in r for r in d.reasons)


def test_fidelity_and_floor_are_read_at_the_policy_level(tmp_path):
    run = make_run(tmp_path, kl=0.004)
    ev = collect(run, CAND, fidelity_level=0.90)
    assert ev.fidelity.kl.level == 0.90 and ev.fidelity.kl.low < 0.004 * 1.0 < ev.fidelity.kl.high
    assert ev.floor.kl.mean < ev.fidelity.kl.mean and ev.fidelity.n_samples == 80
    wide = collect(run, CAND, fidelity_level=0.99)
    assert wide.fidelity.kl.high - wide.fidelity.kl.low > ev.fidelity.kl.high - ev.fidelity.kl.low
    (run / "fidelity" / "floor.json").unlink()
    no_floor = collect(run, CAND)
    assert no_floor.floor is None and "floor.json" in no_floor.gaps["fidelity"].reason
    d = gate_run(run, DEFAULT)[0][0]
    assert d.decision == "INCONCLUSIVE" and any(r.startswith("fidelity:floor") for r in d.reasons)


def _rm(p: Path) -> None:
    p.unlink()


def _corrupt(p: Path) -> None:
    p.write_text("{not json")


def _run(tmp_path: Path) -> Path:
    return tmp_path / "run"


def _base_eval(tmp_path: Path) -> Path:
    return tmp_path / "cache" / "base" / "default"


def _cand_eval(tmp_path: Path) -> Path:
    return tmp_path / "cache" / "cand" / "default"


# (id, file to break, how, gap slot, check that must fail (None: decision unaffected), words in the reason)
BROKEN = [
    ("compare-missing", lambda t: _run(t) / "compare" / f"{CAND}.json", _rm, "compare", "primary:exact_match", "missing file"),
    ("compare-corrupt", lambda t: _run(t) / "compare" / f"{CAND}.json", _corrupt, "compare", "primary:", "corrupt JSON"),
    ("compare-wrong-shape", lambda t: _run(t) / "compare" / f"{CAND}.json",
     lambda p: p.write_text('{"default": {"metrics": 3}}'), "compare", "primary:", "unexpected content"),
    ("baseline-evidence-missing", lambda t: _run(t) / "baseline" / "evidence.json", _rm, "parity", "engine_parity",
     "no engine parity verdict"),
    ("candidate-evidence-corrupt", lambda t: _run(t) / CAND / "evidence.json", _corrupt, "error_rate",
     "error_rate:unreadable", "corrupt JSON"),
    ("eval-summary-missing", lambda t: _cand_eval(t) / "summary.json", _rm, "error_rate", "error_rate:unreadable",
     "has no summary.json"),
    ("eval-failed-run", lambda t: _cand_eval(t) / "summary.json",
     lambda p: (p.unlink(), (p.parent / "manifest.json").write_text(
         '{"status": "failed", "error_rate": 0.2, "n_samples": 300}')), None, f"error_rate:{CAND}/default", "20.00%"),
    ("fidelity-corrupt", lambda t: _run(t) / "fidelity" / f"{CAND}.json", _corrupt, "fidelity", "fidelity",
     "corrupt JSON"),
    ("recall-delta-missing", lambda t: _run(t) / CAND / "recall" / "delta.json", _rm, "recall", "recall:", "missing file"),
    ("recall-baseline-records-missing", lambda t: _run(t) / "baseline" / "recall" / "requests.jsonl", _rm, "recall",
     "recall:", "no confidence interval"),
    ("recall-records-corrupt", lambda t: _run(t) / "baseline" / "recall" / "requests.jsonl", _corrupt, "recall",
     "recall:", "unreadable"),
    ("judge-corrupt-optional", lambda t: _run(t) / CAND / "judge" / "report.json", _corrupt, "judge", None, "corrupt JSON"),
    ("pay-off-corrupt", lambda t: _run(t) / CAND / "pay_off.json", _corrupt, "throughput", "pay_off:speed", "corrupt JSON"),
]


@pytest.mark.parametrize("target, breaker, slot, failing, words", [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_broken_evidence_becomes_a_gap_and_fails_closed(tmp_path, target, breaker, slot, failing, words):
    run = make_run(tmp_path)
    breaker(target(tmp_path))
    ev = collect(run, CAND)  # never raises
    if slot:
        assert words in ev.gaps[slot].reason, ev.gaps
    decisions, _ = gate_run(run, DEFAULT)
    d = decisions[0]
    if failing is None:
        assert d.decision == "PROMOTE", d.reasons
        return
    bad = [c for c in d.checks if c.name.startswith(failing)]
    # evidence that is broken or missing is not harm: inconclusive (not promoted, not rejected); a failed eval
    # run that is readable (slot None) is harm: its error rate fails the check
    outcome, decision = ("inconclusive", "INCONCLUSIVE") if slot else ("fail", "REJECT")
    assert bad and bad[0].outcome == outcome and words in bad[0].reason, [c.reason for c in d.checks]
    assert d.decision == decision


def test_pay_off_figures_required_by_the_strict_policy(tmp_path):
    run = make_run(tmp_path, throughput_ratio=None)
    d = gate_run(run, STRICT)[0][0]
    c = next(c for c in d.checks if c.name == "pay_off:speed")
    assert c.outcome == "inconclusive" and "no performance probe figures" in c.reason
    # the flow may pass the probe's figures directly instead of a file
    d2 = gate_run(run, STRICT, pay_off={CAND: {**pay_off_doc(1.5), "file": "perf/x.json"}})[0][0]
    c2 = next(c for c in d2.checks if c.name == "pay_off:latency/tpot_p50_ms")
    assert c2.passed is True and c2.evidence_file == "perf/x.json" and d2.workload == "latency"


def test_size_falls_back_to_the_quantization_manifest(tmp_path):
    run = make_run(tmp_path)
    ev_file = run / CAND / "evidence.json"
    data = json.loads(ev_file.read_text())
    del data["variant"]["size_bytes"], data["variant"]["scheme"]
    ev_file.write_text(json.dumps(data))
    (run / CAND / "quantization.json").write_text(json.dumps({"scheme": CAND, "compression_ratio": 2.5}))
    ev = collect(run, CAND)
    assert ev.scheme == CAND and ev.size_ratio.value == pytest.approx(0.4)
    assert ev.size_ratio.file.endswith("quantization.json")


def test_unknown_candidate_is_rejected_not_crashed(tmp_path):
    d = gate_run(make_run(tmp_path), DEFAULT, ["int8-w8a8"])[0][0]
    assert d.decision == "INCONCLUSIVE" and d.scheme is None
    assert any("missing evidence" in r for r in d.reasons)


def test_candidates_follow_the_spec_order(tmp_path):
    run = make_run(tmp_path)
    (run / "compare" / "a-first.json").write_text("{}")
    (run / "run.json").write_text(json.dumps({"spec": {"schemes": [CAND, "a-first"]}}))
    assert candidates(run) == [CAND, "a-first"]


def test_recall_and_judge_can_live_elsewhere(tmp_path):
    run = make_run(tmp_path, judge={"reliable": False})
    moved = tmp_path / "elsewhere"
    (run / CAND / "recall").rename(moved)
    d = gate_run(run, STRICT, recall_dirs={CAND: moved}, judge_reports={CAND: run / CAND / "judge" / "report.json"})[0][0]
    rows = {c.name: c for c in d.checks}
    assert rows["recall:exact"].passed is True and rows["recall:exact"].evidence_file == str(moved / "delta.json")
    assert rows["judge:non_inferiority"].passed is False and "failed calibration" in rows["judge:non_inferiority"].reason
