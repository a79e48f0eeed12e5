"""Variants from elsewhere (quantgate.spec.external, quantgate.serving.endpoint): the spec's `candidates` and
endpoint `baseline`, the scheme an existing checkpoint carries, the endpoint adapter, and how the gate handles
evidence that cannot exist for an endpoint (the policy's `not_applicable`).

Fast. The endpoint adapter is tested against tests/_fake_openai.py's loopback server (a real HTTP server; the
release test against a real vLLM server is tests/test_endpoint_release.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _fake_openai import FakeServer
from _gate_fixtures import make_run

from quantgate.base.errors import ConfigError, QuantgateError
from quantgate.base.paths import EVAL_SETS, REPO, RELEASES
from quantgate.gate.checks import evaluate
from quantgate.gate.evidence import gate_run
from quantgate.gate.models import Gap, GateEvidence
from quantgate.gate.policy import load_policy
from quantgate.release import schedule, steps
from quantgate.release.cachelayout import variant_cache
from quantgate.spec.external import EXTERNAL, detect_scheme
from quantgate.spec.resolve import load_spec
from quantgate.release.variants import baseline_for, endpoint_keys, external_variant, server_config
from quantgate.serving.endpoint import EndpointConfig, EndpointServer, fingerprint

DATA = REPO / "tests" / "data" / "external"
INT8 = json.loads((DATA / "int8-w8a8" / "config.json").read_text())["quantization_config"]


def group(w: tuple, a: tuple | None, sym: bool = True, dynamic: bool = True) -> dict:
    args = {"type": w[0], "num_bits": w[1], "symmetric": sym, "strategy": "channel"}
    act = None if a is None else {"type": a[0], "num_bits": a[1], "dynamic": dynamic, "strategy": "token"}
    return {"targets": ["Linear"], "weights": args, "input_activations": act}


def ct(*groups: dict, **extra) -> dict:
    return {"quant_method": "compressed-tensors", "config_groups": {f"group_{i}": g for i, g in enumerate(groups)}, **extra}


@pytest.mark.parametrize("config, scheme, words", [
    (INT8, "int8-w8a8", "int8 weights, int8 dynamic activations"),
    (ct(group(("float", 8), ("float", 8))), "fp8-dynamic", "float8 weights"),
    (ct(group(("float", 8), ("float", 8), dynamic=False)), EXTERNAL, "no quantgate scheme has this format"),
    (ct(group(("int", 4), None)), "w4a16-gptq", "symmetric int4 weights"),
    (ct(group(("int", 4), None, sym=False)), "w4a16-awq", "asymmetric int4 weights"),
    (ct(group(("float", 4), ("float", 4))), "nvfp4", "float4 weights"),
    (ct(group(("int", 8), None)), EXTERNAL, "int8 weights, 16-bit activations"),
    (ct(group(("int", 4), None), group(("int", 8), ("int", 8))), EXTERNAL, "different formats"),
    (ct(group(("int", 8), ("int", 8)), kv_cache_scheme={"type": "float", "num_bits": 8}), "int8-w8a8", "KV cache float8"),
    ({"quant_method": "gptq", "bits": 4}, EXTERNAL, "'gptq' is not compressed-tensors"),
    ({"quant_method": "compressed-tensors"}, EXTERNAL, "without config_groups"),
    (None, EXTERNAL, "unquantized"),
])
def test_scheme_detection_from_a_quantization_config(config, scheme, words):
    found, why = detect_scheme(config)
    assert found == scheme and words in why, why


SPEC = """\
version: 1
name: ext
model: demo
hardware: x86-cpu
schemes: []
candidates:
  - {name: ext-int8, checkpoint: CKPT}
baseline: {endpoint: http://127.0.0.1:9/v1, model: demo, api_key_env: QG_TEST_NO_SUCH_KEY}
"""


def spec_file(tmp_path: Path, text: str = SPEC, ckpt: str = "ckpt") -> Path:
    if not (tmp_path / "ckpt").exists():
        shutil.copytree(DATA / "int8-w8a8", tmp_path / "ckpt")
    path = tmp_path / "spec.yaml"
    path.write_text(text.replace("CKPT", ckpt))
    return path


def test_a_checkpoint_candidate_and_an_endpoint_baseline_load(tmp_path):
    spec = load_spec(spec_file(tmp_path))
    (c,) = spec.candidates
    assert (c.checkpoint, c.scheme) == (tmp_path / "ckpt", "int8-w8a8") and spec.schemes == []
    assert spec.baseline.model == "demo" and spec.baseline.api_key_env == "QG_TEST_NO_SUCH_KEY"
    assert any(n.startswith("candidate ext-int8: int8-w8a8 (compressed-tensors") for n in spec.machine_notes)
    assert schedule.variant_count(spec) == 1  # the endpoint baseline takes no slot, the checkpoint one
    run = tmp_path / "run"
    variant = external_variant(spec, "ext-int8", tmp_path / "model", run)  # as the flow makes it
    record = json.loads((run / "ext-int8" / "checkpoint.json").read_text())
    assert record == {"checkpoint": str(tmp_path / "ckpt"), "scheme": "int8-w8a8", "detected": c.note,
                      "size_bytes": variant.size_bytes}


@pytest.mark.parametrize("edit, line, field, words", [
    (("CKPT", "nowhere"), 7, "candidates.0.checkpoint", "checkpoint folder not found"),
    (("CKPT", "empty"), 7, "candidates.0.checkpoint", "no config.json in"),
    (("{name: ext-int8, checkpoint: CKPT}", "{name: e, endpoint: http://h/v1}"), 7, "candidates.0",
     "`model` is required with `endpoint`"),
    (("{name: ext-int8, checkpoint: CKPT}", "{name: e, endpoint: http://h/v1, model: m, checkpoint: ckpt}"), 7,
     "candidates.0", "exactly one of `checkpoint`"),
    (("{name: ext-int8, checkpoint: CKPT}", "{name: e, checkpoint: ckpt, api_key_env: K}"), 7, "candidates.0",
     "not with `checkpoint`: api_key_env"),
    (("{name: ext-int8, checkpoint: CKPT}", "{name: e, checkpoint: ckpt, scheme: w4a16-gptq}"), 7, "candidates.0",
     "is not what"),
    (("{name: ext-int8, checkpoint: CKPT}", "{name: baseline, checkpoint: ckpt}"), 7, "candidates", "reserved"),
    (("schemes: []", "schemes: [ext-int8]"), 5, "schemes", "also a candidate's name"),
    (("candidates:\n  - {name: ext-int8, checkpoint: CKPT}\n", ""), 5, "schemes", "at least 1"),
    (("model: demo, api_key_env", "api_key_env"), 8, "baseline", "model"),
    (("api_key_env: QG_TEST_NO_SUCH_KEY}", "api_key_env: A, prefect_secret: B}"), 8, "baseline", "not both"),
    (("{name: ext-int8, checkpoint: CKPT}", "{name: e, endpoint: h/v1, model: m}"), 7, "candidates.0.endpoint",
     "should match pattern"),
])
def test_spec_mistakes_name_the_line_and_field(tmp_path, edit, line, field, words):
    (tmp_path / "empty").mkdir()
    path = spec_file(tmp_path, SPEC.replace(*edit))
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    text = err.value.render()
    assert f"spec.yaml:{line}" in text and field in text and words in text, text


def test_a_checkpoint_the_hardware_cannot_serve_is_refused_with_the_item_line(tmp_path):
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    (fp8 / "config.json").write_text(json.dumps({"quantization_config": ct(group(("float", 8), ("float", 8)))}))
    with pytest.raises(ConfigError) as err:
        load_spec(spec_file(tmp_path, ckpt="fp8"))
    text = err.value.render()
    assert "spec.yaml:7" in text and "candidate ext-int8: its checkpoint is fp8-dynamic" in text and "x86-cpu" in text


def header_only_weights(path: Path) -> Path:
    """A safetensors file holding only the tensor header of an INT8 W8A8 layer (and 6 bytes): what `check` reads
    of a checkpoint's weights. Written at test time (*.safetensors stay out of git)."""
    header = json.dumps({"model.layers.0.mlp.down_proj.weight": {"dtype": "I8", "shape": [4], "data_offsets": [0, 4]},
                         "model.layers.0.mlp.down_proj.weight_scale": {"dtype": "BF16", "shape": [1],
                                                                       "data_offsets": [4, 6]}},
                        separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(6))
    return path


def test_the_shipped_example_passes_release_check():
    weights = DATA / "int8-w8a8" / "model.safetensors"  # git-ignored: the example's checkpoint has config.json only
    if not weights.is_file():
        header_only_weights(weights)
    proc = subprocess.run([sys.executable, "-m", "quantgate.cli.main", "release", str(DATA / "release.yaml"), "--check"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok policy" in proc.stdout and "endpoint.yaml" in proc.stdout


def test_an_endpoint_key_that_is_not_set_at_run_time_names_the_field(tmp_path, monkeypatch):
    monkeypatch.delenv("QG_TEST_NO_SUCH_KEY", raising=False)
    spec = load_spec(spec_file(tmp_path))  # loading does not read the key
    with pytest.raises(ConfigError) as err:
        endpoint_keys(spec)
    assert "release spec field 'baseline.api_key_env'" in err.value.render()
    assert "QG_TEST_NO_SUCH_KEY is not set" in err.value.message


def test_an_endpoint_variant_is_planned_as_an_endpoint_and_cached_in_its_run(tmp_path):
    spec = load_spec(spec_file(tmp_path))
    base = baseline_for(spec, tmp_path / "ckpt")
    assert base.origin == "endpoint" and base.size_bytes is None and base.endpoint.model == "demo"
    config = server_config(spec, base, tmp_path / "run" / "baseline")
    assert isinstance(config, EndpointConfig) and config.where == "baseline" and config.name == "demo"
    assert not (tmp_path / "run" / "baseline" / "plan.json").exists()  # nothing planned: it runs elsewhere
    one, two = (variant_cache(base, config, fp, tmp_path / "run") for fp in ("a", "b"))
    assert one.parent == tmp_path / "run" / "endpoints" and one != two  # another /v1/models report: another folder


def test_endpoint_server_checks_the_model_and_notices_a_redeployment(tmp_path, monkeypatch):
    monkeypatch.setenv("QG_TEST_KEY", "secret")
    with FakeServer(model="prod") as fake:
        cfg = EndpointConfig(url=fake.url + "/v1", name="prod", api_key_env="QG_TEST_KEY", where="candidates.0")
        with EndpointServer(cfg, tmp_path / "endpoint.log") as srv:
            assert srv.api_key == "secret" and srv.command == [] and srv.alive()
            srv.raise_if_dead()
        log = (tmp_path / "endpoint.log").read_text().splitlines()
        assert log[0].split(" ", 1)[1].startswith("entry: not started by quantgate") and "exit: not stopped" in log[1]
        with pytest.raises(QuantgateError) as err:
            with EndpointServer(cfg.model_copy(update={"name": "other"}), tmp_path / "x.log"):
                pass
        assert "model 'other' is not served; served: prod" in err.value.message
        with pytest.raises(QuantgateError) as err:
            with EndpointServer(cfg, tmp_path / "y.log"):
                fake.max_model_len = 8192  # redeployed while it was measured
        assert "changed while it was measured" in err.value.message and "candidates.0" in err.value.render()
    assert fingerprint({"id": "m", "created": 1}) == fingerprint({"id": "m", "created": 2})  # vLLM stamps `created`


# --- the gate: evidence that cannot exist ------------------------------------------------------------------------

def endpoint_run(tmp_path: Path) -> Path:
    """A complete run (the default policy promotes it) whose baseline is an endpoint: no parity, no sizes."""
    run = make_run(tmp_path)
    path = run / "baseline" / "evidence.json"
    base = json.loads(path.read_text())
    base.update(parity=None, not_applicable={"parity": "not applicable: endpoint: no local weights",
                                             "size": "not applicable: endpoint: no checkpoint files"})
    base["variant"]["size_bytes"] = None
    path.write_text(json.dumps(base))
    return run


def policy_with(tmp_path: Path, rules: dict) -> Path:
    doc = yaml.safe_load((RELEASES / "policies" / "default.yaml").read_text())
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump({**doc, "not_applicable": rules}))
    return path


@pytest.mark.parametrize("rules, decision, outcome", [
    ({}, "INCONCLUSIVE", "inconclusive"),                                   # default: missing evidence, fail-closed
    ({"engine_parity": "skip", "size_ratio": "skip"}, "PROMOTE", "skipped"),
    ({"engine_parity": "fail", "size_ratio": "skip"}, "REJECT", "fail"),
])
def test_the_policy_decides_what_not_applicable_evidence_means(tmp_path, rules, decision, outcome):
    run = endpoint_run(tmp_path)
    (d,), path = gate_run(run, policy_with(tmp_path, rules), ["w4a16-gptq"])
    checks = {c.name: c for c in d.checks}
    parity, size = checks["engine_parity"], checks["pay_off:size_ratio"]
    assert d.decision == decision and parity.outcome == outcome, d.reasons
    assert parity.measured == size.measured == "not applicable"
    assert parity.reason.startswith("not applicable: endpoint: no local weights") and "not_applicable.engine_parity" in parity.reason
    assert size.reason.startswith("not applicable: endpoint: no checkpoint files")
    doc = json.loads(path.read_text())["candidates"]["w4a16-gptq"]["checks"]
    assert [c["reason"] for c in doc if c["name"] == "engine_parity"] == [parity.reason]  # decision.json names them


def test_present_evidence_is_never_overridden_and_the_endpoint_policy_loads():
    policy = load_policy(RELEASES / "policies" / "endpoint.yaml")
    assert (policy.not_applicable.engine_parity, policy.not_applicable.size_ratio) == ("skip", "skip")
    assert load_policy(RELEASES / "policies" / "default.yaml").not_applicable.engine_parity == "missing"
    ev = GateEvidence(candidate="c", scheme="int8-w8a8", gaps={"parity": Gap(reason="not applicable: x",
                                                                                not_applicable=True)})
    checks = {c.name: c for c in evaluate(policy, ev).checks}
    assert checks["engine_parity"].outcome == "skipped"
    ev = ev.model_copy(update={"gaps": {"parity": Gap(reason="no verdict")}})  # merely missing: the usual rule
    assert {c.name: c for c in evaluate(policy, ev).checks}["engine_parity"].outcome == "inconclusive"


def test_a_policy_with_an_unknown_not_applicable_check_is_refused(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_policy(policy_with(tmp_path, {"engine_parity": "skip", "recall": "skip"}))
    assert "not_applicable.recall" in err.value.render()


def test_the_demo_spec_is_unchanged_by_candidates():
    spec = load_spec(RELEASES / "demo.yaml")
    assert spec.candidates == [] and spec.baseline is None and schedule.variant_count(spec) == 2
    assert EVAL_SETS.is_dir()


def test_an_endpoint_baseline_is_measured_through_the_release_steps(tmp_path, monkeypatch):
    """serve_and_evaluate on an endpoint (the fake loopback server): evals at its URL under its served name, no
    parity, no slot, its checks in endpoint.log and its results in the run folder; nothing is started."""
    monkeypatch.setenv("QG_TEST_KEY", "secret")
    monkeypatch.setenv("QUANTGATE_RESULTS", str(tmp_path / "results"))
    with FakeServer(model="prod") as fake:
        text = (SPEC.replace("http://127.0.0.1:9/v1", fake.url + "/v1").replace("model: demo, api_key_env: "
                "QG_TEST_NO_SUCH_KEY", "model: prod, api_key_env: QG_TEST_KEY")
                + f"eval_sets: [{EVAL_SETS / 'default.jsonl'}]\neval: {{limit: 4}}\nrecall: null\nperf: null\n"
                "fidelity: null\n")
        spec = load_spec(spec_file(tmp_path, text))
        run = tmp_path / "run"
        ev = steps.serve_and_evaluate(steps.MeasureRequest(spec, baseline_for(spec, tmp_path / "ckpt"), run, parity=True),
                                      log=lambda _: None)
        assert {r["model"] for r in fake.requests} == {"prod"} and len(fake.requests) == 4
    assert ev.parity is None and ev.served and ev.serve_command == [] and set(ev.not_applicable) == {"parity", "size"}
    assert ev.cache.parent == run / "endpoints" and not (tmp_path / "results" / "cache" / "variants").exists()
    assert len((run / "baseline" / "endpoint.log").read_text().splitlines()) == 2
    assert json.loads((run / "baseline" / "evidence.json").read_text())["variant"]["origin"] == "endpoint"


def test_a_ladder_tries_the_schemes_then_the_candidates(tmp_path):
    class D:
        def __init__(self, candidate, decision):
            self.candidate, self.decision, self.reasons = candidate, decision, []

    spec = load_spec(spec_file(tmp_path, SPEC.replace("schemes: []", "schemes: [int8-w8a8]\nladder: true")))
    assert steps.next_schemes(spec, []) == ["int8-w8a8"]
    assert steps.next_schemes(spec, [D("int8-w8a8", "REJECT")]) == ["ext-int8"]
    assert steps.next_schemes(spec, [D("int8-w8a8", "PROMOTE")]) == []
    assert schedule.variant_count(spec) == 1  # an endpoint baseline and one rung at a time
