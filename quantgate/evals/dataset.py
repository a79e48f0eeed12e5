"""Eval sets: a JSONL file of samples plus a `<name>.meta.yaml` sidecar; schema in eval_sets/README.md.

`load_evalset` checks every line first (JSON syntax and the parser's limits: nesting, digits; fields, duplicate ids,
empty prompts, unknown metrics or categories, prompts too long for the served context) and reports ALL problems
with file and line; then it loads the file through Hugging Face `datasets` (which knows no line numbers) and checks
that its rows are those samples.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from quantgate.base.errors import ConfigError, did_you_mean
from quantgate.base.paths import EVAL_SETS
from quantgate.base.yamlconfig import describe_error, load_model, not_utf8, read_bytes, read_yaml
from quantgate.evals.metrics import MetricSpec, TABLE, load_table

CATEGORIES_FILE = EVAL_SETS / "categories.yaml"
MAX_PROBLEMS_SHOWN = 40


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
    """`<name>.meta.yaml`: the set's version and the metrics it uses (which must agree with the metric table)."""
    model_config = ConfigDict(extra="forbid")
    name: str
    version: int = Field(ge=1)
    description: str = ""
    default_max_tokens: int = Field(default=32, ge=1)
    metrics: dict[str, MetricDecl] = Field(min_length=1)

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


def estimate_tokens_chars4(text: str) -> int:
    """ESTIMATE of a prompt's token count: characters / 4, rounded up (no tokenizer, no chat template)."""
    return math.ceil(len(text) / 4)


estimate_tokens_chars4.label = "estimate: characters/4"  # type: ignore[attr-defined]


@dataclass
class EvalSet:
    path: Path
    meta: SetMeta
    samples: list[Sample]
    lines: dict[str, int]  # id -> 1-based line in the JSONL
    sha256: str  # of the JSONL bytes and the sidecar bytes
    dataset: Any = field(repr=False, default=None)  # the datasets.Dataset the samples came from

    def max_tokens(self, s: Sample) -> int:
        return s.max_tokens or self.meta.default_max_tokens

    def load_dataset(self):
        """Load the file through Hugging Face `datasets` and check that its rows are the validated samples."""
        import datasets

        datasets.disable_progress_bars()
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
    """The first `limit` samples taken round-robin over categories (in file order within each), so a CI subset still
    covers every category; the result keeps file order. None or a limit >= len(samples): all samples."""
    if not limit or limit >= len(samples):
        return list(samples)
    by_cat: dict[str, list] = {}
    for s in samples:
        by_cat.setdefault(s.category, []).append(s)
    chosen: set[int] = set()
    depth = 0
    while len(chosen) < limit:
        for group in by_cat.values():
            if depth < len(group) and len(chosen) < limit:
                chosen.add(id(group[depth]))
        depth += 1
    return [s for s in samples if id(s) in chosen]


def meta_path_for(path: Path) -> Path:
    """`eval_sets/default.jsonl` -> `eval_sets/default.meta.yaml`."""
    return path.with_name(path.name.removesuffix(".jsonl") + ".meta.yaml")


def load_categories(path: Path = CATEGORIES_FILE) -> set[str]:
    data, _ = read_yaml(path)
    if not isinstance(data, dict) or not data:
        raise ConfigError("expected a mapping of category name -> description", where=f"{path}:1")
    return set(data)


def _field_problem(err: Mapping[str, Any]) -> str:
    loc = ".".join(str(p) for p in err["loc"])
    msg = describe_error(err, Sample)
    return f"field '{loc}': {msg}" if loc else msg


def _jsonl_lines(path: Path) -> list[tuple[int, str | None, str | None]]:
    """(line number, text, problem) per line of a JSONL file: UTF-8, a byte-order mark and CRLF accepted; a line
    that is not UTF-8 has no text and a problem naming its column."""
    data = read_bytes(path).removeprefix(b"\xef\xbb\xbf")
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
        return json.loads(raw), None
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON: {exc.msg} (column {exc.colno})"
    except RecursionError:
        return None, ("invalid JSON: nested too deeply for the parser (arrays or objects inside each other); "
                      "a sample nests at most 3 levels")
    except ValueError as exc:  # int("1" * 5000): Python's limit on digits
        return None, f"invalid JSON: a value Python cannot read: {str(exc).split('; use sys.', 1)[0]}"


def check_lines(
    path: Path,
    meta: SetMeta,
    categories: set[str],
    *,
    max_context: int | None = None,
    count_tokens: Callable[[str], int] = estimate_tokens_chars4,
) -> tuple[list[str], list[Sample], dict[str, int]]:
    """Every problem in the JSONL as 'file:line: message'; the valid samples; id -> line of each."""
    problems: list[str] = []
    samples: list[Sample] = []
    lines: dict[str, int] = {}
    label = getattr(count_tokens, "label", getattr(count_tokens, "__name__", "tokenizer"))
    for no, raw, bad in _jsonl_lines(path):
        at = f"{path}:{no}"
        if raw is None:
            problems.append(f"{at}: {bad}")
            continue
        if not raw.strip():
            continue
        obj, bad = parse_json_line(raw)
        if bad:
            problems.append(f"{at}: {bad}")
            continue
        if not isinstance(obj, dict):
            problems.append(f"{at}: expected a JSON object, got {type(obj).__name__}")
            continue
        if isinstance(obj.get("id"), str) and obj["id"] in lines:
            problems.append(f"{at}: duplicate id {obj['id']!r} (first at line {lines[obj['id']]})")
        try:
            s = Sample.model_validate(obj, strict=True)  # JSON types as they are: "32" is no integer
        except ValidationError as exc:
            problems.extend(f"{at}: {_field_problem(e)}" for e in exc.errors())
            continue
        if s.id not in lines:
            lines[s.id] = no
            samples.append(s)
        if s.category not in categories:
            problems.append(f"{at}: field 'category': unknown category {s.category!r}{did_you_mean(s.category, categories)};"
                            f" known: {', '.join(sorted(categories))}")
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
    h = hashlib.sha256()
    for p in paths:
        h.update(read_bytes(Path(p)))
    return h.hexdigest()


def load_evalset(
    path: Path | str,
    *,
    max_context: int | None = None,
    count_tokens: Callable[[str], int] = estimate_tokens_chars4,
    categories_file: Path = CATEGORIES_FILE,
    with_dataset: bool = True,
) -> EvalSet:
    """Validate and load an eval set; a ConfigError lists every problem with file and line.

    With `with_dataset=False` the `datasets` load is left to a later `EvalSet.load_dataset()` call (the eval
    run does it in a background thread, so that importing `datasets` does not delay the first request).
    """

    path = Path(path)
    if not path.is_file():
        raise ConfigError("eval set not found", where=str(path), fix="give the path of a .jsonl eval set")
    meta_path = meta_path_for(path)
    if not meta_path.is_file():
        raise ConfigError(
            "eval set has no sidecar", where=str(meta_path),
            fix="write it beside the JSONL: name, version, metrics (see eval_sets/README.md)",
        )
    meta = load_model(meta_path, SetMeta)
    problems, samples, lines = check_lines(
        path, meta, load_categories(categories_file), max_context=max_context, count_tokens=count_tokens
    )
    if not samples and not problems:
        problems.append(f"{path}:1: the eval set has no samples")
    if problems:
        more = len(problems) - MAX_PROBLEMS_SHOWN
        shown = problems[:MAX_PROBLEMS_SHOWN] + ([f"... and {more} more"] if more > 0 else [])
        head = shown[0].split(": ", 1)
        raise ConfigError(
            f"{len(problems)} problem(s) in the eval set: {head[1]}" + "".join(f"\n  {p}" for p in shown[1:]),
            where=head[0], fix="correct the lines named above (schema: eval_sets/README.md)",
        )
    es = EvalSet(path, meta, samples, lines, file_sha256(path, meta_path))
    if with_dataset:
        es.load_dataset()
    return es
