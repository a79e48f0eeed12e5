"""The quantize files through their models: the manifest (quantgate-quant.json and the run folder's
quantization.json), and the child's job.json and result file. Same keys in the same order as the dicts they replace."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from quantgate.base.paths import REPO
from quantgate.base.typedfile import RunFileError
from quantgate.quantize.jobfile import DeviceRecord, RunnerJob, RunnerResult
from quantgate.quantize.manifest import MANIFEST, CalibrationRecord, QuantManifest, SourceRef, read_quantization
from quantgate.quantize.run import reusable
from quantgate.target.families import Kept

ORDER = ["format", "key", "source", "scheme", "hardware", "recipe_file", "recipe_applied", "overrides", "family", "kept",
         "preflight",
         "calibration", "quantization_config", "versions", "workarounds", "device", "timings_s", "size_on_disk_bytes",
         "weights_bytes", "compression_ratio", "files", "created"]


def manifest(**over) -> QuantManifest:
    """A manifest as quantize.run._manifest makes it: every field set, None included."""
    fields = dict(format=2, key="k" * 64, source=SourceRef(path="/m", sha256="s", weights_bytes=100), scheme="w4a16",
                  hardware=None, recipe_file="r.yaml", recipe_applied="x: 1\n", overrides={"group_size": None},
                  family="llama", kept=[Kept(pattern="lm_head", why="every recipe keeps it")],
                  preflight={"notes": []}, calibration=None, quantization_config={"format": "pack"},
                  versions={"torch": "2"}, workarounds=[], device=DeviceRecord(device="cpu", physical_gpu=None, reason="r"),
                  timings_s={"prepare_s": None, "wall": 1.5}, size_on_disk_bytes=60, weights_bytes=50,
                  compression_ratio=2.0, files={"model.safetensors": 50}, created="2026-12-05T10:00:00+0000")
    return QuantManifest(**(fields | over))


def test_manifest_keys_in_the_writers_order_none_kept_unset_left_out(tmp_path):
    m = manifest()
    m.write(tmp_path)
    text = (tmp_path / MANIFEST).read_text(encoding="utf-8")
    doc = json.loads(text)
    assert list(doc) == ORDER and doc["hardware"] is None and doc["calibration"] is None
    assert doc["device"] == {"device": "cpu", "physical_gpu": None, "reason": "r"}  # the runner's keys only
    assert not text.endswith("\n") and text == json.dumps(doc, indent=2)  # json.dumps, as before


def test_run_copy_puts_reused_first(tmp_path):
    m = manifest(calibration=CalibrationRecord(source="c", sha256="h", samples=4, available=9, max_seq_length=8,
                                               seed=0, tokens=None))
    m.write_run_copy(tmp_path / "quantization.json", reused=True)
    text = (tmp_path / "quantization.json").read_text(encoding="utf-8")
    assert list(json.loads(text)) == ["reused", *ORDER] and text.endswith("}\n")
    assert "reused" not in m.dump()  # the copy, not the manifest, carries it
    back = read_quantization(tmp_path / "quantization.json")
    assert back.reused is True and back.calibration is not None and back.calibration.tokens is None


def test_an_old_or_partial_file_reads_and_dumps_only_its_keys(tmp_path):
    (tmp_path / "q.json").write_text(json.dumps({"reused": False, "scheme": "s", "compression_ratio": 2.5, "new": 1}))
    q = read_quantization(tmp_path / "q.json")
    assert q.scheme == "s" and q.dump() == {"reused": False, "scheme": "s", "compression_ratio": 2.5, "new": 1}


def test_a_manifest_that_does_not_fit_names_its_field(tmp_path):
    (tmp_path / "q.json").write_text(json.dumps({"scheme": "s", "files": {"a": "big"}}))
    with pytest.raises(RunFileError) as err:
        read_quantization(tmp_path / "q.json")
    assert err.value.field == "files.a"


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"key": "k", "files": {"model.safetensors": "ten"}}'])
def test_reuse_refuses_an_unreadable_manifest(tmp_path, text):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    (tmp_path / MANIFEST).write_text(text)
    assert reusable(tmp_path, "k") is None


def test_job_file_has_every_key_in_order(tmp_path):
    job = RunnerJob(model="/m", recipe="/r.yaml", out="/o", result="/w/result.json", seed=3)
    job.write(tmp_path / "job.json")
    text = (tmp_path / "job.json").read_text(encoding="utf-8")
    assert text == json.dumps({"model": "/m", "recipe": "/r.yaml", "out": "/o", "result": "/w/result.json", "seed": 3,
                               "calibration": None, "max_seq_length": None}, indent=2)
    assert RunnerJob.read(tmp_path / "job.json") == job


def test_result_holds_what_the_child_set_in_order(tmp_path):
    r = RunnerResult(versions={"torch": "2"}, workarounds=[])
    r.prepare_s, r.calibration_tokens = 1.0, 7  # set out of order: written in the file's order
    r.device = DeviceRecord.model_validate({"device": "cuda:0", "physical_gpu": "1", "reason": "first visible GPU",
                                            "name": "H100", "load_dtype": "bfloat16", "calibration_dtype_reason": "r"})
    r.device.peak_memory_bytes = 5
    r.write(tmp_path / "result.json")
    doc = json.loads((tmp_path / "result.json").read_text(encoding="utf-8"))
    assert list(doc) == ["versions", "workarounds", "calibration_tokens", "prepare_s", "device"]
    assert list(doc["device"])[-1] == "peak_memory_bytes"
    assert RunnerResult.read(tmp_path / "result.json").dump() == doc
    assert RunnerResult.read(tmp_path / "absent.json").dump() == {}  # killed before it wrote one


def test_the_child_writes_its_crash_through_the_model(tmp_path):
    """The runner as quantize.run starts it, on a job whose recipe is missing: it crashes before importing
    llmcompressor or torch, and its result file says so (only `crashed`)."""
    job = RunnerJob(model=str(tmp_path), recipe=str(tmp_path / "missing.yaml"), out=str(tmp_path / "o"),
                    result=str(tmp_path / "result.json"))
    job.write(tmp_path / "job.json")
    done = subprocess.run([sys.executable, "-m", "quantgate.quantize.runner", str(tmp_path / "job.json")], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    result = RunnerResult.read(tmp_path / "result.json")
    assert list(result.dump()) == ["crashed"] and "missing.yaml" in (result.crashed or "")


def _stand_ins(monkeypatch, torch, saved: list) -> None:
    """llmcompressor and transformers replaced by stand-ins (the real ones run in the slow tests): the runner's own
    code runs for real, on this machine's torch."""
    import types

    class Model:
        dtype = torch.float32

        def to(self, dtype):
            return self

        def save_pretrained(self, out, save_compressed):
            saved.append(out)

    class Tokenizer:
        chat_template = None

        def __call__(self, text, truncation, max_length, add_special_tokens=True):
            ids = list(range(len(text.split())))
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}

        def save_pretrained(self, out):
            pass

    llmc = types.ModuleType("llmcompressor")
    llmc.__version__, llmc.oneshot = "0", lambda **kw: None
    recipe = types.ModuleType("llmcompressor.recipe")
    recipe.Recipe = types.SimpleNamespace(create_instance=lambda path: None)
    tf = types.ModuleType("transformers")
    tf.AutoModelForCausalLM = types.SimpleNamespace(from_pretrained=lambda path, dtype, device_map: Model())
    tf.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda path: Tokenizer())
    tf.PreTrainedTokenizerBase = tf.PreTrainedModel = type("Absent", (), {})  # what `datasets` asks of transformers
    for name, mod in (("llmcompressor", llmc), ("llmcompressor.recipe", recipe), ("transformers", tf)):
        monkeypatch.setitem(sys.modules, name, mod)


def test_the_runner_writes_its_result_in_order(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from quantgate.quantize import runner

    saved: list = []
    _stand_ins(monkeypatch, torch, saved)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    (tmp_path / "recipe.yaml").write_text("stage: {}\n")
    (tmp_path / "calibration.jsonl").write_text('{"text": "one two three"}\n{"text": "four five"}\n')
    job = RunnerJob(model=str(tmp_path), recipe=str(tmp_path / "recipe.yaml"), out=str(tmp_path / "o"),
                    result=str(tmp_path / "result.json"), calibration=str(tmp_path / "calibration.jsonl"),
                    max_seq_length=8)
    job.write(tmp_path / "job.json")
    assert runner.main(["runner", str(tmp_path / "job.json")]) == 0 and saved == [str(tmp_path / "o")]
    doc = json.loads((tmp_path / "result.json").read_text(encoding="utf-8"))
    assert list(doc) == ["versions", "workarounds", "calibration_tokens", "prepare_s", "load_s", "device", "oneshot_s",
                         "save_s", "total_s"]
    assert doc["calibration_tokens"] == 5 and list(doc["device"]) == ["device", "physical_gpu", "reason", "load_dtype",
                                                                       "calibration_dtype_reason"]
