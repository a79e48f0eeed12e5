"""Quantize adapter: bad input refused before any child/model load; finished outputs only; reuse; the AWQ-on-CPU
workaround; and (slow) real quantization of the demo model to the four schemes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from quantgate.base.errors import ConfigError, QuantgateError
from quantgate.quantize.calibration import CalibrationSpec
from quantgate.quantize.recipes import RecipeOverrides, dump_recipe, load_recipe, quant_settings
from quantgate.quantize.run import LOCKS, MANIFEST, QuantizeRequest, _clean_stale, keyed_folder, plan, quantize, reusable
from quantgate.quantize.runner import needs_pin_memory_workaround
from quantgate.target.hardware import get_profile, load_catalogue

from _quant_fixtures import fake_quantizer, llama
from _shared import CHECKPOINTS, LAYER0_ONLY


@pytest.fixture
def no_child(monkeypatch):
    """Fail the test if anything tries to start the quantization child (i.e. load a model)."""
    def refuse(*a, **k):
        raise AssertionError("a child process was started")

    monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.fixture
def tiny(tmp_path):
    folder = llama(tmp_path / "tiny", hidden=576, inter=1536)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    return folder


def req(model, tmp_path, **kw) -> QuantizeRequest:
    return QuantizeRequest(model=model, out=tmp_path / "out", **({"scheme": "w4a16-gptq"} | kw))


@pytest.mark.parametrize(
    "kwargs, expect",
    [
        ({"scheme": "fp8-dynamic", "hardware": "a100"}, ["a100", "int8-w8a8", "w4a16-gptq", "h100"]),  # names alternatives
        ({"scheme": "w4a16-awq", "hardware": "ARM-CPU"}, ["int8-w8a8"]),
        ({"scheme": "int4"}, ["unknown scheme", "w4a16-awq"]),
        ({"scheme": "fp8-dynamic", "hardware": "tpu9"}, ["unknown hardware", "h100"]),
    ],
)
def test_refused_before_any_model_load(no_child, tiny, tmp_path, kwargs, expect):
    with pytest.raises(QuantgateError) as err:
        quantize(req(tiny, tmp_path, **kwargs))
    assert all(e in err.value.render() for e in expect), err.value.render()
    assert not (tmp_path / "out").exists()


def test_invalid_recipe_and_bad_calibration_refused(no_child, tiny, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("quant_stage:\n  quant_modifiers:\n    GPTQModifier: {targets: [Linear]}\n")
    with pytest.raises(ConfigError, match="neither `scheme` nor `config_groups`"):
        quantize(req(tiny, tmp_path, recipe=bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="no records"):
        quantize(req(tiny, tmp_path, calibration=CalibrationSpec(path=empty)))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(ConfigError, match=f"{broken}:2"):
        quantize(req(tiny, tmp_path, calibration=CalibrationSpec(path=broken)))


def test_chat_records_need_a_chat_template(no_child, tiny, tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    (tiny / "chat_template.jinja").unlink()
    with pytest.raises(QuantgateError, match="no chat template"):
        quantize(req(tiny, tmp_path, calibration=CalibrationSpec(path=chat)))


def test_data_free_scheme_refuses_calibration_data(no_child, tiny, tmp_path):
    with pytest.raises(QuantgateError, match="data-free"):
        plan(req(tiny, tmp_path, scheme="fp8-dynamic", calibration=CalibrationSpec(path=tmp_path / "x.jsonl")))


def test_plan_resolves_recipe_and_key_changes_with_inputs(tiny, tmp_path):
    a = plan(req(tiny, tmp_path))
    assert a.preflight.group_size == 64 and "group_size: 64" in a.recipe_text
    assert a.calibration is not None and len(a.calibration.records) == a.scheme.calibration.samples
    assert plan(req(tiny, tmp_path)).key == a.key
    assert plan(req(tiny, tmp_path, calibration=CalibrationSpec(samples=8))).key != a.key
    assert plan(req(tiny, tmp_path, scheme="w4a16-awq")).key != a.key
    (tiny / "config.json").write_text((tiny / "config.json").read_text().replace("1000", "1001"))
    assert plan(req(tiny, tmp_path)).key != a.key  # the source hash covers every file


def test_reuse_only_for_a_complete_output_with_the_same_key(tmp_path):
    out = tmp_path / "out"
    assert reusable(out, "k") is None
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"x" * 10)
    assert reusable(out, "k") is None  # no manifest: not finished
    (out / MANIFEST).write_text(json.dumps({"key": "k", "files": {"model.safetensors": 10}}))
    assert reusable(out, "k").key == "k"
    assert reusable(out, "other") is None
    (out / "model.safetensors").write_bytes(b"x" * 9)
    assert reusable(out, "k") is None  # a file changed since


def test_existing_output_from_other_inputs_is_not_replaced_silently(no_child, tiny, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(QuantgateError, match="`overwrite`"):
        quantize(req(tiny, tmp_path))


def test_stale_temp_folders_are_removed_under_the_lock_whatever_their_pid(tmp_path):
    # made under the output's lock, so the lock's holder knows them all to be stale: a live pid in a name
    # (ours here; on shared storage it may be another host's) changes nothing; other outputs' folders stay
    mine = [tmp_path / f".out.{kind}-{os.getpid()}-abcd1234" for kind in ("partial", "work", "old")]
    other = tmp_path / f".out2.partial-{os.getpid()}-abcd1234"
    for d in [*mine, other]:
        d.mkdir()
    assert sorted(_clean_stale(tmp_path / "out")) == sorted(d.name for d in mine)
    assert not any(d.exists() for d in mine) and other.exists()


def _outputs(folder: Path) -> list[Path]:
    """What a folder holds besides the output locks' folder (quantize.run.LOCKS: kept, like every lock file)."""
    return [p for p in folder.iterdir() if p.name != LOCKS]


def test_a_killed_child_leaves_no_output(tiny, tmp_path):
    with pytest.raises(QuantgateError, match="ran past 1 s"):
        quantize(req(tiny, tmp_path, scheme="fp8-dynamic"), timeout_s=1)
    assert _outputs(tmp_path) == [tiny]  # no out, no partial or work folder


def test_an_interrupted_parent_takes_the_child_down(tiny, tmp_path, monkeypatch):
    started, real = [], subprocess.Popen

    def record(*a, **k):
        started.append(real(*a, **k))
        return started[-1]

    class Interrupt(Exception):
        pass

    def boom(*_):
        raise Interrupt()

    monkeypatch.setattr(subprocess, "Popen", record)
    old = signal.signal(signal.SIGUSR1, boom)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGUSR1))
    timer.start()
    try:
        with pytest.raises(Interrupt):
            quantize(req(tiny, tmp_path, scheme="fp8-dynamic"))
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, old)
    assert started and started[0].poll() is not None  # the child is gone, not orphaned
    assert _outputs(tmp_path) == [tiny]


def keyed_req(model, prefix, **kw) -> QuantizeRequest:
    return QuantizeRequest(model=model, out=prefix, name_by_key=True, **({"scheme": "w4a16-gptq"} | kw))


def test_two_quantization_keys_give_two_folders_and_the_same_key_reuses(tiny, tmp_path, monkeypatch):
    calls = fake_quantizer(monkeypatch)
    prefix = tmp_path / "checkpoints" / "abcdef012345-w4a16-gptq"
    first = quantize(keyed_req(tiny, prefix))
    before = {f.name: f.read_bytes() for f in first.out.iterdir()}
    assert first.out == keyed_folder(prefix, first.manifest.key)
    assert first.out.name == f"abcdef012345-w4a16-gptq-{first.manifest.key[:12]}"
    other = quantize(keyed_req(tiny, prefix, calibration=CalibrationSpec(samples=8)))  # another calibration: another key
    assert other.manifest.key != first.manifest.key and other.out != first.out
    assert {f.name: f.read_bytes() for f in first.out.iterdir()} == before  # the first folder is untouched
    again = quantize(keyed_req(tiny, prefix))
    assert again.reused and again.out == first.out and len(calls) == 2  # same key: reused, not recomputed
    assert sorted(d.name for d in _outputs(prefix.parent)) == sorted([first.out.name, other.out.name])


def test_a_broken_keyed_folder_is_refused_not_replaced(no_child, tiny, tmp_path):
    prefix = tmp_path / "checkpoints" / "abc-w4a16-gptq"
    folder = keyed_folder(prefix, plan(keyed_req(tiny, prefix)).key)
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"not what the key says")
    with pytest.raises(QuantgateError, match="named by this quantization key"):
        quantize(keyed_req(tiny, prefix))
    assert (folder / "model.safetensors").read_bytes() == b"not what the key says"


@pytest.mark.slow
def test_a_crashing_child_reports_its_log_and_leaves_no_output(tiny, tmp_path):
    # the synthetic checkpoint has no tokenizer and no weights: the child fails after starting up
    with pytest.raises(QuantgateError) as err:
        quantize(req(tiny, tmp_path, scheme="fp8-dynamic"))
    assert "child failed" in err.value.render() and "last lines of the log" in err.value.render()
    assert _outputs(tmp_path) == [tiny]


@pytest.mark.slow
def test_recipe_arguments_llmcompressor_rejects_are_refused_before_the_model_loads(demo_model, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n"
                   "      scheme: FP8_DYNAMIC\n      ignore: [lm_head]\n      no_such_argument: 1\n")
    with pytest.raises(QuantgateError) as err:
        quantize(QuantizeRequest(model=demo_model, scheme="fp8-dynamic", recipe=bad, out=tmp_path / "out"))
    assert "refused the recipe before loading the model" in err.value.render()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "version, accel, patch",
    [("0.14.0.1", False, True), ("0.14.0.1", True, False), ("0.15.0", False, False), ("0.13.0", False, False)],
)
def test_pin_memory_workaround_is_narrow(version, accel, patch):
    assert needs_pin_memory_workaround(version, accel) is patch


@pytest.mark.slow
def test_pin_memory_bug_and_workaround_on_this_machine(monkeypatch):
    torch = pytest.importorskip("torch")
    if torch.accelerator.is_available():
        pytest.skip("the upstream bug only shows without an accelerator")
    from llmcompressor.pipelines.cache import IntermediatesCache

    from quantgate.quantize.runner import pin_memory_workaround

    monkeypatch.setattr(IntermediatesCache, "pin_memory", IntermediatesCache.pin_memory)  # restored after the test
    cache = IntermediatesCache.empty(1, torch.device("cpu"))
    cache.update(0, {"x": torch.ones(4)})
    with pytest.raises(RuntimeError, match="accelerator"):
        cache.pin_memory(0)  # the upstream failure docs/design.md describes; if this stops failing, drop the workaround
    assert "0.14.0.1" in pin_memory_workaround()
    cache.pin_memory(0)
    assert torch.equal(cache.fetch(0)["x"], torch.ones(4))


# --- real quantization of the demo model (small calibration so the four take a few minutes on 2 cores) ---------

SCHEMES = {  # scheme -> (weights num_bits, weights type, group size, activations quantized?)
    "fp8-dynamic": (8, "float", None, True),
    "int8-w8a8": (8, "int", None, True),
    "w4a16-gptq": (4, "int", 64, False),
    "w4a16-awq": (4, "int", 64, False),
}


# AWQ's grid search scales with the calibration tokens: fewer for it keeps the four schemes near 5 minutes
CALIBRATION = {"w4a16-awq": (8, 64)}
# AWQ searches its scales per smoothed layer (llmcompressor skips a mapping whose layers are all ignored): only decoder
# layer 0 is quantized here, its real format end to end in seconds instead of four minutes on 2 cores. The whole
# model's W4A16 size is the GPTQ case's (the same format); bench/quantize_demo.py quantizes every scheme of the whole model.
LAYER0 = {"w4a16-awq": RecipeOverrides(ignore=[LAYER0_ONLY])}
# These checkpoints are served through the whole release in tests/test_release_e2e.py, which reuses them (INT8 in its
# first run, GPTQ in the added one): a server start here would repeat that
SERVED_BY_THE_RELEASE_TEST = {"w4a16-gptq", "int8-w8a8"}


def demo_request(model, out, scheme: str) -> QuantizeRequest:
    hw = "h100" if scheme == "fp8-dynamic" else "x86-cpu"
    samples, length = CALIBRATION.get(scheme, (16, 128))
    return QuantizeRequest(model=model, scheme=scheme, out=out, hardware=hw, overrides=LAYER0.get(scheme, RecipeOverrides()),
                           calibration=CalibrationSpec(samples=samples, max_seq_length=length))


@pytest.fixture(scope="session")
def checkpoints(demo_model, tmp_path_factory):
    """This session's quantized checkpoints, in a folder named like the release flow's (see tests/_shared.py)."""
    from quantgate.target.catalogue import checkpoint_hash

    return tmp_path_factory.mktemp("checkpoints"), checkpoint_hash(demo_model)[:12]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # minutes on 2 idle cores; much longer when other jobs share them
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_demo_model_quantized(demo_model, vllm_server, checkpoints, scheme, require_kernel):
    root, model_hash = checkpoints
    # named by the key, as the release flow names its own: results/checkpoints/<model hash12>-<scheme>-<key12>
    res = quantize(demo_request(demo_model, root / f"{model_hash}-{scheme}", scheme).model_copy(update={"name_by_key": True}))
    assert not res.reused
    CHECKPOINTS[scheme] = res.out
    bits, kind, group, acts = SCHEMES[scheme]
    out = res.out
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors"
    (grp,) = cfg["config_groups"].values()
    assert (grp["weights"]["num_bits"], grp["weights"]["type"], grp["weights"]["group_size"]) == (bits, kind, group)
    assert (grp["input_activations"] is not None) is acts
    assert "lm_head" in cfg["ignore"]
    assert (out / "tokenizer.json").is_file() and (out / "recipe_resolved.yaml").is_file()
    applied = load_recipe(out / "recipe.yaml")  # plain YAML in llmcompressor's grammar, as applied
    assert dump_recipe(applied) == json.loads((out / MANIFEST).read_text())["recipe_applied"]
    if group:
        assert quant_settings(applied)["group_sizes"] == [group]
    m = json.loads((out / MANIFEST).read_text())
    src = m["source"]["weights_bytes"]
    if scheme in LAYER0:  # layer 0's linear weights packed to 4 bits, layer 1's kept as they were
        from safetensors import safe_open

        with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
            names = set(f.keys())
        assert {"model.layers.0.mlp.down_proj.weight_packed", "model.layers.1.mlp.down_proj.weight"} <= names
        assert "model.layers.1.mlp.down_proj.weight_packed" not in names and m["weights_bytes"] < src
    else:
        limit = 0.65 if bits == 8 else 0.45  # embeddings (tied, 57 MB) stay BF16
        assert m["weights_bytes"] < limit * src and m["compression_ratio"] > 1 / limit
    assert m["scheme"] == scheme and m["source"]["sha256"] and m["versions"]["llmcompressor"] == "0.14.0.1"
    assert m["timings_s"]["wall"] > 0 and m["size_on_disk_bytes"] >= m["weights_bytes"]
    if scheme != "fp8-dynamic":
        assert (m["calibration"]["samples"], m["calibration"]["max_seq_length"]) == CALIBRATION.get(scheme, (16, 128))
    import torch

    # only AWQ reaches the pinning, and only a machine without an accelerator needs the workaround
    assert bool(m["workarounds"]) is (scheme == "w4a16-awq" and not torch.accelerator.is_available())
    assert not [p for p in _outputs(out.parent) if p.name.startswith(".")]  # no temporary folders left
    # the serving environment's vLLM loads the compressed-tensors checkpoint and answers (CPU kernels: BF16 activations).
    # FP8 is not a CPU scheme (x86-cpu profile): vLLM 0.32 CPU loads it by a fallback but hung on the first request here.
    if not get_profile("x86-cpu").supports(scheme) or scheme in SERVED_BY_THE_RELEASE_TEST:
        return
    for op in load_catalogue().cpu_kernels.get(scheme, []):  # W4A16 needs cpu_gemm_wna16: not in the AVX2 build
        require_kernel(op)
    with vllm_server(out, name=scheme, args=["--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "1024"]) as srv:
        resp = httpx.post(f"{srv.base_url}/chat/completions", headers={"Authorization": f"Bearer {srv.api_key}"}, timeout=300,
                          json={"model": scheme, "max_tokens": 16, "temperature": 0,
                                "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] > 0 and resp.json()["choices"][0]["message"]["content"].strip()


@pytest.mark.slow
def test_same_inputs_reuse_the_artifact(demo_model, tmp_path, monkeypatch):
    # the checkpoint quantized above, else one made now
    req = demo_request(demo_model, CHECKPOINTS.get("fp8-dynamic", tmp_path / "fp8-dynamic"), "fp8-dynamic")
    first = quantize(req)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("recomputed instead of reused"))
    t = time.perf_counter()
    again = quantize(req)
    assert again.reused and again.manifest.key == first.manifest.key
    assert time.perf_counter() - t < 10
