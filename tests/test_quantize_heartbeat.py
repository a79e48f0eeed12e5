"""The quantization child's heartbeat (quantgate.quantize.heartbeat): which layer and module llmcompressor is at,
read from its log's tail, said at a fixed interval while the parent waits, within the parent's timeout."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from quantgate.quantize import heartbeat

# llmcompressor 0.x's own lines, as a SmoothQuant + GPTQ run writes them to quantize.log (tqdm rewrites with \r)
SMOOTHING = ("2026-12-06T02:03:36.7922 | initialize | INFO - Compression lifecycle initialized for 2 modifiers\n"
             "(2/31): Calibrating:  50%|#####     | 32/64 [00:01<00:01, 23.23it/s]\r"
             "(2/31): Calibrating: 100%|##########| 64/64 [00:02<00:00, 26.13it/s]\n"
             "2026-12-06T02:03:39.5939 | _apply_smoothing | INFO - Smoothing with model.layers.0.post_attention_layernorm\n"
             "(3/31): Calibrating:   9%|#         | 6/64 [00:00<00:00, 59.02it/s]\r")
GPTQ = ("(5/31): Propagating: 100%|##########| 64/64 [00:00<00:00, 102.31it/s]\n"
        "2026-12-06T02:05:01.1 | compress_modules | INFO - Quantizing 3 module(s): model.layers.3.self_attn.q_proj, "
        "model.layers.3.self_attn.k_proj, model.layers.3.self_attn.v_proj\n")


def test_the_stage_is_the_last_layer_and_module_in_the_log():
    assert heartbeat.stage(SMOOTHING) == "calibrating layer 3 of 31, last module model.layers.0.post_attention_layernorm"
    assert heartbeat.stage(GPTQ) == "propagating layer 5 of 31, last module model.layers.3.self_attn.q_proj"
    assert heartbeat.stage("Loading weights:  40%|####      | 109/272\r") is None


def test_waiting_for_the_child_says_where_it_is_at_every_interval(tmp_path):
    log_file, lines = tmp_path / "quantize.log", []
    script = f"import sys, time; open(sys.argv[1], 'w').write({SMOOTHING!r}); time.sleep(0.8)"
    with open(log_file, "wb"):
        proc = subprocess.Popen([sys.executable, "-c", script, str(log_file)])
    code = heartbeat.wait(proc, log_file, "quantizing int8-w8a8", lines.append, timeout_s=30, every_s=0.2)
    assert code == 0 and len(lines) >= 2, lines
    assert lines[-1].startswith("quantizing int8-w8a8: ") and lines[-1].endswith(
        " s, calibrating layer 3 of 31, last module model.layers.0.post_attention_layernorm"), lines


def test_the_timeout_still_holds_between_heartbeats(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    lines: list[str] = []
    t0 = time.monotonic()
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            heartbeat.wait(proc, tmp_path / "none.log", "quantizing x", lines.append, timeout_s=0.5, every_s=0.2)
        assert time.monotonic() - t0 < 5
        assert lines and all(ln.endswith("s, loading the model") for ln in lines), lines
    finally:
        proc.kill()
        proc.wait()
