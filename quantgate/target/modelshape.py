"""A model's shape and weight bytes, from its config.json (+ safetensors headers) or from a few numbers.

`load_model_spec(path)` takes a checkpoint folder, a config.json, or a YAML of a hypothetical model (see
tests/data/model_shapes/). Weight bytes come from the safetensors headers when the files are on disk (no torch),
otherwise from the shape x bytes per parameter, where `quantization_config` sets the bytes per parameter.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.errors import ConfigError
from quantgate.base.yamlconfig import load_model

DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
               "fp8": 1, "float8": 1, "int8": 1, "int4": 0.5}
MAX_HEADER = 100 * 1024**2  # a safetensors JSON header larger than this is not a header


class WeightFormat(BaseModel):
    """How the linear weights are stored: bytes per parameter includes scale/zero-point overhead."""
    model_config = ConfigDict(extra="forbid")

    method: str = "none"
    bits: float = 16
    group_size: int | None = None
    bytes_per_param: float = 2.0
    lm_head_quantized: bool = False

    @property
    def quantized(self) -> bool:
        return self.method != "none"


class ModelShape(BaseModel):
    """Architecture numbers the planner needs. MoE and MLA fields are 0 for dense / standard attention."""
    model_config = ConfigDict(extra="forbid")

    name: str = "model"
    layers: int = Field(ge=1)
    hidden: int = Field(ge=1)
    heads: int = Field(ge=1)
    kv_heads: int = Field(0, ge=0, description="0 means equal to heads")
    head_dim: int = Field(0, ge=0, description="0 means hidden / heads")
    intermediate: int = Field(ge=1)
    vocab: int = Field(ge=1)
    tied_embeddings: bool = False
    max_positions: int = Field(ge=1)
    dtype: str = "bfloat16"
    num_experts: int = Field(0, ge=0)
    experts_per_token: int = Field(0, ge=0)
    moe_intermediate: int = Field(0, ge=0, description="0 means intermediate")
    dense_layers: int = Field(0, ge=0, description="leading layers with a dense MLP instead of experts")
    shared_expert_intermediate: int = Field(0, ge=0, description="total width of always-on shared experts")
    kv_lora_rank: int = Field(0, ge=0, description="MLA latent width (DeepSeek); 0 = standard attention")
    qk_rope_head_dim: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    weights: WeightFormat = Field(default_factory=WeightFormat)

    def model_post_init(self, _: Any) -> None:
        if not self.kv_heads:
            self.kv_heads = self.heads
        if not self.head_dim:
            self.head_dim = self.hidden // self.heads
        if self.num_experts and not self.moe_intermediate:
            self.moe_intermediate = self.intermediate

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def uses_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def dtype_bytes(self) -> float:
        return DTYPE_BYTES.get(self.dtype, 2)

    def kv_bytes_per_token(self, kv_dtype_bytes: float) -> float:
        """2 x layers x kv_heads x head_dim x bytes; MLA caches one latent (rank + rope dims) per layer."""
        if self.uses_mla:
            return self.layers * (self.kv_lora_rank + self.qk_rope_head_dim) * kv_dtype_bytes
        return 2 * self.layers * self.kv_heads * self.head_dim * kv_dtype_bytes

    def param_counts(self) -> dict[str, int]:
        """Parameters by part (gated MLPs, no biases): embed, lm_head, linear (quantizable), experts, other."""
        h, L = self.hidden, self.layers
        if self.uses_mla:
            nope, rope = self.qk_nope_head_dim, self.qk_rope_head_dim
            v = self.v_head_dim or self.head_dim
            qk = nope + rope
            q = h * self.q_lora_rank + self.q_lora_rank * self.heads * qk if self.q_lora_rank else h * self.heads * qk
            attn = q + h * (self.kv_lora_rank + rope) + self.kv_lora_rank * self.heads * (nope + v) + self.heads * v * h
        else:
            attn = 2 * h * self.heads * self.head_dim + 2 * h * self.kv_heads * self.head_dim
        moe_layers = max(L - self.dense_layers, 0) if self.is_moe else 0
        dense_mlp = (L - moe_layers) * 3 * h * self.intermediate
        experts = moe_layers * self.num_experts * 3 * h * self.moe_intermediate
        shared = moe_layers * 3 * h * self.shared_expert_intermediate
        router = moe_layers * h * self.num_experts
        embed = self.vocab * h
        return {
            "embed": embed,
            "lm_head": 0 if self.tied_embeddings else embed,
            "linear": L * attn + dense_mlp + shared + experts,
            "experts": experts,
            "other": router + L * 2 * h + h,
        }


class ModelWeights(BaseModel):
    model_config = ConfigDict(extra="forbid")

    total_bytes: int = Field(ge=0)
    expert_bytes: int = Field(0, ge=0, description="routed-expert weights (split by expert parallel)")
    source: Literal["safetensors", "computed"]
    files: int = 0


class ModelSpec(BaseModel):
    """What the planner gets: the shape, the weight bytes, and where the model is (for the vLLM command)."""
    model_config = ConfigDict(extra="forbid")

    ref: str = Field(description="the path or name `vllm serve` gets")
    shape: ModelShape
    weights: ModelWeights


class HypotheticalModel(ModelShape):
    """A model given by a few numbers (YAML): the shape, plus params and the weight dtype."""
    params: float | None = Field(None, gt=0, description="total parameters; computed from the shape if absent")
    expert_params: float | None = Field(None, ge=0, description="routed-expert parameters; from the shape if absent")
    weight_dtype: Literal["fp32", "bf16", "fp16", "fp8", "int8", "int4"] = "bf16"


# ---------------------------------------------------------------- pure: config.json -> shape


def _get(cfg: dict, *keys: str, default: Any = None) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def weight_format(qcfg: dict | None, dtype_bytes: float, where: str) -> WeightFormat:
    """Bytes per linear-weight parameter from a `quantization_config` (None: unquantized)."""
    if not qcfg:
        return WeightFormat(bytes_per_param=dtype_bytes, bits=dtype_bytes * 8)
    method = str(qcfg.get("quant_method", "")).lower()
    field = f"{where} field 'quantization_config.quant_method'"
    if method == "compressed-tensors":
        groups = qcfg.get("config_groups") or {}
        wq = next((g.get("weights") for g in groups.values() if isinstance(g, dict) and g.get("weights")), None)
        if not wq:
            raise ConfigError("compressed-tensors config has no config_groups.*.weights", where=where,
                              fix="check the checkpoint's quantization_config (written by llmcompressor)")
        bits = float(wq.get("num_bits", 8))
        group = wq.get("group_size") if wq.get("strategy") == "group" else None
        scale = 1 if (wq.get("type") == "float" and bits == 4) else 2  # NVFP4 keeps FP8 scales
        zero = 0 if wq.get("symmetric", True) else 2
        per = bits / 8 + ((scale + zero) / group if group else 0)
        ignore = [str(i) for i in qcfg.get("ignore") or []]
        return WeightFormat(method=method, bits=bits, group_size=group, bytes_per_param=per,
                            lm_head_quantized=not any("lm_head" in i for i in ignore))
    if method in ("gptq", "awq"):
        bits = float(qcfg.get("bits", qcfg.get("w_bit", 4)))
        group = int(qcfg.get("group_size", qcfg.get("q_group_size", 128)))
        per = bits / 8 + ((2 + bits / 8) / group if group > 0 else 0)
        return WeightFormat(method=method, bits=bits, group_size=group if group > 0 else None, bytes_per_param=per)
    if method in ("fp8", "fbgemm_fp8"):
        block = qcfg.get("weight_block_size")
        per = 1 + (4 / (block[0] * block[1]) if block else 0)
        return WeightFormat(method=method, bits=8, bytes_per_param=per)
    if method == "bitsandbytes":
        four = bool(qcfg.get("load_in_4bit"))
        return WeightFormat(method=method, bits=4 if four else 8, group_size=64 if four else None,
                            bytes_per_param=0.5 + 4 / 64 if four else 1.0)
    if method == "mxfp4":
        return WeightFormat(method=method, bits=4, group_size=32, bytes_per_param=0.5 + 1 / 32)
    raise ConfigError(f"unknown quantization method '{method}'", where=field,
                      fix="supported: compressed-tensors, gptq, awq, fp8, bitsandbytes, mxfp4; or plan from a "
                          "checkpoint folder with safetensors files (bytes are then read from disk)")


def shape_from_config(cfg: dict, where: str = "config.json") -> ModelShape:
    """Parse a Hugging Face config.json dict (multimodal configs: the `text_config` part)."""
    qcfg = cfg.get("quantization_config")
    text = cast(dict, cfg.get("text_config")) if isinstance(cfg.get("text_config"), dict) else cfg
    required = {"layers": ("num_hidden_layers", "n_layer", "num_layers"), "hidden": ("hidden_size", "n_embd", "d_model"),
                "heads": ("num_attention_heads", "n_head"), "vocab": ("vocab_size",),
                "max_positions": ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")}
    values = {}
    for name, keys in required.items():
        values[name] = _get(text, *keys)
        if values[name] is None:
            raise ConfigError(f"missing field '{keys[0]}'", where=where,
                              fix=f"add {keys[0]} to config.json (or describe the model as a hypothetical YAML)")
    dtype = str(_get(text, "dtype", "torch_dtype", default=_get(cfg, "dtype", "torch_dtype", default="bfloat16")))
    dtype_bytes = DTYPE_BYTES.get(dtype.replace("torch.", ""), 2)
    kv = _get(text, "num_key_value_heads", "num_kv_heads", default=1 if text.get("multi_query") else 0)
    dense = _get(text, "first_k_dense_replace", default=len(text.get("mlp_only_layers") or []))
    n_shared = _get(text, "n_shared_experts", default=0)
    moe_inter = _get(text, "moe_intermediate_size", default=0)
    shared = _get(text, "shared_expert_intermediate_size", default=n_shared * (moe_inter or 0))
    return ModelShape(
        name=str(_get(cfg, "_name_or_path", "model_type", default="model")),
        layers=values["layers"], hidden=values["hidden"], heads=values["heads"], kv_heads=kv,
        head_dim=_get(text, "head_dim", default=0) if not text.get("kv_lora_rank") else _get(text, "v_head_dim", default=0),
        intermediate=_get(text, "intermediate_size", "n_inner", "ffn_dim", default=4 * values["hidden"]),
        vocab=values["vocab"], tied_embeddings=bool(_get(text, "tie_word_embeddings", default=cfg.get("tie_word_embeddings", False))),
        max_positions=values["max_positions"], dtype=dtype.replace("torch.", ""),
        num_experts=_get(text, "num_local_experts", "num_experts", "n_routed_experts", default=0),
        experts_per_token=_get(text, "num_experts_per_tok", "moe_topk", default=0),
        moe_intermediate=moe_inter, dense_layers=dense, shared_expert_intermediate=shared,
        kv_lora_rank=_get(text, "kv_lora_rank", default=0), qk_rope_head_dim=_get(text, "qk_rope_head_dim", default=0),
        q_lora_rank=_get(text, "q_lora_rank", default=0), qk_nope_head_dim=_get(text, "qk_nope_head_dim", default=0),
        v_head_dim=_get(text, "v_head_dim", default=0),
        weights=weight_format(qcfg, dtype_bytes, where),
    )


def computed_weights(shape: ModelShape) -> ModelWeights:
    """Weight bytes from the shape: linear layers at the quantized width, embeddings/norms at the model dtype."""
    c, fmt, d = shape.param_counts(), shape.weights, shape.dtype_bytes
    lm = c["lm_head"] * (fmt.bytes_per_param if fmt.lm_head_quantized else d)
    total = c["linear"] * fmt.bytes_per_param + lm + (c["embed"] + c["other"]) * d
    return ModelWeights(total_bytes=int(total), expert_bytes=int(c["experts"] * fmt.bytes_per_param), source="computed")


def hypothetical_spec(model: HypotheticalModel, ref: str) -> ModelSpec:
    """params x bytes per param (the reference's arithmetic); experts from the shape unless given."""
    per = DTYPE_BYTES[model.weight_dtype]
    shape = ModelShape.model_validate(model.model_dump(exclude={"params", "expert_params", "weight_dtype", "weights"}))
    shape.weights = WeightFormat(method="none" if per >= 2 else model.weight_dtype, bits=per * 8, bytes_per_param=per)
    counts = shape.param_counts()
    params = model.params if model.params is not None else sum(v for k, v in counts.items() if k != "experts")
    experts = model.expert_params if model.expert_params is not None else counts["experts"]
    return ModelSpec(ref=ref, shape=shape,
                     weights=ModelWeights(total_bytes=int(params * per), expert_bytes=int(experts * per), source="computed"))


# ---------------------------------------------------------------- adapters: files on disk


def safetensors_weights(files: list[Path]) -> ModelWeights:
    """Sum tensor bytes from each file's header (8-byte little-endian length + JSON); no tensor data is read."""
    total = experts = 0
    for f in files:
        with open(f, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ConfigError("not a safetensors file (shorter than its 8-byte header length)", where=str(f),
                                  fix="re-download or re-save the checkpoint")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER:
                raise ConfigError(f"not a safetensors file (header length {n})", where=str(f), fix="re-save the checkpoint")
            try:
                header = json.loads(fh.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ConfigError(f"unreadable safetensors header: {exc}", where=str(f), fix="re-save the checkpoint") from None
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            total += end - start
            if ".experts." in name:
                experts += end - start
    return ModelWeights(total_bytes=total, expert_bytes=experts, source="safetensors", files=len(files))


def load_model_spec(path: Path | str) -> ModelSpec:
    """A checkpoint folder, a config.json (weights computed unless safetensors sit beside it), or a YAML."""
    path = Path(path)
    if path.suffix in (".yaml", ".yml"):
        model = load_model(path, HypotheticalModel)
        return hypothetical_spec(model, ref=model.name)
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        raise ConfigError("no config.json here", where=str(config),
                          fix="pass a checkpoint folder, its config.json, or a hypothetical model YAML")
    try:
        cfg = json.loads(config.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"invalid JSON: {exc.msg}", where=f"{config}:{exc.lineno}", fix="correct the JSON") from None
    shape = shape_from_config(cfg, where=str(config))
    files = sorted(config.parent.glob("*.safetensors"))
    if "_name_or_path" not in cfg:
        shape.name = config.parent.name if files or path.is_dir() else config.stem
    weights = safetensors_weights(files) if files else computed_weights(shape)
    return ModelSpec(ref=str(config.parent if files or path.is_dir() else config), shape=shape, weights=weights)


def gib(n: float) -> float:
    return n / 1024**3
