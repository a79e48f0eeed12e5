"""run.json and evidence.json through their versioned models (quantgate.base.runinfo, quantgate.release.variants):
a release's start records what this machine decided for the spec (the ResolvedRelease: `hardware: auto` probed on
this CPU's serving build, schemes dropped by skip_unsupported) beside what the spec said; a run folder of an older
quantgate (no schema_version) is read through its migration; a version this quantgate does not know is refused
naming the field."""

from __future__ import annotations

import json

import pytest

from quantgate.base.paths import REPO
from quantgate.base.runinfo import SCHEMA, load_run_record
from quantgate.base.typedfile import RunFileError
from quantgate.release import steps as rel
from quantgate.spec.resolve import load_spec
from quantgate.serving.env import serve_python, vllm_version

SPEC = f"""version: 1
name: resolved
model: demo
hardware: auto
schemes: [int8-w8a8, w4a16-gptq]
skip_unsupported: true
eval_sets: [{REPO / 'eval_sets' / 'default.jsonl'}]
"""


def test_a_run_records_what_the_machine_decided_beside_what_the_spec_said(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTGATE_RESULTS", str(tmp_path / "results"))
    (tmp_path / "spec.yaml").write_text(SPEC)
    spec = load_spec(tmp_path / "spec.yaml")
    run = rel.start_run(spec, tmp_path / "spec.yaml", "r-resolved")
    record = load_run_record(run)
    r = record.resolved
    assert record.schema_version == SCHEMA and r is not None
    assert r.hardware_written == "auto" and r.hardware == spec.hardware and r.hardware.startswith("x86-")
    assert r.schemes_written == ["int8-w8a8", "w4a16-gptq"] and r.schemes == spec.schemes and "int8-w8a8" in r.schemes
    # AVX2's vLLM build has no W4A16 kernel: dropped there with its reason, kept on AVX-512
    assert r.dropped == [s for s in ("int8-w8a8", "w4a16-gptq") if s not in spec.schemes]
    assert all(any(s in n for n in r.notes) for s in r.dropped) and any("auto" in n for n in r.notes)
    assert r.serving_python == str(serve_python()) and record.packages["vllm"] == vllm_version(serve_python())
    assert json.loads((run / "run.json").read_text())["resolved"]["hardware_written"] == "auto"  # on disk, not derived


def test_an_older_run_json_is_read_through_its_migration(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({  # as quantgate wrote it before schema_version 2
        "spec_file": "releases/demo.yaml", "git": {"commit": "abc", "dirty": False}, "packages": {"vllm": "0.11.0"},
        "machine": ["hardware: auto is x86-avx2"],
        "spec": {"name": "demo", "hardware": "x86-avx2", "schemes": ["int8-w8a8"], "candidates": [{"name": "mine"}],
                 "serving": {"python": None}}}))
    record = load_run_record(tmp_path)
    assert record.schema_version == SCHEMA and record.git.commit == "abc" and record.spec["name"] == "demo"
    r = record.resolved
    assert r is not None and r.hardware == "x86-avx2" and r.schemes == ["int8-w8a8"] and r.candidates == ["mine"]
    assert r.hardware_written is None and record.packages["vllm"] == "0.11.0" and r.notes == ["hardware: auto is x86-avx2"]
    assert "machine" not in record.model_dump()  # moved into the resolved record's notes


@pytest.mark.parametrize("doc, words", [
    ({"schema_version": SCHEMA + 1, "spec": {}}, f"schema_version {SCHEMA + 1} is not one this quantgate reads"),
    ({"schema_version": "2", "spec": {}}, "schema_version '2' is not one"),
    ({"schema_version": SCHEMA, "spec": []}, "unexpected content in field spec"),
    (["not", "a", "dict"], "expected a JSON dict, found list"),
])
def test_a_run_json_this_quantgate_cannot_read_is_refused_naming_the_field(tmp_path, doc, words):
    (tmp_path / "run.json").write_text(json.dumps(doc))
    with pytest.raises(RunFileError) as err:
        load_run_record(tmp_path)
    assert words in err.value.message and err.value.path == str(tmp_path / "run.json")


def test_evidence_json_is_versioned_and_read_back_through_its_model(tmp_path):
    """evidence.json: written by Evidence.write alone with its schema_version; one of an older quantgate (none) reads
    as the current model; a newer one is refused."""
    from quantgate.release.variants import EVIDENCE_SCHEMA, Evidence, Variant, load_evidence

    v = Variant(name="int8-w8a8", path=tmp_path / "ckpt", scheme="int8-w8a8", content_hash="0" * 64, size_bytes=10)
    ev = Evidence(variant=v, folder=tmp_path, cache=tmp_path / "cache", serve_command=["vllm", "serve"], dtype="bfloat16",
                  served=True, skipped={"perf": "decided early"})
    path = ev.write()
    assert json.loads(path.read_text())["schema_version"] == EVIDENCE_SCHEMA and load_evidence(path) == ev
    older = json.loads(path.read_text())
    del older["schema_version"]
    path.write_text(json.dumps(older))
    assert load_evidence(path) == ev
    path.write_text(json.dumps({**older, "schema_version": EVIDENCE_SCHEMA + 1}))
    with pytest.raises(RunFileError, match="schema_version"):
        load_evidence(path)


def test_a_baselines_eval_folders_are_as_planned_or_a_subset_only_when_skipped(tmp_path):
    """The flow's check that the candidates scored the baseline's own answers: every planned folder, or (its eval
    sets skipped once every candidate's REJECT was decided) those it had measured; never another folder."""
    from quantgate.release.variants import Evidence, Variant

    v = Variant(name="baseline", path=tmp_path, content_hash="0" * 64, size_bytes=1)
    planned = {"a": tmp_path / "a", "b": tmp_path / "b"}

    def ev(evals: dict, skipped: dict) -> Evidence:
        return Evidence(variant=v, folder=tmp_path, cache=tmp_path, serve_command=[], dtype=None, served=True,
                        evals=evals, skipped=skipped)
    assert ev(planned, {}).evals_as_planned(planned)
    assert not ev({"a": tmp_path / "a"}, {}).evals_as_planned(planned)  # a set gone without a reason
    assert ev({"a": tmp_path / "a"}, {"evals": "decided"}).evals_as_planned(planned)
    assert ev({}, {"evals": "decided"}).evals_as_planned(planned)
    assert not ev({"a": tmp_path / "other"}, {"evals": "decided"}).evals_as_planned(planned)  # another cache key
