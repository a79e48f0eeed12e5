"""The promotion gate (pure): every check, the ci/point bound, the three outcomes, every fail-closed path; policy files."""

from __future__ import annotations

import copy
import math

import pytest
import yaml

from quantgate.base.errors import ConfigError
from quantgate.base.paths import RELEASES
from quantgate.gate.checks import GateEvidence, evaluate
from quantgate.gate.policy import GatePolicy, load_policy

POLICY = {
    "version": 1, "name": "t", "source": "test", "bound": "ci", "min_samples": 10,
    "primary": {"metrics": ["exact_match"], "families": {
        "fp8": {"schemes": ["fp8-dynamic"], "max_relative_drop": 0.01},
        "w4a16": {"schemes": ["w4a16-gptq"], "max_relative_drop": 0.03}}},
    "categories": {"arithmetic_numbers": {"metric": "numeric_match", "max_relative_drop": 0.05,
                                          "by_family": {"w4a16": 0.08}}},
    "recall": {"max_absolute_drop": 0.05},
    "judge": {"margin": 0.05, "required": False},
    "error_rate": {"max": 0.02},
    "engine_parity": {},
    "pay_off": {"max_size_ratio": 0.8, "min_throughput_ratio": 1.0, "required": False},
    "pooled": {"required": True},
    "fidelity": {"families": {"fp8": {"max_kl": 0.01, "min_top1": 0.95}, "w4a16": {"max_kl": 0.05, "min_top1": 0.9}}},
}


def stat(base=0.8, delta=-0.004, lo=-0.016, hi=0.008, n=100, higher=True, p_harm=0.6, sd=None, disc=None) -> dict:
    """Primary-metric default: relative drop 0.5% (point) and 2% (CI's worst end), no harm detected (p=0.6)."""
    return {"n": n, "base_mean": base, "cand_mean": None if base is None or delta is None else base + delta, "delta": delta,
            "ci_low": lo, "ci_high": hi, "higher_is_better": higher, "file": "compare/x.json", "p_harm": p_harm,
            "sd_diff": sd, "discordance": disc, "binary": disc is not None}


def fid(kl=0.005, lo=0.004, hi=0.006, top1=(0.97, 0.965, 0.975), file="fidelity/c.json") -> dict:
    return {"n_samples": 100, "n_tokens": 5000, "kl": {"mean": kl, "low": lo, "high": hi, "level": 0.9},
            "top1": {"mean": top1[0], "low": top1[1], "high": top1[2], "level": 0.9}, "file": file}


def evidence() -> dict:
    """Evidence that the test POLICY promotes for w4a16-gptq."""
    return {
        "candidate": "w4a16-gptq", "scheme": "w4a16-gptq",
        "metrics": {"default": {"exact_match": stat()}},
        "categories": {"default": {"arithmetic_numbers": {"numeric_match": stat(base=0.5, delta=-0.01, lo=-0.02, n=50)}}},
        "recall": {"recall": stat(base=1.0, delta=-0.01, lo=-0.03, hi=0.0, n=40)},
        "judge": {"counts_as_evidence": True, "n": 300, "net": 0.0, "lower_bound": -0.03, "file": "judge/report.json"},
        "parity": {"verdict": "pass", "reason": "100% of 6 prompts agree", "file": "baseline/evidence.json"},
        "error_rates": [{"name": "baseline/default", "rate": 0.0, "n": 300}, {"name": "w4a16-gptq/default", "rate": 0.01, "n": 300}],
        "size_ratio": {"value": 0.4, "file": "w4a16-gptq/evidence.json"},
        "throughput_ratio": {"value": 1.3, "file": "w4a16-gptq/pay_off.json"},
        "pooled": {"default": stat(base=0.6, n=250, disc=0.05)},
        "fidelity": fid(),
        "floor": fid(kl=0.0002, lo=0.0001, hi=0.0003, top1=(0.998, 0.997, 0.999), file="fidelity/floor.json"),
    }


def put(d: dict, path: str, value) -> dict:
    """Set a dotted path; value None with a trailing '!' deletes the key."""
    keys = path.rstrip("!").split(".")
    for k in keys[:-1]:
        d = d[int(k)] if isinstance(d, list) else d[k]
    if path.endswith("!"):
        del d[keys[-1]]
    else:
        d[keys[-1]] = value
    return d


def run_gate(policy_edits=(), evidence_edits=()):
    pol, ev = copy.deepcopy(POLICY), evidence()
    for path, value in policy_edits:
        put(pol, path, value)
    for path, value in evidence_edits:
        put(ev, path, value)
    return evaluate(GatePolicy.model_validate(pol), GateEvidence.model_validate(ev))


def check(decision, prefix):
    found = [c for c in decision.checks if c.name.startswith(prefix)]
    assert found, f"no check {prefix!r} in {[c.name for c in decision.checks]}"
    return found[0]


def test_good_evidence_promotes_with_every_check_recorded():
    d = run_gate()
    assert d.decision == "PROMOTE" and d.reasons == [] and d.family == "w4a16"
    names = {c.name.split(":")[0] for c in d.checks}
    assert names == {"engine_parity", "error_rate", "primary", "category", "recall", "judge", "pay_off", "pooled",
                     "fidelity"}
    for c in d.checks:
        assert c.passed is True and c.reason and c.limit is not None
    assert all(c.evidence_file for c in d.checks if not c.name.startswith("error_rate"))


S, FP8 = "scheme", ("scheme", "fp8-dynamic")
P, F, I, K = "pass", "fail", "inconclusive", "skipped"
HARM = ("metrics.default.exact_match.p_harm", 0.001)
NO_FID = ("fidelity", None)
CASES = [
    # id, policy edits, evidence edits, check prefix, expected outcome, expected decision, words in the reason
    # --- primary metrics: within the limit, harm detected, neither (then fidelity decides), bound ci vs point ---
    ("w4a16-ci-passes", [], [], "primary:", P, "PROMOTE", "2.00% <= limit 3.00%"),
    ("fp8-over-limit-no-harm-fidelity-proves", [], [FP8], "primary:default/exact_match", P, "PROMOTE",
     "fidelity carries the proof"),
    ("fp8-over-limit-harm", [], [FP8, HARM], "primary:default/exact_match", F, "REJECT", "harm detected"),
    ("fp8-over-limit-no-fidelity", [], [FP8, NO_FID], "primary:default/exact_match", I, "INCONCLUSIVE",
     "needs about"),
    ("fp8-point-passes", [("bound", "point")], [FP8], "primary:default/exact_match", P, "PROMOTE", "point estimate"),
    ("check-bound-overrides-policy", [("primary.bound", "point")], [FP8], "primary:", P, "PROMOTE", "0.50%"),
    ("non-inferiority-role-crossing", [], [FP8, ("metrics.default.exact_match", stat(sd=0.05, n=4000, lo=-0.016))],
     "primary:default/exact_match", I, "INCONCLUSIVE", "crosses the limit"),
    ("lower-is-better-uses-ci-high", [], [("metrics.default.exact_match", stat(base=0.2, delta=0.0, lo=-0.5, hi=0.001,
                                                                            higher=False))], "primary:", P, "PROMOTE", "0.50%"),
    ("zero-baseline-no-drop", [], [("metrics.default.exact_match", stat(base=0.0, delta=0.0, lo=0.0, hi=0.02))],
     "primary:", P, "PROMOTE", "0.00%"),
    ("zero-baseline-any-drop-harm", [], [("metrics.default.exact_match", stat(base=0.0, delta=0.0, lo=-0.01, hi=0.02,
                                                                             p_harm=0.001))], "primary:", F, "REJECT", "inf"),
    ("unknown-scheme", [], [(S, "nvfp4")], "primary", I, "INCONCLUSIVE", "in no family"),
    ("no-scheme", [], [(S, None)], "primary", I, "INCONCLUSIVE", "scheme is unknown"),
    # --- fail-closed on statistical evidence: inconclusive, not harm ---
    ("metric-missing", [], [("metrics", {})], "primary:exact_match", I, "INCONCLUSIVE", "no eval set measured exact_match"),
    ("metric-missing-gap-reason", [], [("metrics", {}), ("gaps", {"compare": {"reason": "corrupt JSON in c.json"}})],
     "primary:exact_match", I, "INCONCLUSIVE", "corrupt JSON"),
    ("too-few-samples", [], [("metrics.default.exact_match.n", 5)], "primary:", I, "INCONCLUSIVE",
     "fewer than min_samples=10"),
    ("too-few-samples-optional", [("primary.required", False)], [("metrics.default.exact_match.n", 5)], "primary:",
     K, "PROMOTE", "skipped"),
    ("nan-ci", [], [("metrics.default.exact_match.ci_low", math.nan)], "primary:", I, "INCONCLUSIVE",
     "no confidence interval"),
    ("nan-ci-point-bound", [("bound", "point")], [("metrics.default.exact_match.ci_low", math.nan)], "primary:", P,
     "PROMOTE", "point"),
    ("nan-delta-point-bound", [("bound", "point")], [("metrics.default.exact_match.delta", math.nan)], "primary:", I,
     "INCONCLUSIVE", "no delta"),
    ("relative-without-base", [], [("metrics.default.exact_match.base_mean", None)], "primary:", I, "INCONCLUSIVE",
     "no baseline mean"),
    # --- pooled harm test ---
    ("pooled-harm", [], [("pooled.default.p_harm", 0.001), ("pooled.default.ci_low", -0.05)], "pooled:default", F,
     "REJECT", "harm detected"),
    ("pooled-missing", [], [("pooled", {})], "pooled", I, "INCONCLUSIVE", "binary-scored"),
    ("pooled-power-stated", [], [("pooled.default.ci_low", -0.05)], "pooled:default", P, "PROMOTE", "detects drops >="),
    # --- categories ---
    ("category-family-limit", [], [("categories.default.arithmetic_numbers.numeric_match",
                                    stat(base=0.5, delta=-0.01, lo=-0.035, n=50))], "category:", P, "PROMOTE", "limit 8.00%"),
    ("category-default-limit-harm", [], [FP8, ("metrics.default.exact_match.ci_low", -0.004),
                                         ("categories.default.arithmetic_numbers.numeric_match",
                                          stat(base=0.5, delta=-0.01, lo=-0.035, n=50, p_harm=0.0001))],
     "category:", F, "REJECT", "7.00%"),
    ("category-absolute-limit", [("categories.arithmetic_numbers.max_relative_drop", None),
                                 ("categories.arithmetic_numbers.max_absolute_drop", 0.015),
                                 ("categories.arithmetic_numbers.by_family", {})],
     [("categories.default.arithmetic_numbers.numeric_match.p_harm", 0.0001)], "category:", F, "REJECT",
     "+0.0200 > limit 0.0150"),
    ("category-missing", [], [("categories", {})], "category:arithmetic_numbers", I, "INCONCLUSIVE",
     "no eval set has category"),
    ("category-missing-optional", [("categories.arithmetic_numbers.required", False)], [("categories", {})],
     "category:", K, "PROMOTE", "skipped"),
    # a listed primary metric no set measures, beside one that a set does: not applicable; none measured: missing
    ("primary-metric-not-in-any-set", [("primary.metrics", ["exact_match", "numeric_match"])], [],
     "primary:numeric_match", K, "PROMOTE", "no eval set of this release is scored with numeric_match"),
    ("primary-no-metric-in-any-set", [("primary.metrics", ["numeric_match"])], [], "primary:numeric_match", I,
     "INCONCLUSIVE", "no eval set measured numeric_match"),
    # a team's own set without the category: the check does not apply (skipped), it is not missing evidence
    ("category-not-in-any-set", [], [("categories", {"default": {"billing": {"numeric_match": stat(n=50)}}})],
     "category:arithmetic_numbers", K, "PROMOTE", "no eval set of this release has category 'arithmetic_numbers'"),
    ("category-in-a-set-without-its-metric", [], [("categories", {"default": {"arithmetic_numbers": {
        "exact_match": stat(n=50)}}})], "category:arithmetic_numbers", I, "INCONCLUSIVE", "no eval set has category"),
    # --- recall ---
    ("recall-drop-harm", [], [("recall.recall.ci_low", -0.08), ("recall.recall.p_harm", 0.0001)], "recall:recall", F,
     "REJECT", "+0.0800 > limit 0.0500"),
    ("recall-no-ci", [], [("recall.recall.ci_low", None)], "recall:", I, "INCONCLUSIVE", "no confidence interval"),
    ("recall-no-ci-point", [("recall.bound", "point")], [("recall.recall.ci_low", None)], "recall:", P, "PROMOTE", "point"),
    ("recall-missing", [], [("recall", {}), ("gaps", {"recall": {"reason": "missing file r/delta.json"}})], "recall:",
     I, "INCONCLUSIVE", "missing file r/delta.json"),
    ("recall-missing-optional", [("recall.required", False)], [("recall", {})], "recall:", K, "PROMOTE", "skipped"),
    ("recall-exact-measure", [("recall.measure", "exact")], [], "recall:exact", I, "INCONCLUSIVE", "no recall comparison"),
    # --- fidelity ---
    ("fidelity-passes", [], [], "fidelity:kl", P, "PROMOTE", "upper bound 0.006"),
    ("fidelity-beyond-limit", [], [FP8, ("fidelity", fid(kl=0.02, lo=0.018, hi=0.022))], "fidelity:kl", F, "REJECT",
     "beyond the limit"),
    ("fidelity-crossing", [], [FP8, ("fidelity", fid(kl=0.009, lo=0.007, hi=0.011))], "fidelity:kl", I, "INCONCLUSIVE",
     "needs about"),
    # a skewed interval: its upper margin (0.007), not its half-width, says how far n must grow: 100 x (7/6)^2
    ("fidelity-skewed-crossing-needs-more", [], [FP8, ("fidelity", fid(kl=0.004, lo=0.0039, hi=0.011))], "fidelity:kl",
     I, "INCONCLUSIVE", "needs about 137 samples"),
    ("fidelity-top1-low", [], [("fidelity", fid(top1=(0.8, 0.78, 0.82)))], "fidelity:top1", F, "REJECT", "top-1"),
    ("floor-too-high", [], [FP8, ("floor", fid(kl=0.008, lo=0.007, hi=0.009))], "fidelity:floor", I, "INCONCLUSIVE",
     "cannot judge"),
    ("floor-missing", [], [("floor", None)], "fidelity:floor", I, "INCONCLUSIVE", "no noise floor"),
    ("fidelity-missing", [], [NO_FID, ("gaps", {"fidelity": {"reason": "missing file f.json"}})], "fidelity", I,
     "INCONCLUSIVE", "missing file f.json"),
    # --- judge ---
    ("judge-inferior-ci", [], [("judge.lower_bound", -0.06)], "judge:", I, "INCONCLUSIVE", "-0.060 <= -margin -0.050"),
    ("judge-harm", [], [("judge.net", -0.2), ("judge.lower_bound", -0.25)], "judge:", F, "REJECT", "prefers the baseline"),
    ("judge-inferior-ci-point", [("bound", "point"), ("primary.bound", "ci")], [("judge.lower_bound", -0.06)], "judge:", P,
     "PROMOTE", "point estimate"),
    ("judge-uncalibrated-optional", [], [("judge.counts_as_evidence", False), ("judge.lower_bound", -0.5)], "judge:", K,
     "PROMOTE", "failed calibration"),
    ("judge-uncalibrated-required", [("judge.required", True)], [("judge.counts_as_evidence", False)], "judge:", I,
     "INCONCLUSIVE", "failed calibration"),
    ("judge-not-stronger", [("judge.required", True)], [("judge.not_stronger", "the judge model is the baseline model")],
     "judge:", I, "INCONCLUSIVE", "not known to be stronger"),
    ("judge-not-stronger-accepted", [("judge.required", True), ("judge.accept_not_stronger", True)],
     [("judge.not_stronger", "same model")], "judge:", P, "PROMOTE", "lower confidence bound"),
    ("judge-missing-required", [("judge.required", True)], [("judge", None)], "judge:", I, "INCONCLUSIVE",
     "no judge report"),
    ("judge-too-few-pairs", [("judge.required", True)], [("judge.n", 3)], "judge:", I, "INCONCLUSIVE", "3 judged pairs"),
    # --- error rate ---
    ("error-rate-over", [], [("error_rates.1.rate", 0.03)], "error_rate:w4a16-gptq/default", F, "REJECT",
     "3.00% of 300 requests failed > limit 2.00%"),
    ("error-rate-none", [], [("error_rates.1.rate", None)], "error_rate:w4a16-gptq", I, "INCONCLUSIVE", "no error rate"),
    ("error-rate-no-summaries", [], [("error_rates", [])], "error_rate", I, "INCONCLUSIVE", "no eval summary"),
    ("error-rate-unreadable-part", [], [("gaps", {"error_rate": {"reason": "missing file b/summary.json"}})],
     "error_rate:unreadable", I, "INCONCLUSIVE", "missing file b/summary.json"),
    # --- engine parity ---
    ("parity-fail", [], [("parity.verdict", "fail"), ("parity.reason", "engine problem, not quantization")],
     "engine_parity", F, "REJECT", "engine problem"),
    ("parity-missing", [], [("parity", None)], "engine_parity", I, "INCONCLUSIVE", "no engine parity report"),
    ("parity-missing-optional", [("engine_parity.required", False)], [("parity", None)], "engine_parity", K, "PROMOTE",
     "skipped"),
    # --- must pay off ---
    ("size-not-smaller-enough", [], [("size_ratio.value", 0.9)], "pay_off:size_ratio", F, "REJECT", "0.900 > 0.800"),
    ("slower", [], [("throughput_ratio.value", 0.9)], "pay_off:throughput_ratio", F, "REJECT", "0.900 < 1.000"),
    ("no-probe-optional", [], [("throughput_ratio", None)], "pay_off:throughput_ratio", K, "PROMOTE", "skipped"),
    ("no-probe-required", [("pay_off.required", True)], [("throughput_ratio", None)], "pay_off:throughput_ratio", I,
     "INCONCLUSIVE", "missing evidence (required)"),
]


@pytest.mark.parametrize("policy_edits, evidence_edits, prefix, outcome, decision, words",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_check(policy_edits, evidence_edits, prefix, outcome, decision, words):
    d = run_gate(policy_edits, evidence_edits)
    c = check(d, prefix)
    assert c.outcome == outcome, c
    assert c.passed is {"pass": True, "skipped": None}.get(outcome, False)
    assert words in c.reason, c.reason
    assert d.decision == decision, d.reasons
    if decision != "PROMOTE":
        assert any(r.startswith(c.name) for r in d.reasons), d.reasons  # the decision says which check decided it
    if decision == "INCONCLUSIVE":
        assert d.needs


def test_statistical_checks_state_their_power():
    d = run_gate([], [FP8, ("metrics.default.exact_match", stat(n=300, sd=0.3))])
    c = check(d, "primary:default/exact_match")
    assert c.power and c.power.n == 300 and c.power.role == "harm" and c.power.limit_below_mdd
    assert c.power.mdd > 0.01 and c.power.needs_samples > 300 and 0 < c.power.alpha <= 0.05
    pooled = check(d, "pooled:default").power
    assert pooled.discordance == 0.05 and pooled.mdd is not None
    assert d.operating and d.operating.false_reject_bound == 0.05 and "at most 5%" in d.operating.note


def test_harm_tests_are_holm_corrected_within_their_group():
    # p = 0.02 is significant alone at 0.05 * (1 - 0.6) = 0.02, but not as the smallest of three at Holm's 0.0067
    one = run_gate([("recall", None), ("categories", {})], [FP8, ("metrics.default.exact_match.p_harm", 0.02)])
    assert check(one, "primary:default/exact_match").outcome == "fail"
    two = run_gate([], [FP8, ("metrics.default.exact_match.p_harm", 0.02)])
    assert check(two, "primary:default/exact_match").outcome == "pass"


def test_measured_and_limit_follow_the_bound():
    ci = check(run_gate([], [FP8]), "primary:")
    point = check(run_gate([("bound", "point")], [FP8]), "primary:")
    assert ci.outcome == point.outcome == "pass"
    assert (ci.bound, point.bound) == ("ci", "point")
    assert ci.measured == pytest.approx(0.016 / 0.8) and point.measured == pytest.approx(0.004 / 0.8)
    assert ci.limit == point.limit == 0.01


def test_disabled_checks_are_absent_and_nothing_checked_is_inconclusive():
    off = [(k, None) for k in ("primary", "recall", "judge", "error_rate", "engine_parity", "pay_off", "pooled",
                               "fidelity")]
    d = run_gate(off + [("categories", {})])
    assert d.checks == [] and d.decision == "INCONCLUSIVE" and "no check passed" in d.reasons[-1]
    only_optional = run_gate(off[:2] + off[3:] + [("categories", {})], [("judge", None)])
    assert [c.outcome for c in only_optional.checks] == ["skipped"] and only_optional.decision == "INCONCLUSIVE"


def test_one_check_per_eval_set_and_a_failure_in_any_rejects():
    d = run_gate([], [("metrics.other", {"exact_match": stat(lo=-0.1, p_harm=0.0001)})])
    rows = {c.name: c.outcome for c in d.checks if c.name.startswith("primary:")}
    assert rows == {"primary:default/exact_match": "pass", "primary:other/exact_match": "fail"}
    assert d.decision == "REJECT"


def test_a_sets_own_categories_get_checks_with_their_own_metric_under_own_categories():
    """A team's categories (billing here) had no task-level check unless the policy named them; `own_categories`
    gives each one, read with the metric that scores most of its samples, at the family's limit."""
    own = [("categories.default.billing", {"token_f1": stat(base=0.5, delta=-0.2, lo=-0.3, hi=-0.1, n=60,
                                                                 p_harm=0.0001),
                                             "contains": stat(base=0.5, n=20)})]
    off = run_gate([], own)
    assert not [c for c in off.checks if "billing" in c.name] and off.decision == "PROMOTE"  # not named: unchecked
    on = run_gate([("own_categories", {"max_relative_drop": 0.05, "by_family": {"w4a16": 0.08}})], own)
    (billing,) = [c for c in on.checks if "billing" in c.name]
    assert billing.name == "category:default/billing/token_f1" and billing.outcome == "fail", billing
    assert on.decision == "REJECT" and billing.limit == 0.08  # w4a16: the family's limit
    # the named category keeps its own check and limit, not a second one from own_categories
    assert [c.name for c in on.checks if "arithmetic_numbers" in c.name] == \
        ["category:default/arithmetic_numbers/numeric_match"]


def test_own_metric_takes_the_metric_scoring_most_samples_then_the_primary_order():
    from quantgate.gate.policy import own_metric
    assert own_metric({"token_f1": 28, "exact_match": 34, "contains": 34}, ["exact_match"]) == "exact_match"
    assert own_metric({"contains": 34, "exact_match": 34}) == "contains"  # no preference: name order
    assert own_metric({"rouge_l": 50}) == "rouge_l" and own_metric({}) is None


# --- policy files -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["default", "strict"])
def test_shipped_policies_load(name):
    p = load_policy(RELEASES / "policies" / f"{name}.yaml")
    assert p.bound == "ci" and p.engine_parity and p.engine_parity.required
    assert p.primary.family_of("fp8-dynamic") == "fp8" and p.primary.family_of("w4a16-gptq") == "w4a16"
    assert {"arithmetic_numbers", "proper_nouns", "multilingual"} <= set(p.categories) and p.recall and p.judge


def test_strict_is_stricter_than_default():
    d, s = load_policy(RELEASES / "policies" / "default.yaml"), load_policy(RELEASES / "policies" / "strict.yaml")
    for fam in d.primary.families:
        assert s.primary.families[fam].value <= d.primary.families[fam].value
    assert s.min_samples >= d.min_samples and s.judge.required and s.error_rate.max <= d.error_rate.max


DEFAULT_TEXT = (RELEASES / "policies" / "default.yaml").read_text()


def _line_of(text: str, needle: str) -> int:
    return next(i for i, ln in enumerate(text.splitlines(), 1) if needle in ln)


BAD_POLICIES = [
    ("bound: ci", "bound: upper", "bound", "'ci' or 'point'"),
    ("min_samples: 10", "min_samples: 0", "min_samples", "greater than or equal to 1"),
    ("max_relative_drop: 0.01}", "max_relative_drop: 1.5}", "primary.families.fp8.max_relative_drop", "less than or equal to 1"),
    ("max_relative_drop: 0.01}", "max_relative_drop: -0.01}", "primary.families.fp8.max_relative_drop", "greater than"),
    ("max_relative_drop: 0.01}", "max_relative_drop: 0.01, max_absolute_drop: 0.01}", "primary.families.fp8", "exactly one"),
    ("max_relative_drop: 0.01}", "max_relative_drop: 0.01, extra: 1}", "primary.families.fp8.extra", "Extra inputs"),
    ("error_rate: {max: 0.02", "error_rate: {max: 2", "error_rate.max", "less than or equal to 1"),
    ("error_rate: {max: 0.02", "error_rate: {max: lots", "error_rate.max", "valid number"),
    ("pay_off: {max_size_ratio: 0.8", "pay_off: {max_size_ratio: 0", "pay_off.max_size_ratio", "greater than 0"),
    ("judge: {margin: 0.05", "judge: {margin: 2", "judge.margin", "less than or equal to 1"),
    ("metrics: [exact_match,", "metrics: [exact_matc,", "primary.metrics", "unknown metric 'exact_matc'"),
    ("metric: chrf,", "metric: chrff,", "categories.multilingual.metric", "unknown metric"),
    ("{w4a16: 0.08, fp4: 0.08}}\n  proper", "{w4a16: 1.08, fp4: 0.08}}\n  proper",
     "categories.arithmetic_numbers.by_family.w4a16", "less than or equal to 1"),
    ("schemes: [int8-w8a8]", "schemes: [int8-w8a8, fp8-dynamic]", "primary.families", "in two families",
     "  families:   "),  # primary's (fidelity's `families:` comes first in the file)
    ("recall: {measure: recall", "recal: {measure: recall", "recal", "Extra inputs"),
]


@pytest.mark.parametrize("old, new, field, words, line_of", [(*c, None)[:5] for c in BAD_POLICIES])
def test_bad_policy_names_file_line_and_field(tmp_path, old, new, field, words, line_of):
    assert old in DEFAULT_TEXT, old
    text = DEFAULT_TEXT.replace(old, new, 1)
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_policy(path)
    msg = err.value.render()
    assert f"field '{field}" in msg and words in msg, msg
    assert f"{path}:{_line_of(text, line_of or new.split(chr(10))[0].strip()[:12])}" in msg, msg


def test_missing_policy_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_policy(tmp_path / "nope.yaml")


# --- sizing --------------------------------------------------------------------------------------------------

def test_sizing_flags_limits_below_the_detectable_drop_and_names_the_n_they_need():
    from quantgate.gate.sizing import sizing, warnings

    pol = load_policy(RELEASES / "policies" / "default.yaml")
    small = sizing(pol, "w4a16", {"pooled": 300, "primary": 300, "category:proper_nouns": 50})
    assert all(r.below for r in small) and all(r.needs > r.n for r in small)
    pooled = next(r for r in small if r.check == "pooled")
    assert pooled.mdd < next(r for r in small if r.check == "primary").mdd  # the pooled test gets most of the budget
    (line,) = warnings(small)
    assert "pooled limit 3.0%" in line and f"needs ~{pooled.needs}" in line and "n=300" in line
    big = sizing(pol, "w4a16", {"pooled": pooled.needs})
    assert not big[0].below and warnings(big) == []


def test_sizing_command_prints_the_recall_checks_detectable_drop_per_needle_count():
    from typer.testing import CliRunner

    from quantgate.cli.main import app
    from quantgate.gate.sizing import recall_sizing

    pol = load_policy(RELEASES / "policies" / "default.yaml")
    r = CliRunner().invoke(app, ["sizing", "--needles", "60", "--needles", "120", "--design-effect", "1.5"])
    assert r.exit_code == 0, r.output
    rows = {int(line.split("|")[1]): line for line in r.output.splitlines() if line.startswith("| 60 ") or line.startswith("| 120 ")}
    at = {n: recall_sizing(pol, n, other_checks=5, design_effect=1.5) for n in (60, 120)}
    assert f"{at[120].mdd:.1%}" in rows[120] and f"{at[60].mdd:.1%}" in rows[60]
    assert at[120].mdd < at[60].mdd  # twice the needles detect a smaller drop
    assert "design effect 1.5" in r.output and f"about {at[60].needs} needles" in r.output


def test_a_policy_is_validated_once_per_content_and_each_caller_gets_its_own_copy(tmp_path, monkeypatch):
    """A release asks for its policy many times (warnings, streaming looks, judge, gate): the file is validated
    once per content; a caller that changes its copy changes no other's, and an edited file is read anew."""
    from quantgate.base import yamlconfig
    from quantgate.gate import policy as policy_module

    path = tmp_path / "p.yaml"
    path.write_text((RELEASES / "policies" / "default.yaml").read_text())
    validated = []
    real = policy_module.load_model
    monkeypatch.setattr(policy_module, "load_model", lambda *a, **k: validated.append(a[0]) or real(*a, **k))
    first, second = load_policy(path), load_policy(path)
    assert len(validated) == 1 and first == second and first is not second
    first.min_samples = 999
    assert load_policy(path).min_samples != 999
    edited = yaml.safe_load(path.read_text())
    edited["min_samples"] = 7
    path.write_text(yaml.safe_dump(edited))
    assert load_policy(path).min_samples == 7 and len(validated) == 2
    assert yamlconfig.load_model is real  # only this module's name was wrapped
