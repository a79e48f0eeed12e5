"""Model shape and weight bytes: config.json parsing, safetensors headers, quantization_config widths."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from quantgate.base.errors import ConfigError
from quantgate.base.paths import models_dir
from quantgate.target.modelshape import (computed_weights, load_model_spec, safetensors_weights, shape_from_config,
                                         weight_format)

DATA = Path(__file__).parent / "data"
DEMO_CFG = json.loads((DATA / "model_configs" / "smollm2-135m.json").read_text())


def test_tiny_checkpoint_bytes_from_headers(tmp_path):
    tensors = {
        "model.embed_tokens.weight": np.zeros((64, 16), np.float16),
        "model.layers.0.mlp.experts.0.up_proj.weight": np.zeros((32, 16), np.float32),
        "model.layers.0.mlp.experts.1.up_proj.weight": np.zeros((32, 16), np.int8),
        "model.layers.0.mlp.shared_experts.up_proj.weight": np.zeros((32, 16), np.float16),
    }
    half = dict(list(tensors.items())[:2])
    save_file(half, str(tmp_path / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file({k: v for k, v in tensors.items() if k not in half}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(DEMO_CFG))
    spec = load_model_spec(tmp_path)
    assert spec.weights.source == "safetensors" and spec.weights.files == 2
    assert spec.weights.total_bytes == sum(t.nbytes for t in tensors.values())
    # routed experts only: shared experts stay with every rank under expert parallel
    assert spec.weights.expert_bytes == 32 * 16 * 4 + 32 * 16
    assert spec.ref == str(tmp_path) and spec.shape.name == tmp_path.name


def test_corrupt_header_names_the_file(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes((20).to_bytes(8, "little") + b"{not json at all....")
    with pytest.raises(ConfigError) as exc:
        safetensors_weights([bad])
    assert exc.value.where == str(bad)


def test_demo_shape_matches_field_notes():
    s = shape_from_config(DEMO_CFG)
    assert (s.layers, s.hidden, s.heads, s.kv_heads, s.head_dim, s.tied_embeddings) == (30, 576, 9, 3, 64, True)
    assert sum(s.param_counts().values()) - s.param_counts()["experts"] == pytest.approx(134.5e6, rel=0.001)
    assert s.kv_bytes_per_token(2) == 2 * 30 * 3 * 64 * 2


@pytest.mark.skipif(not (models_dir() / "smollm2-135m-instruct" / "model.safetensors").exists(),
                    reason="demo checkpoint not materialized")
def test_real_demo_checkpoint_headers_equal_shape_arithmetic():
    spec = load_model_spec(models_dir() / "smollm2-135m-instruct")
    assert spec.weights.source == "safetensors"
    assert spec.weights.total_bytes == computed_weights(spec.shape).total_bytes


def _ct(bits, type_, strategy, group=None, symmetric=True, ignore=("lm_head",)):
    w = {"num_bits": bits, "type": type_, "strategy": strategy, "group_size": group, "symmetric": symmetric}
    return {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"targets": ["Linear"], "weights": w}},
            "ignore": list(ignore)}


@pytest.mark.parametrize("qcfg,per_param,lm_head_q", [
    (None, 2.0, False),
    (_ct(8, "float", "channel"), 1.0, False),                        # FP8 W8A8
    (_ct(8, "int", "channel"), 1.0, False),                          # INT8 W8A8
    (_ct(4, "int", "group", 64), 0.5 + 2 / 64, False),               # W4A16 GPTQ, symmetric, group 64
    (_ct(4, "int", "group", 128, symmetric=False), 0.5 + 4 / 128, False),  # AWQ asymmetric: + zero points
    (_ct(4, "float", "group", 16, ignore=()), 0.5 + 1 / 16, True),   # NVFP4: FP8 scales, lm_head quantized
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, 0.5 + 2.5 / 128, False),
    ({"quant_method": "awq", "bits": 4, "group_size": -1}, 0.5, False),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, 1 + 4 / 128**2, False),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, 1.0, False),
])
def test_bytes_per_param(qcfg, per_param, lm_head_q):
    f = weight_format(qcfg, 2.0, "config.json")
    assert f.bytes_per_param == pytest.approx(per_param)
    assert f.lm_head_quantized is lm_head_q


def test_fp8_checkpoint_computed_bytes():
    """FP8 linear layers at 1 byte, tied embeddings and norms stay BF16."""
    s = shape_from_config(DEMO_CFG | {"quantization_config": _ct(8, "float", "channel")})
    linear = 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536)
    embed, norms = 49152 * 576, 30 * 2 * 576 + 576
    assert computed_weights(s).total_bytes == linear * 1 + (embed + norms) * 2
    plain = computed_weights(shape_from_config(DEMO_CFG)).total_bytes
    assert computed_weights(s).total_bytes < 0.61 * plain


def test_unknown_quant_method_names_the_field():
    with pytest.raises(ConfigError, match="unknown quantization method 'hqq'") as exc:
        shape_from_config(DEMO_CFG | {"quantization_config": {"quant_method": "hqq"}}, where="x/config.json")
    assert "quantization_config.quant_method" in exc.value.where


def test_missing_field_and_missing_config(tmp_path):
    cfg = {k: v for k, v in DEMO_CFG.items() if k != "num_attention_heads"}
    with pytest.raises(ConfigError, match="num_attention_heads"):
        shape_from_config(cfg)
    with pytest.raises(ConfigError, match="no config.json"):
        load_model_spec(tmp_path)


def test_moe_config_fields():
    cfg = {"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 256, "vocab_size": 100, "max_position_embeddings": 512, "num_local_experts": 8,
           "num_experts_per_tok": 2}  # Mixtral spelling: experts use intermediate_size
    s = shape_from_config(cfg)
    assert (s.num_experts, s.experts_per_token, s.moe_intermediate) == (8, 2, 256)
    assert s.param_counts()["experts"] == 4 * 8 * 3 * 64 * 256
    ds = shape_from_config(cfg | {"n_routed_experts": 16, "num_local_experts": None, "moe_intermediate_size": 32,
                                  "first_k_dense_replace": 1, "n_shared_experts": 2})
    assert ds.param_counts()["experts"] == 3 * 16 * 3 * 64 * 32 and ds.shared_expert_intermediate == 64


def test_reference_moe_shape_is_671b():
    spec = load_model_spec(DATA / "model_shapes" / "moe-671b-fp8.yaml")
    counts = spec.shape.param_counts()
    assert sum(v for k, v in counts.items() if k != "experts") == pytest.approx(671e9, rel=0.005)
    assert spec.weights.total_bytes == 671e9  # FP8: 1 byte per parameter


def test_hypothetical_yaml_typo_names_line(tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("name: x\nlayers: 2\nhidden: 64\nheads: 4\nintermediate: 128\nvocab: 10\nmax_positions: 64\nlayer: 3\n")
    with pytest.raises(ConfigError) as exc:
        load_model_spec(f)
    assert "m.yaml:8 field 'layer'" in exc.value.where
