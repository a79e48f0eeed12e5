"""The GPU path without a GPU: device placement (quantize.devices), the adapters that use it (the quantize runner,
the parity reference), and scripts/gpu_check.sh's CPU-side parts (its wheel list, the random model of the demo's
shape, the install plan, the figure table, the refusal without a GPU).

This machine has no NVIDIA GPU. Where a GPU answer is needed (placement on cuda, the runner's GPU record) torch's
CUDA facts are stand-ins, and the tests say so; everything else runs for real on the CPU.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from quantgate.cli.main import user_error
from quantgate.base.errors import QuantgateError
from quantgate.parity.engine import reference_greedy, reference_placement, run_parity
from quantgate.quantize.preflight import checkpoint_dtype
from quantgate.quantize import devices
from quantgate.quantize.devices import Placement, place, visible_gpus
from quantgate.quantize.runner import device_record

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"


def _load_script(name: str):
    sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = _load_script("gpu_check")
gpu_check_run = _load_script("gpu_check_run")


# --- placement: one pure rule -------------------------------------------------------------------------------------

@pytest.mark.parametrize("cuda, count, served, visible, ckpt, device, dtype, physical", [
    # no GPU: the served dtype, FP32 when auto (CPU baselines serve FP32), as before
    (False, 0, None, None, "bfloat16", "cpu", "float32", None),
    (False, 0, "auto", None, None, "cpu", "float32", None),
    (False, 0, "float32", None, None, "cpu", "float32", None),
    (False, 0, "bfloat16", None, None, "cpu", "bfloat16", None),
    # a GPU: the served dtype; auto follows vLLM (checkpoint dtype; FP32 checkpoints serve BF16)
    (True, 1, "bfloat16", None, None, "cuda:0", "bfloat16", "0"),
    (True, 8, "half", None, None, "cuda:0", "float16", "0"),
    (True, 1, "float32", None, None, "cuda:0", "float32", "0"),
    (True, 1, None, None, "bfloat16", "cuda:0", "bfloat16", "0"),
    (True, 1, "auto", None, "float16", "cuda:0", "float16", "0"),
    (True, 1, "auto", None, "float32", "cuda:0", "bfloat16", "0"),
    (True, 1, None, None, None, "cuda:0", "bfloat16", "0"),
    # CUDA_VISIBLE_DEVICES: the first entry is the physical GPU; empty or -1 hides them all
    (True, 2, "bfloat16", "3,5", None, "cuda:0", "bfloat16", "3"),
    (True, 1, "bfloat16", "GPU-8f2c", None, "cuda:0", "bfloat16", "GPU-8f2c"),
    (True, 1, "bfloat16", "", None, "cpu", "bfloat16", None),
    (True, 1, None, "-1", "bfloat16", "cpu", "float32", None),
    (True, 0, None, "0", None, "cpu", "float32", None),        # visible by name, but torch sees no device
])
def test_place(cuda, count, served, visible, ckpt, device, dtype, physical):
    p = place(cuda, count, served, visible, ckpt)
    assert (p.device, p.dtype, p.physical_gpu) == (device, dtype, physical)
    assert p.is_gpu == device.startswith("cuda") and p.reason


@pytest.mark.parametrize("count, ours, slot, device, physical, why", [
    # the parity reference beside a server on a slot: the slot's first GPU, as this process numbers it
    (8, None, "2,3", "cuda:2", "2", "the slot's GPU"),
    (4, "4,5,6,7", "6,7", "cuda:2", "6", "the slot's GPU"),
    (2, "GPU-a,GPU-b", "GPU-b", "cuda:1", "GPU-b", "the slot's GPU"),
    (2, "4,5", "6", "cuda:0", "4", "slot GPU 6 not visible here"),        # not ours to see: the first visible one
    (2, None, "7", "cuda:0", "0", "slot GPU 7 not visible here"),          # beyond torch's device count
    (2, None, "GPU-x", "cuda:0", "0", "slot GPU GPU-x not visible here"),  # a UUID we cannot map without our list
    (2, None, None, "cuda:0", "0", "first visible GPU"),
    (2, None, "", "cuda:0", "0", "first visible GPU"),
])
def test_place_on_the_slot(count, ours, slot, device, physical, why):
    p = place(True, count, "bfloat16", ours, slot_devices=slot)
    assert (p.device, p.physical_gpu, p.dtype) == (device, physical, "bfloat16")
    assert p.reason.startswith(why)
    assert place(False, 0, None, ours, slot_devices=slot).device == "cpu"


@pytest.mark.parametrize("value, expected", [(None, None), ("", []), ("-1", []), ("0", ["0"]), ("2, 3", ["2", "3"]),
                                             ("1,-1,2", ["1"]), ("MIG-a,MIG-b", ["MIG-a", "MIG-b"])])
def test_visible_gpus(value, expected):
    assert visible_gpus(value) == expected


def test_unknown_dtype_names_where_it_came_from():
    with pytest.raises(QuantgateError) as e:
        place(True, 1, "float8", None)
    assert e.value.where == "dtype" and "float8" in e.value.message and "bfloat16" in e.value.fix  # the setting
    assert user_error(e.value).where == "--dtype"  # the command line shows it as its flag
    with pytest.raises(QuantgateError) as e:
        place(True, 1, "auto", None, "int4")
    assert "torch_dtype" in e.value.where


@pytest.mark.parametrize("device,ckpt,native,dtype", [
    ("cpu", "bfloat16", set(), "float32"),                 # AVX2 only: BF16 would be emulated
    ("cpu", "bfloat16", {"bfloat16"}, "bfloat16"),         # AVX512-BF16 / AMX: its own dtype
    ("cpu", "float16", {"bfloat16"}, "float32"),
    ("cpu", "float32", set(), "float32"),
    ("cuda:0", "bfloat16", set(), "bfloat16"),             # a GPU calibrates in the checkpoint's dtype
])
def test_calibration_dtype(device, ckpt, native, dtype):
    got, why = devices.calibration_dtype(device, ckpt, native)
    assert got == dtype and why


def test_placement_module_is_pure():
    tree = ast.parse(Path(devices.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
               {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"__future__", "dataclasses", "quantgate.base.errors"}, imported


# --- the adapters ---------------------------------------------------------------------------------------------------

def test_runner_records_the_cpu_here(monkeypatch):
    """Real torch on this CPU-only machine: the runner says it calibrates on the CPU, and why."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    rec = device_record(torch)
    assert rec == {"device": "cpu", "physical_gpu": None, "reason": "no CUDA device visible to torch"}


def test_runner_records_the_gpu(monkeypatch):
    """Stand-in for torch.cuda (no GPU here): the record names the GPU and resets the peak-memory counter that the
    runner reads after oneshot."""
    calls = []
    cuda = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 2,
                                 get_device_name=lambda i: f"NVIDIA H100 #{i}", reset_peak_memory_stats=calls.append)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    rec = device_record(types.SimpleNamespace(cuda=cuda))
    assert rec == {"device": "cuda:0", "physical_gpu": "6", "reason": "first visible GPU", "name": "NVIDIA H100 #0"}
    assert calls == [0]


def test_checkpoint_dtype(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert [checkpoint_dtype(tmp_path / x) for x in ("a", "b", "missing")] == ["bfloat16", "float16", None]


@pytest.fixture(scope="module")
def tiny_demo_shape(tmp_path_factory) -> Path:
    """The demo's shape with 2 of its 30 layers, random weights, synthetic tokenizer, built on the CPU."""
    out = tmp_path_factory.mktemp("tiny") / "model"
    info = gpu_check.build_model(out, layers=2, device="cpu", dtype="float32")
    assert info["tokenizer"] == "synthetic" and info["layers"] == 2
    return out


def test_reference_runs_where_placed_on_the_cpu(tiny_demo_shape, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    where = reference_placement(tiny_demo_shape, "auto")
    assert (where.device, where.dtype) == ("cpu", "float32")
    ids = [[1, 17, 400, 9000], [1, 5]]
    a = reference_greedy(tiny_demo_shape, ids, 3, where)
    b = reference_greedy(tiny_demo_shape, ids, 3, Placement("cpu", "float32", None, "test"))
    assert a == b and [len(x) for x in a] == [3, 3]
    assert all(0 <= t < 49152 for x in a for t in x)


# --- scripts/gpu_check.py: the CPU-side parts ---------------------------------------------------------------------

def _pins(text: str) -> dict[str, str]:
    return {gpu_check.norm(n): v for n, v in (line.split("==") for line in text.splitlines() if "==" in line)}


def test_wheel_list_is_the_lock_pins():
    """The dry run names each wheel at the version pipeline.lock pins, for the target Pythons; nothing is fetched."""
    r = subprocess.run([sys.executable, str(SCRIPTS / "gpu_check.py"), "wheels"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    first, *rest = r.stdout.splitlines()
    assert first.split()[1:] == list(gpu_check.PYTHONS)
    listed = _pins("\n".join(rest))
    lock = _pins((REPO / "requirements" / "pipeline.lock").read_text())
    assert listed and all(lock[n] == v for n, v in listed.items())
    assert {"llmcompressor", "compressed-tensors", "loguru"} <= set(listed)
    assert not {"torch", "numpy", "pyarrow", "pandas"} & set(listed)        # the large ones are the machine's
    cmds = gpu_check.download_commands(Path("/x"), sorted(listed.items()))
    assert all("--no-deps" in c and c[c.index("-d") + 1] == "/x" for c in cmds)


def test_wheel_list_refuses_a_name_the_lock_lacks():
    lock = (REPO / "requirements" / "pipeline.lock").read_text().replace("loguru==", "logoru==")
    with pytest.raises(SystemExit, match="loguru"):
        gpu_check.wheel_pins(lock)


@pytest.mark.parametrize("installed, expected", [
    # a bare machine (torch, transformers 5.17 present): the roots it lacks and what they need, transitively
    ({"transformers": "5.17.0", "tqdm": "4.70.1"}, ["llmcompressor", "compressed-tensors", "pydantic", "loguru",
                                                    "pydantic-core"]),
    # everything present at good versions: only the two that are always installed
    ({"transformers": "5.17.0", "pydantic": "2.14.4", "loguru": "0.7.3", "tqdm": "4.70.1", "pydantic-core": "2.50.5"},
     ["llmcompressor", "compressed-tensors"]),
    # transformers too old for llmcompressor: brought, with what it needs that is too old or absent
    ({"transformers": "4.57.0", "pydantic": "2.14.4", "loguru": "0.7.3", "tqdm": "4.67.0", "pydantic-core": "2.50.5"},
     ["llmcompressor", "compressed-tensors", "transformers", "tqdm"]),
])
def test_install_plan(installed, expected):
    requires = {  # a slice of the real wheels' Requires-Dist
        "llmcompressor": ["loguru>=0.7.2", "tqdm>=4.66.3", "transformers<=5.17.0,>=5.15.0", "torch>=2.10.0",
                          "compressed-tensors==0.19.0", "pytest>=6.0.0; extra == \"dev\""],
        "compressed-tensors": ["pydantic>=2.0", "loguru"],
        "transformers": ["tqdm>=4.70"],
        "pydantic": ["pydantic-core==2.50.5"],
        "loguru": [], "tqdm": [], "pydantic-core": [],
    }
    full = {n: installed.get(n) for n in requires}
    roots = gpu_check.ROOTS
    try:
        gpu_check.ROOTS = ("pydantic", "transformers")
        assert gpu_check.install_plan(requires, full) == expected
    finally:
        gpu_check.ROOTS = roots


def test_build_model_has_the_demo_shape(tiny_demo_shape, demo_model):
    """The random model's tensors have the real demo checkpoint's names and shapes (its safetensors header)."""
    from safetensors import safe_open

    def shapes(folder: Path, layers: int) -> dict[str, tuple]:
        out = {}
        with safe_open(str(next(folder.glob("*.safetensors"))), "pt") as f:
            for k in f.keys():
                layer = k.split(".layers.")[1].split(".")[0] if ".layers." in k else None
                if layer is None or int(layer) < layers:
                    out[k] = tuple(f.get_slice(k).get_shape())
        return out

    built, real = shapes(tiny_demo_shape, 2), shapes(demo_model, 2)
    assert built == real and len(built) > 10
    cfg = json.loads((REPO / "tests/data/demo_shape/config.json").read_text())
    assert cfg == json.loads((demo_model / "config.json").read_text())   # tests/data holds the demo's own config


def test_demo_shape_parameter_count():
    """All 30 layers, built on the meta device (no memory): the demo's parameter count, from its config alone."""
    from transformers import AutoModelForCausalLM

    cfg = gpu_check.demo_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    h, i, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * cfg.head_dim
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    assert sum(p.numel() for p in model.parameters()) == cfg.vocab_size * h + cfg.num_hidden_layers * per_layer + h
    assert cfg.num_hidden_layers == 30


def test_figure_table():
    rows = [{"step": "quantize w4a16-gptq", "device": "cuda:0 NVIDIA H100", "seconds": 41.2, "peak_gpu_mib": "1,234.5",
             "size_mib": "98.1", "result": "2.74x smaller"},
            {"step": "eval baseline (50/50)", "seconds": 12.0, "result": "exact_match 0.000", "dtype": None}]
    lines = gpu_check.table(rows).splitlines()
    assert lines[0].split("|")[1].strip() == "step" and [c.strip() for c in lines[0].split("|")[1:-1]] == \
        ["step", "device", "dtype", "s", "peak GPU MiB", "size MiB", "result"]
    assert set(lines[1]) == {"|", "-"} and len({len(x) for x in lines}) == 1      # aligned columns
    cells = [c.strip() for c in lines[3].split("|")[1:-1]]
    assert cells == ["eval baseline (50/50)", "", "", "12.0", "", "", "exact_match 0.000"]
    assert gpu_check.mib(3 * 2**20) == "3.0" and gpu_check.mib(None) == ""


def test_eval_set_without_sacrebleu_leaves_out_bleu_and_chrf(tmp_path, monkeypatch):
    """The wheel folder carries no lxml (sacrebleu needs it): the eval then runs on the other samples, through the
    real eval-set loader."""
    from quantgate.evals.dataset import load_evalset

    path, note = gpu_check_run.eval_set(tmp_path)
    assert path == REPO / "eval_sets" / "default.jsonl" and note == ""     # sacrebleu imports here
    monkeypatch.setitem(sys.modules, "sacrebleu", None)                     # as on a machine without lxml
    path, note = gpu_check_run.eval_set(tmp_path)
    assert path.parent == tmp_path / "evalset" and "BLEU/chrF" in note
    kept = load_evalset(path, with_dataset=False).samples
    full = load_evalset(REPO / "eval_sets" / "default.jsonl", with_dataset=False).samples
    assert kept and all(not {"bleu", "chrf"} & set(x.metrics) for x in kept)
    assert len(kept) == sum(1 for x in full if not {"bleu", "chrf"} & set(x.metrics))


# --- refusing without a GPU -----------------------------------------------------------------------------------------

def test_gpu_check_sh_refuses_without_a_gpu(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("dirname", "python3"):
        (bindir / tool).symlink_to(shutil.which(tool) if tool != "python3" else sys.executable)
    env = {"PATH": str(bindir), "HOME": str(tmp_path)}
    r = subprocess.run([shutil.which("bash"), str(SCRIPTS / "gpu_check.sh"), str(tmp_path / "wheels")], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no NVIDIA GPU visible" in r.stderr
    assert not (tmp_path / "wheels").exists() and not list(tmp_path.glob("gpu_check.*"))   # nothing made


def test_gpu_check_run_refuses_without_a_gpu(tmp_path):
    """Past the shell's check (a GPU listed by nvidia-smi but none visible to torch): the Python side refuses too."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, str(SCRIPTS / "gpu_check.py"), "run", str(tmp_path / "out")], env=env,
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and "no NVIDIA GPU visible" in r.stderr
    assert not (tmp_path / "out").exists()


# --- slow: the adapters for real -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_parity_auto_dtype_runs_the_reference_in_fp32_on_the_cpu(demo_model, demo_server, tmp_path):
    """The release now passes the served --dtype or "auto"; on a CPU that is the FP32 reference, as before, and
    parity.json says where it ran."""
    report = run_parity(demo_model, demo_server.base_url, demo_server.api_key, "demo", tmp_path, dtype="auto")
    saved = json.loads((tmp_path / "parity.json").read_text())
    assert report.verdict == "pass", report.reason
    assert saved["dtype"] == "float32" and saved["served_dtype"] == "auto"
    assert saved["device"]["device"] == "cpu" and saved["device"]["reason"]


@pytest.mark.slow
def test_gpu_check_rehearsal_on_the_cpu(tmp_path):
    """`gpu_check.py run --cpu` walks the GPU check's steps on this CPU (2 layers, 8 x 64 calibration: the scheme's
    64 x 256 ran past 300 s here on the shared 2 cores; no vLLM): the random model, both quantizations through
    quantgate's runner, the parity reference, and the figure table."""
    r = subprocess.run([sys.executable, str(SCRIPTS / "gpu_check.py"), "run", str(tmp_path / "run"), "--cpu",
                        "--layers", "2", "--calib-samples", "8", "--calib-len", "64"], capture_output=True, text=True,
                       timeout=1800, cwd=REPO,
                       env={**os.environ, "QUANTGATE_HOME": str(tmp_path / "home")})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((tmp_path / "run" / "figures.json").read_text())
    assert [x["step"] for x in rows] == ["build random model", "quantize fp8-dynamic", "quantize w4a16-gptq",
                                         "parity reference"]
    assert all(x["device"].startswith("cpu") for x in rows) and rows[3]["dtype"] == "float32"
    assert float(rows[2]["size_mib"]) < float(rows[0]["size_mib"])
    assert "| step" in r.stdout and "quantize w4a16-gptq" in r.stdout


@pytest.mark.slow
def test_quantize_manifest_records_the_device(tiny_demo_shape, tmp_path):
    """llmcompressor for real (fp8-dynamic, data-free) on the 2-layer model: the manifest says where it ran."""
    from quantgate.quantize.run import QuantizeRequest, quantize

    res = quantize(QuantizeRequest(model=tiny_demo_shape, scheme="fp8-dynamic", out=tmp_path / "fp8"), timeout_s=900)
    dev = res.manifest.dump()["device"]
    assert dev["device"] == "cpu" and dev["reason"] == "no CUDA device visible to torch"
    assert dev["load_dtype"] == "float32" and "peak_memory_bytes" not in dev


@pytest.mark.slow
def test_a_bf16_checkpoint_calibrated_in_fp32_is_saved_in_bf16(tmp_path):
    """llmcompressor for real on a 2-layer BF16 model: on a CPU without native BF16 it calibrates in FP32 (several
    times faster than emulated BF16) and the checkpoint keeps BF16 tensors; a CPU with it calibrates in BF16."""
    from safetensors import safe_open

    from quantgate.quantize.run import QuantizeRequest, quantize
    from quantgate.quantize.runner import native_half

    model = tmp_path / "bf16"
    gpu_check.build_model(model, layers=2, device="cpu", dtype="bfloat16")
    res = quantize(QuantizeRequest(model=model, scheme="fp8-dynamic", out=tmp_path / "fp8"), timeout_s=900)
    expected = "bfloat16" if "bfloat16" in native_half(torch) else "float32"
    assert res.manifest.device is not None and res.manifest.device.load_dtype == expected, res.manifest.device
    with safe_open(str(res.out / "model.safetensors"), "pt") as f:
        kept = {f.get_slice(k).get_dtype() for k in f.keys() if k.endswith("norm.weight") or "embed" in k}
    assert kept == {"BF16"}
    assert checkpoint_dtype(res.out) == "bfloat16"
