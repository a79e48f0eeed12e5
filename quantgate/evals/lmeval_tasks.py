"""lm-evaluation-harness tasks on disk, the spec's `lm_eval:` section, and lm-eval's per-sample log as quantgate's
per-sample records. No process, no network: quantgate.evals.lmeval runs lm-eval and uses these.

A task is a YAML file of lm-eval's task format under an include folder (default `eval_sets/lm_eval/`), found by its
`task:` name. Only what the served chat endpoint can answer is accepted: `output_type: generate_until`, with every
metric of `metric_list` known to quantgate's metric table (quantgate/evals/metrics/table.yaml, e.g. `exact_match`),
so that the paired comparison and the gate read lm-eval's scores like those of a JSONL set. Data files are read
from disk: relative `data_files` are relative to the task file's folder (lm-eval runs there).

lm-eval's `--log_samples` file (samples_<task>_<time>.jsonl) holds one line per document and filter: doc_id, doc,
target, resps, filtered_resps, filter, and each metric's value. `convert` keeps the lines of one filter (the first
in the file) and makes, per document, a results record {id, output, filtered, error} and a scores record {id,
category, scores, references}: the id is the document's own `id` field when it has one, else lm-eval's doc_id;
the category is the task name. An answer lm-eval could not get (the placeholder quantgate gives it) is a failed sample.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from quantgate.base.errors import ConfigError
from quantgate.base.paths import EVAL_SETS
from quantgate.base.yamlconfig import item_error
from quantgate.evals.metrics import load_table

DEFAULT_INCLUDE = EVAL_SETS / "lm_eval"
SET_PREFIX = "lm_eval:"  # an lm-eval task's name among the eval sets of a release (compare, gate, report)
NO_ANSWER = "<quantgate: no answer>"  # what lm-eval records for a request the server answered with no content


class _TaskLoader(yaml.SafeLoader):
    """Reads lm-eval task files, whose `!function module.name` tags name Python code: kept as text, never run."""


_TaskLoader.add_multi_constructor("!", lambda loader, tag, node: f"{tag} {getattr(node, 'value', '')}")


def read_task(path: Path) -> dict[str, Any]:
    """One task file as a mapping ({} when it is not a mapping); ConfigError names the file when it is no YAML."""
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_TaskLoader)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"not a readable lm-eval task file: {exc}", where=str(path),
                          fix="correct the YAML, or move the file out of the include folder") from None
    return data if isinstance(data, dict) else {}


def find_tasks(include: Path) -> dict[str, Path]:
    """{task name: its YAML file} for every `*.yaml` under `include` that names one task (`task: NAME`)."""
    found: dict[str, Path] = {}
    for path in sorted(include.rglob("*.yaml")):
        name = read_task(path).get("task")
        if isinstance(name, str) and name not in found:
            found[name] = path
    return found


def task_problem(name: str, config: Mapping[str, Any]) -> str | None:
    """Why quantgate cannot run the task against a chat endpoint and pair its samples, or None when it can."""
    kind = config.get("output_type", "generate_until")
    if kind != "generate_until":
        return (f"task {name!r} is {kind}: a chat endpoint answers generate_until tasks only (lm-eval's "
                "local-chat-completions has no log-likelihoods)")
    table = load_table()
    metrics = [m.get("metric") for m in config.get("metric_list") or [] if isinstance(m, dict)]
    unknown = [m for m in metrics if m not in table]
    if not metrics or unknown:
        return (f"task {name!r} scores {unknown or 'no metric'}: quantgate pairs per-sample scores of the metrics of "
                f"its table only ({', '.join(sorted(table))}); use one of them in the task's metric_list")
    return None


def data_files(task_file: Path, config: Mapping[str, Any]) -> list[Path]:
    """The local data files a task reads (dataset_kwargs.data_files, relative to the task file's folder)."""
    spec = (config.get("dataset_kwargs") or {}).get("data_files") or {}
    names = [spec] if isinstance(spec, str) else [v for vs in (spec.values() if isinstance(spec, dict) else spec)
                                                   for v in ([vs] if isinstance(vs, str) else vs)]
    return [p if p.is_absolute() else task_file.parent / p for p in map(Path, names)]


def task_digest(task_file: Path, extra: Mapping[str, Any] | None = None) -> str:
    """sha256 of what decides a task's answers: its file, the files it includes, its data files, and `extra` (the
    lm-eval settings and version). Files that are missing count as missing, so they change the digest when added."""
    config = read_task(task_file)
    parts = [task_file]
    if isinstance(config.get("include"), str):
        parts.append(task_file.parent / config["include"])
    parts += data_files(task_file, config)
    h = hashlib.sha256(json.dumps(extra or {}, sort_keys=True).encode())
    for p in parts:
        h.update(p.name.encode() + b"\0" + (p.read_bytes() if p.is_file() else b"<missing>") + b"\0")
    return h.hexdigest()


def set_name(task: str) -> str:
    """The task's name among a release's eval sets: `lm_eval:<task>` (no JSONL set's file stem has a colon)."""
    return SET_PREFIX + task


def task_of(name: str) -> str | None:
    """The lm-eval task of an eval set name, or None for a JSONL set."""
    return name.removeprefix(SET_PREFIX) if name.startswith(SET_PREFIX) else None


class LmEvalSpec(BaseModel):
    """`lm_eval:` of a release spec: lm-evaluation-harness tasks run against every variant's server (quantgate.evals.
    lmeval), each one more eval set named `lm_eval:<task>` for the paired comparison and the gate."""
    model_config = ConfigDict(extra="forbid")

    include_path: Path = Field(str(DEFAULT_INCLUDE), validate_default=True,  # text: defaults validate as JSON
                               description="folder of task YAML files (and their data); default eval_sets/lm_eval")
    tasks: list[str] = Field(min_length=1, description="task names (`task:` in a file under include_path)")
    limit: int | None = Field(None, ge=1, description="the first N documents of each task; None: all")
    num_fewshot: int | None = Field(None, ge=0, description="few-shot examples; None: the task's own setting")
    concurrency: int = Field(16, ge=1, description="requests in flight (lm-eval's num_concurrent)")
    max_error_rate: float = Field(0.05, ge=0, le=1, description="share of unanswered samples above which a run fails")

    @field_validator("include_path")
    @classmethod
    def _folder(cls, v: Path, info: ValidationInfo) -> Path:
        base = (info.context or {}).get("path")
        path = v if v.is_absolute() or base is None else Path(base).parent / v
        if not path.is_dir():
            raise ValueError(f"not a folder: {path} (relative paths are relative to the spec file's folder)")
        return path.resolve()

    @field_validator("tasks")
    @classmethod
    def _known_tasks(cls, v: list[str], info: ValidationInfo) -> list[str]:
        include = info.data.get("include_path")
        if include is None:  # include_path failed; its error says why
            return v
        try:
            found = find_tasks(include)
        except ConfigError as exc:
            raise ValueError(f"{exc.where}: {exc.message}") from None
        for i, name in enumerate(v):
            if name not in found:
                raise item_error(i, f"no lm-eval task {name!r} under {include}; tasks found there: "
                                    f"{', '.join(sorted(found)) or 'none'}")
            if v.index(name) != i:
                raise item_error(i, f"task {name!r} listed twice")
            if (why := task_problem(name, read_task(found[name]))) is not None:
                raise item_error(i, f"{why} ({found[name]})")
        return v

    def task_file(self, task: str) -> Path:
        return find_tasks(self.include_path)[task]


def answered_in_log(text: str) -> int:
    """Requests lm-eval reports done in its log (its 'Requesting API: ... N/M' progress lines); 0 before any."""
    found = re.findall(r"Requesting API:[^\n\r]*?(\d+)/(\d+)", text)
    return int(found[-1][0]) if found else 0


def _sample_id(line: Mapping[str, Any]) -> str:
    doc = line.get("doc")
    own = doc.get("id") if isinstance(doc, dict) else None
    return str(own) if isinstance(own, (str, int)) and not isinstance(own, bool) else str(line["doc_id"])


def _scores(line: Mapping[str, Any], metrics: Iterable[str], where: str) -> dict[str, float]:
    out = {}
    for m in metrics:
        value = line.get(m)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ConfigError(f"metric {m!r} of doc {line.get('doc_id')} is {value!r}, not a per-sample number in "
                              "[0, 1]", where=where, fix="score the task with a per-sample metric (e.g. exact_match)")
        out[m] = float(value)
    return out


def convert(lines: Iterable[Mapping[str, Any]], task: str, metrics: list[str], where: str = "samples file"
            ) -> tuple[list[dict], list[dict], str | None]:
    """(results records, scores records, filter used) of lm-eval's sample lines of one task (module docstring).
    A failed sample has a results record with an error and no scores record."""
    results, scores, seen, used = [], [], set(), None
    for line in lines:
        used = line.get("filter") if used is None else used
        if line.get("filter") != used:
            continue
        sid = _sample_id(line)
        if sid in seen:
            raise ConfigError(f"two documents of task {task!r} have the id {sid!r}", where=where,
                              fix="give every document a unique `id` field, or none (lm-eval's doc_id is used)")
        seen.add(sid)
        raw = (line.get("resps") or [[None]])[0]
        output = raw[0] if isinstance(raw, list) and raw else raw
        filtered = (line.get("filtered_resps") or [None])[0]
        if not isinstance(output, str) or output == NO_ANSWER:
            results.append({"id": sid, "output": None, "filtered": None, "error": "the server returned no answer"})
            continue
        results.append({"id": sid, "output": output, "filtered": filtered, "error": None})
        scores.append({"id": sid, "category": task, "scores": _scores(line, metrics, where),
                       "references": [str(line.get("target"))]})
    return results, scores, used
