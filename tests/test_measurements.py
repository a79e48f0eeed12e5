"""The measurement kinds and their registry (quantgate.release.measurements), without a server: which folders a
spec asks for, which of them are done (each kind's own test, on real files), what the evidence records, and that a
kind added to the registry is planned, ordered and compared like the built-in ones. The real path (a release that
measures and compares through the registry) is tests/test_release_e2e.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_decide_early import SPEC  # one spec with every kind: eval set, recall grid, perf probe, fidelity

from quantgate.base.runfiles import MANIFEST, PERF
from quantgate.perf.models import PerfResult, Workload
from quantgate.release import measurements
from quantgate.release.measurements import KINDS, VariantJob, ordered_steps, plan, recorded
from quantgate.release.replicas import Step
from quantgate.spec.resolve import load_spec
from quantgate.release.variants import Evidence, Variant



def _job(tmp_path: Path, spec_text: str = SPEC, baseline: bool = False) -> VariantJob:
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(spec_text)
    spec = load_spec(spec_file)
    variant = Variant(name="baseline" if baseline else "int8-w8a8", path=tmp_path, content_hash="0" * 64,
                      size_bytes=1)
    ref = {"default": tmp_path / "base-cache" / "evals" / "default-x-all"}
    return VariantJob(spec=spec, variant=variant, run=tmp_path / "run", folder=tmp_path / "run" / variant.name,
                      cache=tmp_path / "cache", tokenizer=tmp_path, reference=ref, baseline=baseline,
                      log=lambda _: None)


def test_every_kind_of_the_spec_has_its_folders_and_nothing_is_done_in_an_empty_cache(tmp_path):
    job = _job(tmp_path)
    folders, todo = plan(job)
    assert [k.name for k in KINDS] == ["evals", "recall", "perf", "fidelity"]  # built in; then the installed ones
    assert list(folders) == [k.name for k in measurements.all_kinds()]  # a spec without `measure`: theirs are empty
    assert all(folders[k.name] == {} for k in measurements.all_kinds()[len(KINDS):])
    assert list(folders["evals"]) == ["default"] and folders["evals"]["default"].parent == job.cache / "evals"
    assert folders["recall"]["recall"].parent == job.cache / "recall"
    assert folders["perf"]["perf"].parent == job.cache / "perf"  # perf.rounds: null: each variant's own probe
    window = _job(tmp_path, SPEC.replace(", rounds: null", ""))  # the default: the release's speed window probes
    assert plan(window)[0]["perf"] == {}  # ... so no variant has a probe of its own to run or to reuse
    assert list(folders["fidelity"]) == ["main"]  # a candidate; the baseline also scores the floor's path
    assert list(plan(_job(tmp_path, baseline=True))[0]["fidelity"]) == ["main", "alt"]
    assert todo == {k: list(v) for k, v in folders.items()}


def test_a_kind_the_spec_does_not_ask_for_has_no_folder_and_no_step(tmp_path):
    bare = "\n".join(ln for ln in SPEC.splitlines() if not ln.startswith(("recall:", "perf:")))
    job = _job(tmp_path, bare + "\nrecall: null\nperf: null\nfidelity: null\n")
    folders, todo = plan(job)
    assert folders["recall"] == folders["perf"] == folders["fidelity"] == {}
    assert [s.name for s in ordered_steps(job, folders, todo, None)] == ["eval default"]
    fields = recorded(folders, {})
    assert fields.pop("kinds", {}) == {}  # the added kinds (quantgate/kinds/): none asked for
    assert fields == {"evals": folders["evals"], "recall": None, "perf": None, "fidelity": {}}


def _perf(status: str) -> str:
    """A perf.json as the probe writes it (quantgate.perf.models.PerfResult), no run in it."""
    return PerfResult(client="vllm bench serve", endpoint="http://127.0.0.1:8000", model="m",
                      workload=Workload(num_prompts=4, input_len=8, output_len=4, tokenizer="t"), concurrency=[1],
                      repeats=1, runs=[], medians=[], status=status, started="2026-01-01T00:00:00",
                      seconds=1.0).model_dump_json(indent=2)


def test_each_kind_counts_only_complete_work_as_done(tmp_path):
    job = _job(tmp_path)
    folders, _ = plan(job)
    ev_dir, perf_dir = folders["evals"]["default"], folders["perf"]["perf"]
    for d in (ev_dir, perf_dir):
        d.mkdir(parents=True)
    (ev_dir / MANIFEST).write_text(json.dumps({"status": "partial"}))  # failed requests: asked again
    (perf_dir / PERF).write_text(_perf("error"))
    assert plan(job)[1]["evals"] == ["default"] and plan(job)[1]["perf"] == ["perf"]
    (ev_dir / MANIFEST).write_text(json.dumps({"status": "complete"}))
    (perf_dir / PERF).write_text(_perf("ok"))
    _, todo = plan(job)
    assert todo["evals"] == [] and todo["perf"] == []
    assert todo["recall"] == ["recall"] and todo["fidelity"] == ["main"]  # still nothing of theirs on disk


def test_a_skipped_step_is_recorded_as_not_measured(tmp_path):
    folders, _ = plan(_job(tmp_path))
    rec = recorded(folders, {"recall": "decided early", "perf": "decided early"})
    assert rec["recall"] is None and rec["perf"] is None and rec["fidelity"] == folders["fidelity"]


class _Probe:
    """A kind added to the registry: one folder, one step, one comparison file."""
    name = "probe"

    def __init__(self) -> None:
        self.compared: list[str] = []

    def folders(self, job):
        return {"probe": job.cache / "probe"}

    def pending(self, job, folders):
        return [k for k, d in folders.items() if not (d / "done").exists()]

    def steps(self, job, folders, pending, early):
        return [Step("probe", lambda srv: (folders["probe"] / "done").touch())] if pending else []

    def phase(self, job, early):
        return 2.5  # after recall and perf, before a candidate's fidelity when it does not decide early

    def record(self, folders, skipped):
        return {}

    def compare(self, run, base, cand):
        self.compared.append(cand.variant.name)
        return {"probe": "compared"}


def test_a_kind_added_to_the_registry_is_planned_ordered_run_and_compared(tmp_path, monkeypatch):
    probe = _Probe()
    monkeypatch.setattr(measurements, "KINDS", (*KINDS, probe))
    job = _job(tmp_path)
    folders, todo = plan(job)
    assert todo["probe"] == ["probe"]
    steps = ordered_steps(job, folders, todo, None)
    assert [s.name for s in steps] == ["eval default", "recall", "perf", "probe", "fidelity (main)"]
    (folders["probe"]["probe"]).mkdir(parents=True)
    next(s for s in steps if s.name == "probe").run(None)
    assert plan(job)[1]["probe"] == []  # its own done test sees its work
    base = Evidence(variant=job.variant.model_copy(update={"name": "baseline"}), folder=tmp_path, cache=tmp_path,
                    serve_command=[], dtype=None, served=False)
    cand = base.model_copy(update={"variant": job.variant})
    got = measurements.compare_all(job.run, base, cand)  # nothing else measured: the others write nothing
    assert got["probe"] == {"probe": "compared"} and probe.compared == ["int8-w8a8"]
    assert not (job.run / "int8-w8a8" / "pay_off.json").exists()


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_every_registered_kind_follows_the_protocol(kind):
    for method in ("folders", "pending", "steps", "phase", "record", "compare"):
        assert callable(getattr(kind, method, None)), f"{kind.name}.{method}"
    assert kind.name and kind.name in {"evals", "recall", "perf", "fidelity"}


def test_evidence_refuses_a_field_a_kind_records_but_the_model_lacks(tmp_path, monkeypatch):
    """A kind whose record() returns a key Evidence does not declare fails when the evidence is made, naming the key,
    instead of its result being dropped from evidence.json without a word (pydantic's default is to ignore it)."""
    from pydantic import ValidationError

    probe = _Probe()
    probe.record = lambda folders, skipped: {"probe": str(folders["probe"])}  # no such Evidence field
    monkeypatch.setattr(measurements, "KINDS", (*KINDS, probe))
    job = _job(tmp_path)
    folders, _ = plan(job)
    fields = recorded(folders, {})
    assert "probe" in fields and "evals" in fields
    with pytest.raises(ValidationError, match="probe") as err:
        Evidence(variant=job.variant, folder=tmp_path, cache=tmp_path, serve_command=[], dtype=None, served=False, **fields)
    assert "extra" in str(err.value).lower()
    monkeypatch.setattr(measurements, "KINDS", KINDS)  # what every registered kind records is accepted as it is
    Evidence(variant=job.variant, folder=tmp_path, cache=tmp_path, serve_command=[], dtype=None, served=False,
             **recorded(folders, {}))
