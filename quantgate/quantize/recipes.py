"""llmcompressor recipes as data: check their grammar, read their quantization parameters, apply overrides.

A recipe is llmcompressor's own YAML (`<name>_stage` -> `<name>_modifiers` -> `ModifierName: {kwargs}`); no
wrapper schema. This module checks the shape and the modifier names we support (so a typo is refused before
any model is loaded); the runner child then lets llmcompressor itself validate every argument, still before
loading the model. Everything here except `load_recipe` is pure.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, TypedDict
from collections.abc import Iterator, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.errors import ConfigError
from quantgate.base.yamlconfig import read_yaml

# Modifiers quantgate's recipes use. `quantizes` = it writes a quantization config (QuantizationMixin).
MODIFIERS: dict[str, dict[str, bool]] = {
    "QuantizationModifier": {"quantizes": True},
    "GPTQModifier": {"quantizes": True},
    "AWQModifier": {"quantizes": False},
    "SmoothQuantModifier": {"quantizes": False},
}
# Weight group size implied by llmcompressor/compressed-tensors preset scheme names (None = per channel/tensor).
PRESET_GROUP_SIZE: dict[str, int | None] = {
    "FP8_DYNAMIC": None, "FP8": None, "W8A8": None, "INT8": None, "W8A16": None,
    "W4A16": 128, "W4A16_ASYM": 128, "NVFP4": 16, "NVFP4A16": 16, "MXFP4": 32, "MXFP4A16": 32,
}
FIXED_GROUP_PRESETS = {"NVFP4", "NVFP4A16", "MXFP4", "MXFP4A16"}


class RecipeOverrides(BaseModel):
    """Recipe parameters a release spec may override (calibration settings live in CalibrationSpec)."""
    model_config = ConfigDict(extra="forbid")

    group_size: int | None = Field(None, ge=8, description="weight group size for group-wise int schemes")
    ignore: list[str] = Field(default_factory=list, description="extra module names or `re:` patterns kept at 16 bits")
    smoothing_strength: float | None = Field(None, gt=0, lt=1, description="SmoothQuant alpha (int8-w8a8)")


def load_recipe(path: Path) -> dict[str, Any]:
    """Read a recipe file and check its grammar; errors name the file and line."""
    data, lines = read_yaml(Path(path))
    check_recipe(data, where=str(path), lines=lines)
    return data


def check_recipe(data: Any, *, where: str = "recipe", lines: dict[tuple, int] | None = None) -> None:
    """Refuse anything that is not `*_stage -> *_modifiers -> KnownModifier: {kwargs}` with a quantizing step."""
    lines = lines or {}

    def at(*path: Any) -> str:
        line = next((lines[path[:i]] for i in range(len(path), 0, -1) if path[:i] in lines), None)
        return f"{where}:{line}" if line else where

    known = ", ".join(MODIFIERS)
    if not isinstance(data, dict) or not data:
        raise ConfigError("a recipe is a mapping of `<name>_stage:` entries", where=where, fix="start the file with `quant_stage:`")
    sequence: list[tuple[str, tuple]] = []
    for stage, groups in data.items():
        if not str(stage).endswith("_stage") or not isinstance(groups, dict):
            raise ConfigError(f"top-level key '{stage}' is not a `<name>_stage:` mapping", where=at(stage), fix="nest modifiers as quant_stage -> quant_modifiers -> ModifierName")
        for group, mods in groups.items():
            if not str(group).endswith("_modifiers") or not isinstance(mods, dict) or not mods:
                raise ConfigError(f"'{stage}.{group}' is not a non-empty `<name>_modifiers:` mapping", where=at(stage, group), fix="list modifiers under e.g. `quant_modifiers:`")
            for name, kwargs in mods.items():
                if name not in MODIFIERS:
                    raise ConfigError(f"unknown modifier '{name}'", where=at(stage, group, name), fix=f"use one of: {known}")
                if kwargs is not None and not isinstance(kwargs, dict):
                    raise ConfigError(f"arguments of '{name}' must be a mapping", where=at(stage, group, name), fix="write `Name: {key: value}`")
                sequence.append((name, (stage, group, name)))
    names = [n for n, _ in sequence]
    if not any(MODIFIERS[n]["quantizes"] for n in names):
        raise ConfigError("the recipe quantizes nothing", where=where, fix="add a QuantizationModifier or GPTQModifier")
    for i, (name, path) in enumerate(sequence):
        if not MODIFIERS[name]["quantizes"] and not any(MODIFIERS[n]["quantizes"] for n in names[i + 1:]):
            raise ConfigError(f"{name} must be followed by a QuantizationModifier or GPTQModifier", where=at(*path), fix=f"add a quantizing modifier after {name}")
    for _, _, name, kw in iter_modifiers(data):
        if MODIFIERS[name]["quantizes"] and not (kw.get("scheme") or kw.get("config_groups")):
            raise ConfigError(f"{name} has neither `scheme` nor `config_groups`", where=where, fix="add e.g. `scheme: W4A16` or a config_groups block")
        for gname, group in (kw.get("config_groups") or {}).items():
            if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
                raise ConfigError(f"{name}.config_groups.{gname} needs a `weights:` mapping", where=where, fix="see quant_recipes/w4a16-gptq.yaml")


def iter_modifiers(data: dict[str, Any]) -> Iterator[tuple[str, str, str, dict[str, Any]]]:
    """(stage, group, modifier name, kwargs) for every modifier, in order."""
    for stage, groups in data.items():
        for group, mods in groups.items():
            for name, kwargs in mods.items():
                yield stage, group, name, kwargs if kwargs is not None else {}


class QuantSettings(TypedDict):
    group_sizes: list[int | None]  # each quantizing group's weight group size (None: not group-wise)
    ignore: list[str]
    targets: list[str]
    fixed_group: bool  # a preset scheme whose group size cannot change


def quant_settings(data: dict[str, Any]) -> QuantSettings:
    """What the pre-flight check needs: weight group sizes, ignore list, targets, fixed-format flag."""
    groups: list[int | None] = []
    ignore: list[str] = []
    targets: list[str] = []
    fixed = False
    for _, _, name, kw in iter_modifiers(data):
        if not MODIFIERS[name]["quantizes"]:
            continue
        ignore += [i for i in kw.get("ignore", []) if i not in ignore]
        scheme = kw.get("scheme")
        if isinstance(scheme, str):
            fixed |= scheme.upper() in FIXED_GROUP_PRESETS
            groups.append(PRESET_GROUP_SIZE.get(scheme.upper()))
            t = kw.get("targets", ["Linear"])
            targets += [t] if isinstance(t, str) else list(t)
        for group in (kw.get("config_groups") or {}).values():
            groups.append(group["weights"].get("group_size") if group["weights"].get("strategy") in ("group", "tensor_group") else None)
            targets += list(group.get("targets", []))
    return {"group_sizes": groups, "ignore": ignore, "targets": targets or ["Linear"], "fixed_group": fixed}


def apply_overrides(data: dict[str, Any], overrides: RecipeOverrides, *, group_size: int | None = None,
                    extra_ignore: Sequence[str] = (), where: str = "recipe") -> dict[str, Any]:
    """A new recipe dict with the overrides applied. `group_size` (from the pre-flight) wins over the override."""
    out = copy.deepcopy(data)
    gsize = group_size or overrides.group_size
    ignore_add = list(overrides.ignore) + [i for i in extra_ignore if i not in overrides.ignore]
    smooth_seen = False
    for _, _, name, kw in iter_modifiers(out):
        if name == "SmoothQuantModifier" and overrides.smoothing_strength is not None:
            kw["smoothing_strength"] = overrides.smoothing_strength
            smooth_seen = True
        if not MODIFIERS[name]["quantizes"]:
            continue
        kw["ignore"] = list(kw.get("ignore", [])) + [i for i in ignore_add if i not in kw.get("ignore", [])]
        if gsize is None:
            continue
        scheme = kw.get("scheme")
        if isinstance(scheme, str) and PRESET_GROUP_SIZE.get(scheme.upper()) not in (None, gsize):
            if scheme.upper() in FIXED_GROUP_PRESETS:
                raise ConfigError(f"{scheme} fixes its group size at {PRESET_GROUP_SIZE[scheme.upper()]}", where=where, fix="drop the group_size override for this scheme")
            raise ConfigError(f"{name} uses preset `scheme: {scheme}`, whose group size cannot be overridden", where=where, fix="write the scheme as config_groups (see quant_recipes/w4a16-gptq.yaml)")
        for group in (kw.get("config_groups") or {}).values():
            if group["weights"].get("strategy") == "group":
                group["weights"]["group_size"] = gsize
    if overrides.smoothing_strength is not None and not smooth_seen:
        raise ConfigError("smoothing_strength given, but the recipe has no SmoothQuantModifier", where=where, fix="use it only with int8-w8a8 (or a recipe with SmoothQuant)")
    return out


def dump_recipe(data: dict[str, Any]) -> str:
    """Stable YAML text of a recipe (what is hashed and written next to the weights)."""
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None)
