"""Model families and the support matrix: which family a checkpoint is, what it keeps at 16 bits (and the manifest
says why), what the matrix says of a family x scheme x platform, and the refusal before any work. Synthetic matrices
for the logic; the shipped data (quant_recipes/families.yaml, support_matrix.yaml) and docs/support-matrix.md are
checked to agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from quantgate.quantize import preflight
from quantgate.quantize.recipes import load_recipe
from quantgate.base.paths import RECIPES, REPO
from quantgate.spec import familycheck
from quantgate.target import families as fam
from quantgate.target.hardware import KernelProbe, get_profile

from _quant_fixtures import llama, write_checkpoint

DOC = REPO / "docs" / "support-matrix.md"


def matrix(rows: dict) -> fam.SupportMatrix:
    return fam.SupportMatrix.model_validate({"version": 1, "results": rows})


OK = {"status": "ok"}
GEMMA_FAILS = {"status": "fails", "step": "serve", "cause": "ValueError: soft-capping is not supported"}


def by_id(family_id: str) -> fam.Family:
    return next(f for f in fam.load_families() if f.id == family_id)


@pytest.mark.parametrize("config, expect", [
    ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}, "qwen3_moe"),
    ({"architectures": ["MixtralForCausalLM"]}, "mixtral"),
    ({"model_type": "gemma3_text"}, "gemma3"),                      # no architectures: the model type decides
    ({"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {"model_type": "gemma3_text"}}, "gemma3"),
    ({"architectures": ["FalconForCausalLM"], "model_type": "falcon"}, None),
])
def test_a_checkpoint_s_family_comes_from_its_config(config, expect):
    got = fam.family_of(config)
    assert (got.id if got else None) == expect


def probe(build: str, amx: bool = False) -> KernelProbe:
    return KernelProbe(arch="x86_64", build=build, flags={"avx512f": build != "avx2", "amx": amx})


@pytest.mark.parametrize("profile, found, platform", [
    ("x86-cpu", probe("avx512-bf16"), "cpu-x86-avx512"), ("x86-cpu", probe("avx512-bf16", amx=True), "cpu-x86-amx"),
    ("x86-cpu", probe("avx2"), "cpu-x86-avx2"), ("x86-avx2", None, "cpu-x86-avx2"), ("x86-avx512", None, "cpu-x86-avx512"),
    ("arm-cpu", None, "cpu-arm"), ("h100", None, "gpu-nvidia"), ("mi300x", None, "gpu-amd")])
def test_a_platform_is_what_vllm_runs_on_an_x86_cpu_s_from_its_kernels(profile, found, platform):
    assert fam.platform_of(get_profile(profile), found) == platform


def test_support_ok_fails_unmeasured_and_a_baseline_that_cannot_serve_fails_every_scheme():
    m = matrix({"qwen3": {"cpu-x86-avx512": {"baseline": OK, "int8-w8a8": OK,
                                             "w4a16-gptq": {"status": "fails", "step": "fidelity", "cause": "boom"}}},
                "gemma2": {"cpu-x86-avx512": {"baseline": GEMMA_FAILS}}})
    qwen3, gemma2 = by_id("qwen3"), by_id("gemma2")
    assert fam.support(qwen3, "int8-w8a8", "cpu-x86-avx512", m).status == "ok"
    bad = fam.support(qwen3, "w4a16-gptq", "cpu-x86-avx512", m)
    assert (bad.status, bad.step, bad.cause) == ("fails", "fidelity", "boom")
    assert fam.support(qwen3, "w4a16-awq", "cpu-x86-avx512", m).status == "unmeasured"  # scheme not measured
    assert fam.support(qwen3, "int8-w8a8", "gpu-nvidia", m).status == "unmeasured"      # platform not measured
    assert fam.support(None, "int8-w8a8", "cpu-x86-avx512", m).status == "unmeasured"   # family not known
    for scheme in ("int8-w8a8", "w4a16-gptq"):
        said = fam.support(gemma2, scheme, "cpu-x86-avx512", m)
        assert said.status == "fails" and "baseline" in (said.step or "") and "soft-capping" in (said.cause or "")
        assert "fails on cpu-x86-avx512 at the serve (the unquantized baseline) step" in said.describe()


def test_a_lesser_cpu_s_ok_holds_on_a_greater_one_and_its_failure_is_only_unmeasured_there():
    """vLLM 0.32's quantized MoE experts on CPU need AMX: a failure measured on an AVX-512 CPU without it must not
    refuse an AMX machine, and an ok measured there holds on AMX."""
    m = matrix({"mixtral": {"cpu-x86-avx512": {"baseline": OK, "int8-w8a8": {
        "status": "fails", "step": "serve", "cause": "NotImplementedError: No Int8 MoE backend supports it"}}},
        "qwen3": {"cpu-x86-avx512": {"baseline": OK, "int8-w8a8": OK}}})
    mixtral, qwen3 = by_id("mixtral"), by_id("qwen3")
    assert fam.support(mixtral, "int8-w8a8", "cpu-x86-avx512", m).status == "fails"
    amx = fam.support(mixtral, "int8-w8a8", "cpu-x86-amx", m)
    assert (amx.status, amx.measured_on) == ("unmeasured", "cpu-x86-avx512")
    assert "never measured on cpu-x86-amx; it fails on cpu-x86-avx512 at the serve step (NotImplementedError" in amx.describe()
    ok = fam.support(qwen3, "int8-w8a8", "cpu-x86-amx", m)
    assert (ok.status, ok.measured_on) == ("ok", "cpu-x86-avx512")
    assert fam.support(qwen3, "int8-w8a8", "cpu-x86-avx2", m).status == "unmeasured"  # never downwards
    assert fam.lookup_order("cpu-x86-amx") == ["cpu-x86-amx", "cpu-x86-avx512", "cpu-x86-avx2"]


def test_findings_refuse_what_fails_and_warn_for_what_was_never_measured(monkeypatch):
    m = matrix({"qwen3": {"cpu-x86-avx512": {"baseline": OK, "int8-w8a8": OK, "w4a16-gptq": GEMMA_FAILS}},
                "gemma2": {"cpu-x86-avx512": {"baseline": GEMMA_FAILS}}})
    monkeypatch.setattr(familycheck, "load_matrix", lambda: m)
    monkeypatch.setattr(familycheck, "_probe", lambda python: probe("avx512-bf16"))
    qwen3 = {"architectures": ["Qwen3ForCausalLM"]}
    found = familycheck.findings(qwen3, "x86-cpu", ["int8-w8a8", "w4a16-gptq", "w4a16-awq"])
    assert [(s, r.status) for s, r in found.refusals] == [("w4a16-gptq", "fails")]
    assert len(found.warnings) == 1 and "w4a16-awq was never measured on cpu-x86-avx512" in found.warnings[0]
    gemma = familycheck.findings({"architectures": ["Gemma2ForCausalLM"]}, "x86-avx512", ["int8-w8a8"])
    assert [s for s, _ in gemma.refusals] == [None]  # the model itself: refused at the spec's `model`
    assert familycheck.findings(qwen3, "h100", ["int8-w8a8"]).warnings[0].startswith(
        "model family Qwen3 (dense) was never measured on gpu-nvidia")
    unknown = familycheck.findings({"architectures": ["FalconForCausalLM"]}, "x86-cpu", ["int8-w8a8"])
    assert not unknown.refusals and "FalconForCausalLM is not one quantgate has measured" in unknown.warnings[0]
    monkeypatch.setattr(familycheck, "_probe", lambda python: probe("avx512-bf16", amx=True))
    amx = familycheck.findings(qwen3, "x86-cpu", ["w4a16-gptq"])  # measured to fail without AMX: a warning here
    assert not amx.refusals and "never measured on cpu-x86-amx; it fails on cpu-x86-avx512" in amx.warnings[0]


def _mixtral(folder: Path) -> Path:
    t = {"model.embed_tokens.weight": [1000, 256], "lm_head.weight": [1000, 256]}
    for i in range(2):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": [256, 256], p + "block_sparse_moe.gate.weight": [4, 256]}
        t |= {p + f"block_sparse_moe.experts.{e}.w1.weight": [512, 256] for e in range(4)}
    return write_checkpoint(folder, t, {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                                        "hidden_size": 256, "vocab_size": 1000, "num_local_experts": 4})


def test_the_family_s_kept_modules_join_the_ignore_list_each_with_its_reason(tmp_path):
    recipe = load_recipe(RECIPES / "int8-w8a8.yaml")
    res = preflight.check(preflight.read_layout(_mixtral(tmp_path / "mixtral")), recipe)
    assert res.family == "mixtral"
    assert [k.pattern for k in res.kept] == ["lm_head", "re:.*block_sparse_moe.gate$"]
    assert "router" in res.kept[1].why
    # the family's pattern covers the routers the pre-flight found by shape: no second pattern for them
    assert [p for p in res.ignore_added if p != "lm_head"] == ["re:.*block_sparse_moe.gate$"]
    assert not any("gate" in name for name in res.targeted) and any("experts.0.w1" in n for n in res.targeted)
    dense = preflight.check(preflight.read_layout(llama(tmp_path / "llama", 576, 1536)), recipe)
    assert dense.family == "llama" and [k.pattern for k in dense.kept] == ["lm_head"]
    # what the spec (or a repair rung) asks to keep is listed too, with its reason, and skipped by the recipe
    asked = preflight.check(preflight.read_layout(llama(tmp_path / "llama", 576, 1536)), recipe,
                            extra_ignore=[r"re:model\.layers\.0\."])
    assert [k.pattern for k in asked.kept] == ["lm_head", r"re:model\.layers\.0\."] and "asked for" in asked.kept[1].why
    assert not any(n.startswith("model.layers.0.") for n in asked.targeted) and asked.skipped


def test_a_family_pattern_that_matches_no_module_is_left_out(tmp_path):
    gemma = by_id("gemma3")
    assert [k.pattern for k in fam.kept_modules(gemma, ["model.layers.0.mlp.up_proj"])] == []
    names = ["model.vision_tower.encoder.layers.0.fc1", "model.layers.0.mlp.up_proj"]
    assert [k.pattern for k in fam.kept_modules(gemma, names)] == ["re:.*vision_tower.*"]


def test_the_shipped_data_reads_and_the_doc_is_rendered_from_it():
    families = fam.load_families()
    ids = [f.id for f in families]
    assert len(ids) == len(set(ids)) and {"llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "mixtral",
                                          "qwen3_moe"} <= set(ids)
    m = fam.load_matrix()
    assert set(m.results) <= set(ids), "a measured family that families.yaml does not list"
    for f in families:  # every keep pattern is llmcompressor's grammar: `re:` + a valid regex, or a name
        for k in f.keep:
            if k.pattern.startswith("re:"):
                __import__("re").compile(k.pattern[3:])
    assert DOC.read_text(encoding="utf-8") == fam.render_markdown(families, m), \
        "docs/support-matrix.md is stale: run `python bench/family_matrix.py --render`"
    cpu = {f: rows[p] for f, rows in m.results.items() for p in fam.CPU_X86 if p in rows}
    assert {"llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "mixtral", "qwen3_moe"} <= set(cpu), \
        "the matrix lacks a family the issue names"
    assert {x.platform for x in m.measured} <= {*fam.CPU_X86, "cpu-arm", "gpu-nvidia", "gpu-amd"}
    for f, rows in cpu.items():
        for scheme, cell in rows.items():
            assert cell.status == "ok" or (cell.step and cell.cause), (f, scheme, "a failure needs its step and cause")


def _checkpoint(folder: Path, arch: str, model_type: str) -> Path:
    """A checkpoint folder `check` accepts (config.json and whole, if tiny, safetensors weights) of a family."""
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    save_file({"model.embed_tokens.weight": np.zeros((64, 16), np.float16),
               "model.layers.0.mlp.up_proj.weight": np.zeros((32, 16), np.float16)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": model_type, "hidden_size": 16,
                                                    "vocab_size": 64, "max_position_embeddings": 4096}))
    return folder


def test_check_refuses_a_family_the_matrix_says_fails_here_before_any_work(tmp_path):
    """A real spec naming a checkpoint of a family whose baseline a matrix (a team's own, through
    $QUANTGATE_SUPPORT_MATRIX) measured to fail on every x86 CPU: `quantgate check` exits 2 at the spec's `model`
    line, naming the step and the cause, and does no work; `allow_unsupported_family: true` lets it through."""
    cause = "ValueError: Torch SDPA backend does not support logits soft cap."
    rows = {p: {"baseline": {"status": "fails", "step": "serve", "cause": cause}} for p in fam.CPU_X86}
    own = tmp_path / "matrix.yaml"
    own.write_text(yaml.safe_dump({"version": 1, "results": {"gemma2": rows}}))
    model = _checkpoint(tmp_path / "model", "Gemma2ForCausalLM", "gemma2")
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"version: 1\nname: fam\nmodel: {model}\nhardware: x86-cpu\nworkload: latency\n"
                    f"schemes: [int8-w8a8]\neval_sets: [{REPO / 'eval_sets' / 'default.jsonl'}]\n"
                    "recall: null\nperf: null\nfidelity: null\n")
    env = {**os.environ, fam.MATRIX_ENV: str(own)}
    r = subprocess.run([sys.executable, "-m", "quantgate.cli", "check", str(spec)], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "Traceback" not in out and f"{spec}:3 field 'model'" in out and cause in out, out
    assert "fails on cpu-x86-" in out and "at the serve (the unquantized baseline) step" in out, out
    assert "allow_unsupported_family: true" in out and not (tmp_path / "results").exists()
    spec.write_text(spec.read_text() + "allow_unsupported_family: true\n")  # the documented override
    r = subprocess.run([sys.executable, "-m", "quantgate.cli", "check", str(spec)], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode in (0, 6) and "Traceback" not in r.stderr, r.stdout + r.stderr


def test_check_warns_for_a_family_never_measured(tmp_path):
    model = _checkpoint(tmp_path / "model", "FalconForCausalLM", "falcon")
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"version: 1\nname: fam\nmodel: {model}\nhardware: x86-cpu\nworkload: latency\n"
                    f"schemes: [int8-w8a8]\neval_sets: [{REPO / 'eval_sets' / 'default.jsonl'}]\n"
                    "recall: null\nperf: null\nfidelity: null\n")
    r = subprocess.run([sys.executable, "-m", "quantgate.cli", "check", str(spec)], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode in (0, 6), r.stdout + r.stderr
    assert "warning spec" in r.stderr and "FalconForCausalLM is not one quantgate has measured" in r.stderr


def test_the_manifest_lists_what_was_kept_and_why(tmp_path, monkeypatch):
    from _quant_fixtures import fake_quantizer
    from quantgate.quantize.calibration import CalibrationSpec
    from quantgate.quantize.run import QuantizeRequest, quantize

    fake_quantizer(monkeypatch)  # the llmcompressor child stands in: the manifest is the parent's
    calib = tmp_path / "calib.jsonl"
    calib.write_text('{"text": "one"}\n{"text": "two"}\n')
    out = quantize(QuantizeRequest(model=_mixtral(tmp_path / "mixtral"), scheme="int8-w8a8", out=tmp_path / "q",
                                   calibration=CalibrationSpec(path=calib, samples=2, max_seq_length=16))).out
    manifest = json.loads((out / "quantgate-quant.json").read_text())
    assert manifest["family"] == "mixtral"
    assert [k["pattern"] for k in manifest["kept"]] == ["lm_head", "re:.*block_sparse_moe.gate$"]
    assert all(k["why"] for k in manifest["kept"])
    assert "re:.*block_sparse_moe.gate$" in yaml.safe_load(manifest["recipe_applied"])["quant_stage"]["quant_modifiers"]["GPTQModifier"]["ignore"]


def test_a_known_cause_is_explained_where_a_person_reads_it():
    moe = "NotImplementedError: No Int8 MoE backend supports the deployment configuration (weight_key=...)"
    assert "AMX" in (fam.explain(moe) or "")
    assert fam.explain("ValueError: something else") is None and fam.explain(None) is None
    m = matrix({"mixtral": {"cpu-x86-avx512": {"baseline": OK, "int8-w8a8": {"status": "fails", "step": "serve",
                                                                              "cause": moe}}}})
    m.measured.append(fam.MeasuredOn(date="2026-12-06", machine="AMD EPYC", platform="cpu-x86-avx512",
                                     checkpoint="tiny", command="python bench/family_matrix.py --write"))
    page = fam.render_markdown(fam.load_families(), m)
    assert "**fails** (serve) [1]" in page and "1. **Mixtral (MoE), int8-w8a8**: fails at serve" in page
    assert page.count("vLLM 0.32 runs quantized MoE experts on an x86 CPU only through its AMX kernels") == 1
    assert "(why: A)" in page and "- **A**: vLLM 0.32 runs quantized MoE experts" in page


def test_schemes_auto_and_the_ranking_leave_out_what_the_matrix_says_fails(monkeypatch, tmp_path):
    """`schemes: auto` must not pick a scheme the resolver would then refuse: the matrix's failures for the model's
    family are ranked as not running, with the matrix's reason."""
    from quantgate.spec import autoschemes

    fails = {"status": "fails", "step": "serve", "cause": "NotImplementedError: No Int8 MoE backend supports it"}
    m = matrix({"mixtral": {"cpu-x86-avx512": {"baseline": OK, "int8-w8a8": fails, "w4a16-gptq": OK}}})
    monkeypatch.setattr(familycheck, "load_matrix", lambda: m)
    monkeypatch.setattr(familycheck, "_probe", lambda python: probe("avx512-bf16"))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 128,
                                  "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "vocab_size": 1000, "num_local_experts": 4,
                                  "num_experts_per_tok": 2, "max_position_embeddings": 4096, "dtype": "bfloat16"}))
    reasons = familycheck.matrix_reasons(config, "x86-avx512", ["int8-w8a8", "w4a16-gptq", "w4a16-awq"])
    assert list(reasons) == ["int8-w8a8"] and "No Int8 MoE backend" in reasons["int8-w8a8"]
    monkeypatch.setattr(autoschemes, "kernel_reasons", lambda hardware, schemes, python=None: {})
    picked, why = autoschemes.choose("x86-avx512", "latency", 3, config)
    assert "int8-w8a8" not in picked and picked, (picked, why)
    assert familycheck.matrix_reasons(tmp_path / "nowhere" / "config.json", "x86-avx512", ["int8-w8a8"]) == {}
