"""`quantgate check PATH... [--kind KIND]`: validate input files without serving or quantizing anything.

Kinds (detected per file, or forced with --kind):
  spec     release spec YAML: a `model:` key, or a YAML file under releases/ (not releases/policies/)
  policy   gate policy YAML: `primary:` or another check key, or a YAML file under releases/policies/
  evalset  eval set: `<name>.jsonl` with its `<name>.meta.yaml` sidecar (either file may be named)
  review   filled human-review CSV (`quantgate review export`); review ids are not matched against the key
A spec is checked with everything it names: each eval set (prompts against the spec's `context`, an estimate of
characters/4) and its gate policy (default: releases/policies/default.yaml). Its schemes are checked against what
this machine's serving build runs (the kernel probe, quantgate.serving.cpu_kernels) when its hardware is a CPU profile:
an explicit scheme that cannot run here is an error naming the probe's finding (`skip_unsupported: true` drops it
instead); what `hardware: auto` and `skip_unsupported` decided is printed as `note` lines on stderr.

Output: `ok KIND PATH` per good file (stdout); per bad file `error KIND PATH` and the problem with its file, line,
field and fix (stderr); `skip PATH` for YAML files of another kind (the model catalogue, the engine parity policy).
Exit 0 when every file is good, 2 when any is bad. No traceback for bad input.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from quantgate.base.errors import QuantgateError
from quantgate.base.yamlconfig import read_yaml
from quantgate.evals.dataset import load_evalset, meta_path_for
from quantgate.gate.policy import CHECK_SECTIONS, DEFAULT_POLICY, GatePolicy, load_policy
from quantgate.judge.review import check_csv
from quantgate.release.spec import ReleaseSpec, load_spec
from quantgate.serving.cpu_kernels import split_schemes


class Kind(str, Enum):
    spec = "spec"
    policy = "policy"
    evalset = "evalset"
    review = "review"


# Top-level keys that tell a spec from a gate policy (`judge`, `recall` and `fidelity` are sections of both).
SPEC_KEYS = {"model", "hardware"}
POLICY_KEYS = set(CHECK_SECTIONS) - set(ReleaseSpec.model_fields)
# Keys of one model only: a file with a misspelt key still has others (or the misspelling is close to one).
SPEC_ONLY = set(ReleaseSpec.model_fields) - set(GatePolicy.model_fields)
POLICY_ONLY = set(GatePolicy.model_fields) - set(ReleaseSpec.model_fields)
# YAML files of other kinds, by a top-level key: named and skipped, not refused.
OTHER_KINDS = {"models": "the model catalogue", "agree_prefix_tokens": "an engine parity policy",
               "profiles": "the hardware catalogue", "selection": "the scheme catalogue",
               "quant_stage": "a quantization recipe"}
_TOP_KEY = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\s*:", re.M)


class Skip(Exception):
    """A file of a kind `quantgate check` does not validate."""


def _show(path: Path) -> str:
    """A path as the user would write it: relative to the current directory when below it."""
    try:
        return os.path.relpath(path) if Path(path).resolve().is_relative_to(Path.cwd().resolve()) else str(path)
    except ValueError:
        return str(path)


def _score(keys: set[str], only: set[str]) -> int:
    """How many top-level keys belong to one model only, a misspelling close to such a key counting too."""
    return sum(1 for k in keys if k in only or difflib.get_close_matches(k, only, n=1, cutoff=0.8))


def _kind_from_keys(keys: set[str]) -> Kind | None:
    if keys & SPEC_KEYS:
        return Kind.spec
    if keys & POLICY_KEYS:
        return Kind.policy
    other = next((OTHER_KINDS[k] for k in sorted(keys) if k in OTHER_KINDS), None)
    if other:
        raise Skip(other)
    spec, policy = _score(keys, SPEC_ONLY), _score(keys, POLICY_ONLY)
    return Kind.spec if spec > policy else Kind.policy if policy > spec else None


def _kind_from_folder(path: Path) -> Kind | None:
    parents = [p.name for p in path.resolve().parents]
    if parents and parents[0] == "policies":
        return Kind.policy
    return Kind.spec if "releases" in parents else None


def detect_kind(path: Path) -> Kind:
    """The kind of a file from its name, its top-level keys and its folder (QuantgateError when unknown)."""
    name = path.name.lower()
    if name.endswith(".jsonl") or name.endswith(".meta.yaml"):
        return Kind.evalset
    if name.endswith(".csv"):
        return Kind.review
    if not name.endswith((".yaml", ".yml")):
        raise QuantgateError("cannot tell what kind of file this is", where=str(path),
                             fix="pass --kind spec|policy|evalset|review")
    try:
        data, _ = read_yaml(path)
        keys = set(data) if isinstance(data, dict) else set()
    except QuantgateError as exc:  # unreadable YAML: its top-level keys from the text, to name the kind
        keys = set(_TOP_KEY.findall(path.read_bytes().decode("utf-8", "replace")))
        kind = _kind_from_keys(keys) or _kind_from_folder(path)
        if kind is None:
            raise exc from None
        return kind
    kind = _kind_from_keys(keys) or _kind_from_folder(path)
    if kind is None:
        raise QuantgateError("cannot tell what kind of YAML file this is: it has neither a `model:` key (release spec) "
                             "nor a check section such as `primary:` (gate policy)", where=f"{path}:1",
                             fix="pass --kind spec or --kind policy")
    return kind


Result = tuple[Kind | None, Path, QuantgateError | None]


def _attempt(kind: Kind | None, path: Path, fn, *args, **kwargs) -> tuple[Result, object]:
    """Run one loader: ((kind, path, error or None), its value). Anything but a QuantgateError is a bug in quantgate,
    still reported as one message."""
    try:
        return (kind, path, None), fn(*args, **kwargs)
    except Skip:
        raise
    except QuantgateError as exc:
        return (kind, path, exc), None
    except Exception as exc:  # not the user's input: no traceback either
        return (kind, path, QuantgateError(f"unexpected {type(exc).__name__}: {exc}", where=str(path),
                                           fix="report this as a quantgate bug, with the file")), None


def _check_evalset(path: Path, max_context: int | None = None) -> None:
    if not path.is_file() and meta_path_for(path).is_file():
        raise QuantgateError("eval set not found (its sidecar is there)", where=str(path),
                             fix="write the samples beside the sidecar: <name>.jsonl")
    load_evalset(path, max_context=max_context)


def _check_machine(path: Path, spec: ReleaseSpec) -> None:
    """Refuse the spec's schemes that this machine's serving build cannot run (CPU profiles: the kernel probe)."""
    _, why = split_schemes(spec.hardware, spec.schemes, spec.serving.python)
    if not why:
        return
    first = next(s for s in spec.schemes if s in why)
    data, lines = read_yaml(path)
    raw = data.get("schemes") if isinstance(data, dict) else None
    index = raw.index(first) if isinstance(raw, list) and first in raw else None
    line = lines.get(("schemes", index)) or lines.get(("schemes",)) or 1
    item = f" (list item {index + 1})" if index is not None else ""
    raise QuantgateError(f"{', '.join(why)} cannot be served here: " + "; ".join(f"{s}: {r}" for s, r in why.items()),
                         where=f"{path}:{line} field 'schemes'{item}",
                         fix="remove it, release on a machine whose vLLM build has the kernel, or set "
                             "`skip_unsupported: true` to drop it with a logged note")


def _load_spec(path: Path) -> ReleaseSpec:
    """The spec, its schemes checked against this machine; the notes of `hardware: auto` / skip_unsupported."""
    spec = load_spec(path)
    _check_machine(path, spec)
    for note in spec.machine_notes:
        print(f"note spec {_show(path)}: {note}", file=sys.stderr, flush=True)
    return spec


def _check_one(path: Path, kind: Kind, done: set[Path]) -> list[Result]:
    """(kind, path, error or None) for the file and, for a spec, every file it names; files in `done` are skipped."""
    if kind is Kind.evalset and path.name.endswith(".meta.yaml"):
        path = path.with_name(path.name.removesuffix(".meta.yaml") + ".jsonl")
    if path.resolve() in done:
        return []
    done.add(path.resolve())
    loader = {Kind.spec: _load_spec, Kind.policy: load_policy, Kind.evalset: _check_evalset, Kind.review: check_csv}[kind]
    result, value = _attempt(kind, path, loader, path)
    results = [result]
    if kind is Kind.spec and isinstance(value, ReleaseSpec):
        for es in value.eval_sets:
            if es.resolve() not in done:
                done.add(es.resolve())
                results.append(_attempt(Kind.evalset, es, _check_evalset, es, max_context=value.context)[0])
        results += _check_one(value.policy or DEFAULT_POLICY, Kind.policy, done)
    return results


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())


def check(
    paths: Annotated[list[Path], typer.Argument(help="files to check: release specs, gate policies, eval sets "
                                                     "(.jsonl), human-review CSVs", show_default=False)],
    kind: Annotated[Optional[Kind], typer.Option(help="the kind of every PATH (default: detected per file)")] = None,
) -> None:
    """Validate input files without serving or quantizing anything: `ok KIND PATH` per good file, the problem
    (file, line, field, fix) per bad one. Exit 0 when all are good, 2 when any is bad."""
    bad = 0
    done: set[Path] = set()
    for path in paths:
        if path.is_dir():
            results: list[Result] = [(kind, path, QuantgateError("is a folder", where=str(path),
                                                                 fix="name the files, e.g. releases/*.yaml"))]
        elif not path.exists():
            results = [(kind, path, QuantgateError("file not found", where=str(path), fix="check the path"))]
        else:
            try:
                result, detected = (kind, path, None), kind
                if detected is None:
                    result, detected = _attempt(kind, path, detect_kind, path)
            except Skip as why:
                print(f"skip {_show(path)}: {why}, not a kind `quantgate check` validates", flush=True)
                continue
            results = _check_one(path, detected, done) if detected else [result]
        for k, p, err in results:
            label = k.value if k else ("yaml" if p.suffix in (".yaml", ".yml") else "file")
            if err is None:
                print(f"ok {label} {_show(p)}", flush=True)
            else:
                bad += 1
                print(f"error {label} {_show(p)}\n{_indent(err.render())}", file=sys.stderr, flush=True)
    if bad:
        print(f"check: {bad} bad file(s)", file=sys.stderr)
        raise typer.Exit(2)
