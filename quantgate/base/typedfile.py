"""Read a JSON file of a run folder into its pydantic model, with one clear error when it does not validate.

Every typed run-folder file (comparison, judge report, recall cells and delta, pay-off, summary) is read through
`read_model`: a missing, unreadable or corrupt file, or one whose content does not fit the model, raises
`RunFileError` naming the file and the first field that failed (`metrics.exact_match.overall.n`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from quantgate.base.errors import QuantgateError

M = TypeVar("M", bound=BaseModel)


class RunFileError(QuantgateError):
    """A run-folder file that cannot be read as its model: `path` is the file, `field` the dotted field (or None)."""

    def __init__(self, message: str, *, path: Path | str, fix: str, field: str | None = None):
        self.path, self.field = str(path), field
        super().__init__(message, where=f"{path}: {field}" if field else str(path), fix=fix)


def field_path(loc: tuple) -> str:
    """A pydantic error location as a dotted field path ("comparison.overall.non_inferiority.n")."""
    return ".".join(str(p) for p in loc) or "(the whole file)"


def read_model(path: Path | str, model: type[M], what: str, fix: str) -> M:
    """The file's content validated by `model`; `what` names the file's role in the error ("judge report")."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RunFileError(f"{what}: missing file", path=path, fix=fix) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RunFileError(f"{what}: cannot read the file ({exc})", path=path, fix=fix) from None
    try:
        return model.model_validate_json(text)
    except ValidationError as exc:
        err = exc.errors()[0]
        if err["type"] == "json_invalid":
            raise RunFileError(f"{what}: corrupt JSON ({err['msg']})", path=path, fix=fix) from None
        if not err["loc"] and err["type"] in ("model_type", "dict_type"):  # a list, a string, ... where an object goes
            found = type(json.loads(text)).__name__
            raise RunFileError(f"{what}: expected a JSON dict, found {found}", path=path, fix=fix) from None
        field = field_path(err["loc"])
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise RunFileError(f"{what}: unexpected content in field {field}: {err['msg']}{more}", path=path, fix=fix,
                           field=field) from None
