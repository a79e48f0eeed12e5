"""Fidelity at each context length (the slices context:<length>): held to the family's limits widened by the
policy's `context_factor`, every other category to the family's own (or its named limits)."""

from __future__ import annotations

import numpy as np
import pytest

from quantgate.base.errors import ConfigError
from quantgate.fidelity.core import SampleFidelity
from quantgate.gate.fidelityevidence import fidelity_evidence
from quantgate.gate.policy import FidelityLimit, load_policy
from quantgate.gate.statistical import _category_fidelity


def _samples(category: str, kl: float, n: int, rng: np.random.Generator, top1: float = 0.97) -> list[SampleFidelity]:
    out = []
    for i in range(n):
        tokens = 200
        k = kl * float(rng.gamma(25.0, 1 / 25.0))  # a tight spread (CV 0.2): the bounds sit near the mean
        out.append(SampleFidelity(id=f"{category}-{i}", category=category, n_tokens=tokens, kl_sum=k * tokens,
                                  top1_agree=round(top1 * tokens), dnll_sum=k * tokens, kl_max=k))
    return out


def test_the_default_policy_widens_the_context_slices_only():
    f = load_policy().fidelity
    assert f is not None and f.context_factor == 2.0
    fam = f.families["int8"]
    wide = f.limit_for("int8", "context:4096")
    assert wide.max_kl == 2 * fam.max_kl and wide.min_top1 == pytest.approx(1 - 2 * (1 - fam.min_top1))
    assert f.limit_for("int8", "multilingual") == fam and f.limit_for("int8") == fam
    lenient = f.model_copy(update={"families": {"int8": FidelityLimit(max_kl=10.0, min_top1=0.0)}})
    assert lenient.limit_for("int8", "context:512").max_kl == 20.0  # widened past what a policy may write: fine
    named = f.model_copy(update={"categories": {"context:4096": FidelityLimit(max_kl=0.005)}})
    assert named.limit_for("int8", "context:4096").max_kl == 0.005  # a slice named in `categories` keeps its own


def test_a_length_at_1_5x_the_family_limit_passes_at_factor_2_and_not_at_1():
    rng = np.random.default_rng(7)
    policy = load_policy()
    limit = policy.fidelity.families["int8"].max_kl
    fid = fidelity_evidence(_samples("qa", 0.3 * limit, 40, rng) + _samples("context:2048", 1.5 * limit, 30, rng),
                            0.90, None)
    checks = {c.name: c for c in _category_fidelity(policy, fid, "int8")}
    assert checks["fidelity:kl:context:2048"].outcome == "pass"
    assert checks["fidelity:kl:context:2048"].limit == pytest.approx(2 * limit)
    strict = policy.model_copy(update={"fidelity": policy.fidelity.model_copy(update={"context_factor": 1.0})})
    checks = {c.name: c for c in _category_fidelity(strict, fid, "int8")}
    assert checks["fidelity:kl:context:2048"].outcome == "fail"  # its lower bound is above the family's limit
    assert checks["fidelity:kl:qa"].outcome == "pass"


def test_a_context_factor_below_one_is_refused(tmp_path):
    from quantgate.base.paths import RELEASES

    text = (RELEASES / "policies" / "default.yaml").read_text().replace("context_factor: 2.0", "context_factor: 0.5")
    (tmp_path / "p.yaml").write_text(text)
    with pytest.raises(ConfigError, match="context_factor"):
        load_policy(tmp_path / "p.yaml")
