"""The root cause of a failed start, read from a log the way a person reads it: the last exception line that is not a
wrapper's ("Engine core initialization failed. See root cause above."), without vLLM's process prefix."""

from __future__ import annotations

from quantgate.serving.logcause import log_cause, root_cause

VLLM_LOG = """\
INFO 12-06 09:20:11 [api_server.py:1200] vLLM API server version 0.32.0
(EngineCore_DP0 pid=4242) ERROR 12-06 09:20:19 [core.py:700] EngineCore failed to start.
(EngineCore_DP0 pid=4242) ERROR 12-06 09:20:19 [core.py:700] Traceback (most recent call last):
(EngineCore_DP0 pid=4242) ERROR 12-06 09:20:19 [core.py:700]   File "/x/vllm/v1/engine/core.py", line 690, in run
(EngineCore_DP0 pid=4242) ERROR 12-06 09:20:19 [core.py:700] ValueError: Torch SDPA backend does not support logits soft cap.
Process EngineCore_DP0:
Traceback (most recent call last):
  File "/x/vllm/v1/engine/core.py", line 690, in run
ValueError: Torch SDPA backend does not support logits soft cap.
Traceback (most recent call last):
  File "/x/vllm/entrypoints/openai/api_server.py", line 1800, in <module>
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_the_root_cause_is_the_last_exception_that_is_not_a_wrapper():
    assert root_cause(VLLM_LOG) == "ValueError: Torch SDPA backend does not support logits soft cap."


def test_a_prefixed_line_alone_is_read_without_its_prefix_and_long_causes_are_cut(tmp_path):
    line = "(EngineCore_DP0 pid=7) ERROR 12-06 09:20:19 [core.py:700] torch.OutOfMemoryError: " + "x" * 500
    got = root_cause(line, limit=80)
    assert got is not None and got.startswith("torch.OutOfMemoryError: x") and len(got) == 80 and got.endswith("...")
    assert root_cause("INFO all good\nWARNING nothing wrong here\n") is None
    assert log_cause(tmp_path / "missing.log") is None
    (tmp_path / "server.log").write_text(VLLM_LOG)
    assert log_cause(tmp_path / "server.log", limit=300).startswith("ValueError: Torch SDPA")
