"""Read a JSON file of a run folder into its pydantic model, with one clear error when it does not validate.

Every typed run-folder file (comparison, judge report, recall cells and delta, pay-off, summary) is read through
`read_model`: a missing, unreadable or corrupt file, or one whose content does not fit the model, raises
`RunFileError` naming the file and the first field that failed (`metrics.exact_match.overall.n`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from quantgate.base.errors import QuantgateError

M = TypeVar("M", bound=BaseModel)



class SetFields(BaseModel):
    """A file's model written as its writer gave it: `dump` is the fields the writer set (None included), under their
    file names, in the model's order, so a file moved onto its model keeps its bytes. Keys of a newer writer are
    kept."""
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    def dump(self) -> dict[str, object]:
        return self.model_dump(by_alias=True, exclude_unset=True)

class RunFileError(QuantgateError):
    """A run-folder file that cannot be read as its model: `path` is the file, `field` the dotted field (or None)."""

    def __init__(self, message: str, *, path: Path | str, fix: str, field: str | None = None):
        self.path, self.field = str(path), field
        super().__init__(message, where=f"{path}: {field}" if field else str(path), fix=fix)


def field_path(loc: tuple) -> str:
    """A pydantic error location as a dotted field path ("comparison.overall.non_inferiority.n")."""
    return ".".join(str(p) for p in loc) or "(the whole file)"


def _text(path: Path, what: str, fix: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RunFileError(f"{what}: missing file", path=path, fix=fix) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RunFileError(f"{what}: cannot read the file ({exc})", path=path, fix=fix) from None


def _refusal(exc: ValidationError, text: str, path: Path, what: str, fix: str) -> RunFileError:
    """The first field that failed, as a RunFileError."""
    err = exc.errors()[0]
    if err["type"] == "json_invalid":
        return RunFileError(f"{what}: corrupt JSON ({err['msg']})", path=path, fix=fix)
    if not err["loc"] and err["type"] in ("model_type", "dict_type"):  # a list, a string, ... where an object goes
        found = type(json.loads(text)).__name__
        return RunFileError(f"{what}: expected a JSON dict, found {found}", path=path, fix=fix)
    field = field_path(err["loc"])
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return RunFileError(f"{what}: unexpected content in field {field}: {err['msg']}{more}", path=path, fix=fix,
                        field=field)


def read_model(path: Path | str, model: type[M], what: str, fix: str) -> M:
    """The file's content validated by `model`; `what` names the file's role in the error ("judge report")."""
    path = Path(path)
    text = _text(path, what, fix)
    try:
        return model.model_validate_json(text)
    except ValidationError as exc:
        raise _refusal(exc, text, path, what, fix) from None


def read_migrated(path: Path | str, model: type[M], what: str, fix: str,
                  migrations: Mapping[int, Callable[[dict[str, object]], dict[str, object]]], current: int) -> M:
    """read_model for a versioned file: its `schema_version` (1 when absent) is brought to `current` by
    `migrations[v]` (v -> v+1) before it is validated; a version newer than `current` is refused."""
    path = Path(path)
    text = _text(path, what, fix)
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise RunFileError(f"{what}: corrupt JSON ({exc})", path=path, fix=fix) from None
    if not isinstance(doc, dict):
        raise RunFileError(f"{what}: expected a JSON dict, found {type(doc).__name__}", path=path, fix=fix)
    version = doc.get("schema_version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= current:
        raise RunFileError(f"{what}: schema_version {version!r} is not one this quantgate reads (1 to {current})",
                           path=path, field="schema_version", fix="read it with the quantgate that wrote it (a newer "
                           "one writes versions this one does not know), or re-run the release")
    while version < current:
        doc = migrations[version](doc)
        version += 1
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        raise _refusal(exc, text, path, what, fix) from None
