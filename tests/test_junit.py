"""The gate's decision as JUnit XML: a testsuite per candidate, a testcase per check (failure for FAIL and, by
default, for INCONCLUSIVE; skipped for not applicable, and for inconclusive when asked), with the reason, written next
to decision.json by the release's gate step and by `quantgate gate`, from real gate decisions."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
from _gate_fixtures import make_run
from typer.testing import CliRunner

from quantgate.cli.main import app
from quantgate.gate.evidence import gate_run
from quantgate.gate.policy import DEFAULT_POLICY
from quantgate.report.junit import junit_path, render_junit, write_junit

CAND = "w4a16-gptq"


def suites(xml: str) -> dict[str, ET.Element]:
    root = ET.fromstring(xml)
    assert root.tag == "testsuites"
    return {s.get("name"): s for s in root.findall("testsuite")}


def cases(suite: ET.Element) -> dict[str, ET.Element]:
    return {c.get("name"): c for c in suite.findall("testcase")}


@pytest.mark.parametrize("run_kw, verdict, inconclusive, kind", [
    ({}, "PROMOTE", "failure", None),
    ({"lose": {"proper_nouns": 10}}, "REJECT", "failure", "failure"),
    ({"kl": None}, "INCONCLUSIVE", "failure", "failure"),  # nothing was promoted: CI shows a failure
    ({"kl": None}, "INCONCLUSIVE", "skipped", "skipped"),  # the team's choice (junit_inconclusive)
])
def test_one_testcase_per_check_and_the_decision(tmp_path, run_kw, verdict, inconclusive, kind):
    run = make_run(tmp_path, CAND, **run_kw)
    (d,), path = gate_run(run, DEFAULT_POLICY)
    assert d.decision == verdict
    doc = json.loads(path.read_text())
    suite = suites(render_junit(doc, inconclusive))[CAND]
    got = cases(suite)
    assert list(got) == [c.name for c in d.checks] + ["decision"]
    as_failure = inconclusive == "failure"
    for c in d.checks:
        case = got[c.name]
        if c.outcome == "fail":
            assert case.find("failure").get("message") == c.reason and str(c.limit) in case.find("failure").text
        elif c.outcome == "inconclusive" and as_failure:
            failure = case.find("failure")
            assert failure.get("type") == "inconclusive" and failure.get("message") == f"inconclusive: {c.reason}"
        elif c.outcome in ("inconclusive", "skipped"):
            want = "inconclusive" if c.outcome == "inconclusive" else "not applicable"
            assert case.find("skipped").get("message") == f"{want}: {c.reason}"
        else:
            assert case.find("failure") is None and case.find("skipped") is None
    decision = got["decision"]
    assert {e.tag for e in decision} & {"failure", "skipped"} == ({kind} if kind else set())
    unsure = sum(c.outcome == "inconclusive" for c in d.checks) + (verdict == "INCONCLUSIVE")
    n_fail = sum(c.outcome == "fail" for c in d.checks) + (verdict == "REJECT") + (unsure if as_failure else 0)
    n_skip = sum(c.outcome == "skipped" for c in d.checks) + (0 if as_failure else unsure)
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == (str(len(d.checks) + 1), str(n_fail), str(n_skip))
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props["decision"] == verdict and props["scheme"] == CAND


def test_a_reject_names_the_failed_check_and_its_reason(tmp_path):
    (d,), path = gate_run(make_run(tmp_path, CAND, lose={"proper_nouns": 10}), DEFAULT_POLICY)
    failed = [c for c in d.checks if c.outcome == "fail"]
    assert failed  # the test's premise: this evidence fails a check
    got = cases(suites(render_junit(json.loads(path.read_text())))[CAND])
    assert {n for n, c in got.items() if c.find("failure") is not None} == {c.name for c in failed} | {"decision"}
    assert got["decision"].find("failure").get("message") == "; ".join(d.reasons)


def test_ladder_rungs_not_tried_are_skipped_suites():
    doc = {"run": "/r/run-1", "candidates": {}, "ladder": [
        {"scheme": "w4a16-gptq", "status": "PROMOTE", "reasons": []},
        {"scheme": "int8-w8a8", "status": "not tried", "reasons": ["w4a16-gptq was promoted first"]}]}
    s = suites(render_junit(doc))
    assert list(s) == ["int8-w8a8"]
    assert cases(s["int8-w8a8"])["decision"].find("skipped").get("message") == "not tried: w4a16-gptq was promoted first"
    assert ET.fromstring(render_junit(doc)).get("skipped") == "1"


def test_the_gate_command_writes_it_next_to_the_decision(tmp_path):
    run = make_run(tmp_path, CAND, lose={"proper_nouns": 10})
    res = CliRunner().invoke(app, ["gate", "--policy", str(DEFAULT_POLICY), "--evidence", str(run)])
    assert res.exit_code == 3, res.output
    xml = (run / "decision.junit.xml").read_text()
    assert xml.startswith('<?xml version="1.0" encoding="UTF-8"?>') and suites(xml)[CAND].get("failures") != "0"
    other = tmp_path / "elsewhere.json"
    res = CliRunner().invoke(app, ["gate", "--policy", str(DEFAULT_POLICY), "--evidence", str(run), "--out", str(other)])
    assert res.exit_code == 3 and junit_path(other) == tmp_path / "elsewhere.junit.xml" and junit_path(other).is_file()


def test_the_gate_command_renders_an_inconclusive_candidate_as_the_team_chose(tmp_path):
    run = make_run(tmp_path, CAND, kl=None)
    for choice, tag in (("failure", "failure"), ("skipped", "skipped")):
        res = CliRunner().invoke(app, ["gate", "--policy", str(DEFAULT_POLICY), "--evidence", str(run),
                                       "--junit-inconclusive", choice])
        assert res.exit_code == 4, res.output
        decision = cases(suites((run / "decision.junit.xml").read_text())[CAND])["decision"]
        assert decision.find(tag) is not None and "inconclusive" in decision.find(tag).get("message")


def test_write_junit_reads_the_decision_file(tmp_path):
    _, path = gate_run(make_run(tmp_path, CAND), DEFAULT_POLICY)
    out = write_junit(path)
    assert out == path.parent / "decision.junit.xml"
    assert out.read_text() == render_junit(json.loads(path.read_text()))
