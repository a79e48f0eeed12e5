"""Which kind of input file `quantgate check` is given (quantgate.cli.check): a release spec, a gate policy, an eval
set or a filled human-review CSV, from its name, its top-level keys and its folder; YAML files of other kinds the
project ships (the model catalogue, an engine parity policy, ...) are named and skipped, not refused."""

from __future__ import annotations

import difflib
import re
from enum import Enum
from pathlib import Path

from quantgate.base.errors import QuantgateError
from quantgate.base.yamlconfig import read_yaml, top_line
from quantgate.evals.setsource import is_evalset_folder, meta_path_for
from quantgate.gate.policy import CHECK_SECTIONS, GatePolicy
from quantgate.spec.schema import ReleaseSpec


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
    if name.endswith((".jsonl", ".parquet", ".meta.yaml")) or (path.is_dir() and is_evalset_folder(path)):
        return Kind.evalset
    if name.endswith(".csv"):
        return Kind.evalset if meta_path_for(path).is_file() else Kind.review
    if not name.endswith((".yaml", ".yml")):
        raise QuantgateError("cannot tell what kind of file this is", where=str(path),
                             fix="pass --kind spec|policy|evalset|review")
    line = 1
    try:
        data, lines = read_yaml(path)
        keys, line = (set(data) if isinstance(data, dict) else set()), top_line(lines)
    except QuantgateError as exc:  # unreadable YAML: its top-level keys from the text, to name the kind
        try:
            keys = set(_TOP_KEY.findall(path.read_bytes().decode("utf-8", "replace")))
        except OSError:
            raise exc from None
        kind = _kind_from_keys(keys) or _kind_from_folder(path)
        if kind is None:
            raise exc from None
        return kind
    kind = _kind_from_keys(keys) or _kind_from_folder(path)
    if kind is None:
        if data is not None and not isinstance(data, dict):
            got = "list" if isinstance(data, list) else type(data).__name__
            raise QuantgateError(f"expected a mapping at the top level, got a {got}", where=f"{path}:{line}",
                                 fix="write the file as `key: value` fields: a release spec (version, name, model, "
                                     "...) or a gate policy")
        raise QuantgateError("cannot tell what kind of YAML file this is: it has neither a `model:` key (release spec) "
                             "nor a check section such as `primary:` (gate policy)", where=f"{path}:{line}",
                             fix="pass --kind spec or --kind policy")
    return kind
