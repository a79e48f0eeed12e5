"""Load YAML into pydantic models; every validation error names the file, the field path and the line.

All of quantgate's data files (release specs, policies, hardware profiles) go through `load_model`, so a
typo in any of them reads the same way:  `releases/demo.yaml:7 field 'workload': Input should be ...`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from quantgate.base.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


def _line_index(node: yaml.Node, path: tuple = (), out: dict | None = None) -> dict[tuple, int]:
    """Map each key path (tuple of str/int) in a composed YAML tree to its 1-based line."""
    out = {} if out is None else out
    out.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            sub = path + (key.value,)
            out[sub] = key.start_mark.line + 1
            _line_index(value, sub, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _line_index(item, path + (i,), out)
    return out


def read_yaml(path: Path) -> tuple[Any, dict[tuple, int]]:
    """Parse a YAML file, returning (data, line index). Syntax errors name the line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("file not found", where=str(path), fix="check the path (relative paths are from the current directory)")
    text = path.read_text(encoding="utf-8")
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"invalid YAML: {getattr(exc, 'problem', exc)}", where=where, fix="correct the YAML syntax at that line") from None
    return data, (_line_index(node) if node is not None else {})


def validation_error(path: Path, exc: ValidationError, lines: dict[tuple, int], schema: str = "") -> ConfigError:
    """Turn a pydantic error into one ConfigError listing every problem with its line."""
    problems = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        # the deepest prefix of the location that exists in the file gives the line
        line = next((lines[loc[:i]] for i in range(len(loc), -1, -1) if loc[:i] in lines), None)
        field = ".".join(str(p) for p in loc) or "(top level)"
        problems.append(f"{path}:{line or '?'} field '{field}': {err['msg']}")
    first = problems[0].split(": ", 1)
    rest = "".join(f"\n  {p}" for p in problems[1:])
    return ConfigError(first[1] + rest, where=first[0], fix=f"edit the field(s) named above{f' (schema: {schema})' if schema else ''}")


def load_model(path: Path | str, model: type[M], **context: Any) -> M:
    """Read `path` and validate it as `model`. `context` goes to validators (e.g. the base directory)."""
    path = Path(path)
    data, lines = read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError("expected a mapping at the top level", where=f"{path}:1", fix=f"write the file as `key: value` fields of {model.__name__}")
    try:
        return model.model_validate(data, context={"path": path, **context})
    except ValidationError as exc:
        raise validation_error(path, exc, lines, f"{model.__module__}.{model.__name__}") from None
