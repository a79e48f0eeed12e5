"""The spec sections of registered measurement kinds: a release spec's `measure: {<kind>: {...}}`.

A kind added as one module (quantgate/kinds/) registers the model of its section here; the spec validates each
entry of `measure` with it, and names the registered kinds when an entry names none of them. The kinds built in
before this registry keep their own top-level sections (`recall`, `perf`, `fidelity`, `judge`, `eval_sets`).
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, ValidationInfo

from quantgate.base.plugins import load_kinds
from quantgate.base.yamlconfig import under


class KindSpec(BaseModel):
    """Base of a kind's spec section: unknown fields are refused, as everywhere in a spec."""
    model_config = ConfigDict(extra="forbid")


_MODELS: dict[str, type[KindSpec]] = {}


def register(name: str, model: type[KindSpec]) -> None:
    _MODELS[name] = model


def registered() -> Mapping[str, type[KindSpec]]:
    """Every installed kind's section model (quantgate.base.plugins imports them on first need)."""
    load_kinds()
    return dict(_MODELS)


def section(name: str, raw: object, info: ValidationInfo) -> KindSpec:
    """`measure.<name>` validated by its kind's model (with the spec's validation context: relative paths resolve
    against the spec file's folder); an unknown kind names the registered ones."""
    if name not in registered():
        known = ", ".join(sorted(_MODELS)) or "none is installed"
        raise ValueError(f"measure.{name}: no such measurement kind (registered: {known})")
    return under(name, _MODELS[name], raw, info.context)
