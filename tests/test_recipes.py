"""Recipes: the shipped ones follow llmcompressor's grammar, bad ones are refused with file:line, overrides apply."""

from __future__ import annotations

import copy

import pytest

from quantgate.base.errors import ConfigError
from quantgate.base.paths import RECIPES
from quantgate.quantize.recipes import (RecipeOverrides, apply_overrides, check_recipe, dump_recipe, load_recipe,
                                        quant_settings)
from quantgate.quantize.schemes import load_schemes


@pytest.mark.parametrize("scheme", [s.id for s in load_schemes().schemes])
def test_every_scheme_recipe_loads_and_keeps_lm_head(scheme):
    info = load_schemes().get(scheme)
    settings = quant_settings(load_recipe(RECIPES / info.recipe))
    assert "lm_head" in settings["ignore"]
    assert (settings["group_sizes"][0] if settings["group_sizes"] else None) == info.group_size


@pytest.mark.parametrize(
    "text, message",
    [
        ("quant_modifiers:\n  GPTQModifier: {scheme: W4A16}\n", "not a `<name>_stage:`"),
        ("quant_stage:\n  quant_modifiers:\n    GPTQModifer: {scheme: W4A16}\n", "unknown modifier 'GPTQModifer'"),
        ("quant_stage:\n  quant_modifiers:\n    AWQModifier: {}\n", "quantizes nothing"),
        ("quant_stage:\n  quant_modifiers:\n    GPTQModifier: {scheme: W4A16}\n    SmoothQuantModifier: {}\n", "must be followed"),
        ("quant_stage:\n  quant_modifiers:\n    GPTQModifier: {ignore: [lm_head]}\n", "neither `scheme` nor `config_groups`"),
        ("quant_stage:\n  quant_modifiers:\n    QuantizationModifier: [1, 2]\n", "must be a mapping"),
        ("quant_stage: [\n", "invalid YAML"),
    ],
)
def test_invalid_recipes_are_refused_with_the_reason(tmp_path, text, message):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_recipe(path)
    assert message in err.value.render() and str(path) in err.value.render()


def test_unknown_modifier_error_names_line_and_alternatives(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("quant_stage:\n  quant_modifiers:\n    GPTQModifier: {scheme: W4A16}\n    Pruner: {}\n")
    with pytest.raises(ConfigError) as err:
        load_recipe(path)
    assert f"{path}:4" in err.value.render() and "QuantizationModifier" in err.value.render()


def test_overrides_change_group_ignore_and_smoothing_without_touching_the_original():
    gptq = load_recipe(RECIPES / "w4a16-gptq.yaml")
    before = copy.deepcopy(gptq)
    out = apply_overrides(gptq, RecipeOverrides(group_size=32, ignore=["re:.*down_proj$"]))
    assert gptq == before
    group = out["quant_stage"]["quant_modifiers"]["GPTQModifier"]["config_groups"]["group_0"]["weights"]
    assert group["group_size"] == 32
    assert out["quant_stage"]["quant_modifiers"]["GPTQModifier"]["ignore"] == ["lm_head", "re:.*down_proj$"]
    int8 = apply_overrides(load_recipe(RECIPES / "int8-w8a8.yaml"), RecipeOverrides(smoothing_strength=0.5))
    assert int8["quant_stage"]["quant_modifiers"]["SmoothQuantModifier"]["smoothing_strength"] == 0.5
    assert "smoothing_strength: 0.5" in dump_recipe(int8)


def test_preflight_group_size_wins_over_the_override():
    out = apply_overrides(load_recipe(RECIPES / "w4a16-awq.yaml"), RecipeOverrides(group_size=128), group_size=64)
    assert quant_settings(out)["group_sizes"] == [64]


@pytest.mark.parametrize(
    "recipe, overrides, message",
    [
        ("nvfp4.yaml", RecipeOverrides(group_size=32), "fixes its group size"),
        ("w4a16-gptq.yaml", RecipeOverrides(smoothing_strength=0.5), "no SmoothQuantModifier"),
    ],
)
def test_overrides_that_cannot_apply_are_refused(recipe, overrides, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(load_recipe(RECIPES / recipe), overrides)


def test_override_values_are_validated():
    with pytest.raises(ValueError):
        RecipeOverrides(smoothing_strength=1.5)
    with pytest.raises(ValueError):
        RecipeOverrides(group_sizee=64)


def test_check_recipe_accepts_the_grammar_llmcompressor_documents():
    check_recipe({"sparsity_stage": {"prune_modifiers": {"SmoothQuantModifier": {}},
                                     "quant_modifiers": {"QuantizationModifier": {"scheme": "W8A8"}}}})
