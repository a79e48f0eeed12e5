"""Calibration data: the user's JSONL, Parquet or CSV file, a folder saved by `datasets`, or a `datasets` dataset,
checked and sampled before any model is loaded.

A record is `{"text": "..."}` or `{"messages": [{"role": "user", "content": "..."}, ...]}` (chat messages are
rendered with the model's chat template in the runner child); a table's `text` or `messages` column gives them, and a
table with neither but a `prompt` column (an eval set's) gives one user turn per row. The default set, written for this project, is
`quant_recipes/calibration/default.jsonl`. Sample count, sequence length and seed come from the spec.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from typing_extensions import TypedDict  # pydantic validates typing's TypedDict only from Python 3.12

from quantgate.base.errors import ConfigError
from quantgate.base.paths import RECIPES

DEFAULT_CALIBRATION = RECIPES / "calibration" / "default.jsonl"
ROLES = {"system", "user", "assistant", "tool"}


class CalibrationSpec(BaseModel):
    """Where calibration text comes from and how much of it to use."""
    model_config = ConfigDict(extra="forbid")

    path: Path | None = Field(None, description="JSONL file of {text} or {messages} records, a Parquet or CSV file, or "
                                                "a folder saved by `datasets` (save_to_disk; `split` picks a split)")
    dataset: str | None = Field(None, description="`datasets` name or local folder/file, read with load_dataset")
    split: str = "train"
    samples: int | None = Field(None, ge=1, le=100_000, description="default: the scheme's (schemes.yaml)")
    max_seq_length: int | None = Field(None, ge=8, le=1_000_000, description="tokens per sample; default: the scheme's")
    seed: int = 0

    @model_validator(mode="after")
    def _one_source(self) -> CalibrationSpec:
        if self.path is not None and self.dataset is not None:
            raise ValueError("give either `path` or `dataset`, not both")
        return self


class CalibrationSample(TypedDict, total=False):
    """One calibration record as check_record normalizes it: a `text`, or chat `messages` ({"role", "content"})."""
    text: str
    messages: list[dict[str, str]]


class CalibrationSet(BaseModel):
    """The selected records, as handed to the runner, with the hash that identifies them."""
    source: str
    records: list[CalibrationSample]
    available: int
    max_seq_length: int
    seed: int
    sha256: str
    uses_chat: bool


def check_record(rec: Any, where: str) -> CalibrationSample:
    """Normalize one record to {"text"} or {"messages"}; refuse anything else naming where it is."""
    fix = 'write {"text": "..."} or {"messages": [{"role": "user", "content": "..."}]}'
    if not isinstance(rec, dict):
        raise ConfigError("record is not a JSON object", where=where, fix=fix)
    if isinstance(rec.get("text"), str):
        if not rec["text"].strip():
            raise ConfigError("empty `text`", where=where, fix="remove the line or give it text")
        return {"text": rec["text"]}
    msgs = rec.get("messages")
    if isinstance(msgs, list) and msgs:
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str) or not m["content"].strip():
                raise ConfigError(f"messages[{i}] needs a role in {sorted(ROLES)} and non-empty string content", where=where, fix=fix)
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in msgs]}
    raise ConfigError("record has neither a non-empty `text` string nor a `messages` list", where=where, fix=fix)


def read_jsonl(path: Path) -> list[CalibrationSample]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError("calibration file not found", where=str(path), fix="check the path, or omit it to use the default set")
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"invalid JSON: {exc.msg} (column {exc.colno})", where=f"{path}:{n}", fix="one JSON object per line") from None
            records.append(check_record(rec, f"{path}:{n}"))
    if not records:
        raise ConfigError("calibration file has no records", where=str(path), fix=f"add records, or omit it to use {DEFAULT_CALIBRATION.name}")
    return records


TABLES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def is_table(path: Path) -> bool:
    """A calibration `path` read through `datasets`: a Parquet or CSV file, or a folder `datasets` saved."""
    return path.is_dir() or path.suffix in (".parquet", ".csv")


def read_dataset(name: str, split: str) -> list[CalibrationSample]:
    """Records from `datasets`: a folder saved by it (load_from_disk, `split` of a DatasetDict), a local
    .json/.jsonl/.parquet/.csv file (the matching builder), or a dataset name already in its cache."""
    import datasets  # the pipeline env has it; imported here so plain JSONL use stays light

    p = Path(name)
    try:
        if p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file()):
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ConfigError(f"no split {split!r}; the folder has {', '.join(ds)}", where=name,
                                      fix="set calibration.split to one of them")
                ds = ds[split]
        elif p.is_file() and p.suffix in TABLES:
            ds = datasets.load_dataset(TABLES[p.suffix], data_files=str(p), split="train")
        else:
            ds = datasets.load_dataset(name, split=split)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - datasets raises many types; the message is what the user needs
        raise ConfigError(f"could not load dataset: {type(exc).__name__}: {str(exc)[:300]}", where=name,
                          fix="give a local file/folder, or a dataset already in the datasets cache (no network at run time)") from None
    cols = [c for c in ("text", "messages") if c in ds.column_names]
    if not cols and "prompt" not in ds.column_names:
        raise ConfigError(f"dataset has no `text`, `messages` or `prompt` column (columns: {ds.column_names})",
                          where=f"{name}[{split}]", fix="rename the column, or convert it to JSONL records")

    def record(row: Mapping[str, object]) -> dict[str, object]:  # a row of the dataset, as `datasets` gives it
        if cols:
            return {c: row[c] for c in cols if row[c] is not None}
        return {"messages": [{"role": "user", "content": row["prompt"]}]} if isinstance(row["prompt"], str) else {}

    records = [check_record(record(row), f"{name}[{split}] row {i}") for i, row in enumerate(ds, start=1)]
    if not records:
        raise ConfigError("dataset split is empty", where=f"{name}[{split}]", fix="choose another split")
    return records


def select(records: list[CalibrationSample], samples: int, seed: int) -> list[CalibrationSample]:
    """`samples` records drawn without replacement by `seed` (all of them, shuffled, when fewer exist)."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    return [records[i] for i in order[:samples]]


def build(spec: CalibrationSpec, samples: int, max_seq_length: int) -> CalibrationSet:
    """Read, check and sample the calibration data; the hash covers the chosen records and the length."""
    if spec.dataset is not None:
        source, records = f"datasets:{spec.dataset}[{spec.split}]", read_dataset(spec.dataset, spec.split)
    elif spec.path is not None and is_table(Path(spec.path)):
        if not Path(spec.path).exists():
            raise ConfigError("calibration file not found", where=str(spec.path), fix="check the path")
        source, records = f"{spec.path}[{spec.split}]", read_dataset(str(spec.path), spec.split)
    else:
        path = Path(spec.path) if spec.path is not None else DEFAULT_CALIBRATION
        source, records = str(path), read_jsonl(path)
    chosen = select(records, samples, spec.seed)
    digest = hashlib.sha256(json.dumps({"records": chosen, "max_seq_length": max_seq_length},
                                       sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    return CalibrationSet(source=source, records=chosen, available=len(records), max_seq_length=max_seq_length,
                          seed=spec.seed, sha256=digest, uses_chat=any("messages" in r for r in chosen))


def write_jsonl(records: list[CalibrationSample], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
