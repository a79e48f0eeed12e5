"""The quantization child's heartbeat: while llmcompressor calibrates (minutes on a CPU, with nothing on the
orchestrator's log: 476 s of silence once), the parent says every HEARTBEAT_S seconds how long it has run and,
read from the tail of the child's log, which layer its sequential pipeline is at and the last module it smoothed
or quantized."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

HEARTBEAT_S = 25.0  # under the 30 s a release's log may stay silent while quantizing
TAIL_BYTES = 16384  # the tqdm bars rewrite their line with \r: the last few KB hold the current one
# llmcompressor's sequential pipeline ("(12/31): Calibrating: 40%|...") and its modifiers' per-module lines
_LAYER = re.compile(r"\((\d+)/(\d+)\): (Calibrating|Propagating)")
_MODULE = re.compile(r"(?:Smoothing with|Quantizing \d+ module\(s\):) ([\w.]+)")


def stage(tail: str) -> str | None:
    """What the log's tail says llmcompressor is doing ('calibrating layer 12 of 31, last module
    model.layers.11.mlp.down_proj'), or None when it says neither (still loading the model)."""
    parts = []
    if layers := _LAYER.findall(tail):
        k, n, what = layers[-1]
        parts.append(f"{what.lower()} layer {k} of {n}")
    if modules := _MODULE.findall(tail):
        parts.append(f"last module {modules[-1]}")
    return ", ".join(parts) or None


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, 2) - TAIL_BYTES))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


def wait(proc: subprocess.Popen, log_file: Path, label: str, log: Callable[[str], None],
         timeout_s: float | None = None, every_s: float = HEARTBEAT_S) -> int:
    """proc.wait(timeout_s), saying '<label>: 50 s, calibrating layer 12 of 31, ...' every `every_s` seconds
    meanwhile; subprocess.TimeoutExpired past `timeout_s`, as proc.wait raises it."""
    start = time.monotonic()
    while True:
        left = None if timeout_s is None else timeout_s - (time.monotonic() - start)
        try:
            return proc.wait(timeout=every_s if left is None else max(0.0, min(every_s, left)))
        except subprocess.TimeoutExpired:
            if left is not None and left <= every_s:
                raise
        log(f"{label}: {time.monotonic() - start:.0f} s, {stage(_tail(log_file)) or 'loading the model'}")
