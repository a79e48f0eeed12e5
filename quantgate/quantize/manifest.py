"""The quantize manifest: `quantgate-quant.json` in a checkpoint folder, written by quantize.run once the child's
output is checked; a release copies it, `reused` in front, to `<run>/<candidate>/quantization.json`.

One model for both files. Every field is optional so that an older or partial file still reads; the writer sets every
field (None included) and only the set ones are written, in this order (`reused` only in the run folder's copy).
`overrides`, `preflight` and `quantization_config` are kept as the dicts they are (a RecipeOverrides and a
PreflightResult dumped, llmcompressor's config), `timings_s` as {part: seconds}.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from quantgate.base.fileio import write_json
from quantgate.base.typedfile import SetFields, read_model
from quantgate.quantize.jobfile import DeviceRecord
from quantgate.target.families import Kept

MANIFEST = "quantgate-quant.json"


class SourceRef(BaseModel):
    """The checkpoint that was quantized."""
    model_config = ConfigDict(extra="allow")

    path: str | None = None
    sha256: str | None = None         # quantize.run.source_hash
    weights_bytes: int | None = None  # its .safetensors files together


class CalibrationRecord(BaseModel):
    """The calibration set as the child used it."""
    model_config = ConfigDict(extra="allow")

    source: str | None = None
    sha256: str | None = None
    samples: int | None = None         # records used
    available: int | None = None       # records the source had
    max_seq_length: int | None = None
    seed: int | None = None
    tokens: int | None = None          # tokens after rendering (the child counts them)


class QuantManifest(SetFields):
    """What a checkpoint was made from, how, with what, and what came out."""

    reused: bool | None = None                   # only in quantization.json: the checkpoint existed already
    format: int | None = None                    # quantize.run.FORMAT when it was made
    key: str | None = None                       # the quantization key (all inputs); names the keyed folder
    source: SourceRef | None = None
    scheme: str | None = None
    hardware: str | None = None                  # the hardware profile asked for, if any
    recipe_file: str | None = None
    recipe_applied: str | None = None            # the recipe text as applied (overrides included)
    overrides: dict[str, object] | None = None   # the request's RecipeOverrides
    family: str | None = None                    # the model family (quant_recipes/families.yaml), None if not listed
    kept: list[Kept] | None = None               # every module pattern kept at 16 bits, and why
    preflight: dict[str, object] | None = None   # the PreflightResult, `targeted` as a count
    calibration: CalibrationRecord | None = None  # None for a data-free scheme
    quantization_config: dict[str, Any] | None = None  # config.json's, as llmcompressor wrote it
    versions: dict[str, str] | None = None       # library versions, quantgate included
    workarounds: list[str] | None = None         # upstream bugs worked around
    device: DeviceRecord | None = None           # where oneshot calibrated
    timings_s: dict[str, float | None] | None = None  # the child's parts and the whole wall time
    size_on_disk_bytes: int | None = None
    weights_bytes: int | None = None
    compression_ratio: float | None = None       # source weights / quantized weights
    files: dict[str, int] | None = None          # every file of the folder -> its size
    created: str | None = None

    def write(self, folder: Path) -> None:
        """<folder>/quantgate-quant.json, as json.dumps(indent=2) writes it (no final newline)."""
        (folder / MANIFEST).write_text(json.dumps(self.dump(), indent=2), encoding="utf-8")

    def write_run_copy(self, path: Path, reused: bool) -> None:
        """A release's <run>/<candidate>/quantization.json: `reused`, then the manifest (fileio.write_json)."""
        write_json(path, self.model_copy(update={"reused": reused}).dump())

    @classmethod
    def read(cls, path: Path) -> QuantManifest | None:
        """The manifest, or None when it is missing, unreadable or does not fit (not a finished output)."""
        try:
            return cls.model_validate_json(path.read_bytes())
        except (OSError, ValidationError):
            return None


def read_quantization(path: Path | str) -> QuantManifest:
    """A quantization.json (or a quantgate-quant.json); RunFileError naming the file and field."""
    return read_model(path, QuantManifest, "quantization manifest",
                      "re-run the release with the same --run-id: the variant's step writes it again")
