"""How a release tells Prefect its decision (quantgate.release.outcome): the event's shape, the Failed state's
data, and the summary read back from either state. The event reaching a real Prefect server is
tests/test_release_e2e.py's deployment test."""

from __future__ import annotations

import pickle
from pathlib import Path

from prefect.states import Completed, Failed

from quantgate.gate.models import Check, Decision
from quantgate.release.outcome import EVENT, NotPromoted, artifact_key, check_rows, decided_event, summary_of


def _decision(verdict: str) -> Decision:
    checks = [Check(name="fidelity:kl", measured=0.036, limit=0.02, required=True, outcome="fail",
                    reason="KL 0.036 > 0.02"),
              Check(name="pooled:default", measured=0.01, limit=0.02, required=True, outcome="pass", reason="ok")]
    return Decision(decision=verdict, candidate="int8-w8a8", scheme="int8-w8a8", family="int8",
                    policy={"name": "default"}, checks=checks, reasons=["fidelity:kl: KL 0.036 > 0.02"])


def test_the_decision_event_names_the_release_and_candidate_and_carries_the_failing_checks():
    ev = decided_event("demo", Path("/r/runs/demo-1"), _decision("REJECT"))
    assert ev["event"] == EVENT == "quantgate.release.decided"
    assert ev["resource"]["prefect.resource.id"] == "quantgate.release.demo.int8-w8a8"
    assert ev["resource"]["quantgate.decision"] == "REJECT" and ev["resource"]["quantgate.run"] == "demo-1"
    assert ev["payload"]["failing"] == ["fidelity:kl"]
    assert ev["payload"]["figures"]["fidelity:kl"] == {"measured": 0.036, "limit": 0.02, "outcome": "fail"}
    assert all(isinstance(v, str) for v in ev["resource"].values())  # Prefect's resource labels are strings


def test_a_failed_state_carries_an_exception_with_the_summary_and_reads_back_like_a_completed_one():
    summary = {"decision": "REJECT", "run": "demo-1", "promoted": []}
    failed = Failed(name="Rejected", message="REJECT", data=NotPromoted("REJECT", summary))
    got = failed.result(raise_on_failure=False)
    assert isinstance(got, BaseException) and summary_of(got) == summary
    assert summary_of(pickle.loads(pickle.dumps(got))) == summary  # a worker may persist it
    assert summary_of(Completed(data={"decision": "PROMOTE"}).result()) == {"decision": "PROMOTE"}
    assert summary_of(None) is None and summary_of("crashed") is None


def test_artifact_keys_are_what_prefect_accepts_and_the_table_has_a_row_per_check():
    from prefect.artifacts import Artifact

    for name in ("demo", "My_Release.v2", "a--b"):
        key = artifact_key(name, "checks")
        Artifact(type="table", key=key, data=[])  # Prefect's own validation: lowercase, digits, dashes
        assert key.startswith("release-") and key.endswith("-checks")
    rows = check_rows([_decision("REJECT")])
    assert [(r["candidate"], r["check"], r["outcome"]) for r in rows] == [
        ("int8-w8a8", "fidelity:kl", "fail"), ("int8-w8a8", "pooled:default", "pass")]


def test_the_headline_says_the_decision_and_the_deciding_checks_in_one_line():
    from quantgate.release.outcome import headline

    many = _decision("REJECT").model_copy(update={"checks": [
        Check(name=f"fidelity:kl:{c}", measured=0.04, limit=0.02, required=True, outcome="fail", reason="x")
        for c in ("a", "b", "c", "d", "e")]})
    inconclusive = _decision("INCONCLUSIVE").model_copy(update={"candidate": "w4a16", "checks": [
        Check(name="fidelity:kl", measured=0.02, limit=0.02, required=True, outcome="inconclusive", reason="x"),
        Check(name="pooled:default", measured=0.0, limit=0.02, required=True, outcome="fail", reason="x")]})
    assert headline("REJECT", [_decision("REJECT")]) == "REJECT: int8-w8a8 REJECT by fidelity:kl"
    assert headline("REJECT", [many, inconclusive]) == (
        "REJECT: int8-w8a8 REJECT by fidelity:kl:a, fidelity:kl:b, fidelity:kl:c and 2 more; "
        "w4a16 INCONCLUSIVE by fidelity:kl")
    assert headline("PROMOTE", [_decision("PROMOTE")]) == "PROMOTE: int8-w8a8 PROMOTE"
    assert "\n" not in headline("REJECT", [many, inconclusive])
