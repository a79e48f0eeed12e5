"""Where an eval set's samples come from (quantgate.evals.dataset reads them through this): the sidecar's `source`
section (format, split, column mapping, defaults), the file names that go together (`<name>.jsonl|.parquet|.csv`
or a folder, beside `<name>.meta.yaml`), and the rows of each format with the place each came from: a JSONL
line, or a row of a Parquet or CSV file or of a folder saved by `datasets` (read through Hugging Face `datasets`).
A chat log in OpenAI's messages format becomes prompt turns and a reference here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.errors import ConfigError, did_you_mean
from quantgate.base.yamlconfig import not_utf8, read_bytes, read_yaml
from quantgate.evals.settext import json_list_cell, lone_surrogate, wrong_encoding

SUFFIXES = {".jsonl": "jsonl", ".parquet": "parquet", ".csv": "csv"}  # file name -> format; a folder: datasets
FIELDS = ("id", "category", "messages", "prompt", "references", "metrics", "criteria", "max_tokens")


class Columns(BaseModel):
    """Which column of the set holds each sample field (default: the field's own name)."""
    model_config = ConfigDict(extra="forbid")
    id: str = "id"
    category: str = "category"
    messages: str = "messages"
    prompt: str = "prompt"
    references: str = "references"
    metrics: str = "metrics"
    criteria: str = "criteria"
    max_tokens: str = "max_tokens"


class Defaults(BaseModel):
    """Values for the fields a set has no column for (a row's own value wins)."""
    model_config = ConfigDict(extra="forbid")
    category: str | None = Field(None, min_length=1)
    metrics: list[str] | None = Field(None, min_length=1)
    max_tokens: int | None = Field(None, ge=1)


class Source(BaseModel):
    """Where a set's samples come from and how its columns map onto sample fields. Without this section the set
    is a JSONL file in the schema's own fields, read strictly (no other field accepted)."""
    model_config = ConfigDict(extra="forbid")
    format: Literal["jsonl", "parquet", "csv", "datasets", "chat"] | None = Field(
        None, description="default from the path: .jsonl, .parquet, .csv, a folder (datasets' save_to_disk); chat: a "
                          "JSONL or Parquet log of OpenAI-format conversations whose last assistant turn is the reference")
    split: str | None = Field(None, description="the split of a datasets folder with several (default: its only one)")
    columns: Columns = Field(default_factory=Columns)
    defaults: Defaults = Field(default_factory=Defaults)

    @property
    def plain(self) -> bool:
        """The schema's own JSONL: no mapping, no defaults, no chat log."""
        return self.format in (None, "jsonl") and self.columns == Columns() and self.defaults == Defaults()


def meta_path_for(path: Path) -> Path:
    """`eval_sets/default.jsonl` -> `eval_sets/default.meta.yaml`; the same for .parquet and .csv, and beside a
    folder saved by `datasets`: `data/tickets/` -> `data/tickets.meta.yaml`."""
    suffix = next((x for x in SUFFIXES if path.name.endswith(x)), "")
    return path.with_name(path.name.removesuffix(suffix) + ".meta.yaml") if suffix or path.name else path


def samples_beside(meta: Path) -> Path:
    """The samples a sidecar describes: `<name>.jsonl`, `.parquet` or `.csv`, or the folder `<name>`, the first that
    exists (`<name>.jsonl` when none does)."""
    stem = meta.name.removesuffix(".meta.yaml")
    found = [meta.with_name(stem + x) for x in SUFFIXES] + [meta.with_name(stem)]
    return next((p for p in found if p.exists() and p != meta), found[0])


class SameName(ValueError):
    """Two eval sets of one release that no name tells apart (one file listed twice): `index` is the second's."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index


def _qualified(path: Path, depth: int, whole: bool) -> str:
    """`depth` folders before the file's stem (its whole name with `whole`), joined by dots: `emea.tickets`."""
    folders = path.parent.parts[len(path.parent.parts) - depth:] if depth else ()
    return ".".join([*folders, path.name if whole else path.stem])


def set_names(paths: Sequence[Path]) -> list[str]:
    """Each eval set's name in a release, in order: its cache folder, its key in the evidence, the compare files,
    the report and the gate's checks (`primary:<set>/<metric>`). The file's stem where no other set of the release
    has it (the names runs always had); where two share a stem, the fewest folders before it that tell them apart
    (`emea/tickets.parquet`, `apac/tickets` -> `emea.tickets`, `apac.tickets`), or the file names where they share
    a folder (`tickets.jsonl`, `tickets.parquet`). Dots, never `/`: a check name splits set from metric at
    `/`. Raises SameName naming both files when two still share a name (one file listed twice)."""
    names = [p.stem for p in paths]
    for stem in {n for n in names if names.count(n) > 1}:
        group = [i for i, n in enumerate(names) if n == stem]
        deepest = max(len(paths[i].parent.parts) for i in group)
        same_folder = len({paths[i].parent for i in group}) == 1  # then only the file names tell them apart
        for depth, whole in [(0, True)] * same_folder + [(d, w) for d in range(1, deepest + 1) for w in (False, True)]:
            tried = {i: _qualified(paths[i], depth, whole) for i in group}
            if len(set(tried.values())) == len(group):
                names = [tried.get(i, n) for i, n in enumerate(names)]
                break
    for i, name in enumerate(names):
        if name in names[:i]:
            first = names.index(name)
            raise SameName(f"eval sets {paths[first]} (list item {first + 1}) and {paths[i]} would both be named "
                           f"{name!r} in the run, its compare files and the gate: "
                           + ("the same file is listed twice; list it once" if paths[first] == paths[i] else
                              "rename one of the files"), i)
    return names


def format_of(path: Path, source: Source | None) -> str:
    """The set's format: the sidecar's `source.format`, else from the path (a folder: datasets)."""
    if source is not None and source.format is not None:
        return source.format
    if path.is_dir():
        return "datasets"
    return next((f for x, f in SUFFIXES.items() if path.name.endswith(x)), "jsonl")


def is_evalset_folder(path: Path) -> bool:
    """A folder `datasets` saved (save_to_disk), or one with an eval-set sidecar beside it."""
    return meta_path_for(path).is_file() or (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _jsonl_lines(path: Path) -> list[tuple[int, str | None, str | None]]:
    """(line number, text, problem) per line of a JSONL file: UTF-8, a byte-order mark and CRLF accepted; a line
    that is not UTF-8 has no text and a problem naming its column. A file in UTF-16 or UTF-32 is refused whole."""
    data = read_bytes(path)
    if (wrong := wrong_encoding(data, path)) is not None:  # one cause, said once, not once per line
        raise wrong
    data = data.removeprefix(b"\xef\xbb\xbf")
    out: list[tuple[int, str | None, str | None]] = []
    for no, raw in enumerate(data.split(b"\n"), start=1):
        try:
            out.append((no, raw.decode("utf-8"), None))
        except UnicodeDecodeError as exc:
            out.append((no, None, not_utf8(exc, raw, path, no).message))
    return out


def parse_json_line(raw: str) -> tuple[Any, str | None]:
    """One JSONL line -> (value, None), or (None, the problem): bad syntax, and the parser's limits (nesting deeper
    than Python's stack allows, a number of more than 4300 digits), which are the input's fault, not quantgate's."""
    try:
        value = json.loads(raw)
        return (None, bad) if (bad := lone_surrogate(value)) else (value, None)
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON: {exc.msg} (column {exc.colno})"
    except RecursionError:
        return None, ("invalid JSON: nested too deeply for the parser (arrays or objects inside each other); "
                      "a sample nests at most 3 levels")
    except ValueError as exc:  # int("1" * 5000): Python's limit on digits
        return None, f"invalid JSON: a value Python cannot read: {str(exc).split('; use sys.', 1)[0]}"


def _chat_turns(messages: Any) -> tuple[list[dict], str] | str:
    """An OpenAI-format conversation -> (the prompt's turns, the reply that ends it), or why it cannot be one.
    A turn's content may be text or a list of parts of which the text parts are kept."""
    if not isinstance(messages, list) or not messages:
        return "a chat log row needs a non-empty list of messages"
    turns = []
    for i, m in enumerate(messages):
        tool = [k for k in ("tool_calls", "function_call") if isinstance(m, Mapping) and m.get(k)]
        if tool or (isinstance(m, Mapping) and m.get("role") in ("tool", "function")):
            what = f"an assistant turn with {tool[0]}" if tool else f"role {m['role']!r}"
            return (f"message {i}: {what}: tool turns are refused (a chat log row is replayed as its text turns, and "
                    "a tool call has none); drop the row, or its tool turns")
        if not isinstance(m, Mapping) or m.get("role") not in ("system", "user", "assistant"):
            role = m.get("role") if isinstance(m, Mapping) else None
            return f"message {i}: role {role!r}; a chat log turn is system, user or assistant"
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text") or "" for p in content if isinstance(p, Mapping) and p.get("type") == "text")
        if not isinstance(content, str):
            return f"message {i}: content is {type(content).__name__}, not text"
        turns.append({"role": m["role"], "content": content})
    if turns[-1]["role"] != "assistant" or not turns[-1]["content"].strip():
        return "the last message is not an assistant reply with text: a chat log row's reply is its reference"
    return turns[:-1], turns[-1]["content"]


def mapped_row(obj: Mapping[str, Any], source: Source, fmt: str) -> tuple[dict[str, Any], list[str]]:
    """A row of the set's own columns -> a sample dict (defaults filled in), and the problems found doing it."""
    cols = source.columns
    out: dict[str, Any] = {}
    for name in FIELDS:
        column = getattr(cols, name)
        if column in obj and obj[column] is not None:
            out[name] = obj[column]
    for name in ("category", "metrics", "max_tokens"):
        default = getattr(source.defaults, name)
        if name not in out and default is not None:
            out[name] = default
    problems = []
    for name in ("references", "metrics"):
        if isinstance(out.get(name), str):  # a CSV cell: one item, or a JSON array written as text
            out[name], bad = json_list_cell(out[name])
            if bad:
                problems.append(f"column '{getattr(cols, name)}': {bad}")
                out.pop(name)
    if fmt == "chat":
        turns = _chat_turns(out.pop("messages", None))
        if isinstance(turns, str):
            problems.append(f"column '{cols.messages}': {turns}")
        else:
            out["messages"], reply = turns
            out.setdefault("references", [reply])
    for name in ("category", "metrics"):
        if name not in out:
            problems.append(f"no {name}: map a column to it (source.columns.{name}) or give source.defaults.{name}")
    return out, problems


def check_columns(source: Source, rows: list[Row], dataset: Any, meta: Path) -> None:
    """Refuse, before any row, a column the sidecar maps that the file does not have, at the mapping's line with
    the columns the file has: a mapped `id` that names no column used to give every row the id `row-N` (and resume
    and pairing go by id), a mapped `references` an error on every row naming no sidecar line."""
    have = list(dataset.column_names) if dataset is not None else \
        list(dict.fromkeys(k for _, _, obj, _ in rows if isinstance(obj, Mapping) for k in obj))
    if not have:  # no row could be read: the rows' own problems say why
        return
    given = [f for f in FIELDS if f in source.columns.model_fields_set]  # mapped in the sidecar, not by default
    missing = [(f, getattr(source.columns, f)) for f in given if getattr(source.columns, f) not in have]
    if not missing:
        return
    _, lines = read_yaml(meta)
    field, column = missing[0]
    line = lines.get(("source", "columns", field)) or lines.get(("source", "columns")) or 1
    more = "".join(f"; source.columns.{f} maps {c!r}, not there either" for f, c in missing[1:])
    raise ConfigError(f"source.columns.{field} maps column {column!r}{did_you_mean(column, have)}, which the file does "
                      f"not have{more}; its columns: {', '.join(have)}",
                      where=f"{meta}:{line} field 'source.columns.{field}'",
                      fix="name one of the file's columns, or remove the mapping to read the field's own name"
                          + (f" (or give source.defaults.{field})" if field in Defaults.model_fields else ""))


Row = tuple[str, int, Any, str | None]  # (where: 'file:line' or 'file:row N', line or row, the row, its problem)


def rows_of_lines(path: Path) -> list[Row]:
    """One Row per non-blank line of a JSONL file (its JSON object, or why it has none)."""
    out: list[Row] = []
    for no, raw, bad in _jsonl_lines(path):
        if raw is not None and not raw.strip():
            continue
        obj, bad = (None, bad) if raw is None else parse_json_line(raw)
        out.append((f"{path}:{no}", no, obj, bad))
    return out


def rows_of_table(path: Path, fmt: str, split: str | None) -> tuple[list[Row], Any]:
    """One Row per row of a Parquet or CSV file or a `datasets` folder, read through `datasets` (rows 1-based), and
    the Dataset itself. A file with no rows is refused as such (datasets says "BatchSize must be greater than 0" or
    "corresponds to no data"); a CSV's text is checked first (encoding, the line of a byte that is not UTF-8)."""
    import datasets

    datasets.disable_progress_bars()
    csv = not path.is_dir() and (fmt == "csv" or path.name.endswith(".csv"))
    if csv:
        _csv_has_rows(path)
    elif (_parquet_rows(path) if not path.is_dir() else _saved_shards(path)) == 0:
        raise ConfigError(f"no rows: the {'folder' if path.is_dir() else 'Parquet file'} holds its columns but no "
                          "row", where=str(path), fix="write the samples into it, or remove it from the spec's eval_sets")
    try:
        ds = _load_table(datasets, path, "csv" if csv else "parquet", split)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow and datasets name the problem; the user's file, not a bug
        kind = "a folder saved by datasets (save_to_disk)" if path.is_dir() else \
            "a CSV file" if fmt == "csv" else "a Parquet file"
        raise ConfigError(f"datasets could not read it as {kind}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                          where=str(path), fix="check the file, or set source.format in the sidecar") from None
    if len(ds) == 0:
        raise ConfigError("no rows: the dataset holds its columns but no row", where=str(path),
                          fix="save the samples into it, or name another split (source.split)")
    return [(f"{path}:row {i}", i, row, None) for i, row in enumerate(ds, start=1)], ds


def _load_table(datasets: Any, path: Path, builder: str, split: str | None) -> Any:
    """The Dataset of a file (by `builder`) or of a folder saved by `datasets` (its split)."""
    if not path.is_dir():
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds)
        if split is None and len(names) != 1:
            raise ConfigError(f"the folder holds splits {', '.join(names)}", where=str(path),
                              fix="name one in the sidecar: source.split")
        if split is not None and split not in ds:
            raise ConfigError(f"no split {split!r}{did_you_mean(split, names)}; the folder has "
                              f"{', '.join(names)}", where=str(meta_path_for(path)), fix="correct source.split")
        ds = ds[split or names[0]]
    return ds


def _csv_has_rows(path: Path) -> None:
    """A CSV's text before `datasets` reads it: UTF-16/32 named once, a byte that is not UTF-8 at its line, and a
    file of a header alone (or nothing) refused as having no rows."""
    data = read_bytes(path)
    if (wrong := wrong_encoding(data, path)) is not None:
        raise wrong
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise not_utf8(exc, data, path) from None
    lines = [x for x in text.splitlines() if x.strip()]
    if len(lines) < 2:
        raise ConfigError("no rows: the CSV file " + ("holds only its header line" if lines else "is empty"),
                          where=str(path), fix="write one sample per line under the header, or remove it from the "
                                               "spec's eval_sets")


def _saved_shards(path: Path) -> int | None:
    """Data files of a folder that `datasets` saved with one split (its state.json); None where it says none (a
    folder of splits, or not one `datasets` wrote). An empty Dataset saves none, and load_from_disk then fails with
    "list index out of range"."""
    try:
        files = json.loads((path / "state.json").read_bytes()).get("_data_files")
    except (OSError, ValueError, AttributeError):
        return None
    return len(files) if isinstance(files, list) else None


def _parquet_rows(path: Path) -> int | None:
    """Rows of a Parquet file by its footer; None when it has none to read (datasets then says why)."""
    import pyarrow.parquet as pq  # type: ignore[import-untyped]  # pyarrow ships no type hints

    try:
        return pq.read_metadata(str(path)).num_rows
    except Exception:  # noqa: BLE001 - not Parquet, or damaged: the load names the problem
        return None
