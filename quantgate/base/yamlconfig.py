"""Load YAML into pydantic models; every validation error names the file, the field path and the line.

All of quantgate's data files (release specs, policies, hardware profiles) go through `load_model`, so a
typo in any of them reads the same way:  `releases/demo.yaml:7 field 'workload': Input should be ...`.

Input rules, the same for every file:
- text is UTF-8; a UTF-8 byte-order mark and CRLF line ends are accepted; a byte that is not UTF-8 is reported
  with its file and line (`read_text`);
- a key given twice in one mapping is refused at the line of its second occurrence (YAML would silently keep the
  last value);
- every mapping key and every list item has its own line (`read_yaml`'s line index), so an error inside a list
  points at the item, not at the list's key;
- types are strict: a number or boolean field takes a YAML number or boolean, never a string ("0.05" is refused).
  Validation runs in pydantic's strict JSON mode, where strings still become paths, literals and enums (what a
  YAML file can express), but nothing is coerced from a string to a number. Exponent notation is a number
  (`1e-3`, `8.0e9`: YAML 1.2 rules; YAML 1.1 would read them as text);
- an unknown key is refused with the closest known one suggested;
- parser limits are input errors naming the line, never a crash: nesting deeper than MAX_DEPTH levels, more than
  MAX_VALUES values (aliases expanding into an "alias bomb"), a number of more than Python's 4300 digits, a date
  that does not exist (`2024-13-01`). A path the file names that cannot be looked at (a symlink loop) is refused
  naming the field that holds it (`load_model`).
"""

from __future__ import annotations

import datetime
import errno
import json
import math
import os
import re
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from quantgate.base.errors import ConfigError, did_you_mean

M = TypeVar("M", bound=BaseModel)
ITEM = "quantgate_item"  # ctx key of `item_error`: the index of the list item an error is about
FIELD = "quantgate_field"  # ctx key of `field_error`: the field (below the error's place) it is about
_MERGE = "tag:yaml.org,2002:merge"
_BOM = "\ufeff"


MAX_DEPTH = 100  # mappings and lists inside each other; quantgate's own files nest fewer than 10 levels
MAX_VALUES = 200_000  # values in one file, aliases expanded (the largest shipped file has a few thousand)


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads YAML 1.2 exponent floats (`1e-3`, `8.0e9`) as numbers, not text; that refuses
    nesting deeper than MAX_DEPTH (the composer recurses: Python's stack would overflow) and turns a value Python
    cannot construct (a 5000-digit integer, the 13th month) into a YAML error at the value's line."""

    _depth = 0

    def compose_node(self, parent, index):
        if self._depth >= MAX_DEPTH:
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"nested more than {MAX_DEPTH} levels deep (mappings and "
                                              "lists inside each other)", event.start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as exc:  # int(), datetime.date(): Python's limits, not YAML syntax
            problem = f"the value {_short(node)} cannot be read: {str(exc).split('; use sys.', 1)[0]}"
            raise yaml.constructor.ConstructorError(None, None, problem, node.start_mark) from None


def _short(node: yaml.Node) -> str:
    text = node.value if isinstance(node, yaml.ScalarNode) else f"<{node.id}>"
    return repr(text if len(text) <= 40 else f"{text[:20]}...{text[-10:]} ({len(text)} characters)")


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


# --- text ------------------------------------------------------------------------------------------------

def not_utf8(exc: UnicodeDecodeError, data: bytes, source: Path | str, first_line: int = 1) -> ConfigError:
    """The error for bytes that are not UTF-8: file, line and column of the first bad byte."""
    line = first_line + data.count(b"\n", 0, exc.start)
    column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
    return ConfigError(f"not UTF-8: byte 0x{data[exc.start]:02x} at column {column}", where=f"{source}:{line}",
                       fix="save the file as UTF-8 (or replace the character at that place)")


def decode_utf8(data: bytes, source: Path | str, first_line: int = 1) -> str:
    """UTF-8 bytes -> text without a leading byte-order mark; a ConfigError names the line of a bad byte."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise not_utf8(exc, data, source, first_line) from None
    return text.removeprefix(_BOM)


def read_text(path: Path | str) -> str:
    """A UTF-8 text file (BOM removed; CRLF kept for the parsers, which all accept it)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("file not found", where=str(path), fix="check the path (relative paths are from the current directory)")
    return decode_utf8(read_bytes(path), path)


def read_bytes(path: Path) -> bytes:
    """A file's bytes; a ConfigError naming it when it cannot be read (permissions, an I/O error)."""
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the file: {exc.strerror or exc}", where=str(path),
                          fix="check its permissions (and the disk it is on)") from None


# --- YAML ------------------------------------------------------------------------------------------------

def _key_id(node: yaml.Node) -> tuple | None:
    """What makes two mapping keys the same key: tag and text of a scalar (None: not comparable, e.g. a merge)."""
    if isinstance(node, yaml.ScalarNode) and node.tag != _MERGE:
        return (node.tag, node.value)
    return None


def _dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path) or "(top level)"


def _line_index(node: yaml.Node, source: Path | str = "", path: tuple = (), out: dict | None = None,
                _active: frozenset = frozenset()) -> dict[tuple, int]:
    """Map each key path (tuple of str/int) in a composed YAML tree to its 1-based line: a mapping key's line,
    a list item's own line. Refuses a key given twice in one mapping (ConfigError at the second one)."""
    out = {} if out is None else out
    out.setdefault(path, node.start_mark.line + 1)
    if len(out) > MAX_VALUES or len(path) > MAX_DEPTH:  # aliases only: the composer bounds the depth of the text
        what = f"more than {MAX_VALUES} values" if len(out) > MAX_VALUES else f"values nested more than {MAX_DEPTH} levels"
        raise ConfigError(f"the file expands to {what} through its aliases (`*name`)",
                          where=f"{source}:{node.start_mark.line + 1} field '{_dotted(path)}'",
                          fix="write the values out instead of nesting aliases inside each other")
    if id(node) in _active:
        raise ConfigError("a recursive alias: the value contains itself", where=f"{source}:{node.start_mark.line + 1} "
                          f"field '{_dotted(path)}'", fix="write the value out instead of referring to itself")
    inner = _active | {id(node)}
    if isinstance(node, yaml.MappingNode):
        seen: dict[tuple, int] = {}
        for key, value in node.value:
            line = key.start_mark.line + 1
            kid = _key_id(key)
            if kid is not None and kid in seen:
                field = _dotted(path + (key.value,))
                raise ConfigError(f"duplicate key {key.value!r} (first at line {seen[kid]}); YAML would keep only "
                                  "the last value", where=f"{source}:{line} field '{field}'",
                                  fix="delete one of the two, or merge their values into one")
            if kid is not None:
                seen[kid] = line
            if not isinstance(key, yaml.ScalarNode):
                continue
            sub = path + (key.value,)
            out[sub] = line
            _line_index(value, source, sub, out, inner)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out[path + (i,)] = item.start_mark.line + 1
            _line_index(item, source, path + (i,), out, inner)
    return out


def _yaml_error(path: Path, text: str, exc: yaml.YAMLError) -> ConfigError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    if mark is not None:
        line = mark.line + 1
    elif isinstance(exc, yaml.reader.ReaderError):  # a character YAML does not allow (control characters)
        line = text.count("\n", 0, exc.position) + 1
    else:
        line = None
    problem = getattr(exc, "problem", None) or str(exc)
    if isinstance(exc, yaml.reader.ReaderError):
        char = exc.character if isinstance(exc.character, int) else ord(exc.character[:1] or "\0")
        problem = f"character U+{char:04X} is not allowed in YAML (a control or non-printable character)"
    fix = "correct the YAML syntax at that line"
    if problem.startswith("nested more than"):
        fix = "flatten the structure: no quantgate file nests more than a few levels"
    elif problem.startswith("the value "):
        fix = "correct the value, or quote it to make it text"
    return ConfigError(f"invalid YAML: {problem}", where=f"{path}:{line}" if line else str(path), fix=fix)


def read_yaml(path: Path | str) -> tuple[Any, dict[tuple, int]]:
    """Parse a YAML file, returning (data, line index). Syntax errors, duplicate keys and bytes that are not UTF-8
    name the line."""
    path = Path(path)
    text = read_text(path)
    loader = None
    try:
        loader = _Loader(text)  # refuses characters YAML does not allow (ReaderError)
        node = loader.get_single_node()
        lines = _line_index(node, path) if node is not None else {}
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        raise _yaml_error(path, text, exc) from None
    except RecursionError:  # a stack already deep where read_yaml was called: the line the reader had reached
        line = loader.line + 1 if loader is not None else None
        raise ConfigError("YAML nested too deeply for the parser", where=f"{path}:{line}" if line else str(path),
                          fix="flatten the structure") from None
    finally:
        if loader is not None:
            loader.dispose()
    return data, lines


# --- validation ------------------------------------------------------------------------------------------

def item_error(index: int, message: str) -> PydanticCustomError:
    """For a validator of a whole list: an error about its item `index`, reported at that item's own line."""
    return PydanticCustomError("value_error", message, {ITEM: index})


def field_error(path: tuple[str, ...], message: str) -> PydanticCustomError:
    """For a validator of a whole model (a cross-field check): an error about its field `path` (relative to the
    model, e.g. ("serving", "kv_cache_dtype")), named and reported at that field's own line."""
    return PydanticCustomError("value_error", message, {FIELD: list(path)})


def _jsonable(value: Any) -> Any:
    """YAML data as JSON data: keys as text, dates as ISO text, sets as lists (JSON mode validates the rest)."""
    if isinstance(value, dict):
        return {k if isinstance(k, str) else json.dumps(_jsonable(k)).strip('"'): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (datetime.date, datetime.datetime)):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def _unwrap(tp: Any) -> list[Any]:
    """The concrete types behind Optional/Union/Annotated."""
    origin = get_origin(tp)
    if origin is Annotated:
        return _unwrap(get_args(tp)[0])
    if origin is Union or origin is types.UnionType:
        return [t for a in get_args(tp) for t in _unwrap(a) if t is not type(None)]
    return [tp]


def _step(tp: Any, part: Any) -> Any:
    for t in _unwrap(tp):
        origin = get_origin(t)
        if isinstance(t, type) and issubclass(t, BaseModel):
            if part in t.model_fields:
                return t.model_fields[part].annotation
            if getattr(t, "__pydantic_root_model__", False):
                return _step(t.model_fields["root"].annotation, part)
        elif origin in (list, tuple, set, frozenset) and isinstance(part, int):
            return get_args(t)[0] if get_args(t) else None
        elif origin is dict and isinstance(part, str) and len(get_args(t)) == 2:
            return get_args(t)[1]
    return None


def known_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """The keys the model accepts at `loc` (the location of a mapping inside it); [] when unknown."""
    tp: Any = model
    for part in loc:
        tp = _step(tp, part)
        if tp is None:
            return []
    for t in _unwrap(tp):
        if isinstance(t, type) and issubclass(t, BaseModel) and not getattr(t, "__pydantic_root_model__", False):
            return [f.alias or name for name, f in t.model_fields.items()]
    return []


_NUMBER_TYPES = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
                 "int_parsing": "an integer", "float_parsing": "a number", "bool_parsing": "true or false"}


def describe_error(err: Mapping[str, Any], model: type[BaseModel] | None = None) -> str:
    """One pydantic error as text, with a hint: the closest known key for an unknown one; for a string where a
    number belongs, that the quotes must go."""
    msg = err["msg"].removeprefix("Value error, ")
    value = err.get("input")
    if err["type"] == "extra_forbidden" and model is not None and err["loc"]:
        known = known_keys(model, tuple(err["loc"][:-1]))
        hint = did_you_mean(err["loc"][-1], known)
        msg += hint or (f"; known keys: {', '.join(known)}" if known else "")
    elif err["type"] in _NUMBER_TYPES and isinstance(value, str):
        msg += f"; got the string {value!r}: write {_NUMBER_TYPES[err['type']]} without quotes"
    elif isinstance(value, float) and not math.isfinite(value):  # `.nan` is below, above and equal to nothing
        msg = "not a number (NaN): write the value as a number" if math.isnan(value) else \
            f"{value} is not a finite number: write a finite number"
    return msg


def validation_error(path: Path, exc: ValidationError, lines: dict[tuple, int], schema: str = "",
                     model: type[BaseModel] | None = None) -> ConfigError:
    """Turn a pydantic error into one ConfigError listing every problem with its line."""
    problems = []
    for err in exc.errors():
        loc = tuple(err["loc"]) + tuple((err.get("ctx") or {}).get(FIELD) or ())
        item = (err.get("ctx") or {}).get(ITEM)
        at = loc + (item,) if isinstance(item, int) else loc
        # the deepest prefix of the location that exists in the file gives the line
        line = next((lines[at[:i]] for i in range(len(at), -1, -1) if at[:i] in lines), None)
        field = f"'{_dotted(loc)}'" + (f" (list item {item + 1})" if isinstance(item, int) else "")
        problems.append((f"{path}:{line or '?'} field {field}", describe_error(err, model)))
    rest = "".join(f"\n  {where}: {msg}" for where, msg in problems[1:])
    return ConfigError(problems[0][1] + rest, where=problems[0][0],
                       fix=f"edit the field(s) named above{f' (schema: {schema})' if schema else ''}")


def load_model(path: Path | str, model: type[M], **context: Any) -> M:
    """Read `path` and validate it as `model` (strict types, see the module doc). `context` goes to validators
    (e.g. the base directory)."""
    path = Path(path)
    data, lines = read_yaml(path)
    if not isinstance(data, dict):
        got = "nothing" if data is None else f"a {'list' if isinstance(data, list) else type(data).__name__}"
        raise ConfigError(f"expected a mapping at the top level, got {got}", where=f"{path}:{top_line(lines)}",
                          fix=f"write the file as `key: value` fields of {model.__name__}")
    try:
        return model.model_validate_json(json.dumps(_jsonable(data)), strict=True, context={"path": path, **context})
    except ValidationError as exc:
        raise validation_error(path, exc, lines, f"{model.__module__}.{model.__name__}", model) from None
    except (OSError, RuntimeError) as exc:  # a validator looked at a path the file names: a loop, no permission
        if isinstance(exc, RuntimeError) and not str(exc).startswith("Symlink loop"):
            raise
        raise path_error(path, exc, data, lines) from None


def top_line(lines: dict[tuple, int]) -> int:
    """The line where a file's top-level value starts (after leading comments); 1 for an empty file."""
    return lines.get((), 1)


def _holder(data: Any, named: str, base: Path, at: tuple = ()) -> tuple | None:
    """The key path of the first string in `data` that names the file `named` (as written, or relative to `base`)."""
    if isinstance(data, dict):
        items = list(data.items())
    elif isinstance(data, list):
        items = list(enumerate(data))
    else:
        if isinstance(data, str) and data.strip():
            written = Path(data).expanduser()
            for p in (written, base / written):
                if os.path.abspath(p) == os.path.abspath(named) or str(p) == named:
                    return at
        return None
    for k, v in items:
        if (found := _holder(v, named, base, at + (k,))) is not None:
            return found
    return None


def path_error(path: Path, exc: OSError | RuntimeError, data: Any, lines: dict[tuple, int]) -> ConfigError:
    """A path named in the file that could not be looked at, at the line and field that names it."""
    if isinstance(exc, OSError):
        named = exc.filename or ""
        why = "a symlink loop" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
    else:  # Python < 3.13 pathlib: RuntimeError("Symlink loop from '<path>'")
        named, why = str(exc).partition("'")[2].rpartition("'")[0], "a symlink loop"
    at = _holder(data, str(named), path.parent) if named else None
    where = f"{path}:{lines.get(at, top_line(lines))} field '{_dotted(at)}'" if at is not None else str(path)
    return ConfigError(f"cannot use {named or 'a path this file names'}: {why}", where=where,
                       fix="point the field at an existing file or folder (resolve the link, or fix its permissions)")


def under(name: str, model: type[M], raw: object, context: Mapping[str, object] | None = None) -> M:
    """`raw` validated by `model` inside a validator of an enclosing model, as its entry `name` (a section keyed by a
    name, checked by a model chosen by that name): each error's path keeps `name`, so that the file's error reads
    `kinds.<name>.<field>`, not `kinds.<field>`."""
    try:
        return model.model_validate({} if raw is None else raw, context=context)
    except ValidationError as exc:
        errors: list[InitErrorDetails] = []
        for e in exc.errors(include_url=False):
            one = InitErrorDetails(type=e["type"], loc=(name, *e["loc"]), input=e["input"])
            if "ctx" in e:
                one["ctx"] = e["ctx"]
            errors.append(one)
        raise ValidationError.from_exception_data(exc.title, errors) from None
