"""The model card of a promoted entry: rendered from the run folder, its serve line the one quantgate serves with,
written into the registry entry and covered by the entry's hashes (verify_entry notices a changed card)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from _publish_fixtures import CAND, EXTRA_ARGS, gated_run

from quantgate.base.errors import QuantgateError
from quantgate.plan.models import Plan
from quantgate.release import registry
from quantgate.report.modelcard import (CARD, CardCheck, CardInputs, Serving, card_inputs, checks_of, command_line,
                                        render_card)
from quantgate.serving.server import config_from_plan
from quantgate.target.catalogue import checkpoint_hash


@pytest.fixture
def run(tmp_path):
    return gated_run(tmp_path)


def _minimal(**kw) -> CardInputs:
    return CardInputs(**{"model": "m", "version": "v", "candidate": "c", "decision": "PROMOTE",
                         "serving": Serving(argv=["vllm", "serve", "checkpoint"]), **kw})


@pytest.mark.parametrize("check, row", [
    (CardCheck(name="fidelity:kl", outcome="pass", measured=0.00312345, limit=0.05, bound="ci", required=True,
               reason="within"), "| fidelity:kl | 0.003123 | 0.05 | ci | yes | pass | within |"),
    (CardCheck(name="recall", outcome="fail", measured=0.2, limit=0.05, required=True, reason="a|b\nc"),
     "| recall | 0.2 | 0.05 | - | yes | FAIL | a\\|b c |"),
    (CardCheck(name="judge", outcome="skipped", required=False, reason="no judge"),
     "| judge | - | - | - | no | not applicable | no judge |"),
    (CardCheck(name="pooled", outcome="inconclusive", measured=0.01, limit=0.03, reason="CI across the limit"),
     "| pooled | 0.01 | 0.03 | - | - | inconclusive | CI across the limit |"),
])
def test_each_check_is_one_row_of_the_evidence_table(check, row):
    assert row in render_card(_minimal(checks=[check])).splitlines()


def test_older_decisions_without_outcomes_still_render():
    rows = checks_of({"checks": [{"name": "a", "passed": True}, {"name": "b", "passed": False}, {"name": "c", "passed": None}]})
    assert [r.outcome for r in rows] == ["pass", "fail", "skipped"]


def test_the_command_line_is_shell_quoted():
    s = Serving(argv=["vllm", "serve", "checkpoint", "--chat-template", "a b.jinja"], env={"X": "1 2"})
    assert shlex.split(command_line(s)) == ["X=1 2", "vllm", "serve", "checkpoint", "--chat-template", "a b.jinja"]


def test_card_from_a_gated_run_holds_decision_evidence_recipe_and_serving(run):
    folder, _, decisions = run
    (d,) = decisions
    card = render_card(card_inputs(folder, CAND, model="demo", version="v1"))
    assert "**PROMOTE** under policy default v1" in card
    for c in d.checks:  # every gate check is in the evidence table with its verdict
        assert any(line.startswith(f"| {c.name} |") and line.rstrip().endswith(f"| {c.reason.replace('|', chr(92) + '|')} |")
                   for line in card.splitlines()), c.name
    compare = json.loads((folder / "compare" / f"{CAND}.json").read_text())
    for metric, m in compare["default"]["metrics"].items():  # the key scores, from the comparison (no summary yet)
        assert f"| default/{metric} | {m['overall']['n']} |" in card
    recipe = json.loads((folder / CAND / "quantization.json").read_text())["recipe_applied"]
    assert recipe.strip() in card and "64 samples x 256 tokens" in card


def test_the_serve_line_is_the_planned_one_at_the_served_dtype(run):
    """The card's command is what quantgate's own server config makes of the plan: same flags, same environment,
    with the served dtype and the spec's extra_args, minus host, port and API key."""
    folder, _, _ = run
    inputs = card_inputs(folder, CAND, model="demo", version="v1")
    plan = Plan.model_validate_json((folder / CAND / "plan.json").read_text())
    served = config_from_plan(plan, Path("checkpoint"), "demo-w4a16-gptq", dtype="bfloat16", extra_args=EXTRA_ARGS)
    assert inputs.serving.argv == ["vllm", "serve", "checkpoint", "--served-model-name", "demo-w4a16-gptq", *served.args]
    assert inputs.serving.env == served.env
    line = [ln for ln in render_card(inputs).splitlines() if "vllm serve" in ln][0]
    assert shlex.split(line)[len(served.env):] == inputs.serving.argv and "--dtype bfloat16" in line
    assert not {"--host", "--port", "--api-key"} & set(inputs.serving.argv)


def test_summary_figures_win_once_the_summary_exists(run):
    folder, _, _ = run
    (folder / "summary.json").write_text(json.dumps({"candidates": {CAND: {"metrics": {
        "default/exact_match": {"n": 7, "base_mean": 0.5, "cand_mean": 0.25, "delta": -0.25, "ci_low": -0.5, "ci_high": 0.0}}}}}))
    inputs = card_inputs(folder, CAND, model="demo", version="v1")
    assert list(inputs.scores) == ["default/exact_match"] and inputs.scores["default/exact_match"].n == 7


def test_without_a_run_folder_the_card_says_what_is_missing():
    card = render_card(card_inputs(None, "x", model="m", version="v", decision={"decision": "PROMOTE", "checks": []}))
    assert "No gate checks were recorded" in card and "no plan was recorded" in card and "vllm serve checkpoint" in card


def test_the_registry_entry_holds_the_card_and_verify_covers_it(run, tmp_path):
    folder, ckpt, (d,) = run
    e = registry.promote(d, model="demo", version="v1", checkpoint=ckpt, run=folder, root=tmp_path / "registry")
    entry = Path(e["path"])
    card = (entry / CARD).read_text()
    assert card == render_card(card_inputs(folder, CAND, model="demo", version="v1", decision=d.model_dump(mode="json"),
                                           sha256=checkpoint_hash(ckpt)))
    assert checkpoint_hash(ckpt) in card
    man = json.loads((entry / "manifest.json").read_text())
    assert man["card"] == CARD and set(man["files"]) == {"decision.json", CARD}
    assert registry.verify_entry(entry)["version"] == "v1"
    (entry / CARD).write_text(card.replace("PROMOTE", "PROMOTE (edited)"))
    with pytest.raises(QuantgateError, match="README.md is modified since promotion"):
        registry.verify_entry(entry)
    (entry / CARD).unlink()
    with pytest.raises(QuantgateError, match="README.md is missing"):
        registry.verify_entry(entry)
