"""Every look spends its share (quantgate.gate.looks), planned from the spec (spec.adaptive.fidelity_looks), and a
candidate exactly at its limit stays at most alpha likely to be promoted over every look together (simulated
through the gate's own bounds)."""

from __future__ import annotations

import numpy as np
import pytest

from quantgate.base.errors import QuantgateError
from quantgate.fidelity.core import SampleFidelity
from quantgate.gate.fidelityevidence import fidelity_evidence
from quantgate.gate.looks import plan, repair_split, shares, spend
from quantgate.base.paths import RELEASES
from quantgate.spec.resolve import load_spec


@pytest.mark.parametrize("planned,expected", [
    ([120], [0.05]),
    ([120, 240], [0.025, 0.025]),
    ([100, 200, 400], [0.0125, 0.0125, 0.025]),
    ([120, 120, 240], [0.025, 0.025]),  # a look that adds no sample is no look
])
def test_shares_are_linear_in_the_information_and_add_up_to_alpha(planned, expected):
    got = shares(0.05, planned)
    assert got == pytest.approx(expected) and sum(got) == pytest.approx(0.05)


def test_spend_names_the_look_and_what_was_spent():
    look = spend(0.05, [120, 240], 240)
    assert (look.index, look.of, look.alpha, look.spent, look.planned) == (2, 2, 0.025, 0.05, [120, 240])
    with pytest.raises(QuantgateError, match="no planned look"):
        spend(0.05, [120, 240], 180)
    with pytest.raises(QuantgateError, match="at least one sample"):
        plan([0, 10])


def test_the_looks_are_planned_from_the_spec():
    from quantgate.spec.adaptive import fidelity_looks

    from quantgate.spec.sections import AdaptiveSpec

    demo = load_spec(RELEASES / "demo.yaml")  # every eval prompt at once: one look
    assert fidelity_looks(demo) == [300]
    f120 = demo.model_copy(update={"fidelity": demo.fidelity.model_copy(update={"limit": 120})})
    assert fidelity_looks(f120) == [120]
    # a widening to at most 300 in one round: doubling, so 240; two rounds reach the budget
    assert fidelity_looks(f120.model_copy(update={"adaptive": AdaptiveSpec(max_fidelity_samples=300)})) == [120, 240]
    assert fidelity_looks(f120.model_copy(update={"adaptive": AdaptiveSpec(max_fidelity_samples=300, rounds=2)})) \
        == [120, 240, 300]
    assert fidelity_looks(demo.model_copy(update={"fidelity": None})) is None


def _at_limit(rng: np.random.Generator, n: int, limit: float) -> list[SampleFidelity]:
    """n samples whose true per-token KL is exactly `limit` (skewed across samples, noisy within)."""
    out = []
    for i in range(n):
        tokens = int(rng.poisson(60)) + 10
        kl = float(rng.lognormal(np.log(limit) - 0.5 * 0.8 ** 2, 0.8))
        est = tokens * kl + float(rng.normal(0, np.sqrt(kl * tokens)))
        out.append(SampleFidelity(id=f"s{i}", category="c", n_tokens=tokens, kl_sum=est, top1_agree=tokens,
                                  dnll_sum=est, kl_max=kl))
    return out


def test_two_looks_at_their_shares_keep_the_false_promote_rate(tmp_path):
    """A candidate exactly at its KL limit: 'promoted' when some look's upper bound is within the limit. With each
    look at its share, the rate over both looks stays within alpha (plus Monte Carlo error); judging both at the
    full alpha exceeds it. 150 trials: the test can fail either way."""
    rng, limit, trials = np.random.default_rng(11), 0.02, 150
    spent = full = 0
    for _ in range(trials):
        samples = _at_limit(rng, 240, limit)
        looks = [(120, spend(0.05, [120, 240], 120).alpha), (240, spend(0.05, [120, 240], 240).alpha)]
        spent += any(fidelity_evidence(samples[:n], 1 - 2 * a, None).kl.high <= limit for n, a in looks)
        full += any(fidelity_evidence(samples[:n], 0.90, None).kl.high <= limit for n in (120, 240))
    assert spent / trials <= 0.05 + 0.04  # 0.05 plus about 2.3 standard errors of 150 trials
    assert full >= spent


def test_a_repair_is_one_more_look_the_scheme_and_its_repair_split_alpha():
    first, second = repair_split(0.05, 0.5)
    assert (first.index, first.of, first.alpha, first.spent) == (1, 2, 0.025, 0.025)
    assert (second.index, second.alpha, second.spent, second.shares) == (2, 0.025, 0.05, [0.025, 0.025])
    assert first.growth == second.growth == 1.0  # each judges a whole sample: no interim reweighting
    assert repair_split(0.05, 0.2)[1].alpha == pytest.approx(0.01)
    with pytest.raises(QuantgateError, match="share"):
        repair_split(0.05, 1.0)


def test_the_release_plans_the_split_for_every_scheme_and_its_repair():
    from quantgate.release.repair_step import looks

    spec = load_spec(RELEASES / "demo-repair.yaml")
    got = looks(spec, ["int8-w8a8", "int8-w8a8-repaired", "elsewhere"])
    assert {k: v.alpha for k, v in got.items()} == {"int8-w8a8": 0.025, "int8-w8a8-repaired": 0.025}
    assert looks(load_spec(RELEASES / "demo.yaml"), ["int8-w8a8"]) == {}  # no repair: the plain look


def test_a_scheme_at_its_limit_and_a_repair_at_its_limit_together_promote_at_most_alpha():
    """Two candidates exactly at the KL limit (the worst case for a repair: it removed nothing), each 'promoted'
    when its upper bound is within the limit. At the split shares the chance that either is promoted stays within
    alpha; both at the full alpha, it nearly doubles. 200 trials: the test can fail either way."""
    rng, limit, trials = np.random.default_rng(5), 0.02, 200
    first, second = repair_split(0.05, 0.5)
    split = full = 0
    for _ in range(trials):
        a, b = _at_limit(rng, 200, limit), _at_limit(rng, 200, limit)
        split += (fidelity_evidence(a, 1 - 2 * first.alpha, None).kl.high <= limit
                  or fidelity_evidence(b, 1 - 2 * second.alpha, None).kl.high <= limit)
        full += (fidelity_evidence(a, 0.90, None).kl.high <= limit or fidelity_evidence(b, 0.90, None).kl.high <= limit)
    assert split / trials <= 0.05 + 0.035  # 0.05 plus about 2.3 standard errors of 200 trials
    assert full > split


def test_a_repaired_candidates_decision_says_what_it_keeps_and_its_share_of_alpha(tmp_path):
    from _gate_fixtures import make_run

    from quantgate.gate.evidence import decide_run
    from quantgate.gate.models import KeptLayer
    from quantgate.gate.repairfile import LayerRanking, RepairRecord

    run = make_run(tmp_path, "w4a16-gptq")  # the defaults: a candidate the default policy promotes
    policy = RELEASES / "policies" / "default.yaml"
    plain = decide_run(run, policy, ["w4a16-gptq"])[0]
    assert plain.repair is None and plain.look is None
    kept = [KeptLayer(layer=0, modules=r"re:model\.layers\.0\.", removes={"pooled": 0.004}, added_bytes=10)]
    RepairRecord(candidate="w4a16-gptq", repairs="w4a16-gptq-first", scheme="w4a16-gptq", failing={"pooled": 0.05},
                 kept=kept, min_top1={}, measured={"pooled": 0.01}, measured_top1={}, passes=True, margin=0.7,
                 added_size=0.025, alpha=0.025,
                 ranking=LayerRanking(prompts=["p1", "p2"], per_slice=1, sequences=4, scored_tokens=100,
                                      before={"pooled": 0.06}, before_top1={}, gains={"pooled": [0.004]}, order=[0],
                                      tried={1: {"pooled": 0.01}}, tried_top1={1: {}}, truth_s=1.0, sets_s=1.0)
                 ).write(run / "w4a16-gptq")
    d = decide_run(run, policy, ["w4a16-gptq"], split={"w4a16-gptq": repair_split(0.05, 0.5)[1]})[0]
    assert d.repair is not None and d.repair.repairs == "w4a16-gptq-first" and d.repair.kept == kept
    assert d.repair.held_out == 2 and d.repair.alpha == 0.025
    assert d.look is not None and (d.look.index, d.look.of, d.look.alpha) == (2, 2, 0.025)
    assert "judged at alpha 0.025" in d.operating.note and d.decision == plain.decision
