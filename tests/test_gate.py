"""The promotion gate (pure): every check, the ci/point bound, every fail-closed path; and policy files."""

from __future__ import annotations

import copy
import math

import pytest

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
}


def stat(base=0.8, delta=-0.004, lo=-0.016, hi=0.008, n=100, higher=True) -> dict:
    """Primary-metric default: relative drop 0.5% (point) and 2% (CI's worst end)."""
    return {"n": n, "base": base, "cand": None if base is None or delta is None else base + delta, "delta": delta,
            "ci_low": lo, "ci_high": hi, "higher_is_better": higher, "file": "compare/x.json"}


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
    assert names == {"engine_parity", "error_rate", "primary", "category", "recall", "judge", "pay_off"}
    for c in d.checks:
        assert c.passed is True and c.reason and c.limit is not None
    assert all(c.evidence_file for c in d.checks if not c.name.startswith("error_rate"))


S, FP8 = "scheme", ("scheme", "fp8-dynamic")
CASES = [
    # id, policy edits, evidence edits, check prefix, expected passed, expected decision, words in the reason
    # --- primary metrics, bound ci vs point, per family ---
    ("fp8-ci-fails", [], [FP8], "primary:default/exact_match", False, "REJECT", "CI's worst end 2.00% > limit 1.00%"),
    ("fp8-point-passes", [("bound", "point")], [FP8], "primary:default/exact_match", True, "PROMOTE", "point estimate"),
    ("check-bound-overrides-policy", [("primary.bound", "point")], [FP8], "primary:", True, "PROMOTE", "0.50%"),
    ("w4a16-ci-passes", [], [], "primary:", True, "PROMOTE", "2.00% <= limit 3.00%"),
    ("lower-is-better-uses-ci-high", [], [("metrics.default.exact_match", stat(base=0.2, delta=0.0, lo=-0.5, hi=0.001,
                                                                            higher=False))], "primary:", True, "PROMOTE", "0.50%"),
    ("zero-baseline-no-drop", [], [("metrics.default.exact_match", stat(base=0.0, delta=0.0, lo=0.0, hi=0.02))],
     "primary:", True, "PROMOTE", "0.00%"),
    ("zero-baseline-any-drop", [], [("metrics.default.exact_match", stat(base=0.0, delta=0.0, lo=-0.01, hi=0.02))],
     "primary:", False, "REJECT", "inf"),
    ("unknown-scheme", [], [(S, "nvfp4")], "primary", False, "REJECT", "in no family"),
    ("no-scheme", [], [(S, None)], "primary", False, "REJECT", "scheme is unknown"),
    # --- fail-closed on statistical evidence ---
    ("metric-missing", [], [("metrics", {})], "primary:exact_match", False, "REJECT", "no eval set measured exact_match"),
    ("metric-missing-gap-reason", [], [("metrics", {}), ("gaps", {"compare": {"reason": "corrupt JSON in c.json"}})],
     "primary:exact_match", False, "REJECT", "corrupt JSON"),
    ("too-few-samples", [], [("metrics.default.exact_match.n", 5)], "primary:", False, "REJECT", "fewer than min_samples=10"),
    ("too-few-samples-optional", [("primary.required", False)], [("metrics.default.exact_match.n", 5)], "primary:",
     None, "PROMOTE", "skipped"),
    ("nan-ci", [], [("metrics.default.exact_match.ci_low", math.nan)], "primary:", False, "REJECT", "no confidence interval"),
    ("nan-ci-point-bound", [("bound", "point")], [("metrics.default.exact_match.ci_low", math.nan)], "primary:", True,
     "PROMOTE", "point"),
    ("nan-delta-point-bound", [("bound", "point")], [("metrics.default.exact_match.delta", math.nan)], "primary:", False,
     "REJECT", "no delta"),
    ("relative-without-base", [], [("metrics.default.exact_match.base", None)], "primary:", False, "REJECT",
     "no baseline mean"),
    # --- categories ---
    ("category-family-limit", [], [("categories.default.arithmetic_numbers.numeric_match",
                                    stat(base=0.5, delta=-0.01, lo=-0.035, n=50))], "category:", True, "PROMOTE", "limit 8.00%"),
    ("category-default-limit", [], [FP8, ("metrics.default.exact_match.ci_low", -0.004),
                                    ("categories.default.arithmetic_numbers.numeric_match",
                                     stat(base=0.5, delta=-0.01, lo=-0.035, n=50))], "category:", False, "REJECT",
     "7.00% > limit 5.00%"),
    ("category-absolute-limit", [("categories.arithmetic_numbers.max_relative_drop", None),
                                 ("categories.arithmetic_numbers.max_absolute_drop", 0.015),
                                 ("categories.arithmetic_numbers.by_family", {})], [], "category:", False, "REJECT",
     "+0.0200 > limit 0.0150"),
    ("category-missing", [], [("categories", {})], "category:arithmetic_numbers", False, "REJECT", "no eval set has category"),
    ("category-missing-optional", [("categories.arithmetic_numbers.required", False)], [("categories", {})],
     "category:", None, "PROMOTE", "skipped"),
    # --- recall ---
    ("recall-drop", [], [("recall.recall.ci_low", -0.08)], "recall:recall", False, "REJECT", "+0.0800 > limit 0.0500"),
    ("recall-no-ci", [], [("recall.recall.ci_low", None)], "recall:", False, "REJECT", "no confidence interval"),
    ("recall-no-ci-point", [("recall.bound", "point")], [("recall.recall.ci_low", None)], "recall:", True, "PROMOTE", "point"),
    ("recall-missing", [], [("recall", {}), ("gaps", {"recall": {"reason": "missing file r/delta.json"}})], "recall:",
     False, "REJECT", "missing file r/delta.json"),
    ("recall-missing-optional", [("recall.required", False)], [("recall", {})], "recall:", None, "PROMOTE", "skipped"),
    ("recall-exact-measure", [("recall.measure", "exact")], [], "recall:exact", False, "REJECT", "no recall comparison"),
    # --- judge ---
    ("judge-inferior-ci", [], [("judge.lower_bound", -0.06)], "judge:", False, "REJECT", "-0.060 <= -margin -0.050"),
    ("judge-inferior-ci-point", [("bound", "point"), ("primary.bound", "ci")], [("judge.lower_bound", -0.06)], "judge:", True,
     "PROMOTE", "point estimate"),
    ("judge-uncalibrated-optional", [], [("judge.counts_as_evidence", False), ("judge.lower_bound", -0.5)], "judge:", None,
     "PROMOTE", "failed calibration"),
    ("judge-uncalibrated-required", [("judge.required", True)], [("judge.counts_as_evidence", False)], "judge:", False,
     "REJECT", "failed calibration"),
    ("judge-not-stronger", [("judge.required", True)], [("judge.not_stronger", "the judge model is the baseline model")],
     "judge:", False, "REJECT", "not known to be stronger"),
    ("judge-not-stronger-accepted", [("judge.required", True), ("judge.accept_not_stronger", True)],
     [("judge.not_stronger", "same model")], "judge:", True, "PROMOTE", "lower confidence bound"),
    ("judge-missing-required", [("judge.required", True)], [("judge", None)], "judge:", False, "REJECT", "no judge report"),
    ("judge-too-few-pairs", [("judge.required", True)], [("judge.n", 3)], "judge:", False, "REJECT", "3 judged pairs"),
    # --- error rate ---
    ("error-rate-over", [], [("error_rates.1.rate", 0.03)], "error_rate:w4a16-gptq/default", False, "REJECT",
     "3.00% of 300 requests failed > limit 2.00%"),
    ("error-rate-none", [], [("error_rates.1.rate", None)], "error_rate:w4a16-gptq", False, "REJECT", "no error rate"),
    ("error-rate-no-summaries", [], [("error_rates", [])], "error_rate", False, "REJECT", "no eval summary"),
    ("error-rate-unreadable-part", [], [("gaps", {"error_rate": {"reason": "missing file b/summary.json"}})],
     "error_rate:unreadable", False, "REJECT", "missing file b/summary.json"),
    # --- engine parity ---
    ("parity-fail", [], [("parity.verdict", "fail"), ("parity.reason", "engine problem, not quantization")],
     "engine_parity", False, "REJECT", "engine problem"),
    ("parity-missing", [], [("parity", None)], "engine_parity", False, "REJECT", "no engine parity report"),
    ("parity-missing-optional", [("engine_parity.required", False)], [("parity", None)], "engine_parity", None, "PROMOTE",
     "skipped"),
    # --- must pay off ---
    ("size-not-smaller-enough", [], [("size_ratio.value", 0.9)], "pay_off:size_ratio", False, "REJECT", "0.900 > 0.800"),
    ("slower", [], [("throughput_ratio.value", 0.9)], "pay_off:throughput_ratio", False, "REJECT", "0.900 < 1.000"),
    ("no-probe-optional", [], [("throughput_ratio", None)], "pay_off:throughput_ratio", None, "PROMOTE", "skipped"),
    ("no-probe-required", [("pay_off.required", True)], [("throughput_ratio", None)], "pay_off:throughput_ratio", False,
     "REJECT", "missing evidence (required)"),
]


@pytest.mark.parametrize("policy_edits, evidence_edits, prefix, passed, decision, words",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_check(policy_edits, evidence_edits, prefix, passed, decision, words):
    d = run_gate(policy_edits, evidence_edits)
    c = check(d, prefix)
    assert c.passed is passed, c
    assert words in c.reason, c.reason
    assert d.decision == decision, d.reasons
    if decision == "REJECT":
        assert any(r.startswith(c.name) for r in d.reasons)  # the decision says which check rejected it


def test_measured_and_limit_follow_the_bound():
    ci = check(run_gate([], [FP8]), "primary:")
    point = check(run_gate([("bound", "point")], [FP8]), "primary:")
    assert (ci.bound, point.bound) == ("ci", "point")
    assert ci.measured == pytest.approx(0.016 / 0.8) and point.measured == pytest.approx(0.004 / 0.8)
    assert ci.limit == point.limit == 0.01


def test_disabled_checks_are_absent_and_nothing_checked_rejects():
    off = [(k, None) for k in ("primary", "recall", "judge", "error_rate", "engine_parity", "pay_off")]
    d = run_gate(off + [("categories", {})])
    assert d.checks == [] and d.decision == "REJECT" and "no check passed" in d.reasons[-1]
    only_optional = run_gate(off[:2] + off[3:] + [("categories", {})], [("judge", None)])
    assert [c.passed for c in only_optional.checks] == [None] and only_optional.decision == "REJECT"


def test_one_check_per_eval_set_and_a_failure_in_any_rejects():
    d = run_gate([], [("metrics.other", {"exact_match": stat(lo=-0.1)})])
    rows = {c.name: c.passed for c in d.checks if c.name.startswith("primary:")}
    assert rows == {"primary:default/exact_match": True, "primary:other/exact_match": False}
    assert d.decision == "REJECT"


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
    ("  proper_nouns:  ", "  proper_noun:  ", "categories.proper_noun", "unknown category 'proper_noun'"),
    ("metric: chrf,", "metric: chrff,", "categories.multilingual.metric", "unknown metric"),
    ("{w4a16: 0.08, fp4: 0.08}}\n  proper", "{w4a16: 1.08, fp4: 0.08}}\n  proper",
     "categories.arithmetic_numbers.by_family.w4a16", "less than or equal to 1"),
    ("schemes: [int8-w8a8]", "schemes: [int8-w8a8, fp8-dynamic]", "primary.families", "in two families",
     "  families:"),
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
