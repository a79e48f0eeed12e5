"""The scheme ladder: which schemes a release tries and in what order (pure), and how the release records the rungs
in decision.json, summary.json and the report when some schemes are never tried."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from _gate_fixtures import make_run

from quantgate.evals.comparefile import Comparison, load_comparison
from quantgate.gate.summaryfile import as_json, write_summary
from quantgate.release.ladder import after, describe, next_rung, rungs

S = ["fp8-dynamic", "int8-w8a8", "w4a16-gptq"]


def simulate(schemes, ladder, verdicts):
    """Drive next_rung as the flow does, with a gate that answers `verdicts`; the batches tried and the rungs."""
    decided, batches = {}, []
    while rung := next_rung(schemes, decided, ladder):
        batches.append(rung)
        decided |= {s: verdicts[s] for s in rung}
        assert len(batches) <= len(schemes), "the ladder never stops"
    return batches, rungs(schemes, decided, {s: [f"{s} failed"] for s, d in decided.items() if d == "REJECT"})


@pytest.mark.parametrize("ladder, verdicts, batches, status", [
    # no ladder: every scheme in one batch, whatever the gate says
    (False, "RPR", [S], ["REJECT", "PROMOTE", "REJECT"]),
    (False, "PPP", [S], ["PROMOTE"] * 3),
    # ladder: one at a time, stop at the first PROMOTE
    (True, "PRR", [S[:1]], ["PROMOTE", "not tried", "not tried"]),
    (True, "RPR", [S[:1], S[1:2]], ["REJECT", "PROMOTE", "not tried"]),
    (True, "RRP", [S[:1], S[1:2], S[2:]], ["REJECT", "REJECT", "PROMOTE"]),
    (True, "RRR", [S[:1], S[1:2], S[2:]], ["REJECT", "REJECT", "REJECT"]),
])
def test_ladder_order_and_stop(ladder, verdicts, batches, status):
    got, rows = simulate(S, ladder, dict(zip(S, ("PROMOTE" if v == "P" else "REJECT" for v in verdicts))))
    assert got == batches
    assert [r["status"] for r in rows] == status and [r["scheme"] for r in rows] == S
    for r in rows:
        if r["status"] == "REJECT":
            assert r["reasons"] == [f"{r['scheme']} failed"]
        if r["status"] == "not tried":
            assert r["reasons"][0].endswith("was promoted first") and r["reasons"][0].split()[0] in S


def test_rungs_mid_ladder_and_description():
    rows = rungs(S, {"fp8-dynamic": "REJECT"}, {"fp8-dynamic": ["primary:default/exact_match: drop 3% > 1%"]})
    assert [r["status"] for r in rows] == ["REJECT", "pending", "pending"]
    assert describe(rows) == ("scheme ladder: fp8-dynamic REJECT (primary:default/exact_match: drop 3% > 1%); "
                              "not tried: int8-w8a8, w4a16-gptq")
    assert describe(rungs(S, {})) == f"scheme ladder: nothing tried; not tried: {', '.join(S)}"


SPEC = """\
version: 1
name: t
model: demo
hardware: x86-cpu
schemes: [w4a16-gptq, int8-w8a8]
ladder: true
"""


def test_untried_rung_is_listed_but_is_no_failure(tmp_path):
    """A run whose first rung was promoted: decision.json and summary.json list int8-w8a8 as not tried; the gate,
    the run view and the report do not treat it as a candidate with missing evidence."""
    from quantgate.release import steps as rel
    from quantgate.gate.evidence import candidates
    from quantgate.report.page import write_report
    from quantgate.report.runview import load_run
    from quantgate.spec.resolve import load_spec

    (tmp_path / "spec.yaml").write_text(SPEC)
    spec = load_spec(tmp_path / "spec.yaml")
    run = make_run(tmp_path)  # one candidate, w4a16-gptq, that the default policy promotes
    (run / "run.json").write_text(json.dumps({"spec": spec.model_dump(mode="json")}))
    assert candidates(run) == ["w4a16-gptq"]
    decisions = rel.gate(spec, run, ["w4a16-gptq"])
    assert [d.decision for d in decisions] == ["PROMOTE"] and rel.next_schemes(spec, decisions) == []
    assert not (run / "decision.json").exists()  # a look decides; only the last look's decisions are written, once
    assert rel.record_decisions(spec, run, decisions) == run / "decision.json"
    assert (run / "decision.junit.xml").is_file() and (run / "w4a16-gptq" / "decision.json").is_file()
    doc = json.loads((run / "decision.json").read_text())
    assert doc["decision"] == "PROMOTE" and list(doc["candidates"]) == ["w4a16-gptq"]
    assert [(r["scheme"], r["status"]) for r in doc["ladder"]] == [("w4a16-gptq", "PROMOTE"), ("int8-w8a8", "not tried")]

    def ev(name, size):
        evidence = json.loads((run / name / "evidence.json").read_text())
        variant = rel.Variant(name=name, path=tmp_path, scheme=evidence["variant"]["scheme"], content_hash="0" * 64,
                              size_bytes=size)
        return rel.Evidence(variant=variant, folder=run / name, cache=tmp_path, serve_command=[], dtype=None,
                            evals=evidence["evals"], served=False)

    comparison = load_comparison(run / "compare" / "w4a16-gptq.json")
    typed = rel.finish_run(spec, run, ev("baseline", 1000), [(ev("w4a16-gptq", 400), comparison)], decisions, {})
    write_summary(run, typed)
    summary = as_json(typed)
    assert list(summary["candidates"]) == ["w4a16-gptq"] and summary["decision"] == "PROMOTE"
    assert summary["ladder"][1]["status"] == "not tried"
    assert any("not tried: int8-w8a8" in n for n in summary["notes"])
    view = load_run(run)
    assert list(view.candidates) == ["w4a16-gptq"] and not [g for g in view.gaps if "int8" in g.what]
    html, md = write_report(run)
    assert "not tried: int8-w8a8" in md.read_text() and 'id="cand-int8-w8a8"' not in html.read_text()


# --- adaptive sample size -----------------------------------------------------------------------------------

def test_widen_grows_samples_only_for_inconclusive_candidates_within_the_budget(tmp_path):
    from types import SimpleNamespace

    from quantgate.base.paths import REPO
    from quantgate.spec.resolve import load_spec
    from quantgate.spec.adaptive import widen

    path = tmp_path / "s.yaml"
    path.write_text(f"version: 1\nname: w\nmodel: demo\nhardware: x86-cpu\nschemes: [int8-w8a8]\n"
                    f"eval_sets: [{REPO / 'eval_sets' / 'default.jsonl'}]\neval: {{limit: 60}}\n"
                    "fidelity: {limit: 40}\nadaptive: {max_eval_samples: 200, max_fidelity_samples: 150}\n")
    spec = load_spec(path)
    undecided, rejected = [SimpleNamespace(decision="INCONCLUSIVE")], [SimpleNamespace(decision="REJECT")]
    assert widen(spec, rejected) is None
    w1 = widen(spec, undecided)
    assert (w1.eval.limit, w1.fidelity.limit) == (120, 80)
    w2 = widen(w1, undecided)
    assert (w2.eval.limit, w2.fidelity.limit) == (200, 150)
    assert widen(w2, undecided) is None  # the budget is spent: the decision stands
    assert widen(spec.model_copy(update={"adaptive": None}), undecided) is None


class _Job:
    """A finished job of the flow as `_next_at_verdict` reads it: its state, and its candidate's evidence."""

    def __init__(self, name: str, decided: str | None, completed: bool = True):
        self.ev = SimpleNamespace(variant=SimpleNamespace(name=name), decided=decided)
        self.state = SimpleNamespace(is_completed=lambda: completed)
        self.waited = False

    def wait(self):
        self.waited = True

    def result(self):
        assert self.waited, "read before the job ended"
        return self.ev


def test_a_rung_rejected_early_starts_the_next_at_its_verdict_and_no_other_ends_so():
    from quantgate.release.rungjobs import next_at_verdict as _next_at_verdict

    spec = SimpleNamespace(schemes=S, candidates=[])
    assert [after(S, s) for s in S] == ["int8-w8a8", "w4a16-gptq", None] and after(S, "other") is None
    early = "fidelity:kl:multilingual: 99.5% lower bound 0.031 > 0.02"
    assert _next_at_verdict(spec, _Job("fp8-dynamic", early)) == "int8-w8a8"
    assert _next_at_verdict(spec, _Job("w4a16-gptq", early)) is None  # the last rung: nothing follows
    # not decided early: the gate decides after the measurement, and the ladder goes on from its decision
    assert _next_at_verdict(spec, _Job("fp8-dynamic", None)) is None
    assert _next_at_verdict(spec, _Job("fp8-dynamic", early, completed=False)) is None  # failed: the flow reports it
