"""`schemes: auto` / {auto: N} (quantgate.spec.autoschemes): the candidates are the top of `quantgate schemes`'s
ranking for the spec's hardware, workload and model size, which comes from the model's config. The expected picks
are derived from the data files (quant_recipes/schemes.yaml's preference orders, hardware.yaml's support table),
not written down: a change of the data moves the test with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantgate.base.errors import ConfigError
from quantgate.quantize.preflight import read_layout
from quantgate.quantize.schemes import WORKLOADS, load_schemes, rank_schemes, size_from_shape, top_schemes
from quantgate.spec.autoschemes import at_flow_start, auto_count
from quantgate.release.ladder import next_rung
from quantgate.spec.resolve import load_spec
from quantgate.target.hardware import get_profile
from quantgate.target.modelshape import load_model_spec

DATA = Path(__file__).parent / "data"
DEMO_CONFIG = DATA / "model_configs" / "smollm2-135m.json"
LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 80, "hidden_size": 8192,
             "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 28672,
             "vocab_size": 128256, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}


def demo_size():
    return size_from_shape(load_model_spec(DEMO_CONFIG).shape)


def first_preferred(hw: str, workload: str) -> str:
    """The rule for a model that fits anywhere: the workload's first preference that the profile runs."""
    profile = get_profile(hw)
    return next(s for s in load_schemes().selection.preference[workload] if s in profile.schemes)


def test_size_from_the_config_matches_the_checkpoint(demo_model):
    """The config-only size (what a spec can know before the weights are there) agrees with the safetensors headers."""
    from_config = size_from_shape(load_model_spec(demo_model).shape)
    layout = read_layout(demo_model)
    from_files = layout.size(layout.default_targets())
    assert from_config.quantizable_params == from_files.quantizable_params
    total = from_files.quantizable_params + from_files.other_params
    assert abs(from_config.quantizable_params + from_config.other_params - total) <= 0.01 * total
    assert from_config.group_sizes_ok == from_files.group_sizes_ok


@pytest.mark.parametrize("hw", ["h100", "a100", "l40s", "b200", "x86-cpu"])
def test_workload_changes_the_top_pick(hw):
    picks = {w: top_schemes(rank_schemes(get_profile(hw), w, demo_size(), load_schemes()), 1)[0] for w in WORKLOADS}
    assert picks == {w: [first_preferred(hw, w)] for w in WORKLOADS}
    assert picks["latency"] != picks["throughput"]  # the ranking says so on every one of these profiles


def test_model_size_changes_the_pick_when_8_bits_do_not_fit(tmp_path):
    """On 4 x A10 (22 GiB), a 70B model at 8 bits needs more devices than the node has: throughput falls back to
    the best 4-bit scheme, with the reason in the note."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    big = size_from_shape(load_model_spec(tmp_path).shape)
    small = top_schemes(rank_schemes(get_profile("a10"), "throughput", demo_size(), load_schemes()), 1)
    large, note = top_schemes(rank_schemes(get_profile("a10"), "throughput", big, load_schemes()), 1)
    assert small[0] == [first_preferred("a10", "throughput")] and large != small[0]
    assert load_schemes().get(large[0]).weight_bits == 4
    assert "int8-w8a8" in note and "need" in note and "one node has 4 x" in note


def test_top_n_is_in_rank_order_and_says_when_fewer_exist():
    ranking = rank_schemes(get_profile("mi300x"), "throughput", demo_size(), load_schemes())
    picked, note = top_schemes(ranking, 3)
    assert picked == ["fp8-dynamic"] and "asked for 3, 1 run and fit" in note


def test_spec_with_auto_loads_and_the_ladder_follows_the_ranking():
    spec = load_spec(DATA / "release_auto.yaml")
    ranking = rank_schemes(get_profile("h100"), "throughput", demo_size(), load_schemes())
    expected = [r.scheme for r in ranking.rows if r.supported and r.fits_node][:2]
    assert spec.schemes == expected and spec.auto_schemes == 2
    assert any(n.startswith("at load: schemes auto (top 2) for workload throughput on h100") for n in spec.machine_notes)
    assert next_rung(spec.schemes, {}, spec.ladder) == expected[:1]
    assert next_rung(spec.schemes, {expected[0]: "REJECT"}, spec.ladder) == expected[1:2]


@pytest.mark.parametrize("value,n", [("auto", 1), ("AUTO", 1), ({"auto": 3}, 3), (["auto"], None), (["fp8-dynamic"], None)])
def test_auto_forms(value, n):
    assert auto_count(value) == n


def spec_text(schemes: str, model: str = "demo", hardware: str = "h100", workload: str = "latency") -> str:
    return (f"version: 1\nname: auto\nmodel: {model}\nhardware: {hardware}\nworkload: {workload}\n"
            f"schemes: {schemes}\neval_sets: []\n")


@pytest.mark.parametrize("schemes", ["{auto: 0}", "{auto: 2, top: 1}", "{auto: '2'}", "{auto: true}"])
def test_bad_auto_forms_name_the_field_and_line(tmp_path, schemes):
    path = tmp_path / "spec.yaml"
    path.write_text(spec_text(schemes))
    with pytest.raises(ConfigError) as exc:
        load_spec(path)
    assert exc.value.where.endswith("spec.yaml:6 field 'schemes'") and "auto" in exc.value.message


def test_workload_changes_what_a_spec_picks(tmp_path):
    picked = {}
    for w in WORKLOADS:
        path = tmp_path / f"{w}.yaml"
        path.write_text(spec_text("auto", workload=w))
        picked[w] = load_spec(path).schemes
    assert picked == {w: [first_preferred("h100", w)] for w in WORKLOADS}


def test_unknown_size_is_provisional_and_resolved_at_flow_start(tmp_path):
    """The model is not on disk when the spec loads: ranked without its size, then again at flow start with its
    config, which changes the pick (70B at 8 bits does not fit 4 x A10) and is recorded in the run."""
    model = tmp_path / "llama-70b"
    path = tmp_path / "spec.yaml"
    path.write_text(spec_text("auto", model=str(model), hardware="a10", workload="throughput"))
    spec = load_spec(path)
    assert spec.schemes == [first_preferred("a10", "throughput")]
    assert any("provisional" in n for n in spec.machine_notes)
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_70B))
    run = tmp_path / "run"
    logged: list[str] = []
    resolved = at_flow_start(spec, model, run, log=logged.append)
    assert resolved.schemes != spec.schemes and load_schemes().get(resolved.schemes[0]).weight_bits == 4
    record = json.loads((run / "schemes_auto.json").read_text())
    assert record["schemes"] == resolved.schemes and record["at_load"] == spec.schemes
    assert logged and "resolved at flow start (changed from" in logged[0]
    assert resolved.machine_notes[-1] == logged[0]


def test_explicit_lists_are_left_alone_at_flow_start(tmp_path):
    spec = load_spec(DATA / "release_knobs.yaml")
    assert spec.auto_schemes is None and at_flow_start(spec, tmp_path, tmp_path / "run") is spec
    assert not (tmp_path / "run").exists()
