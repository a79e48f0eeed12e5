"""Pre-flight: group size vs input sizes, lm_head / router gates ignored, clear refusals. Synthetic checkpoints are
written as real safetensors headers (no weight data is needed: the check reads headers only)."""

from __future__ import annotations

import json

import pytest

from quantgate.base.errors import ConfigError, QuantgateError
from quantgate.base.paths import RECIPES
from quantgate.quantize.preflight import check, read_layout, read_safetensors_header
from quantgate.quantize.recipes import load_recipe

from _quant_fixtures import llama, write_checkpoint

GPTQ = load_recipe(RECIPES / "w4a16-gptq.yaml")
NVFP4 = load_recipe(RECIPES / "nvfp4.yaml")
FP8 = load_recipe(RECIPES / "fp8-dynamic.yaml")


def test_demo_shapes_fall_back_from_128_to_64_and_say_so(tmp_path):
    res = check(read_layout(llama(tmp_path / "m", hidden=576, inter=1536)), GPTQ)
    assert res.requested_group_size == 128 and res.group_size == 64
    assert any("128 does not divide" in n and "using 64" in n and "(in 576)" in n for n in res.notes)
    assert "lm_head" in res.skipped and "lm_head" not in res.targeted


@pytest.mark.parametrize("hidden, inter, expected", [(4096, 11008, 128), (576, 1536, 64), (96, 288, 32)])
def test_largest_dividing_group_size(tmp_path, hidden, inter, expected):
    res = check(read_layout(llama(tmp_path / "m", hidden=hidden, inter=inter)), GPTQ)
    assert res.group_size == expected
    assert bool(res.notes) == (expected != 128)


def test_nothing_valid_lists_the_layers(tmp_path):
    with pytest.raises(QuantgateError) as err:
        check(read_layout(llama(tmp_path / "m", hidden=48, inter=144)), GPTQ)
    text = err.value.render()
    assert "self_attn.q_proj (in 48)" in text and "mlp.down_proj (in 144)" in text
    assert "ignore" in text  # the fix names the way out


def test_requested_group_size_from_the_spec_is_checked_too(tmp_path):
    res = check(read_layout(llama(tmp_path / "m", hidden=4096, inter=11136)), GPTQ, requested_group_size=256)
    assert res.group_size == 128  # 11136 = 128 x 87: not divisible by 256
    assert res.requested_group_size == 256 and res.notes


def test_fixed_format_group_is_not_changed_but_refused(tmp_path):
    with pytest.raises(QuantgateError, match="fixed by the scheme"):
        check(read_layout(llama(tmp_path / "m", hidden=72, inter=144)), NVFP4)
    assert check(read_layout(llama(tmp_path / "ok", hidden=576, inter=1536)), NVFP4).group_size == 16


def test_channel_wise_schemes_need_no_group_check(tmp_path):
    res = check(read_layout(llama(tmp_path / "m", hidden=48, inter=144)), FP8)
    assert res.group_size is None and not res.notes


def test_lm_head_is_ignored_even_if_a_custom_recipe_forgets_it(tmp_path):
    recipe = {"quant_stage": {"quant_modifiers": {"QuantizationModifier": {"targets": ["Linear"], "scheme": "FP8_DYNAMIC"}}}}
    res = check(read_layout(llama(tmp_path / "m", hidden=64, inter=128, tied=False)), recipe)
    assert res.ignore_added == ["lm_head"] and "lm_head" in res.skipped


@pytest.mark.parametrize(
    "router, cfg_key",
    [("block_sparse_moe.gate", "num_local_experts"), ("mlp.gate", "num_experts")],
)
def test_moe_router_gates_are_ignored(tmp_path, router, cfg_key):
    t = {"model.embed_tokens.weight": [1000, 256]}
    for i in range(3):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": [256, 256], p + f"{router}.weight": [8, 256]}
        t |= {p + f"mlp.experts.{e}.down_proj.weight": [256, 512] for e in range(8)}
        t |= {p + f"mlp.experts.{e}.up_proj.weight": [512, 256] for e in range(8)}
    folder = write_checkpoint(tmp_path / "moe", t, {"model_type": "moe", "hidden_size": 256, "vocab_size": 1000, cfg_key: 8})
    layout = read_layout(folder)
    assert len(layout.routers) == 3
    res = check(layout, GPTQ)
    assert not any(router in name for name in res.targeted)
    assert any(name.endswith("experts.7.down_proj") for name in res.targeted)
    pattern = next(p for p in res.ignore_added if p.startswith("re:"))
    assert "\\d+" in pattern  # one pattern for all layers, not one entry per layer
    assert any("router" in n for n in res.notes)


def test_model_size_counts_tied_embeddings_once(tmp_path):
    layout = read_layout(llama(tmp_path / "m", hidden=576, inter=1536, layers=30, vocab=49152))
    size = layout.size(layout.default_targets())
    assert size.quantizable_params == 30 * (2 * 576 * 576 + 2 * 192 * 576 + 3 * 576 * 1536)
    assert size.quantizable_params + size.other_params == size.quantizable_params + 49152 * 576 + 31 * 576
    assert size.group_sizes_ok == {128: False, 64: True, 32: True}


def test_refusals_name_the_folder(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        read_layout(tmp_path)
    folder = llama(tmp_path / "q", hidden=64, inter=128)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"quantization_config": {"quant_method": "compressed-tensors"}}))
    with pytest.raises(ConfigError, match="already quantized"):
        read_layout(folder)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.safetensors").write_bytes(b"\x01")
    with pytest.raises(ConfigError, match="too short"):
        read_safetensors_header(tmp_path / "bad" / "x.safetensors")


@pytest.mark.slow
def test_demo_model_preflight(demo_model):
    layout = read_layout(demo_model)
    res = check(layout, GPTQ)
    assert res.group_size == 64 and len(res.targeted) == 30 * 7
    assert layout.has_chat_template
