"""Scheme selection: the rankings of docs/design.md's planner rules, on synthetic model sizes (pure, no files but the catalogues)."""

from __future__ import annotations

import pytest

from quantgate.base.errors import QuantgateError
from quantgate.quantize.schemes import ModelSize, load_schemes, rank_schemes
from quantgate.target.hardware import get_profile

CAT = load_schemes()
SMALL = ModelSize(quantizable_params=7_000_000_000, other_params=500_000_000)      # ~14 GiB at BF16: fits anywhere big
DEMO = ModelSize(quantizable_params=106_168_320, other_params=28_346_880, group_sizes_ok={128: False, 64: True, 32: True})


def ranked(hw: str, workload: str, size: ModelSize = SMALL) -> list[str]:
    return [r.scheme for r in rank_schemes(get_profile(hw), workload, size, CAT).rows]


def first(hw: str, workload: str, size: ModelSize = SMALL) -> str:
    return rank_schemes(get_profile(hw), workload, size, CAT).recommended


@pytest.mark.parametrize(
    "hw, workload, expected_first",
    [
        ("h100", "throughput", "fp8-dynamic"),
        ("h100", "fit", "fp8-dynamic"),
        ("h200", "throughput", "fp8-dynamic"),
        ("l40s", "throughput", "fp8-dynamic"),
        ("l40s", "fit", "fp8-dynamic"),
        ("mi300x", "latency", "fp8-dynamic"),       # the only scheme MI300X runs
        ("a100", "throughput", "int8-w8a8"),        # no FP8: INT8 for throughput
        ("a100", "latency", "w4a16-gptq"),          # ... W4A16 for decode-bound latency
        ("x86-cpu", "throughput", "int8-w8a8"),
        ("x86-cpu", "latency", "w4a16-gptq"),
        ("arm-cpu", "latency", "int8-w8a8"),        # the only scheme Arm CPUs run
        ("v100", "throughput", "w4a16-gptq"),
        ("h100", "latency", "w4a16-gptq"),
    ],
)
def test_recommended_scheme(hw, workload, expected_first):
    assert first(hw, workload) == expected_first


@pytest.mark.parametrize("workload", ["latency", "throughput", "fit"])
def test_a100_never_recommends_fp8_and_ranks_it_below_every_supported_scheme(workload):
    rows = rank_schemes(get_profile("a100"), workload, SMALL, CAT).rows
    fp8 = next(r for r in rows if r.scheme == "fp8-dynamic")
    assert not fp8.supported and "no vLLM kernel" in fp8.reason
    assert all(r.rank < fp8.rank for r in rows if r.supported)
    assert rows[0].scheme in {"int8-w8a8", "w4a16-gptq", "w4a16-awq"}


@pytest.mark.parametrize("workload", ["latency", "throughput", "fit"])
def test_cpu_gets_int8_or_w4a16(workload):
    assert first("x86-cpu", workload) in {"int8-w8a8", "w4a16-gptq", "w4a16-awq"}


def test_b200_offers_nvfp4_and_no_int8():
    rows = {r.scheme: r for r in rank_schemes(get_profile("b200"), "throughput", SMALL, CAT).rows}
    assert rows["nvfp4"].supported and rows["nvfp4"].rank == 2
    assert not rows["int8-w8a8"].supported
    assert not {r.scheme: r for r in rank_schemes(get_profile("h100"), "throughput", SMALL, CAT).rows}["nvfp4"].supported


def test_w4a16_first_when_8_bit_does_not_fit_one_node():
    # 700 B params: 8-bit ~652 GiB > one H100 node's 8 x 79.6 x 0.75 = 477.6 GiB; 4-bit ~340 GiB fits
    big = ModelSize(quantizable_params=690_000_000_000, other_params=10_000_000_000)
    r = rank_schemes(get_profile("h100"), "throughput", big, CAT)
    assert r.recommended == "w4a16-gptq"
    fp8 = next(x for x in r.rows if x.scheme == "fp8-dynamic")
    assert fp8.supported and not fp8.fits_node and "need" in fp8.reason
    assert "fp8-dynamic" in r.explanation  # says which preferred scheme was too large


def test_fit_workload_prefers_fewer_devices():
    # ~60 GiB at 8 bits needs 2 L40S (44.4 x 0.75 = 33.3 GiB each); 4 bits fits on 1
    mid = ModelSize(quantizable_params=62_000_000_000, other_params=1_000_000_000)
    r = rank_schemes(get_profile("l40s"), "fit", mid, CAT)
    assert r.rows[0].scheme == "w4a16-gptq" and r.rows[0].devices_needed == 1
    assert rank_schemes(get_profile("l40s"), "throughput", mid, CAT).recommended == "fp8-dynamic"


def test_too_large_even_at_4_bits_is_explained():
    huge = ModelSize(quantizable_params=2_000_000_000_000, other_params=20_000_000_000)
    r = rank_schemes(get_profile("h100"), "fit", huge, CAT)
    assert r.recommended is None
    assert "even at 4 bits" in r.explanation and "nodes" in r.explanation
    assert all(not row.fits_node for row in r.rows)


def test_memory_after_quantization_tracks_bits_and_groups():
    rows = {r.scheme: r for r in rank_schemes(get_profile("h100"), "fit", DEMO, CAT).rows}
    bf16 = DEMO.bytes_16bit
    # measured here (docs/design.md, "Measured facts"): BF16 269 MB, FP8 160 MB, GPTQ group 64 112 MB
    assert 150e6 < rows["fp8-dynamic"].weight_bytes < 170e6
    assert 105e6 < rows["w4a16-gptq"].weight_bytes < 120e6
    assert rows["w4a16-gptq"].weight_bytes < rows["fp8-dynamic"].weight_bytes < bf16


def test_unknown_workload_and_scheme_name_alternatives():
    with pytest.raises(QuantgateError, match="latency, throughput, fit"):
        rank_schemes(get_profile("h100"), "batch", SMALL, CAT)
    with pytest.raises(QuantgateError) as err:
        CAT.get("int4")
    assert "w4a16-gptq" in err.value.render()


def test_every_row_has_a_reason_and_ranks_are_dense():
    for hw in ("t4", "b200", "x86-cpu"):
        rows = rank_schemes(get_profile(hw), "latency", SMALL, CAT).rows
        assert [r.rank for r in rows] == list(range(1, len(rows) + 1))
        assert all(r.reason for r in rows)


# --- the kernel probe's finding (quantgate.serving.cpu_kernels) narrows a CPU profile ------------------------------

AVX2_WHY = "this CPU's vLLM build (AVX2, _C_AVX2.abi3.so) has no cpu_gemm_wna16 kernel"


@pytest.mark.parametrize("missing, recommended", [
    ({}, "w4a16-gptq"),                                                         # AVX-512 build: W4A16 for latency
    ({"w4a16-gptq": AVX2_WHY, "w4a16-awq": AVX2_WHY}, "int8-w8a8"),           # AVX2 build: INT8 instead
])
def test_a_scheme_whose_kernel_is_missing_is_ranked_as_not_running_with_the_probe_reason(missing, recommended):
    r = rank_schemes(get_profile("x86-cpu"), "latency", DEMO, CAT, missing)
    assert r.recommended == recommended
    rows = {row.scheme: row for row in r.rows}
    for scheme in ("w4a16-gptq", "w4a16-awq"):
        assert rows[scheme].supported is (scheme not in missing)
        assert (rows[scheme].reason == AVX2_WHY) is (scheme in missing)
    assert [row.scheme for row in r.rows if row.supported] == [s for s in ("w4a16-gptq", "w4a16-awq", "int8-w8a8")
                                                              if s not in missing]
