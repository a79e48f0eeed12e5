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
    mod.REAL_SHAPE.update(mod.real_shape(mod.SHAPE_FILE))  # the bench's default: a real demo run's per-sample shape
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
    names = {"numbers-2x", "long-2x", "recall-halved-at-2048", "at-limit+adaptive"}
    counts, _ = oc.run(load_policy(RELEASES / "policies" / "default.yaml"), "demo", ["int8"],
                       [s for s in oc.SCENARIOS if s.name in names], trials, seed=11)
    rows = oc.targets(counts, trials, ["int8"])
    assert len(rows) == 4  # one slice at 2x; the longest length; at the limit over two looks, and pooled only
    missed = [f"{what} = {value:.2f} (target {target})" for what, value, target, met in rows
              if not met and _significantly_missed(value, target, trials)]
    assert not missed, missed
    assert counts[("int8", "at-limit+adaptive (pooled only)")]["PROMOTE"] <= 3


def test_a_good_candidate_is_promoted_at_the_demo_size(oc):
    """Fidelity at half the limits in every slice (the real run's per-sample shape), 5% balanced flips: promoted at
    least 90% of the time, unless significantly fewer here (the bench's 600 trials: 0.885 int8, 0.952 w4a16)."""
    trials = 25
    counts, _ = oc.run(load_policy(RELEASES / "policies" / "default.yaml"), "demo", ["int8", "w4a16"],
                       [s for s in oc.SCENARIOS if s.name == "good-0.5x"], trials, seed=5)
    for family in ("int8", "w4a16"):
        rate = counts[(family, "good-0.5x")]["PROMOTE"] / trials
        assert not _significantly_missed(rate, ">= 0.90", trials), (family, rate)


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


def test_a_real_runs_shape_is_moved_to_the_scenarios_kl_kind_by_kind(oc):
    """The shipped shape (a demo run's INT8 fidelity, KL about 0.028): drawn at another KL, the pooled estimate has
    that KL as its mean and the top-1 miss rate the scenario's; haystack continuations (256 tokens) serve context
    slices only, eval prompts' draws categories only; the residuals are kept, so the spread is the run's, scaled."""
    import numpy as np

    pools = oc.real_shape(oc.SHAPE_FILE)
    assert set(pools) == {"context", "eval"}
    assert max(n for n, *_ in pools["context"]) == 256 and max(n for n, *_ in pools["eval"]) < 200  # a few end early
    rng = np.random.default_rng(0)
    for kind, kl in (("context", 0.01), ("eval", 0.01), ("eval", 0.04)):
        draws = [oc._sample_estimate(rng, kl, 0, kind) for _ in range(4000)]
        tokens = sum(d[0] for d in draws)
        assert abs(sum(d[1] for d in draws) / tokens - kl) < 0.06 * kl, kind
        assert abs(1 - sum(d[2] for d in draws) / tokens - oc._miss_rate(kl)) < 0.1 * oc._miss_rate(kl), kind
        per = np.array([d[1] / d[0] for d in draws])
        assert per.std() > 0.3 * kl  # a real spread, not the mean alone
    # below the run's KL the residuals shrink like sqrt(r), above it like r: more spread than either alone
    assert oc._moved(1.0, 0.04, 0.01) == 0.5 and oc._moved(1.0, 0.01, 0.04) == 4.0


def test_every_subset_a_release_draws_keeps_the_error_rate_that_a_prefix_and_an_interim_mix_broke(oc, monkeypatch):
    """An ordered category at its limit (its later ids worse) over two looks, and a pooled-only policy at its pooled
    limit over three looks with haystacks lighter than the eval prompts: promoted rarely with the release's seeded
    draw and the reweighted interim pooled estimate, often with the first ids and each look's own mix (so the
    scenarios see what they are about)."""
    trials, names = 20, {"numbers-later-1.4x, looks [150, 300]", "pooled-at-limit, haystacks 0.5x, looks [75, 150, 300]"}
    scenarios = [s for s in oc.SCENARIOS if s.name in names]
    policy = load_policy(RELEASES / "policies" / "default.yaml")
    counts, _ = oc.run(policy, "demo", ["w4a16"], scenarios, trials, seed=5)
    assert all(counts[("w4a16", n)]["PROMOTE"] <= 3 for n in names), counts
    monkeypatch.setattr(oc, "DRAW", oc.first_ids)
    monkeypatch.setattr(oc, "REWEIGHT", False)
    before, _ = oc.run(policy, "demo", ["w4a16"], scenarios, trials, seed=5)
    assert all(before[("w4a16", n)]["PROMOTE"] >= 6 for n in names), before
