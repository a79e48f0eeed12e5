"""The two files between quantize.run and its child (quantize.runner), in the child's work folder: `job.json`
(what to quantize, written by the parent) and the result file (what happened, written by the child).

Both sides import this module, so it stays light: pydantic only (the child imports it before torch).
Both files are written with `json.dumps(..., indent=2)`; the result holds only the keys the child set, in this order.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from quantgate.base.typedfile import SetFields, read_model


class RunnerJob(BaseModel):
    """job.json: the child's one argument."""
    model_config = ConfigDict(extra="allow")

    model: str                          # the source checkpoint folder (resolved)
    recipe: str                         # the recipe as applied (a YAML file in the work folder)
    out: str                            # where the child saves the checkpoint (the hidden temporary folder)
    result: str                         # where the child writes its RunnerResult
    seed: int = 0                       # torch seed
    calibration: str | None = None      # the calibration records (JSONL); None for a data-free scheme
    max_seq_length: int | None = None   # calibration length in tokens; None for a data-free scheme

    def write(self, path: Path) -> None:
        """Every field, in this order."""
        Path(path).write_text(json.dumps(self.model_dump(), indent=2), encoding="utf-8")

    @classmethod
    def read(cls, path: Path | str) -> RunnerJob:
        return cls.model_validate_json(Path(path).read_text(encoding="utf-8"))


class DeviceRecord(BaseModel):
    """Where oneshot calibrated (runner.device_record, quantize.devices.choose_device); keys only where known."""
    model_config = ConfigDict(extra="allow")

    device: str                                 # "cpu" or "cuda:0"
    physical_gpu: str | None = None             # the GPU's number among all of the machine's
    reason: str | None = None                   # why there
    name: str | None = None                     # the GPU's name (on a GPU only)
    load_dtype: str | None = None               # the dtype the model was loaded in for calibration
    calibration_dtype_reason: str | None = None  # why that dtype
    peak_memory_bytes: int | None = None        # peak GPU memory of oneshot (on a GPU only)


class RunnerResult(SetFields):
    """The child's result file: what it did, how long each part took, or why it refused or crashed. A field is
    written only once the child set it."""

    versions: dict[str, str] = {}         # library versions in the child
    workarounds: list[str] = []           # upstream bugs worked around in this run
    refused: str | None = None            # "recipe" or "calibration": refused before the model was loaded
    message: str | None = None            # why it was refused
    calibration_tokens: int | None = None  # tokens in the rendered calibration set
    prepare_s: float | None = None
    load_s: float | None = None
    device: DeviceRecord | None = None
    oneshot_s: float | None = None
    save_s: float | None = None
    total_s: float | None = None
    crashed: str | None = None            # the traceback, when the child crashed

    def write(self, path: Path | str) -> None:
        Path(path).write_text(json.dumps(self.dump(), indent=2), encoding="utf-8")

    @classmethod
    def read(cls, path: Path) -> RunnerResult:
        """The result file; an empty result when the child wrote none (killed before it could)."""
        if not path.is_file():
            return cls()
        return read_model(path, cls, "quantization child's result",
                          "run the quantization again (the child left a file it did not finish)")
