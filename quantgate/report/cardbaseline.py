"""What a model card says about its baseline: what the checkpoint is, the Hub model it was made from, its license.

Each is taken from what states it, never guessed; a field nothing states is left out of the card:
    what it is     the model catalogue's `provenance` (releases/models.yaml), when the baseline is a catalogue model:
                   the spec's `model` is a catalogue id, or the baseline folder is a catalogue materialization (its
                   quantgate-model.json names the entry); else the checkpoint folder's name. The demo's baseline is
                   a BF16 checkpoint dequantized from a 4-bit GGUF, and a card that called it "unquantized" would
                   misstate every figure it shows.
    base_model     the catalogue's `base_model`, else the Hugging Face cache layout of the folder, `_name_or_path`
                   in its config.json, or the spec's `model` when that reads as a Hub id (base_model_of)
    license        the release spec's `license`, else the catalogue's, else the baseline's own README.md front
                   matter or config.json (license_of)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from quantgate.base.fileio import json_object
from quantgate.base.runfiles import EVIDENCE
from quantgate.quantize.manifest import QuantManifest
from quantgate.target.catalogue import MANIFEST, CatalogueModel, load_catalogue

README = "README.md"  # a checkpoint's own model card, front matter first
BASELINE = "baseline"  # the baseline's folder in a run folder (quantgate.gate.evidence.BASELINE)
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*", re.ASCII)
_FRONT_MATTER = re.compile(r"\A\s*---\r?\n(.*?)\r?\n---[ \t]*(?:\r?\n|\Z)", re.S)


def _card_data(path: Path) -> dict[str, Any]:
    """The YAML front matter of a model card file, or {} when there is none or it does not parse to a mapping."""
    try:
        found = _FRONT_MATTER.match(path.read_text(encoding="utf-8"))
        doc = yaml.safe_load(found.group(1)) if found else None
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return doc if isinstance(doc, dict) else {}


def hub_id(value: Any) -> str | None:
    """`value` when it reads as a Hub model id, `org/name` (the form base_model takes), else None: a local path
    (absolute, `./`, `~`), a display name, a bare catalogue id."""
    if not isinstance(value, str) or not HUB_ID.fullmatch(value) or "--" in value or ".." in value:
        return None
    return value if all(len(part) <= 96 for part in value.split("/")) else None


def baseline_folder(run: Path, quant: QuantManifest) -> Path | None:
    """The checkpoint the candidate was made from: the quantize manifest's source, else the run's baseline
    variant; None for an endpoint baseline, or a folder that is not on this machine (any more)."""
    variant = json_object(run / BASELINE / EVIDENCE).get("variant")
    for path in (quant.source.path if quant.source else None,
                 (variant or {}).get("path") if isinstance(variant, dict) else None):
        if isinstance(path, str) and path and Path(path).is_dir():
            return Path(path)
    return None


def catalogue_model(folder: Path | None, spec_model: Any) -> CatalogueModel | None:
    """The catalogue entry the baseline is: the spec's `model` when it is a catalogue id, else the entry that the
    folder's catalogue manifest names (a spec may give the materialized folder's path); None for any other model."""
    catalogue = load_catalogue()
    if isinstance(spec_model, str) and spec_model in catalogue:
        return catalogue[spec_model]
    named = json_object(folder / MANIFEST).get("model") if folder is not None else None
    return catalogue.get(named) if isinstance(named, str) else None


def base_model_of(folder: Path | None, spec_model: Any) -> str | None:
    """The baseline's Hub id, from the first of: the Hugging Face cache layout of its folder
    (`.../models--org--name/snapshots/<commit>`, which names the repository), `_name_or_path` in its config.json
    (what transformers recorded loading it from), the release spec's `model` (a catalogue id or a checkpoint folder:
    a folder given as `org/name` is taken to be named after its Hub repository). None when none reads as a Hub id
    (absolute paths, display names, a catalogue id: the catalogue's own `base_model` names those, baseline_facts)."""
    if folder is not None:
        for part in reversed(folder.parts):
            bits = part.split("--")
            if len(bits) == 3 and bits[0] == "models" and (found := hub_id(f"{bits[1]}/{bits[2]}")):
                return found
        if found := hub_id(json_object(folder / "config.json").get("_name_or_path")):
            return found
    return hub_id(spec_model)


def license_of(folder: Path | None) -> dict[str, str]:
    """The baseline's license as it states it: `license` from its README.md front matter (with `license_name` and
    `license_link`, which a `license: other` card gives), else `license` in its config.json; {} when neither says.
    Never a default: the quantized weights carry the baseline's license, and a card without one says nothing wrong."""
    if folder is None:
        return {}
    card = _card_data(folder / README)
    if isinstance(card.get("license"), str):
        return {k: card[k] for k in ("license", "license_name", "license_link") if isinstance(card.get(k), str)}
    stated = json_object(folder / "config.json").get("license")
    return {"license": stated} if isinstance(stated, str) else {}


def baseline_facts(folder: Path | None, spec: dict[str, Any]) -> dict[str, Any]:
    """The CardInputs fields about the baseline (`baseline`, `base_model`, `license` and its name and link), from
    the spec as the run recorded it and the baseline's folder (None: not on this machine); see the module docstring."""
    entry = catalogue_model(folder, spec.get("model"))
    stated = spec.get("license") if isinstance(spec.get("license"), str) else None
    what = f"the checkpoint folder `{folder.name}`" if folder is not None else None
    base: str | None = None
    if entry is not None:
        what, base = f"{entry.name} (catalogue id `{entry.id}`), {entry.provenance}", entry.base_model
        stated = stated or entry.license
    return {"baseline": what, "base_model": base or base_model_of(folder, spec.get("model")),
            **({"license": stated} if stated else license_of(folder))}
