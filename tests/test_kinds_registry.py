"""The registry of measurement kinds added as one module each (quantgate.kinds.register; docs/design.md, "Adding a
measurement kind"): a kind registered once is read by the spec, planned and recorded by the release, read, judged and
fed by the gate and `check`, skipped by an early REJECT, and shown by the report. A stand-in kind ("echo") is
registered for these tests and taken off after; the installed ones come from their entry points."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_decide_early import SPEC

from quantgate.base.errors import QuantgateError
from quantgate.base.plugins import GROUP, load_kinds
from quantgate.base.paths import RELEASES
from quantgate.gate import kinds as gate_kinds
from quantgate.gate.checks import evaluate
from quantgate.gate.evidence import collect
from quantgate.gate.feeding import Feed, unfed
from quantgate.gate.kinds import KindPolicy, comparison_file, missing
from quantgate.gate.models import Check, KindComparison, PairedStat
from quantgate.gate.policy import load_policy
from quantgate.kinds import register
from quantgate.release import early, measurements
from quantgate.release.measurements import VariantJob, plan, recorded
from quantgate.release.variants import Evidence, Variant
from quantgate.report.page import _kinds
from quantgate.report.runview import load_run
from quantgate.spec import kinds as spec_kinds
from quantgate.spec.kinds import KindSpec
from quantgate.spec.resolve import load_spec


class EchoSpec(KindSpec):
    value: float = 1.0


class EchoPolicy(KindPolicy):
    max_delta: float = 0.1


class Echo:
    name = "echo"

    def folders(self, job):
        section = job.spec.measure.get("echo")
        return {} if section is None else {"echo": job.cache / "echo"}

    def pending(self, job, folders):
        return [k for k, d in folders.items() if not d.exists()]

    def steps(self, job, folders, pending, early):
        return []

    def phase(self, job, early):
        return 2

    def record(self, folders, skipped):
        return {"kinds": {} if "echo" in skipped else folders}

    def compare(self, run, base, cand):
        return None


class EchoGate:
    name = "echo"
    policy_model: type[KindPolicy] = EchoPolicy
    spec_field = "measure.echo"

    def checks(self, section, comparison, gap) -> list[Check]:
        if comparison is None or comparison.stat.delta is None:
            return [missing("echo", section, gap)]
        ok = comparison.stat.delta <= section.max_delta
        return [Check(name="echo", measured=comparison.stat.delta, limit=section.max_delta, required=section.required,
                      outcome="pass" if ok else "fail", reason="echo")]


@pytest.fixture
def echo():
    load_kinds()  # the installed ones first, so that they are not loaded again inside the test
    register("echo", EchoSpec, Echo(), EchoGate())
    yield
    spec_kinds._MODELS.pop("echo")
    gate_kinds._KINDS.pop("echo")
    measurements._ADDED[:] = [k for k in measurements._ADDED if k.name != "echo"]


def _policy(tmp_path: Path, kinds: dict) -> Path:
    """The default policy with these `kinds` sections added."""
    policy = yaml.safe_load((RELEASES / "policies" / "default.yaml").read_text())
    policy["kinds"] = {**(policy.get("kinds") or {}), **kinds}
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    return path


def test_the_installed_kinds_come_from_their_entry_points():
    from importlib.metadata import entry_points

    names = {e.name for e in entry_points(group=GROUP)}
    assert set(load_kinds()) == names and load_kinds() == load_kinds()
    assert set(gate_kinds.registered()) >= names and set(spec_kinds.registered()) >= names
    assert {k.name for k in measurements.all_kinds()} >= names


def test_an_unknown_kind_in_a_policy_or_a_spec_names_the_file_the_field_and_the_installed_kinds(tmp_path):
    with pytest.raises(QuantgateError) as err:
        load_policy(_policy(tmp_path, {"nosuch": {"required": True}}))
    said = str(err.value)
    assert "policy.yaml:" in said and "kinds" in said and "no such measurement kind (registered: " in said
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC + "measure: {nosuch: {}}\n")
    with pytest.raises(QuantgateError, match=r"spec\.yaml:\d+ .*measure.*no such measurement kind"):
        load_spec(spec)


def test_a_registered_kind_is_read_by_every_floor(echo, tmp_path):
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(SPEC + "measure: {echo: {value: 2.5}}\n")
    spec = load_spec(spec_file)
    assert isinstance(spec.measure["echo"], EchoSpec) and spec.measure["echo"].value == 2.5
    with pytest.raises(QuantgateError, match=r"measure\.echo\.value"):
        spec_file.write_text(SPEC + "measure: {echo: {value: high}}\n")
        load_spec(spec_file)
    # the release: planned, recorded into the evidence's `kinds` slot, skipped by an early REJECT like recall
    variant = Variant(name="int8-w8a8", path=tmp_path, content_hash="0" * 64, size_bytes=1)
    job = VariantJob(spec=spec, variant=variant, run=tmp_path / "run", folder=tmp_path / "run" / "int8-w8a8",
                     cache=tmp_path / "cache", tokenizer=tmp_path, reference={"default": tmp_path / "ev"}, baseline=False,
                     log=lambda _: None)
    folders, todo = plan(job)
    assert folders["echo"] == {"echo": tmp_path / "cache" / "echo"} and todo["echo"] == ["echo"]
    assert recorded(folders, {})["kinds"] == {"echo": tmp_path / "cache" / "echo"}
    assert recorded(folders, {"echo": "decided early"})["kinds"] == {}
    assert "echo" in early._skippable
    Evidence(variant=variant, folder=job.folder, cache=job.cache, serve_command=[], dtype=None, served=True,
             **recorded(folders, {}))
    # the gate: its policy section by its model, its comparison file read, its check judged
    policy = load_policy(_policy(tmp_path, {"echo": {"max_delta": 0.2, "required": True}}))
    assert isinstance(policy.kinds["echo"], EchoPolicy)
    with pytest.raises(QuantgateError, match=r"kinds\.echo\.max_delta"):
        load_policy(_policy(tmp_path, {"echo": {"max_delta": "lots"}}))
    run = tmp_path / "run"
    missing_check = {c.name: c for c in evaluate(policy, collect(run, "int8-w8a8")).checks}["echo"]
    assert missing_check.outcome == "inconclusive" and "measure.echo" in missing_check.reason
    comp = KindComparison(kind="echo", unit="try", stat=PairedStat(n=3, base_mean=1.0, cand_mean=1.5, delta=0.5, ci_low=0.4,
                                                              ci_high=0.6), figures={"base_value": 1.0})
    comparison_file(run, "int8-w8a8", "echo").parent.mkdir(parents=True)
    comparison_file(run, "int8-w8a8", "echo").write_text(comp.model_dump_json())
    ev = collect(run, "int8-w8a8")
    assert ev.kinds["echo"] == comp
    decision = evaluate(policy, ev)
    assert {c.name: c.outcome for c in decision.checks}["echo"] == "fail" and decision.decision == "REJECT"
    # `check`: a required kind the spec does not measure blocks PROMOTE; one it measures does not
    lines = [u for u in unfed(policy, Feed(sets=[], binary=set(), measured={"recall", "perf"})) if "echo" in u.line]
    assert len(lines) == 1 and lines[0].blocks and "measure.echo" in lines[0].line
    assert not [u for u in unfed(policy, Feed(sets=[], binary=set(), measured={"echo"})) if "echo" in u.line]
    # the report: its row in the candidate's measurements
    (row,) = [r for r in _kinds(load_run(run), "int8-w8a8") if r["kind"] == "echo"]
    assert (row["n"], row["delta"], row["ci_high"], row["figures"]) == (3, 0.5, 0.6, {"base_value": 1.0})
    assert json.loads(comparison_file(run, "int8-w8a8", "echo").read_text())["unit"] == "try"


# --- the gate's built-in kinds (quantgate.gate.builtin): the gate and `check` walk them in their registry's order ---

def test_the_gate_lists_each_built_in_kinds_checks_in_the_registrys_order_and_only_theirs(tmp_path, monkeypatch):
    from _gate_fixtures import make_run

    from quantgate.gate import builtin

    policy = load_policy(RELEASES / "policies" / "default.yaml")
    ev = collect(make_run(tmp_path), "w4a16-gptq")
    names = [c.name for c in evaluate(policy, ev).checks]
    kind_of = {"engine_parity": "engine_parity", "error_rate": "error_rate", "primary": "evals", "pooled": "evals",
               "category": "evals", "fidelity": "fidelity", "recall": "recall", "judge": "judge", "pay_off": "pay_off"}
    seen = [kind_of.get(n.split(":")[0], "registered") for n in names]  # registered: the policy's `kinds`
    assert set(seen) - {"registered"} == {name for name, _ in builtin.BUILT_IN}  # every built-in kind judged
    assert "registered" not in seen or seen[seen.index("registered"):] == ["registered"] * seen.count("registered")
    seen = [k for k in seen if k != "registered"]
    # each kind's own checks first in its order, then the task checks of evals and recall, then the others in order
    firsts = [k for k in seen if k in ("engine_parity", "error_rate", "fidelity")]
    assert seen[:len(firsts)] == firsts and firsts == sorted(firsts, key=["engine_parity", "error_rate",
                                                                          "fidelity"].index)
    tail = seen[len(firsts):]
    assert tail == sorted(tail, key=["evals", "recall", "judge", "pay_off"].index), seen
    # a kind taken off the registry is no longer judged: the gate names none of them itself
    monkeypatch.setattr(builtin, "BUILT_IN", tuple(k for k in builtin.BUILT_IN if k[0] != "judge"))
    assert not [c for c in evaluate(policy, ev).checks if c.name.startswith("judge")]


def test_a_kind_that_proves_closeness_lets_the_task_checks_lean_on_it_and_one_that_cannot_stops_that(tmp_path,
                                                                                                     monkeypatch):
    """The task checks accept fidelity's proof for limits their samples cannot prove; the proof is whatever the
    registry's kinds say in `proof`, not fidelity by name."""
    from _gate_fixtures import make_run

    from quantgate.gate import builtin

    # limits far below what 50 samples per category can prove: the task checks lean on fidelity's proof
    raw = yaml.safe_load((RELEASES / "policies" / "default.yaml").read_text())
    for section in [*raw["primary"]["families"].values(), *raw["categories"].values(), raw["own_categories"]]:
        section["max_relative_drop"] = 0.001
        section.pop("by_family", None)
    (tmp_path / "tight.yaml").write_text(yaml.safe_dump(raw))
    policy = load_policy(tmp_path / "tight.yaml")
    ev = collect(make_run(tmp_path, lose={"factual_qa": 1}), "w4a16-gptq")  # one answer lost: a CI with width
    proven = evaluate(policy, ev)

    def doubter(j: builtin.Judging) -> builtin.KindPart:
        return builtin.KindPart(proof=False)  # a kind that could not prove closeness

    monkeypatch.setattr(builtin, "BUILT_IN", (*builtin.BUILT_IN, ("doubter", doubter)))
    unproven = evaluate(policy, ev)
    lean = [c.name for c in proven.checks if c.outcome == "pass" and "fidelity carries the proof" in c.reason]
    assert lean and all(next(x for x in unproven.checks if x.name == n).outcome != "pass" for n in lean), lean


def test_check_walks_the_kinds_in_the_gates_order():
    from quantgate.gate import builtin, feeding

    gate_order = [name for name, _ in builtin.BUILT_IN]
    fed = [name for name, _ in feeding.FEEDS]
    assert fed[-1] == "registered" and fed[:-1] == [n for n in gate_order if n in fed]
    policy = load_policy(RELEASES / "policies" / "default.yaml")
    lines = [u.line.split(":")[0] for u in unfed(policy, Feed(sets=[], binary=set(), measured=set(), needles={512: 2}))]
    kinds_said = [{"primary": "evals", "pooled": "evals", "category": "evals"}.get(x.split(" ")[0], x.split(" ")[0])
                  for x in lines]
    assert kinds_said == sorted(kinds_said, key=fed.index), lines
