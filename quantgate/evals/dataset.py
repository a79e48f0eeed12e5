"""Eval sets: samples plus a `<name>.meta.yaml` sidecar; schema in eval_sets/README.md.

The samples come as teams keep them: a JSONL file (one sample per line, the schema's own field names), or, with a
`source` section in the sidecar, a JSONL, Parquet or CSV file, a folder saved by `datasets` (`save_to_disk`), or a
log of chat traffic in OpenAI's messages format (`format: chat`: each conversation's last assistant turn is the
reference, the turns before it the prompt). `source.columns` maps the set's columns onto the sample fields and
`source.defaults` fills fields a set has no column for (one category, the metrics). The set declares its own
categories in the sidecar (`categories`); a set without that list takes the default set's and its
`source.defaults.category` (`default_categories`).

`load_evalset` checks every row first (for JSONL, every line: JSON syntax and the parser's limits; then fields,
duplicate ids, empty prompts, unknown metrics or undeclared categories, prompts too long for the served context)
and reports ALL problems with file and line (or row); Parquet, CSV and `datasets` folders are read through Hugging
Face `datasets`, and a plain JSONL set is loaded through it afterwards and checked to give the same samples.
"""

from __future__ import annotations

import hashlib
import math
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from quantgate.base.errors import ConfigError, did_you_mean
from quantgate.base.paths import EVAL_SETS
from quantgate.base.yamlconfig import describe_error, load_model, read_bytes
from quantgate.base.subsets import draw
from quantgate.evals.metrics import MetricSpec, TABLE, load_table
from quantgate.evals.setsource import Row, Source, check_columns, format_of, mapped_row, meta_path_for, rows_of_lines, rows_of_table

MAX_PROBLEMS_SHOWN = 40
DEFAULT_META = EVAL_SETS / "default.meta.yaml"


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class Sample(BaseModel):
    """One line of an eval set. Exactly one of `messages` (chat) or `prompt` (one user turn)."""
    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1)
    category: str
    messages: list[Message] | None = None
    prompt: str | None = None
    references: list[str] = Field(min_length=1)
    metrics: list[str] = Field(min_length=1)
    criteria: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)

    @field_validator("category")
    @classmethod
    def _nfc(cls, v: str) -> str:
        """In NFC: `résumé` typed with a combining accent (NFD, as macOS file names give it) and with a precomposed
        é (NFC) look the same and are one category, in the sidecar, the results and the policy."""
        return unicodedata.normalize("NFC", v)

    @model_validator(mode="after")
    def _one_prompt(self) -> Sample:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of 'messages' or 'prompt'")
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError("empty prompt")
        if self.messages is not None:
            if not any(m.content.strip() for m in self.messages):
                raise ValueError("empty prompt: 'messages' has no non-empty content")
            if self.messages[-1].role != "user":
                raise ValueError("the last message must have role 'user'")
        return self

    def chat(self) -> list[dict[str, str]]:
        """The chat messages to send (a plain `prompt` becomes one user turn; the server applies the template)."""
        if self.messages is not None:
            return [m.model_dump() for m in self.messages]
        return [{"role": "user", "content": self.prompt or ""}]

    def prompt_text(self) -> str:
        return "\n".join(m["content"] for m in self.chat())


class MetricDecl(BaseModel):
    model_config = ConfigDict(extra="forbid")
    higher_is_better: bool
    aggregation: Literal["mean"]


class SetMeta(BaseModel):
    """`<name>.meta.yaml`: the set's version, the metrics it uses (which must agree with the metric table), the
    categories it declares and, for data in another shape, its `source`."""
    model_config = ConfigDict(extra="forbid")
    name: str
    version: int = Field(ge=1)
    description: str = ""
    default_max_tokens: int = Field(default=32, ge=1)
    metrics: dict[str, MetricDecl] = Field(min_length=1)
    categories: dict[str, str] | None = Field(None, description="category -> what it holds; samples must use "
                                              "these (absent: the default set's)")
    source: Source | None = None

    @field_validator("categories")
    @classmethod
    def _categories_nfc(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        """Category names in NFC, as samples' (Sample._nfc); two that only NFC tells apart are one name given twice."""
        if v is None:
            return None
        out: dict[str, str] = {}
        for name, what in v.items():
            key = unicodedata.normalize("NFC", name)
            if key in out:
                raise ValueError(f"category {name!r} is declared twice: once composed (NFC) and once with combining "
                                 "accents (NFD), which look the same; keep one")
            out[key] = what
        return out

    @field_validator("metrics")
    @classmethod
    def _agree_with_table(cls, v: dict[str, MetricDecl]) -> dict[str, MetricDecl]:
        table = load_table(TABLE)
        for name, decl in v.items():
            if name not in table:
                raise ValueError(f"unknown metric {name!r}; known: {', '.join(sorted(table))}")
            row = table[name]
            if (decl.higher_is_better, decl.aggregation) != (row.higher_is_better, row.aggregation):
                raise ValueError(
                    f"metric {name!r} declared higher_is_better={decl.higher_is_better}, aggregation={decl.aggregation}"
                    f" but the metric table says {row.higher_is_better}, {row.aggregation}"
                )
        return v


@lru_cache(maxsize=1)
def default_categories() -> dict[str, str]:
    """The default set's categories (eval_sets/default.meta.yaml): those of a set whose sidecar declares none
    (besides its `source.defaults.category`), as the one list every set used before sets declared their own, so
    that a misspelt or stray name (`trivia`) is still refused at its line rather than becoming a category of its
    own."""
    return load_model(DEFAULT_META, SetMeta).categories or {}


def estimate_tokens_chars4(text: str) -> int:
    """ESTIMATE of a prompt's token count: characters / 4, rounded up (no tokenizer, no chat template)."""
    return math.ceil(len(text) / 4)


estimate_tokens_chars4.label = "estimate: characters/4"  # type: ignore[attr-defined]


@dataclass
class EvalSet:
    path: Path
    meta: SetMeta
    samples: list[Sample]
    lines: dict[str, int]  # id -> 1-based line of a JSONL file, or row of a table
    sha256: str  # of the set's bytes (every file of a folder) and the sidecar's
    dataset: Any = field(repr=False, default=None)  # the datasets.Dataset the samples came from

    def max_tokens(self, s: Sample) -> int:
        return s.max_tokens or self.meta.default_max_tokens

    def load_dataset(self):
        """The set as a `datasets.Dataset`. A plain JSONL set is loaded through `datasets` here and checked to hold
        the validated samples; a mapped JSONL set or a chat log becomes one from its samples (Parquet, CSV and
        folders were read through `datasets` already)."""
        if self.dataset is not None:
            return self.dataset
        import datasets

        datasets.disable_progress_bars()
        if self.meta.source is not None and not self.meta.source.plain:  # a mapped JSONL or a chat log: its samples
            self.dataset = datasets.Dataset.from_list([s.model_dump(exclude_none=True) for s in self.samples])
            return self.dataset
        try:
            ds = datasets.load_dataset("json", data_files=str(self.path), split="train")
        except Exception as exc:  # noqa: BLE001 - pyarrow type conflicts between lines, mostly
            raise ConfigError(f"datasets could not load the file: {exc}", where=str(self.path),
                              fix="make every field the same JSON type on every line") from None
        rows = [Sample.model_validate({k: v for k, v in row.items() if v is not None}) for row in ds]
        if rows != self.samples:
            bad = next((i for i, (a, b) in enumerate(zip(rows, self.samples)) if a != b), min(len(rows), len(self.samples)))
            raise ConfigError(f"datasets read row {bad + 1} differently from the line check", where=str(self.path),
                              fix="report this: the JSONL parses differently in pyarrow and json")
        self.dataset = ds
        return ds

    def metric_specs(self) -> dict[str, MetricSpec]:
        table = load_table(TABLE)
        return {m: table[m] for m in self.meta.metrics}


def stratified_subset(samples: list, limit: int | None) -> list:
    """`limit` samples drawn at random within each category, every category its share (quantgate.base.subsets: a
    seeded draw, nested as the limit grows), so a CI subset or a release's `eval.limit` covers every category and
    every part of an ordered set; the result keeps file order. None or a limit >= len(samples): all samples."""
    if not limit or limit >= len(samples):
        return list(samples)
    chosen = {id(s) for s in draw(samples, limit, lambda s: s.id, lambda s: s.category)}
    return [s for s in samples if id(s) in chosen]


def _field_problem(err: Mapping[str, Any]) -> str:
    loc = ".".join(str(p) for p in err["loc"])
    msg = describe_error(err, Sample)
    return f"field '{loc}': {msg}" if loc else msg


def _undeclared(category: str, categories: Mapping[str, str], by_default: bool) -> str:
    """Why a sample's category is refused: not in the sidecar's `categories`, or, where it declares none, not one of
    the default set's (`by_default`)."""
    head = f"category {category!r}{did_you_mean(category, categories)} "
    if not by_default:
        return head + f"is not declared in the sidecar; it declares: {', '.join(sorted(categories))}"
    return head + (f"is not one of the default set's categories ({', '.join(categories)}), which apply where the "
                   f"sidecar declares none: declare the set's own in its sidecar (`categories: {{{category}: what it "
                   "holds}`)")


def _check_rows(
    rows: list[Row],
    meta: SetMeta,
    fmt: str,
    *,
    max_context: int | None = None,
    count_tokens: Callable[[str], int] = estimate_tokens_chars4,
) -> tuple[list[str], list[Sample], dict[str, int]]:
    """Every problem of the rows as 'where: message'; the valid samples; id -> line (or row) of each."""
    problems: list[str] = []
    samples: list[Sample] = []
    lines: dict[str, int] = {}
    source = meta.source or Source()
    strict = source.plain and fmt == "jsonl"  # the schema's own JSON: "32" is no integer, no other field accepted
    categories = meta.categories if meta.categories is not None else \
        {**default_categories(), **({source.defaults.category: ""} if source.defaults.category else {})}
    label = getattr(count_tokens, "label", getattr(count_tokens, "__name__", "tokenizer"))
    for at, no, obj, bad in rows:
        if bad:
            problems.append(f"{at}: {bad}")
            continue
        if not isinstance(obj, Mapping):
            problems.append(f"{at}: expected a JSON object, got {type(obj).__name__}")
            continue
        if not strict:
            obj, found = mapped_row(obj, source, fmt)
            if found:
                problems.extend(f"{at}: {p}" for p in found)
                continue
            obj.setdefault("id", f"row-{no}")
            if isinstance(obj["id"], int) and not isinstance(obj["id"], bool):
                obj["id"] = str(obj["id"])
        if isinstance(obj.get("id"), str) and obj["id"] in lines:
            problems.append(f"{at}: duplicate id {obj['id']!r} (first at {'line' if strict else 'row'} {lines[obj['id']]})")
        try:
            s = Sample.model_validate(obj, strict=strict)
        except ValidationError as exc:
            problems.extend(f"{at}: {_field_problem(e)}" for e in exc.errors())
            continue
        if s.id not in lines:
            lines[s.id] = no
            samples.append(s)
        if s.category not in categories:
            problems.append(f"{at}: field 'category': {_undeclared(s.category, categories, meta.categories is None)}")
        for i, m in enumerate(s.metrics):
            if m not in meta.metrics:
                problems.append(f"{at}: field 'metrics.{i}': unknown metric {m!r}{did_you_mean(m, meta.metrics)}; "
                                f"this set declares: {', '.join(meta.metrics)}")
        if max_context is not None:
            need = count_tokens(s.prompt_text())
            mt = s.max_tokens or meta.default_max_tokens
            if need + mt > max_context:
                problems.append(
                    f"{at}: prompt of {need} tokens ({label}) + max_tokens {mt} exceeds the served context"
                    f" of {max_context} tokens"
                )
    return problems, samples, lines


def file_sha256(*paths: Path) -> str:
    """Of the files' bytes in order; a folder counts as its files in sorted order (their relative names too)."""
    h = hashlib.sha256()
    for p in map(Path, paths):
        if p.is_dir():
            for f in sorted(x for x in p.rglob("*") if x.is_file()):
                h.update(str(f.relative_to(p)).encode() + b"\0")
                h.update(read_bytes(f))
        else:
            h.update(read_bytes(p))
    return h.hexdigest()


def load_evalset(
    path: Path | str,
    *,
    max_context: int | None = None,
    count_tokens: Callable[[str], int] = estimate_tokens_chars4,
    with_dataset: bool = True,
) -> EvalSet:
    """Validate and load an eval set; a ConfigError lists every problem with file and line (or row).

    With `with_dataset=False` a plain JSONL set's `datasets` load is left to a later `EvalSet.load_dataset()` call
    (the eval run does it in a background thread, so that importing `datasets` does not delay the first request);
    the other formats are read through `datasets` in any case.
    """

    path = Path(path)
    if not path.exists():
        raise ConfigError("eval set not found", where=str(path),
                          fix="give the path of an eval set: a .jsonl, .parquet or .csv file, or a datasets folder")
    meta_path = meta_path_for(path)
    if not meta_path.is_file():
        raise ConfigError(
            "eval set has no sidecar", where=str(meta_path),
            fix="write it beside the samples: name, version, metrics (see eval_sets/README.md)",
        )
    meta = load_model(meta_path, SetMeta)
    fmt = format_of(path, meta.source)
    if path.is_dir() and fmt != "datasets":
        raise ConfigError(f"is a folder, but the sidecar says source.format {fmt}", where=str(path),
                          fix="name the file, or set source.format: datasets for a folder saved by datasets")
    dataset = None
    if fmt == "jsonl" or (fmt == "chat" and path.name.endswith(".jsonl")):
        rows = rows_of_lines(path)
    else:
        rows, dataset = rows_of_table(path, fmt, (meta.source or Source()).split)
    if meta.source is not None:
        check_columns(meta.source, rows, dataset, meta_path)
    problems, samples, lines = _check_rows(rows, meta, fmt, max_context=max_context, count_tokens=count_tokens)
    if not samples and not problems:
        problems.append(f"{path}:1: the eval set has no samples")
    if problems:
        more = len(problems) - MAX_PROBLEMS_SHOWN
        shown = problems[:MAX_PROBLEMS_SHOWN] + ([f"... and {more} more"] if more > 0 else [])
        head = shown[0].split(": ", 1)
        raise ConfigError(
            f"{len(problems)} problem(s) in the eval set: {head[1]}" + "".join(f"\n  {p}" for p in shown[1:]),
            where=head[0], fix="correct the rows named above (schema: eval_sets/README.md)" if dataset is not None
            else "correct the lines named above (schema: eval_sets/README.md)",
        )
    es = EvalSet(path, meta, samples, lines, file_sha256(path, meta_path), dataset)
    if with_dataset:
        es.load_dataset()
    return es
