"""The gate on real evidence from the demo model served by vLLM (slow; CI runs it).

- A/A: the baseline served again as a candidate (another server, another batch size) is PROMOTED under a test
  policy without the pay-off check, with fidelity at the noise floor.
- A deliberately damaged candidate (every linear weight rounded to 3 bits per output channel, made here and never
  shipped) is REJECTED with a fidelity reason.
Both go through the release's own steps (serve_and_evaluate, compare_variants, gate) with one shared baseline.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from quantgate.base.paths import REPO
from quantgate.release import schedule
from quantgate.release import steps as rel
from quantgate.spec.resolve import load_spec
from quantgate.release.variants import Variant, size_bytes
from quantgate.target.catalogue import MANIFEST, checkpoint_hash

SPEC = """\
version: 1
name: gate-real
model: {model}
hardware: x86-cpu
context: 1024
concurrency: 4
schemes: [w4a16-gptq]
eval_sets: [{evalset}]
policy: {policy}
eval: {{limit: 60, concurrency: 8}}
recall: null
perf: null
fidelity: {{limit: 40, top_k: 10, concurrency: 8, draws: 1}}
serving: {{{extra}}}
"""


def _policy(path: Path) -> Path:
    """The default policy without the pay-off check (an A/A candidate is not smaller) and without the recall check
    (no recall grid here: its real run is tests/test_recall.py's and the release tests'), at these sample sizes."""
    policy = yaml.safe_load((REPO / "releases" / "policies" / "default.yaml").read_text())
    policy.update(name="gate-real", min_samples=3)
    policy["fidelity"]["min_category_samples"] = 3  # 40 fidelity prompts: 6-7 per category, each still judged
    policy["pay_off"] = None
    policy["recall"]["required"] = False
    path.write_text(yaml.safe_dump(policy))
    return path


def _damage(src: Path, dst: Path, bits: int = 3) -> Path:
    """A copy of the checkpoint whose linear weights are rounded to `bits` bits, symmetric, per output channel."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if t.ndim == 2 and "proj" in name:
                w = t.float()
                scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / (2 ** (bits - 1) - 1)
                tensors[name] = (torch.round(w / scale) * scale).to(t.dtype)
        save_file(tensors, f, metadata={"format": "pt"})
    (dst / MANIFEST).unlink(missing_ok=True)  # its recorded hashes are the original's: hash the files instead
    return dst


def _variant(path: Path, name: str, scheme: str) -> Variant:
    return Variant(name=name, path=path, scheme=scheme, content_hash=checkpoint_hash(path), size_bytes=size_bytes(path))


@pytest.fixture(scope="module")
def measured(tmp_path_factory, demo_model):
    root = tmp_path_factory.mktemp("gate-real")
    old = os.environ.get("QUANTGATE_RESULTS")
    os.environ["QUANTGATE_RESULTS"] = str(root / "results")
    policy = _policy(root / "policy.yaml")
    evalset = REPO / "eval_sets" / "default.jsonl"

    def spec(extra: str):
        path = root / f"spec-{len(extra)}.yaml"
        path.write_text(SPEC.format(model=demo_model, evalset=evalset, policy=policy, extra=extra))
        return load_spec(path)

    base_spec = spec("")
    # another server with another batch limit: the candidate's requests are batched differently
    cand_spec = spec("max_num_seqs: 4")  # a managed serving knob (quantgate.plan.knobs), no longer an extra arg
    run = rel.start_run(base_spec, root / "spec.yaml", "gate-real")
    damaged_dir = _damage(demo_model, root / "damaged")
    base = rel.serve_and_evaluate(rel.MeasureRequest(base_spec, rel.baseline_variant(demo_model), run, parity=True))
    bad_run = rel.start_run(base_spec, root / "spec.yaml", "gate-real-damaged")
    (bad_run / "baseline").mkdir(parents=True, exist_ok=True)
    shutil.copy(run / "baseline" / "evidence.json", bad_run / "baseline" / "evidence.json")
    # both candidates at once, as a release serves them side by side: their server start-ups overlap
    schedule.preload_libraries()  # as the flow does before its job threads import them
    with ThreadPoolExecutor(2) as pool:
        aa_job = pool.submit(rel.serve_and_evaluate, rel.MeasureRequest(
            cand_spec, _variant(demo_model, "w4a16-gptq", "w4a16-gptq"), run, parity=False, tokenizer=demo_model,
            reference=base.evals))
        bad_job = pool.submit(rel.serve_and_evaluate, rel.MeasureRequest(
            base_spec, _variant(damaged_dir, "w4a16-gptq", "w4a16-gptq"), bad_run, parity=False, tokenizer=demo_model,
            reference=base.evals))
        aa, bad = aa_job.result(), bad_job.result()
    yield {"base": base, "aa": aa, "bad": bad, "run": run, "bad_run": bad_run, "spec": base_spec}
    if old is None:
        os.environ.pop("QUANTGATE_RESULTS", None)
    else:
        os.environ["QUANTGATE_RESULTS"] = old


def _decide(m, run_key: str, cand_key: str):
    run = m[run_key]
    rel.compare_variants(m["base"], m[cand_key], run)
    (decision,) = rel.gate(m["spec"], run, ["w4a16-gptq"])
    rel.record_decisions(m["spec"], run, [decision])
    return decision, run


@pytest.mark.slow
@pytest.mark.timeout(1200)  # minutes alone; a hang must not eat the CI budget
def test_a_a_candidate_is_promoted_with_fidelity_at_the_floor(measured):
    d, run = _decide(measured, "run", "aa")
    checks = {c.name: c for c in d.checks}
    assert d.decision == "PROMOTE", d.reasons
    kl = checks["fidelity:kl"]
    floor = json.loads((run / "fidelity" / "floor.json").read_text())["summary"]
    fid = json.loads((run / "fidelity" / "w4a16-gptq.json").read_text())["summary"]
    # hundreds of scored tokens: the answers are sampled unseeded (quantgate.fidelity.sampling), so the count varies
    # from run to run (906 and over 1,000 seen for these 40 prompts)
    assert fid["n_tokens"] > 500 and fid["kl"]["mean"] <= max(10 * floor["kl"]["mean"], 1e-4), (fid["kl"], floor["kl"])
    print(f"\nA/A: {d.decision}; fidelity KL {fid['kl']} top-1 {fid['top1']['mean']:.4f} over {fid['n_tokens']} tokens; "
          f"floor KL {floor['kl']['mean']:.3g}")
    assert fid["top1"]["mean"] >= 0.99 and kl.outcome == "pass"
    assert checks["pooled:default"].power.mdd is not None and d.operating.false_reject_bound == 0.10
    saved = json.loads((run / "decision.json").read_text())["candidates"]["w4a16-gptq"]
    assert saved["decision"] == "PROMOTE" and saved["checks"][0]["outcome"]


@pytest.mark.slow
@pytest.mark.timeout(1200)  # minutes alone; a hang must not eat the CI budget
def test_damaged_candidate_is_rejected_for_fidelity(measured, demo_model):
    d, run = _decide(measured, "bad_run", "bad")
    checks = {c.name: c for c in d.checks}
    assert d.decision == "REJECT", d.reasons
    assert checks["fidelity:kl"].outcome == "fail", checks["fidelity:kl"].reason
    assert any(r.startswith("fidelity:") for r in d.reasons)
    fid = json.loads((run / "fidelity" / "w4a16-gptq.json").read_text())["summary"]
    print(f"\ndamaged: {d.decision}; fidelity KL {fid['kl']} top-1 {fid['top1']['mean']:.4f}; reasons {d.reasons[:2]}")
    assert fid["kl"]["low"] > 0.05 and fid["worst"], fid["kl"]
    # decided as soon as its fidelity was scored (quantgate.release.early), by the same check the gate failed
    assert measured["bad"].decided and "fidelity:kl:" in measured["bad"].decided, measured["bad"].decided
    assert measured["aa"].decided is None
    # an unchanged re-run decides again from the cached fidelity, before serving: what it skipped stays skipped
    bad = measured["bad"]
    again = rel.serve_and_evaluate(rel.MeasureRequest(measured["spec"], bad.variant, measured["bad_run"], parity=False,
                                                      tokenizer=demo_model, reference=measured["base"].evals))
    assert not again.served and again.decided == bad.decided and again.skipped == bad.skipped
