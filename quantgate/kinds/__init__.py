"""Measurement kinds added as one module each, and their registration (docs/design.md, "Adding a measurement kind").

A kind module holds every floor of one measurement: its spec section, its release side (a
quantgate.release.measurements.Measurement: cache folder and done test, steps, evidence, comparison) and its gate side
(a quantgate.gate.kinds.GateKind: policy section and checks); the report shows what the gate kinds compared. Adding
one is its module (which calls `register` at its end), one entry point in pyproject.toml
(`[project.entry-points."quantgate.kinds"]`), its tests and a policy entry.

The packages below cannot import this one (it sits above `release`): they find the installed kinds through the entry
points (quantgate.base.plugins), which imports each kind's module once, on first need.
"""

from __future__ import annotations

from quantgate.gate import kinds as gate_kinds
from quantgate.gate.kinds import GateKind
from quantgate.release import measurements
from quantgate.release.measurements import Measurement
from quantgate.spec import kinds as spec_kinds
from quantgate.spec.kinds import KindSpec


def register(name: str, spec: type[KindSpec], measurement: Measurement, gate: GateKind) -> None:
    """One kind on every floor, by one name: the spec's `measure.<name>`, the release's steps and evidence, the
    gate's policy section `kinds.<name>` and checks."""
    assert measurement.name == gate.name == name, (name, measurement.name, gate.name)
    spec_kinds.register(name, spec)
    measurements.register(measurement)
    gate_kinds.register(gate)

