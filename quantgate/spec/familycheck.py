"""The support matrix applied to a release: refuse, before any work, a model family x scheme x platform that
quant_recipes/support_matrix.yaml measured to fail, and warn for a family it never measured there.

`quantgate check`, `release --check` and a release's load run it through quantgate.spec.resolve when the model's
config.json is on disk; a release whose model is fetched first runs it again at flow start (`at_flow_start`), still
before any quantization. `allow_unsupported_family: true` in the spec turns a refusal into a logged warning.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from quantgate.base.errors import ConfigError, QuantgateError
from quantgate.spec.external import EXTERNAL, read_config
from quantgate.serving.cpu_kernels import probe_kernels
from quantgate.target.families import BASELINE, Support, explain, family_of, load_matrix, lookup_order, platform_of, support
from quantgate.target.hardware import KernelProbe, get_profile

OVERRIDE = "allow_unsupported_family"


class FamilyFinding(NamedTuple):
    refusals: list[tuple[str | None, Support]]  # (the scheme, or None for the baseline/model) and what the matrix says
    warnings: list[str]


def findings(config: Mapping[str, Any], hardware: str, schemes: list[str], python: Path | None = None) -> FamilyFinding:
    """What the matrix says of this model (its config.json) with each scheme on the hardware's platform (an x86 CPU's
    from the kernel probe of the serving environment `python`)."""
    profile = get_profile(hardware)
    platform = platform_of(profile, _probe(python) if profile.kind == "cpu" and profile.arch != "arm" else None)
    family = family_of(config)
    arch = ", ".join(config.get("architectures") or []) or str(config.get("model_type") or "?")
    if family is None:
        return FamilyFinding([], [f"model family {arch} is not one quantgate has measured (quant_recipes/families.yaml "
                                  "lists those it knows): quantize, serve and parity are untested for it; see "
                                  "docs/support-matrix.md"])
    matrix = load_matrix()
    if not any(matrix.results.get(family.id, {}).get(p) for p in lookup_order(platform)):
        return FamilyFinding([], [f"model family {family.name} was never measured on {platform} (docs/support-matrix.md "
                                  "lists where it was): quantize, serve and parity are untested there"])
    said = {scheme: support(family, scheme, platform, matrix) for scheme in schemes or [BASELINE]}
    refusals: list[tuple[str | None, Support]] = []
    warnings: list[str] = []
    for scheme, x in said.items():
        if x.status == "fails":
            refusals.append((None if x.step and BASELINE in x.step else scheme, x))
        elif x.status == "unmeasured" and (scheme != BASELINE or x.measured_on):
            warnings.append(x.describe() + " (docs/support-matrix.md)")
    return FamilyFinding(refusals, warnings)


def _probe(python: Path | None) -> KernelProbe | None:
    """The serving build's kernels here (cached), or None where no serving environment answers."""
    try:
        return probe_kernels(python)
    except QuantgateError:
        return None


def refusal_text(said: Support) -> tuple[str, str]:
    """(message, fix) for a refused combination, naming where the matrix was measured."""
    when = next((f"measured {m.date} on {m.machine}" for m in load_matrix().measured if m.platform == said.platform), "")
    why = explain(said.cause)
    return (f"{said.describe()} (quant_recipes/support_matrix.yaml{', ' + when if when else ''}; docs/support-matrix.md)"
            + (f". Why: {why}" if why else ""),
            f"choose a scheme the matrix marks ok for this family, release on another platform, or set "
            f"`{OVERRIDE}: true` to try it anyway")


def matrix_reasons(config: Path, hardware: str, schemes: list[str], python: Path | None = None) -> dict[str, str]:
    """Scheme -> why the support matrix rules it out for this model here, for `schemes: auto`'s ranking (a failing
    baseline rules out every scheme); {} where the config cannot be read."""
    try:
        data = read_config(Path(config).parent)
    except ValueError:
        return {}
    out: dict[str, str] = {}
    for scheme, said in findings(data, hardware, schemes, python).refusals:
        for s in [scheme] if scheme else schemes:
            out[s] = f"the support matrix: {said.describe()}"
    return out


def spec_schemes(spec) -> list[str]:
    """The schemes the spec quantizes or whose checkpoints it serves (external endpoints are not served here)."""
    return list(spec.schemes) + [c.scheme for c in spec.candidates if c.checkpoint and c.scheme and c.scheme != EXTERNAL]


def at_flow_start(spec, model_dir: Path, log=print) -> None:
    """The model is on disk now: refuse what the matrix says fails (unless the override), log the warnings."""
    try:
        config = read_config(Path(model_dir))
    except ValueError:
        return  # the model step names an unreadable checkpoint
    found = findings(config, spec.hardware, spec_schemes(spec), spec.serving.python)
    for warning in found.warnings:
        log(f"support matrix: {warning}")
    for scheme, said in found.refusals:
        message, fix = refusal_text(said)
        if getattr(spec, OVERRIDE):
            log(f"support matrix: {message}; trying anyway ({OVERRIDE}: true)")
            continue
        raise ConfigError(message, where="schemes" if scheme else "model", fix=fix)


__all__ = ["FamilyFinding", "at_flow_start", "findings", "matrix_reasons", "refusal_text", "spec_schemes"]
