"""`schemes: auto` in a release spec: the candidates are the top of `quantgate schemes`'s ranking
(quantgate.quantize.schemes.rank_schemes) for the spec's hardware, workload and model size.

    schemes: auto           # the ranking's first scheme that runs here and fits
    schemes: {auto: 2}      # its first two, in rank order (with `ladder: true`, tried in that order)

Schemes the serving build lacks kernels for (the kernel probe), and those the support matrix measured to fail for the
model's family here (quantgate.spec.familycheck), are ranked as not running. The model size comes from the
model's config.json (quantgate.target.modelshape), read without loading weights. At load time the config is read when it is already on disk (a checkpoint folder, or a catalogue model already
materialized); otherwise the spec is ranked provisionally without the size (every scheme counted as fitting) and
`at_flow_start` ranks again once the flow has the model, replacing the list when the size changes it. Both say
what they chose and why in the spec's machine notes, and the flow writes the ranking to <run>/schemes_auto.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import write_json
from quantgate.base.paths import models_dir
from quantgate.base.runfiles import SCHEMES_AUTO
from quantgate.quantize.schemes import ModelSize, load_schemes, rank_schemes, size_from_shape, top_schemes
from quantgate.spec.familycheck import matrix_reasons
from quantgate.serving.cpu_kernels import kernel_reasons
from quantgate.target.catalogue import load_catalogue
from quantgate.target.hardware import get_profile
from quantgate.target.modelshape import load_model_spec

AUTO = "auto"
UNKNOWN_SIZE = ModelSize(quantizable_params=0, other_params=0)


def auto_count(value: Any) -> int | None:
    """How many schemes an auto form asks for (`auto` -> 1, {auto: N} -> N); None for an explicit list. Raises
    ValueError for a malformed auto form."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return 1
    if isinstance(value, dict):
        n = value.get(AUTO)
        if set(value) != {AUTO} or not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError("write `schemes: auto` (the ranking's first scheme), `schemes: {auto: N}` with N >= 1 "
                             "(its first N), or a list of scheme ids")
        return n
    return None


def local_config(model: str) -> Path | None:
    """The model's config.json when it is already on disk (no download); None otherwise."""
    entry = load_catalogue().get(model)
    folder = models_dir() / entry.folder if entry is not None else Path(model).expanduser()
    config = folder / "config.json"
    return config if config.is_file() else None


def choose(hardware: str, workload: str, n: int, config: Path | None, python: Path | None = None) -> tuple[list[str], str]:
    """The top `n` schemes for this hardware and workload (the kernel probe narrows a CPU profile; without a
    serving environment the support table decides) and the note saying which, why, and what the size was."""
    schemes = list(get_profile(hardware).schemes)
    try:
        missing = kernel_reasons(hardware, schemes, python)
        probe = ""
    except QuantgateError as exc:
        missing, probe = {}, f" (kernel probe not run: {exc.message}; the support table decides)"
    if config is not None:  # what the support matrix measured to fail for this model's family here
        missing = matrix_reasons(config, hardware, [s for s in schemes if s not in missing], python) | missing
    size = size_from_shape(load_model_spec(config).shape) if config is not None else UNKNOWN_SIZE
    ranking = rank_schemes(get_profile(hardware), workload, size, load_schemes(), missing)
    picked, why = top_schemes(ranking, n)
    where = (f"model size from {config} ({(size.quantizable_params + size.other_params) / 1e9:.2f} B parameters)"
             if config is not None else "model size not known yet (its config is not on disk): provisional, "
             "ranked again at flow start")
    return picked, f"{why} [{where}{probe}]"


class AutoSchemesRecord(BaseModel):
    """<run>/schemes_auto.json: `schemes: auto` ranked again at flow start with the model's real size."""
    asked: int = Field(description="how many schemes the spec asked for")
    workload: str
    hardware: str
    at_load: list[str] = Field(description="what the ranking picked when the spec was loaded")
    schemes: list[str] = Field(description="what it picked at flow start: the release's schemes")
    note: str = Field(description="why, in words (also the spec's last machine note)")

    def write(self, run: Path) -> None:
        write_json(run / SCHEMES_AUTO, self.model_dump(mode="json"))


def at_flow_start(spec, model_dir: Path, run: Path, log=print):
    """The spec with `schemes: auto` ranked with the model's real size (when load time had to guess), and the
    ranking recorded in <run>/schemes_auto.json; a spec without the auto form comes back unchanged."""
    n = spec.auto_schemes
    if n is None:
        return spec
    picked, note = choose(spec.hardware, spec.workload, n, Path(model_dir) / "config.json", spec.serving.python)
    if not picked:
        raise QuantgateError(note, where="schemes", fix="list schemes explicitly, or pick other hardware")
    changed = picked != spec.schemes
    note = f"resolved at flow start{' (changed from ' + ', '.join(spec.schemes) + ')' if changed else ''}: {note}"
    AutoSchemesRecord(asked=n, workload=spec.workload, hardware=spec.hardware, at_load=list(spec.schemes),
                      schemes=picked, note=note).write(run)
    log(note)
    out = spec.model_copy(update={"schemes": picked}) if changed else spec
    out._machine = [*spec.machine_notes, note]
    return out
