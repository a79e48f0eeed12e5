"""The repair rung's planning step (quantgate.release.repair_step.plan) on the real demo model and a real llmcompressor
checkpoint in which only decoder layer 0 is quantized (tests/conftest.py's `layer0_int8`), REJECTed by a made-up
decision: the ranking child process must name layer 0, the fewest layers kept must be [0], its ignore pattern must
keep that layer only, and repair.json must say so. Slow (the truth over 30 layers); CI runs it."""

from __future__ import annotations

import json

import pytest

from quantgate.base.paths import RELEASES
from quantgate.gate.models import Check, Decision
from quantgate.gate.repairfile import load_repair, repair_note
from quantgate.quantize.preflight import matches
from quantgate.release import fidelity_step, repair_step
from quantgate.release.variants import Evidence, Variant, quantize_request, size_bytes
from quantgate.spec.resolve import load_spec
from test_repair_sensitivity import _sequences


def _samples(folder, seqs) -> None:
    """A baseline samples file as quantgate.fidelity.sampling writes it (prompt ids + sampled ids), one draw each."""
    folder.mkdir(parents=True)
    with open(folder / "samples.jsonl", "w") as f:
        for s in seqs:
            f.write(json.dumps({"id": f"default/{s.id}#0", "category": s.category, "prompt_ids": s.ids[:s.score_from],
                                "ids": s.ids[s.score_from:], "lp": [], "top": []}) + "\n")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_repair_keeps_the_one_quantized_layer_and_says_why(demo_model, layer0_int8, tmp_path):
    seqs = _sequences(demo_model, n=6)
    cache = tmp_path / "cache" / "fidelity"
    _samples(cache / "k-samples", seqs)
    run = tmp_path / "run"
    spec = load_spec(RELEASES / "demo-repair.yaml")
    spec = spec.model_copy(update={"repair": spec.repair.model_copy(update={"rank_prompts": 2, "max_kept": 4})})
    base = Evidence(variant=Variant(name="baseline", path=demo_model, content_hash="b", size_bytes=size_bytes(demo_model)),
                    folder=run / "baseline", cache=tmp_path / "cache", serve_command=[], dtype="float32",
                    fidelity={"main": cache / "k-main"}, served=False)
    cand = Variant(name="int8-w8a8", path=layer0_int8, scheme="int8-w8a8", content_hash="c",
                   size_bytes=size_bytes(layer0_int8), origin="quantized")
    cats = sorted({s.category for s in seqs})
    checks = [Check(name="fidelity:kl", measured=0.0005, limit=1e-3, required=True, outcome="fail", reason="r")]
    checks += [Check(name=f"fidelity:kl:{c}", measured=0.0005, limit=1e-3, required=True, outcome="fail", reason="r")
               for c in cats]
    checks.append(Check(name="fidelity:top1", measured=0.95, limit=0.9, required=True, outcome="pass", reason="r"))
    decision = Decision(decision="REJECT", candidate="int8-w8a8", scheme="int8-w8a8", family="int8", policy={},
                        checks=checks, reasons=["fidelity"])
    assert repair_step.to_repair(spec, [decision], {"int8-w8a8": cand}) == (decision, cand)
    lines: list[str] = []
    rung = repair_step.plan(spec, run, demo_model, base, (decision, cand), lines.append)

    assert rung.name == "int8-w8a8-repaired" and rung.scheme == "int8-w8a8" and rung.repairs == "int8-w8a8"
    rec = load_repair(run / rung.name / "repair.json")
    assert rec.ranking.order[0] == 0 and [k.layer for k in rec.kept] == [0] and rec.passes, rec.ranking.tried
    assert rung.ignore == [r"re:model\.layers\.0\."] and matches("model.layers.0.mlp.up_proj", rung.ignore[0])
    assert not matches("model.layers.10.mlp.up_proj", rung.ignore[0])
    assert rec.failing.keys() == {"pooled", *cats} and rec.ranking.before["pooled"] > 2e-3
    assert rec.measured["pooled"] <= 0.7 * 1e-3 < rec.ranking.before["pooled"]
    assert rec.min_top1 == {"pooled": 0.9, **{c: 0.9 for c in cats}}  # the pooled limit where a slice has none
    assert rec.measured_top1["pooled"] >= rec.ranking.before_top1["pooled"] and rec.measured_top1["pooled"] > 0.97
    assert 0 < rec.added_size < 0.1 and rec.kept[0].added_bytes > 0 and rec.alpha == 0.025
    assert any("keeps layers [0]" in line for line in lines) and any("one layer at a time" in line for line in lines)
    # the ranking prompts are left out of its fidelity sample; its decision says what it keeps
    assert fidelity_step.held_out(run, rung.name) == set(rec.ranking.prompts)
    assert len(rec.ranking.prompts) == len(cats) == len(seqs)  # 2 per slice asked, one sampled in each
    note = repair_note(run, rung.name)
    assert note is not None and note.repairs == "int8-w8a8" and note.kept[0].layer == 0
    # the scheme is quantized again with that layer in its ignore list, under its own checkpoint name
    req = quantize_request(spec, demo_model, rung)
    assert req.overrides.ignore == rung.ignore and req.out.name.endswith("-int8-w8a8-repaired")
    # planned once: a re-run reads repair.json instead of ranking again
    again = repair_step.plan(spec, run, demo_model, base, (decision, cand), lines.append)
    assert again == rung and "planned before" in lines[-1]
    # a REJECT by top-1 alone is a REJECT by fidelity too; one by another check is not repaired
    by_top1 = decision.model_copy(update={"checks": [c.model_copy(update={"outcome": "pass"}) for c in checks[:-1]]
                                          + [checks[-1].model_copy(update={"outcome": "fail"})]})
    assert repair_step.to_repair(spec, [by_top1], {"int8-w8a8": cand}) == (by_top1, cand)
    other = decision.model_copy(update={"checks": [c.model_copy(update={"outcome": "pass"}) for c in checks]
                                        + [Check(name="recall:recall", measured=0.1, limit=0.05, required=True,
                                                 outcome="fail", reason="r")]})
    assert repair_step.to_repair(spec, [other], {"int8-w8a8": cand}) is None
    # once repaired, nothing more to repair
    assert repair_step.to_repair(spec, [decision], {"int8-w8a8": cand, rung.name: cand}) is None
