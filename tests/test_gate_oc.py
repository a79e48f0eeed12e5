"""A small, seeded run of bench/gate_oc.py: a change to the default policy or the gate's statistics that breaks the
operating-characteristic targets fails here (the bench itself runs the full count)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from quantgate.base.paths import RELEASES
from quantgate.gate.policy import load_policy

BENCH = Path(__file__).resolve().parents[1] / "bench" / "gate_oc.py"


@pytest.fixture(scope="module")
def oc():
    spec = importlib.util.spec_from_file_location("gate_oc", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gate_oc"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_default_policy_meets_its_targets_at_the_demo_size(oc):
    trials, families = 25, ["fp8", "w4a16"]
    scenarios = [s for s in oc.SCENARIOS if s.name in {"lossless-2%", "lossless-5%", "kl-2x-limit", "drop-10%",
                                                      "drop-10%-binary"}]
    counts, mdds = oc.run(load_policy(RELEASES / "policies" / "default.yaml"), "demo", families, scenarios, trials,
                          seed=7)
    rows = oc.targets(counts, trials, families)
    assert len(rows) == 4 * len(families)
    # 25 trials estimate each probability within about +-0.06: a target counts as missed here only when the count is
    # significantly on the wrong side of it (one-sided binomial test at 1%); the bench's 200 trials judge the targets
    missed = [f"{what} = {value:.2f} (target {target})" for what, value, target, met in rows
              if not met and _significantly_missed(value, target, trials)]
    assert not missed, missed
    # every statistical check states its minimum detectable drop, and the pooled test is the most sensitive binary one
    pooled = sorted(v[0] for v in mdds[("w4a16", "pooled:default")])
    exact = sorted(v[0] for v in mdds[("w4a16", "primary:default/exact_match")])
    assert pooled and exact and pooled[len(pooled) // 2] < exact[len(exact) // 2]


def test_damage_in_one_slice_and_a_candidate_at_its_limit_over_two_looks_are_not_promoted(oc):
    """Damage confined to one category or to the longest context, and fidelity exactly at its limit judged over the
    demo's two looks (each at its share of alpha; the pooled bound alone too): the gate's targets hold."""
    trials = 20
    names = {"numbers-2x", "long-2x", "recall-halved-at-4k", "at-limit+adaptive"}
    counts, _ = oc.run(load_policy(RELEASES / "policies" / "default.yaml"), "demo", ["int8"],
                       [s for s in oc.SCENARIOS if s.name in names], trials, seed=11)
    rows = oc.targets(counts, trials, ["int8"])
    assert len(rows) == 4  # one slice at 2x; the longest length; at the limit over two looks, and pooled only
    missed = [f"{what} = {value:.2f} (target {target})" for what, value, target, met in rows
              if not met and _significantly_missed(value, target, trials)]
    assert not missed, missed
    assert counts[("int8", "at-limit+adaptive (pooled only)")]["PROMOTE"] <= 3


def test_a_gate_without_fidelity_cannot_promote_at_this_size(oc, tmp_path):
    """Without token-level fidelity the task checks cannot prove a 1-3% limit at 300 samples: INCONCLUSIVE, never a
    silent PROMOTE and never a REJECT of a lossless candidate."""
    text = (RELEASES / "policies" / "default.yaml").read_text()
    start = text.index("fidelity:\n")
    end = text.index("\n\n", start)
    path = tmp_path / "no-fidelity.yaml"
    path.write_text(text[:start] + text[end:])
    policy = load_policy(path)
    assert policy.fidelity is None
    scenario = [s for s in oc.SCENARIOS if s.name == "lossless-5%"]
    counts, _ = oc.run(policy, "demo", ["int8"], scenario, 10, seed=3)
    c = counts[("int8", "lossless-5%")]
    assert c["PROMOTE"] == 0 and c["INCONCLUSIVE"] >= 8


def _significantly_missed(rate: float, target: str, trials: int, level: float = 0.01) -> bool:
    """Whether `rate` over `trials` is significantly below a '>= x' target or above a '<= x' one."""
    op, value = target.split()
    k, p = round(rate * trials), float(value)
    tail = range(0, k + 1) if op == ">=" else range(k, trials + 1)  # as few (or as many) successes as seen, or fewer
    return sum(math.comb(trials, i) * p ** i * (1 - p) ** (trials - i) for i in tail) < level


def test_a_clear_miss_is_still_caught():
    assert _significantly_missed(15 / 25, ">= 0.90", 25) and _significantly_missed(8 / 25, "<= 0.10", 25)
    assert not _significantly_missed(22 / 25, ">= 0.90", 25) and not _significantly_missed(4 / 25, "<= 0.10", 25)
