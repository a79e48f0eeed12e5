"""Speed compared side by side (quantgate.perf.rounds, quantgate.gate.payoff): the window's round order, paired
ratios against the baseline's geometric mean per round, the A/A floor, and how the gate reads a speed figure
against it. The real window (servers, probes, load records) runs in tests/test_own_data_release.py."""

from __future__ import annotations

import math

import pytest
from test_perf_payoff import lat, probe_result

from quantgate.gate.payoff import speed_check
from quantgate.perf.compare import compare
from quantgate.perf.intervals import RatioCI
from quantgate.perf.models import PayOffFigures, SpeedFigure
from quantgate.perf.rounds import FIRST, SECOND, as_rounds, geometric_baseline, plan, rounds_needed


def test_each_round_runs_the_baseline_first_and_last_with_the_candidates_between_in_alternating_order():
    order = plan("baseline", ["int8", "w4a16"], 3)
    rounds = [[(s.variant, s.half) for s in order if s.round == r] for r in range(3)]
    assert rounds[0] == [("baseline", FIRST), ("int8", None), ("w4a16", None), ("baseline", SECOND)]
    assert rounds[1] == [("baseline", FIRST), ("w4a16", None), ("int8", None), ("baseline", SECOND)]
    assert rounds[2] == rounds[0] and [s.index for s in order[:4]] == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        plan("baseline", ["int8"], 0)


def _rounds(tpots: list[float], model: str):
    return as_rounds([probe_result(model, [lat(1, 0, t)]) for t in tpots])


def test_a_drift_that_hits_every_probe_of_a_round_alike_cancels_in_the_paired_ratio():
    """Load that grows within a round and differs between rounds (2x in round 2): the candidate, truly 2x as fast
    (half the TPOT), gets a ratio of 0.5 with a narrow interval; unpaired, the same runs give a wide one."""
    drift = [1.0, 2.0, 1.3]  # per round
    a = _rounds([20 * d for d in drift], "baseline")
    c = _rounds([10 * d * 1.05 for d in drift], "int8")  # runs a third of the way through the round: 5% more load
    b = _rounds([20 * d * 1.10 for d in drift], "baseline")
    paired = compare(geometric_baseline(a, b), c, paired=True)["decide"][0]["ratio"]
    assert paired["method"] == "paired-log" and paired["n_cand"] == 3
    assert paired["value"] == pytest.approx(10 * 1.05 / (20 * math.sqrt(1.10)), rel=1e-6)
    assert paired["high"] - paired["low"] < 1e-6  # the drift cancels exactly: every round gives the same ratio
    unpaired = compare(geometric_baseline(a, b), c)["decide"][0]["ratio"]
    assert unpaired["high"] - unpaired["low"] > 0.3
    aa = compare(a, b, paired=True)["decide"][0]["ratio"]
    assert aa["value"] == pytest.approx(1.10) and aa["low"] > 1.0  # the floor sees the within-round drift


def _figure(value: float, low: float, high: float) -> SpeedFigure:
    return SpeedFigure(figure="tpot_p50_ms", at="lowest", concurrency=1, lower_is_better=True, baseline=20.0,
                       candidate=20.0 * value, ratio=RatioCI(value=value, low=low, high=high, method="paired-log",
                                                             n_base=3, n_cand=3))


def _check(cand: tuple[float, float, float], floor: tuple[float, float, float] | None, demand: float = 1.0):
    f = _figure(*cand)
    fl = None if floor is None else RatioCI(value=floor[0], low=floor[1], high=floor[2], n_base=3, n_cand=3,
                                            method="paired-log")
    return speed_check(f, "latency", demand, bound="ci", required=True, file="x", floor=fl, rounds=3)


@pytest.mark.parametrize("cand, floor, outcome, words", [
    ((0.50, 0.45, 0.55), (1.0, 0.95, 1.05), "pass", "A/A floor 0.95x-1.05x over 3 rounds"),  # 1.8x, clear of it
    ((0.85, 0.80, 0.90), (1.0, 0.85, 1.18), "inconclusive", "not beyond the A/A floor"),  # 1.11x worst, floor to 1.18x
    ((0.50, 0.45, 0.55), (1.25, 1.15, 1.36), "inconclusive", "excludes 1: the load changed within the rounds"),
    ((1.30, 1.20, 1.40), (1.0, 0.9, 1.1), "fail", "slower than the latency profile demands"),  # below the floor
    ((1.04, 1.02, 1.06), (1.0, 0.93, 1.07), "inconclusive", "not below the A/A floor"),  # 4% slower: as A/A varies
    ((0.50, 0.45, 0.55), None, "pass", "it pays off"),  # no window: as before
    ((1.30, 1.20, 1.40), (None, None, None), "fail", "no A/A floor"),  # a figure the floor lacks: as before
])
def test_a_speed_up_must_clear_the_baseline_against_itself(cand, floor, outcome, words):
    c = _check(cand, floor)
    assert c.outcome == outcome and words in c.reason, c.reason


def test_a_speed_up_inside_the_floor_names_the_rounds_that_would_clear_it():
    c = _check((0.80, 0.76, 0.84), (1.0, 0.82, 1.20))  # 1.25x (worst 1.19x) against a floor reaching 1/0.82 = 1.22x
    assert c.outcome == "inconclusive" and "needs about" in c.reason and "rounds (perf.rounds)" in c.reason, c.reason
    n = rounds_needed(1 / 0.80, 1 / 0.84, 1 / 0.82, 3)
    assert n is not None and n > 3 and f"needs about {n} rounds" in c.reason
    assert rounds_needed(1.1, 1.0, 1.2, 3) is None  # the point itself is inside: no count of rounds clears it
    # a non-inferiority demand (fit: 0.9x) does not have to clear the floor
    assert _check((1.0, 0.95, 1.05), (1.0, 0.9, 1.12), demand=0.9).outcome == "pass"


def test_the_pay_off_file_carries_the_floor_per_figure_and_the_window():
    f = _figure(0.5, 0.45, 0.55).model_dump(mode="json")
    figs = PayOffFigures.model_validate({"workload": "latency", "decide": [f], "floor": [f],
                                         "window": {"rounds": 3, "started": "t0", "ended": "t1", "cores": [0, 1]}})
    assert figs.floor_of(figs.decide[0]) == figs.decide[0].ratio and figs.window.rounds == 3
    other = SpeedFigure.model_validate({**f, "at": "highest"})
    assert figs.floor_of(other) is None  # read at another place: not its floor


def test_a_window_with_every_candidate_rejected_early_probes_nothing_and_says_why(tmp_path):
    """The demo's path: the REJECT was decided by fidelity, so no server starts for speed; the candidate's and the
    baseline's evidence.json say why they have no speed figures (the gate shows 'skipped: decided early')."""
    import json

    from test_decide_early import SPEC

    from quantgate.spec.schema import in_window
    from quantgate.release.perf_window import perf_window
    from quantgate.spec.resolve import load_spec
    from quantgate.release.variants import Evidence, Variant

    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(SPEC.replace(", rounds: null", ""))
    spec = load_spec(spec_file)
    assert in_window(spec) and spec.perf.rounds == 3

    def ev(name: str, decided: str | None = None) -> Evidence:
        (tmp_path / name).mkdir()
        return Evidence(variant=Variant(name=name, path=tmp_path, content_hash="0" * 64, size_bytes=1),
                        folder=tmp_path / name, cache=tmp_path / "cache", serve_command=[], dtype=None, served=True,
                        decided=decided)

    base, cand = ev("baseline"), ev("int8-w8a8", decided="fidelity:kl: KL 0.3 > limit 0.02")
    said: list[str] = []
    assert perf_window(spec, tmp_path, None, base, [cand], said.append) == {}  # the pool is never asked
    assert "nothing to probe side by side" in said[0] and "REJECT decided early by fidelity" in said[0]
    on_disk = {v: json.loads((tmp_path / v / "evidence.json").read_text())["skipped"] for v in ("baseline", cand.variant.name)}
    assert on_disk["int8-w8a8"]["perf"].startswith("decided early: REJECT by fidelity (fidelity:kl")
    assert "no speed window" in on_disk["baseline"]["perf"] and not (tmp_path / "perf-window").exists()
