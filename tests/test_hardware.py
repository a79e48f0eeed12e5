"""Hardware profiles: the catalogue loads, ids resolve case-insensitively, and the support data says what vLLM's
table says for the cases the selection depends on."""

from __future__ import annotations

import pytest
import yaml

from quantgate.base.errors import ConfigError
from quantgate.quantize.schemes import check_hardware_schemes, load_schemes
from quantgate.target.hardware import get_profile, load_catalogue

REQUIRED = ["v100", "t4", "a100", "a10", "l40s", "rtx4090", "h100", "h200", "b200", "mi300x", "x86-cpu", "arm-cpu"]


def test_catalogue_has_every_required_profile_and_a_vllm_version():
    cat = load_catalogue()
    assert set(REQUIRED) <= {p.id for p in cat.profiles}
    assert cat.vllm_version.count(".") == 2 and cat.source


def test_every_listed_scheme_exists_in_the_scheme_catalogue():
    check_hardware_schemes(load_catalogue(), load_schemes())


@pytest.mark.parametrize("given", ["H100", " h100 ", "h100"])
def test_ids_are_case_insensitive(given):
    assert get_profile(given).id == "h100"


def test_unknown_hardware_names_the_known_ones():
    with pytest.raises(ConfigError) as err:
        get_profile("h900")
    assert "h100" in err.value.render() and "x86-cpu" in err.value.render()


@pytest.mark.parametrize(
    "hw, runs, does_not_run",
    [
        ("v100", ["w4a16-gptq"], ["fp8-dynamic", "int8-w8a8", "w4a16-awq"]),       # Volta: GPTQ only
        ("t4", ["int8-w8a8", "w4a16-awq"], ["fp8-dynamic"]),                      # Turing: no FP8 compute
        ("a100", ["int8-w8a8", "w4a16-gptq", "w4a16-awq"], ["fp8-dynamic", "nvfp4"]),
        ("l40s", ["fp8-dynamic"], ["nvfp4"]),
        ("h100", ["fp8-dynamic", "int8-w8a8"], ["nvfp4"]),
        ("b200", ["fp8-dynamic", "nvfp4"], ["int8-w8a8"]),                        # INT8 not on CC >= 10.0
        ("mi300x", ["fp8-dynamic"], ["w4a16-gptq", "w4a16-awq", "int8-w8a8"]),    # AMD column of the table
        ("x86-cpu", ["int8-w8a8", "w4a16-gptq", "w4a16-awq"], ["fp8-dynamic"]),
        ("arm-cpu", ["int8-w8a8"], ["w4a16-gptq", "w4a16-awq", "fp8-dynamic"]),
    ],
)
def test_support_matrix(hw, runs, does_not_run):
    p = get_profile(hw)
    assert all(p.supports(s) for s in runs)
    assert not any(p.supports(s) for s in does_not_run)


@pytest.mark.parametrize("hw, fast", [("h100", True), ("mi300x", True), ("l40s", False), ("a10", False), ("x86-cpu", False)])
def test_fast_link(hw, fast):
    assert get_profile(hw).fast_link is fast


def test_fp8_kv_cache_only_where_fp8_compute_exists():
    for p in load_catalogue().profiles:
        assert ("fp8" in p.kv_cache_dtypes) == p.supports("fp8-dynamic"), p.id


def test_cpu_profile_is_this_machine_two_workers():
    p = get_profile("x86-cpu")
    assert (p.kind, p.devices_per_node, p.interconnect) == ("cpu", 2, "none")
    assert p.memory_bytes == 8 * 1024**3


def test_duplicate_ids_are_refused(tmp_path):
    data = load_catalogue().model_dump(mode="json")
    data["profiles"].append(data["profiles"][0])
    path = tmp_path / "hw.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="duplicate hardware id"):
        load_catalogue(path)
