"""Release specs: the demo spec loads; every mistake names the file, the line and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantgate.errors import ConfigError
from quantgate.paths import RELEASES
from quantgate.spec import load_spec

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
    assert spec.hardware == "x86-cpu" and spec.schemes
    assert all(p.is_absolute() and p.exists() for p in spec.eval_sets)


def test_minimal_spec_gets_defaults(tmp_path):
    spec = load_spec(write(tmp_path, GOOD))
    assert spec.nodes == 1 and spec.serving.dtype is None and spec.eval.limit is None and spec.eval_sets == []


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
