"""Pre-flight check of a recipe against a checkpoint, before any calibration time is spent.

Reads only `config.json` and the safetensors headers (no weights, no torch). Checks that every targeted Linear's
input size is divisible by the weight group size; where the recipe's group size fails, picks the largest of
128/64/32 that divides every targeted layer and says so; keeps lm_head and MoE router gates out of quantization;
and refuses with the list of offending layers when no group size works.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypedDict

from pydantic import BaseModel

from quantgate.base.errors import ConfigError, QuantgateError
from quantgate.quantize.recipes import quant_settings
from quantgate.quantize.schemes import ModelSize
from quantgate.target.families import Kept, family_of, kept_modules

GROUP_CANDIDATES = (128, 64, 32)
ROUTER_RE = re.compile(r"(^|\.)(gate|router|shared_expert_gate)$")
EMBED_RE = re.compile(r"(embed_tokens|embed_positions|wte|wpe|word_embeddings|position_embeddings)$")
ALWAYS_IGNORE = "lm_head"


class LinearLayer(BaseModel):
    name: str  # module name, e.g. model.layers.0.self_attn.q_proj
    in_features: int
    out_features: int


class ModelLayout(BaseModel):
    """What the pre-flight needs to know about a checkpoint, from its config and safetensors headers."""
    path: str
    model_type: str
    architectures: list[str]
    linears: list[LinearLayer]
    other_params: int
    routers: list[str]
    has_chat_template: bool

    def default_targets(self) -> list[LinearLayer]:
        """The Linear layers a default recipe quantizes: all but lm_head and router gates."""
        return [lin for lin in self.linears if lin.name != ALWAYS_IGNORE and lin.name not in self.routers]

    def size(self, targeted: list[LinearLayer], group_sizes: tuple[int, ...] = GROUP_CANDIDATES) -> ModelSize:
        quant = sum(lin.in_features * lin.out_features for lin in targeted)
        total = sum(lin.in_features * lin.out_features for lin in self.linears) + self.other_params
        ok = {g: all(lin.in_features % g == 0 for lin in targeted) for g in group_sizes}
        return ModelSize(quantizable_params=quant, other_params=total - quant, group_sizes_ok=ok)


class PreflightResult(BaseModel):
    group_size: int | None
    requested_group_size: int | None
    ignore_added: list[str]
    targeted: list[str]
    skipped: list[str]
    notes: list[str]
    family: str | None = None  # quant_recipes/families.yaml id, None for a family it does not list
    kept: list[Kept] = []      # every module pattern kept at 16 bits, and why (lm_head, routers, the family's own)


class TensorEntry(TypedDict):
    """A tensor in a safetensors header."""
    dtype: str
    shape: list[int]
    data_offsets: list[int]


def read_safetensors_header(path: Path, *, whole: bool = False) -> dict[str, TensorEntry]:
    """The JSON header of a .safetensors file (8-byte little-endian length, then JSON). `whole`: also check that the
    file holds every byte the header's data offsets describe: a truncated copy (an interrupted download or copy) has
    a readable header and fails only when the weights are loaded, minutes into a release."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ConfigError("not a safetensors file (too short)", where=str(path), fix="re-create the checkpoint")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 1024**2:
            raise ConfigError("safetensors header is implausibly large", where=str(path), fix="re-create the checkpoint")
        header = json.loads(f.read(n))
        size = os.fstat(f.fileno()).st_size
    header.pop("__metadata__", None)
    if not whole:
        return header
    ends = [t["data_offsets"][1] for t in header.values() if isinstance(t, dict) and len(t.get("data_offsets") or []) == 2]
    need = 8 + n + max(ends, default=0)
    if size < need:
        raise ConfigError(f"truncated: the file has {size:,} bytes, its header describes {need:,}", where=str(path),
                          fix="copy or download the checkpoint again (an interrupted transfer leaves a file like this)")
    return header


def checkpoint_dtype(model_dir: Path | str) -> str | None:
    """The dtype config.json names (`dtype`, or `torch_dtype` in older files); None when it names none."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return (cfg.get("dtype") or cfg.get("torch_dtype")) if isinstance(cfg, dict) else None


def read_layout(model_dir: Path) -> ModelLayout:
    """Scan a Hugging Face checkpoint folder without loading weights."""
    model_dir = Path(model_dir)
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise ConfigError("no config.json: not a Hugging Face checkpoint folder", where=str(model_dir), fix="pass the folder that holds config.json and *.safetensors")
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    if "quantization_config" in cfg:
        method = cfg["quantization_config"].get("quant_method", "?")
        raise ConfigError(f"checkpoint is already quantized ({method})", where=str(cfg_path), fix="quantize the original 16-bit checkpoint")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError("no *.safetensors files", where=str(model_dir), fix="save the model with safetensors (save_pretrained does by default)")
    tensors: dict[str, list[int]] = {}
    for f in files:
        tensors.update({k: v["shape"] for k, v in read_safetensors_header(f).items()})
    linears, other = [], 0
    for name, shape in sorted(tensors.items()):
        module = name.removesuffix(".weight")
        n = 1
        for d in shape:
            n *= d
        if name.endswith(".weight") and len(shape) == 2 and not EMBED_RE.search(module):
            linears.append(LinearLayer(name=module, in_features=shape[1], out_features=shape[0]))
        else:
            other += n
    text_cfg = cfg.get("text_config", cfg)
    if not any(lin.name == ALWAYS_IGNORE for lin in linears) and text_cfg.get("hidden_size") and text_cfg.get("vocab_size"):
        # tied embeddings: lm_head shares the embedding matrix and has no tensor of its own; list it as present
        linears.append(LinearLayer(name=ALWAYS_IGNORE, in_features=text_cfg["hidden_size"], out_features=text_cfg["vocab_size"]))
        other -= text_cfg["hidden_size"] * text_cfg["vocab_size"]
    n_experts = next((text_cfg[k] for k in ("num_local_experts", "num_experts", "n_routed_experts") if text_cfg.get(k)), None)
    routers = [lin.name for lin in linears if ROUTER_RE.search(lin.name) or (n_experts and lin.out_features == n_experts)]
    tok_cfg = model_dir / "tokenizer_config.json"
    chat = (model_dir / "chat_template.jinja").is_file() or (model_dir / "chat_template.json").is_file() or (
        tok_cfg.is_file() and bool(json.loads(tok_cfg.read_text(encoding="utf-8")).get("chat_template")))
    return ModelLayout(path=str(model_dir), model_type=cfg.get("model_type", "?"), architectures=cfg.get("architectures") or [],
                       linears=linears, other_params=max(other, 0), routers=routers, has_chat_template=chat)


def matches(name: str, entry: str, class_name: str = "Linear") -> bool:
    """llmcompressor's target/ignore semantics: `re:` prefix = regex matched at the start, else exact name or class."""
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return entry in (name, class_name)


def check(layout: ModelLayout, recipe: dict[str, Any], *, extra_ignore: Sequence[str] = (),
          requested_group_size: int | None = None) -> PreflightResult:
    """Decide group size and ignore list for this recipe on this model, or refuse listing the layers."""
    settings = quant_settings(recipe)
    notes: list[str] = []
    ignore_added = [] if ALWAYS_IGNORE in settings["ignore"] else [ALWAYS_IGNORE]
    kept = [Kept(pattern=ALWAYS_IGNORE, why="lm_head: every recipe keeps the output projection at 16 bits")]
    family = family_of({"architectures": layout.architectures, "model_type": layout.model_type})
    names = [lin.name for lin in layout.linears]
    own = kept_modules(family, names)
    ignore_added += [k.pattern for k in own if k.pattern not in settings["ignore"] + ignore_added]
    kept += own
    if own and family is not None:
        notes.append(f"{family.name}: kept at 16 bits (quant_recipes/families.yaml): {', '.join(k.pattern for k in own)}")
    covered = [r for r in layout.routers if any(matches(r, k.pattern) for k in own)]
    router_pattern = _router_patterns([r for r in layout.routers if r not in covered])
    ignore_added += [p for p in router_pattern if p not in settings["ignore"]]
    kept += [Kept(pattern=p, why="MoE router gate (found by its name or its output size, one per expert)") for p in router_pattern]
    if router_pattern:
        notes.append(f"MoE router gates kept at 16 bits: {', '.join(router_pattern)}")
    kept += [Kept(pattern=p, why="asked for: the `ignore` list (the spec's quantization.overrides, `quantize --ignore`, "
                  "or the layers a repair rung keeps)") for p in extra_ignore if p not in {k.pattern for k in kept}]
    ignore = settings["ignore"] + ignore_added + list(extra_ignore)
    targeted, skipped = [], []
    for layer in layout.linears:
        hit = any(matches(layer.name, t) for t in settings["targets"])
        if hit and not any(matches(layer.name, i) for i in ignore) and layer.name not in layout.routers:
            targeted.append(layer)
        elif hit:
            skipped.append(layer.name)
    if not targeted:
        raise QuantgateError("the recipe targets no Linear layer of this model after the ignore list",
                             where=layout.path, fix=f"check `targets`/`ignore`; layers are named like {layout.linears[0].name if layout.linears else '?'}")
    group = next((g for g in settings["group_sizes"] if g), None)
    requested = requested_group_size or group
    chosen = requested
    if requested:
        bad = [lin for lin in targeted if lin.in_features % requested]
        if bad and settings["fixed_group"]:
            raise QuantgateError(f"group size {requested} is fixed by the scheme and does not divide the input size of: {_listing(bad)}",
                                 where=layout.path, fix="choose another scheme, or add these layers to the ignore list")
        if bad:
            chosen = next((g for g in GROUP_CANDIDATES if all(lin.in_features % g == 0 for lin in targeted)), None)
            if chosen is None:
                sizes = sorted({lin.in_features for lin in targeted})
                raise QuantgateError(
                    f"no weight group size among {requested}/{'/'.join(map(str, GROUP_CANDIDATES))} divides every targeted "
                    f"layer's input size ({sizes}); layers failing {GROUP_CANDIDATES[-1]}: "
                    f"{_listing([lin for lin in targeted if lin.in_features % GROUP_CANDIDATES[-1]])}",
                    where=layout.path, fix="add these layers to the ignore list (spec `ignore:`) or use a per-channel scheme (fp8-dynamic, int8-w8a8)")
            notes.append(f"group size {requested} does not divide the input size of {_listing(bad)}; "
                         f"using {chosen}, the largest of {'/'.join(map(str, GROUP_CANDIDATES))} that divides every targeted layer")
    return PreflightResult(group_size=chosen, requested_group_size=requested, ignore_added=ignore_added,
                           targeted=[lin.name for lin in targeted], skipped=skipped, notes=notes,
                           family=family.id if family else None, kept=kept)


def _router_patterns(routers: list[str]) -> list[str]:
    """One `re:` pattern per distinct router module name with its layer index generalized."""
    out: list[str] = []
    for name in routers:
        pattern = "re:" + re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(name)) + "$"
        if pattern not in out:
            out.append(pattern)
    return out


def _listing(layers: list[LinearLayer], limit: int = 6) -> str:
    """Group layers by their name with the layer index removed: 'self_attn.q_proj (in 576) x30, ...'."""
    groups: dict[str, list[LinearLayer]] = {}
    for layer in layers:
        groups.setdefault(re.sub(r"\.\d+\.", ".N.", layer.name), []).append(layer)
    parts = [f"{k} (in {v[0].in_features}) x{len(v)}" if len(v) > 1 else f"{k} (in {v[0].in_features})"
             for k, v in list(groups.items())[:limit]]
    more = f", and {len(groups) - limit} more kinds" if len(groups) > limit else ""
    return ", ".join(parts) + more
