"""The fidelity files written and read through their models: a run's fidelity/<candidate>.json and floor.json
(FidelityRecord) and a samples folder's manifest.json (SamplesManifest), byte for byte the dicts they replaced."""

from __future__ import annotations

import json

import pytest

from quantgate.base import subsets
from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import write_json
from quantgate.fidelity import sampling
from quantgate.fidelity.core import SampleFidelity, merge_draws, summarize
from quantgate.fidelity.record import FidelityRecord, load_fidelity_record
from quantgate.fidelity.sampling import SamplesManifest
from quantgate.release import fidelity_step


def _draws() -> list[SampleFidelity]:
    return [SampleFidelity(id=f"{cat}/s{i}#{k}", category=cat, n_tokens=5 + i, kl_sum=0.01 * (i + 1) * (k + 1),
                           top1_agree=4 + i % 2, dnll_sum=0.003 * i - 0.001, kl_max=0.2 * i, kl_topk_sum=0.005 * i)
            for cat in ("factual_qa", "context:1024") for i in range(6) for k in range(2)]


def test_the_fidelity_record_writes_the_layout_the_gate_reads(tmp_path):
    dumps = {"baseline": "/cache/b-main", "candidate": "/cache/c-main"}
    fidelity_step._write(tmp_path / "c.json", dumps, _draws)
    samples = merge_draws(_draws(), fidelity_step.DRAW)
    drawn = [s.id for s in subsets.order(samples, lambda s: s.id, lambda s: s.category)]
    write_json(tmp_path / "old.json", {"summary": summarize(samples).model_dump(mode="json"),
                                       "estimator": fidelity_step.ESTIMATOR,
                                       "samples": [s.model_dump(mode="json") for s in samples], "dumps": dumps,
                                       "draw": {"rule": subsets.RULE, "seed": subsets.SEED, "order": drawn}})
    assert (tmp_path / "c.json").read_bytes() == (tmp_path / "old.json").read_bytes()
    rec = load_fidelity_record(tmp_path / "c.json")
    assert rec.kl_estimator == "sampled-logratio" and [s.id for s in rec.samples] == [s.id for s in samples]
    # the draw order recorded: round-robin over the sorted categories, each in its seeded random order
    assert rec.draw is not None and [i.split("/")[0] for i in rec.draw.order] == ["context:1024", "factual_qa"] * 6
    doc = json.loads((tmp_path / "c.json").read_text())
    older = {"summary": doc["summary"], "samples": doc["samples"], "later": True}  # no estimator, no dumps
    write_json(tmp_path / "older.json", older)
    rec = load_fidelity_record(tmp_path / "older.json")
    assert rec.kl_estimator == "topk" and rec.dumps == {} and rec.model_extra == {"later": True}
    write_json(tmp_path / "bad.json", {**doc, "samples": [{"id": "x"}]})
    with pytest.raises(QuantgateError, match="fidelity record: unexpected content in field samples.0"):
        load_fidelity_record(tmp_path / "bad.json")


@pytest.mark.parametrize("top_k, error", [(20, None), (None, "p1: HTTP 500")])
def test_the_samples_manifest_keeps_its_keys_and_order(tmp_path, top_k, error):
    values = {"schema": sampling.SCHEMA, "status": "partial" if error else "complete", "n": 12,
              "n_sampled": 11 if error else 12, "prompts_hash": "ab" * 32, "max_tokens": 64, "top_k": top_k,
              "model": "baseline", "endpoint": "http://h:1/v1", "elapsed_s": 3.142, "error": error}
    SamplesManifest(**values).write(tmp_path)
    assert (tmp_path / "manifest.json").read_text() == json.dumps(values, indent=2) + "\n"
    read = SamplesManifest.read(tmp_path)
    assert read is not None and read.top_k == top_k and read.status == values["status"]
    (tmp_path / sampling.SAMPLES).write_text("")
    assert sampling.is_complete(tmp_path) == (error is None)
    for damaged in ("{torn", "[1]", '{"n": 3}'):
        (tmp_path / "manifest.json").write_text(damaged)
        assert SamplesManifest.read(tmp_path) is None and not sampling.is_complete(tmp_path)
