"""Measurement kinds registered with the gate: a kind's policy section, its comparison file and its checks.

A kind added as one module (docs/design.md, "Adding a measurement kind"; the modules are in quantgate/kinds/)
registers a `GateKind` here. Its name is the same on every floor: the spec's `measure.<name>` section, the variant's
evidence slot `kinds.<name>`, the comparison file `<run>/<candidate>/<name>.json` (a gate.models.KindComparison), the policy's
`kinds.<name>` section, and its checks, named `<name>` or `<name>:<slice>`. The gate reads what registered kinds
compared (`read`), judges them (`checks`), and `quantgate check` names a required kind the spec does not measure
(`unfed`); the report shows their comparisons. The kinds built in (eval sets, recall, fidelity, judge, engine
parity, error rates, pay-off) judge their own evidence in quantgate.gate.builtin, whose kinds the gate walks first;
their evidence readers are still one function each in gate.evidence.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, ConfigDict

from quantgate.base.plugins import load_kinds
from quantgate.base.typedfile import read_model
from quantgate.base.yamlconfig import under
from quantgate.gate.models import Check, Gap, KindComparison


class KindPolicy(BaseModel):
    """What every kind's policy section has: whether its check is required (a missing comparison is then
    INCONCLUSIVE, as for the built-in checks) or optional (skipped without one)."""
    model_config = ConfigDict(extra="forbid")

    required: bool = True


class GateKind(Protocol):
    """The gate's side of a registered kind."""
    name: str
    policy_model: type[KindPolicy]
    spec_field: str          # what feeds it, as `quantgate check` names it ("measure.perplexity")

    def checks(self, section: KindPolicy, comparison: KindComparison | None, gap: Gap | None) -> list[Check]: ...


_KINDS: dict[str, GateKind] = {}


def register(kind: GateKind) -> None:
    _KINDS[kind.name] = kind


def registered() -> Mapping[str, GateKind]:
    """Every installed kind's gate side (quantgate.base.plugins imports them on first need)."""
    load_kinds()
    return dict(_KINDS)


def comparison_file(run: Path, candidate: str, name: str) -> Path:
    return run / candidate / f"{name}.json"


def read(run: Path, candidate: str) -> dict[str, KindComparison]:
    """Every registered kind's comparison of `candidate` that the run folder has."""
    found = {}
    for name in registered():
        if (path := comparison_file(run, candidate, name)).is_file():
            found[name] = read_model(path, KindComparison, f"{name} comparison", "re-run the release with the same "
                                     "--run-id: its compare step writes the file again")
    return found


def policy_section(name: str, raw: object) -> KindPolicy:
    """A policy's `kinds.<name>` section validated by its kind's model; an unknown name names the registered ones."""
    if name not in registered():
        known = ", ".join(sorted(_KINDS)) or "none is installed"
        raise ValueError(f"kinds.{name}: no such measurement kind (registered: {known})")
    return under(name, _KINDS[name].policy_model, raw)


def checks(sections: Mapping[str, KindPolicy], found: Mapping[str, KindComparison],
           gaps: Mapping[str, Gap]) -> list[Check]:
    """The checks of every kind the policy has a section for, in the policy's order."""
    out: list[Check] = []
    for name, section in sections.items():
        out += _KINDS[name].checks(section, found.get(name), gaps.get(name))
    return out


def missing(name: str, section: KindPolicy, gap: Gap | None) -> Check:
    """The check of a kind without a comparison: INCONCLUSIVE when required, else skipped. `gap`: why, where the
    release said (a step skipped on purpose)."""
    why = gap.reason if gap is not None else \
        f"no {name} comparison ({name}.json): the spec measures none (`measure.{name}`), or its step did not run"
    return Check(name=name, measured=None, limit=None, required=section.required,
                 outcome="inconclusive" if section.required else "skipped",
                 evidence_file=gap.file if gap is not None else None, reason=why)


def unfed(sections: Mapping[str, KindPolicy], measured: set[str]) -> list[tuple[str, bool, str, str]]:
    """(kind, required, what, fix) for each kind the policy checks that the spec does not measure."""
    out = []
    for name, section in sections.items():
        if name not in measured:
            field = _KINDS[name].spec_field
            out.append((name, section.required, f"the spec measures no {name} (no `{field}` section)",
                        f"give the spec a `{field}` section, or set kinds.{name}.required false in the policy"))
    return out
