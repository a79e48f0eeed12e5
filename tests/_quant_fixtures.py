"""Synthetic checkpoints for quantgate's pre-flight and quantize tests: real safetensors headers, no weights."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def write_checkpoint(folder: Path, tensors: dict[str, list[int]], config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    header, offset = {}, 0
    for name, shape in tensors.items():
        n = 2
        for d in shape:
            n *= d
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def llama(folder: Path, hidden: int, inter: int, layers: int = 2, vocab: int = 1000, tied: bool = True) -> Path:
    """A Llama-shaped checkpoint folder (k/v projections at a third of the hidden size, like the demo model)."""
    t = {"model.embed_tokens.weight": [vocab, hidden], "model.norm.weight": [hidden]}
    for i in range(layers):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": [hidden, hidden], p + "self_attn.k_proj.weight": [hidden // 3, hidden],
              p + "self_attn.v_proj.weight": [hidden // 3, hidden], p + "self_attn.o_proj.weight": [hidden, hidden],
              p + "mlp.gate_proj.weight": [inter, hidden], p + "mlp.up_proj.weight": [inter, hidden],
              p + "mlp.down_proj.weight": [hidden, inter], p + "input_layernorm.weight": [hidden]}
    if not tied:
        t["lm_head.weight"] = [vocab, hidden]
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden, "vocab_size": vocab,
           "tie_word_embeddings": tied}
    return write_checkpoint(folder, t, cfg)


def fake_quantizer(monkeypatch) -> list[str]:
    """Replace the llmcompressor child with one that writes a tiny compressed-tensors-shaped folder whose weights
    depend on the quantization key (different inputs, different bytes). Returns the keys it was run for."""
    from quantgate.quantize import run as qrun

    calls: list[str] = []

    def child(p, tmp: Path, work: Path, log, timeout_s) -> dict:
        calls.append(p.key)
        (work / "quantize.log").write_text("fake quantizer\n")
        (tmp / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {"scheme": p.scheme.id}}))
        (tmp / "model.safetensors").write_bytes(b"quantized weights " + p.key.encode())
        (tmp / "recipe.yaml").write_text(p.recipe_text)
        return {}

    monkeypatch.setattr(qrun, "_run_child", child)
    return calls
