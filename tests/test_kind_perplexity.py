"""The perplexity kind (quantgate/kinds/perplexity.py), added as one module: its statistic against scipy, its check's
three outcomes, its spec and policy sections, and (slow) a real FP32 vLLM server's perplexity of the held-out text
against the exact full-vocabulary value from transformers, then a BF16 server as the candidate, gated."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from pydantic import ValidationError
from test_decide_early import SPEC

from quantgate.base.errors import QuantgateError
from quantgate.base.paths import EVAL_SETS, RELEASES
from quantgate.gate.checks import evaluate
from quantgate.gate.evidence import collect
from quantgate.gate.models import KindComparison, PairedStat
from quantgate.gate.policy import load_policy
from quantgate.kinds.perplexity import NAME, Perplexity, PerplexityGate, PerplexityPolicy, paired_nll
from quantgate.release.measurements import VariantJob, plan
from quantgate.release.variants import Evidence, Variant
from quantgate.spec.resolve import load_spec


def _spec(tmp_path: Path, measure: str = "measure: {perplexity: {}}\n"):
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC + measure)
    return load_spec(path)


T_975_DF7 = 2.3646242515927849  # Student's t, 97.5% quantile, 7 degrees of freedom (statistical tables)


def test_the_paired_statistic_is_the_t_interval_of_the_per_passage_differences():
    base = {f"p{i}": 2.0 + 0.1 * i for i in range(8)}
    cand = {k: v + 0.02 + 0.01 * ((i * 7) % 5 - 2) for i, (k, v) in enumerate(base.items())}
    s = paired_nll(base, {**cand, "only-here": 9.0})  # a passage one side lacks is not paired
    diffs = [cand[k] - base[k] for k in base]
    mean = sum(diffs) / 8
    half = T_975_DF7 * math.sqrt(sum((d - mean) ** 2 for d in diffs) / 7) / math.sqrt(8)
    low, high = mean - half, mean + half
    assert s.n == 8 and s.delta == pytest.approx(sum(diffs) / 8)
    assert (s.ci_low, s.ci_high) == (pytest.approx(low, rel=1e-6), pytest.approx(high, rel=1e-6))
    assert s.base_mean == pytest.approx(sum(base.values()) / 8) and s.higher_is_better is False
    assert paired_nll(base, {}).n == 0 and paired_nll({"a": 1.0}, {"a": 1.5}).ci_high is None


@pytest.mark.parametrize(("delta", "half", "outcome"), [(0.01, 0.01, "pass"), (0.09, 0.02, "fail"),
                                                         (0.045, 0.02, "inconclusive")])
def test_the_check_bounds_the_perplexity_increase_by_its_interval(delta, half, outcome):
    policy = PerplexityPolicy(max_relative_increase=0.05)
    comp = KindComparison(kind=NAME, unit="passage", stat=PairedStat(n=10, base_mean=2.0, cand_mean=2.0 + delta, delta=delta,
                                                               ci_low=delta - half, ci_high=delta + half,
                                                               higher_is_better=False, file="x.json"))
    (check,) = PerplexityGate().checks(policy, comp, None)
    assert check.name == NAME and check.outcome == outcome and check.limit == 0.05, check.reason
    assert check.measured == pytest.approx(math.expm1(delta), abs=1e-6) and f"{math.expm1(delta):+.2%}" in check.reason
    (none,) = PerplexityGate().checks(PerplexityPolicy(required=False), None, None)
    assert none.outcome == "skipped" and "measure.perplexity" in none.reason


def test_the_spec_section_defaults_to_the_bundled_text_and_names_a_missing_file(tmp_path):
    spec = _spec(tmp_path)
    assert spec.measure[NAME].text == (EVAL_SETS / "fidelity_corpus.txt").resolve()
    assert json.loads(spec.model_dump_json())["measure"][NAME]["max_tokens"] == 512  # dumped by its own model
    with pytest.raises(QuantgateError) as err:
        _spec(tmp_path, "measure: {perplexity: {text: nowhere.txt}}\n")
    assert "measure.perplexity.text" in str(err.value) and "nowhere.txt" in str(err.value)
    with pytest.raises(QuantgateError, match=r"no such measurement kind \(registered: .*perplexity"):
        _spec(tmp_path, "measure: {perplexty: {}}\n")
    with pytest.raises(ValidationError):
        PerplexityPolicy(max_relative_increase=0)


def test_the_default_policy_checks_it_optionally_and_a_run_without_it_skips_the_check(tmp_path):
    policy = load_policy(RELEASES / "policies" / "default.yaml")
    assert isinstance(policy.kinds[NAME], PerplexityPolicy) and policy.kinds[NAME].required is False
    ev = collect(tmp_path, "int8-w8a8")
    assert NAME not in ev.kinds
    checks = {c.name: c for c in evaluate(policy, ev).checks}
    assert checks[NAME].outcome == "skipped"


def _job(spec, variant: Variant, tmp_path: Path, tokenizer: Path) -> VariantJob:
    return VariantJob(spec=spec, variant=variant, run=tmp_path / "run", folder=tmp_path / "run" / variant.name,
                      cache=tmp_path / "cache" / variant.name, tokenizer=tokenizer, reference={"default": tmp_path / "ev"},
                      baseline=variant.name == "baseline", log=print)


def _exact_nll(model_dir: Path, text: Path, max_tokens: int) -> dict[str, float]:
    """Passage id -> mean NLL per token from transformers' full-vocabulary logits (FP32), the passages tokenized as
    the kind tokenizes them (fidelity's build_sequences)."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantgate.fidelity.run import build_sequences

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = {}
    for seq in build_sequences([], model_dir, corpus=text, max_len=max_tokens):
        ids = torch.tensor([seq.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
        out[seq.id] = -logp.gather(1, ids[0, 1:, None]).mean().item()
    return out


@pytest.mark.slow
def test_a_served_models_perplexity_is_the_exact_one_and_a_bf16_candidate_is_gated(demo_model, demo_server,
                                                                                     odd_demo_server, tmp_path):
    spec = _spec(tmp_path)
    kind, dumps = Perplexity(), {}
    evidence = {}
    for name, srv in (("baseline", demo_server), ("bf16", odd_demo_server)):
        variant = Variant(name=name, path=demo_model, content_hash=name, size_bytes=1)
        job = _job(spec, variant, tmp_path, demo_model)
        folders, todo = plan(job)
        (step,) = kind.steps(job, folders[NAME], todo[NAME], None)
        step.run(srv)
        assert plan(job)[1][NAME] == []  # its own done test sees its dump
        evidence[name] = Evidence(variant=variant, folder=job.folder, cache=job.cache, serve_command=[], dtype=None,
                                  served=True, kinds=kind.record(folders[NAME], {})["kinds"])
        dumps[name] = evidence[name].kinds[NAME]
    kind.compare(tmp_path / "run", evidence["baseline"], evidence["bf16"])
    comp = KindComparison.model_validate_json((tmp_path / "run" / "bf16" / f"{NAME}.json").read_text())
    # the FP32 server's NLL per passage is transformers' exact full-vocabulary one
    from quantgate.kinds.perplexity import _nll

    served, exact = _nll(dumps["baseline"]), _exact_nll(demo_model, spec.measure[NAME].text, 512)
    assert set(served) == set(exact) and len(exact) == 10
    worst = max(abs(served[k] - exact[k]) for k in exact)
    assert worst < 2e-3, {k: (served[k], exact[k]) for k in exact}
    assert comp.stat.n == 10 and comp.figures["baseline_perplexity"] == pytest.approx(
        math.exp(sum(exact.values()) / 10), rel=2e-3)
    # BF16 activations change the logprobs a little: gated against a 5% limit, through the gate's own evidence
    ev = collect(tmp_path / "run", "bf16")
    policy = load_policy(RELEASES / "policies" / "default.yaml").model_copy(
        update={"kinds": {NAME: PerplexityPolicy(max_relative_increase=0.05, required=True)}})
    (check,) = [c for c in evaluate(policy, ev).checks if c.name == NAME]
    print(f"\nperplexity: FP32 {comp.figures['baseline_perplexity']:.3f}, BF16 {comp.figures['candidate_perplexity']:.3f}"
          f"; worst per-passage NLL gap to transformers {worst:.2e}; check {check.outcome}: {check.reason}")
    assert check.outcome in ("pass", "inconclusive") and comp.stat.ci_low is not None
    assert abs(math.expm1(comp.stat.delta or 0.0)) < 0.05
