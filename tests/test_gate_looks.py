"""Every look spends its share (quantgate.gate.looks), planned from the spec (release.adaptive.fidelity_looks), and a
candidate exactly at its limit stays at most alpha likely to be promoted over every look together (simulated
through the gate's own bounds)."""

from __future__ import annotations

import numpy as np
import pytest

from quantgate.base.errors import QuantgateError
from quantgate.fidelity.core import SampleFidelity
from quantgate.gate.fidelityevidence import fidelity_evidence
from quantgate.gate.looks import plan, shares, spend
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
    from quantgate.release.adaptive import fidelity_looks

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
