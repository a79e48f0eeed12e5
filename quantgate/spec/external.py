"""Variants from elsewhere in a release spec: `candidates:` (existing checkpoint folders, OpenAI-compatible
endpoints) and an endpoint `baseline:`; and which scheme an existing checkpoint carries.

    candidates:
      - {name: redhat-int8, checkpoint: /models/SmolLM2-135M-Instruct-quantized.w8a8}
      - {name: prod-fp8, endpoint: https://host/v1, model: SERVED_NAME, api_key_env: VAR, scheme: fp8-dynamic}
    baseline: {endpoint: https://host/v1, model: SERVED_NAME, prefect_secret: BLOCK}

A checkpoint candidate is served by quantgate like a quantized scheme, without quantizing: its folder must exist and
hold config.json; its scheme is read from `quantization_config` (`detect_scheme`): compressed-tensors groups map to
quantgate's scheme ids where their weight and activation formats match one, anything else is `external` (no policy
family: the gate's family checks cannot pass it). `checkpoint_problems` looks further, for `quantgate check`:
weights files there, readable, and stored as the scheme says (safetensors headers). An endpoint is measured where it
runs and never started or stopped (quantgate.serving.endpoint); its `scheme` may be declared (not verified), default
`external`. Keys come from an environment variable or a Prefect Secret block, read when the release runs, never at
load.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import cast

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from quantgate.base.errors import QuantgateError
from quantgate.quantize.preflight import read_safetensors_header
from quantgate.quantize.schemes import load_schemes
from quantgate.serving.cpu_kernels import split_schemes

EXTERNAL = "external"  # the scheme of a variant whose format quantgate does not map to one of its schemes
NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


class EndpointRef(BaseModel):
    """An OpenAI-compatible server quantgate does not start: URL, served model name, where its key is."""
    model_config = ConfigDict(extra="forbid")

    endpoint: str = Field(pattern=r"^https?://", description="base URL, e.g. https://host/v1")
    model: str = Field(min_length=1, description="the model name the endpoint serves")
    api_key_env: str | None = Field(None, description="environment variable holding its API key (read at run time)")
    prefect_secret: str | None = Field(None, description="Prefect Secret block holding its API key")

    @model_validator(mode="after")
    def _one_key(self) -> EndpointRef:
        if self.api_key_env and self.prefect_secret:
            raise ValueError("give either api_key_env or prefect_secret, not both")
        return self


class CandidateSpec(BaseModel):
    """One entry of `candidates:`: exactly one of `checkpoint` (a folder) or `endpoint` (with `model`)."""
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME, max_length=100, description="its folder in the run and its name in the decision")
    checkpoint: Path | None = Field(None, description="an existing vLLM-loadable checkpoint folder (relative: to the spec)")
    endpoint: str | None = Field(None, pattern=r"^https?://", description="an OpenAI-compatible server's base URL")
    model: str | None = Field(None, description="the model name the endpoint serves (required with endpoint)")
    api_key_env: str | None = None
    prefect_secret: str | None = None
    scheme: str | None = Field(None, description="checkpoint: detected from config.json; endpoint: declared "
                                                 "(a scheme id, not verified), default external")
    _note: str | None = PrivateAttr(None)

    @field_validator("checkpoint")
    @classmethod
    def _checkpoint_folder(cls, v: Path | None, info: ValidationInfo) -> Path | None:
        if v is None:
            return None
        base = (info.context or {}).get("path")
        path = v if v.is_absolute() or base is None else Path(base).parent / v
        why = folder_problem(path)
        if why:
            raise ValueError(f"checkpoint folder {why}" + (" (relative paths are relative to the spec file's folder)"
                                                           if why.startswith("not found") else ""))
        path = path.resolve()
        read_config(path)
        return path

    @field_validator("scheme")
    @classmethod
    def _known_scheme(cls, v: str | None) -> str | None:
        known = [s.id for s in load_schemes().schemes]
        if v is not None and v != EXTERNAL and v not in known:
            raise ValueError(f"unknown scheme {v!r}: use one of {', '.join(known)} or {EXTERNAL}")
        return v

    @model_validator(mode="after")
    def _one_kind(self) -> CandidateSpec:
        if (self.checkpoint is None) == (self.endpoint is None):
            raise ValueError(f"candidate {self.name}: give exactly one of `checkpoint` (a folder quantgate serves) or "
                             "`endpoint` (a server it does not start, with `model`)")
        if self.endpoint is not None:
            if not self.model:
                raise ValueError(f"candidate {self.name}: `model` is required with `endpoint`: the model name "
                                 f"{self.endpoint} serves")
            if self.api_key_env and self.prefect_secret:
                raise ValueError(f"candidate {self.name}: give either api_key_env or prefect_secret, not both")
            self.scheme = self.scheme or EXTERNAL
            return self
        extra = [k for k in ("model", "api_key_env", "prefect_secret") if getattr(self, k) is not None]
        if extra:
            raise ValueError(f"candidate {self.name}: not with `checkpoint`: {', '.join(extra)} (they describe an endpoint)")
        assert self.checkpoint is not None
        found, note = detect_scheme(read_config(self.checkpoint).get("quantization_config"))
        if self.scheme is not None and self.scheme != found:
            raise ValueError(f"candidate {self.name}: scheme {self.scheme} is not what {self.checkpoint}/config.json "
                             f"holds ({found}: {note}); remove `scheme` (it is detected for a checkpoint)")
        unchecked = ": quantgate cannot check that the hardware serves it (its server start will tell) and the " \
            "policy has no family for it" if found == EXTERNAL else ""
        self.scheme, self._note = found, f"candidate {self.name}: {found} ({note}){unchecked}"
        return self

    @property
    def note(self) -> str | None:
        """What the scheme detection found, for the release's notes."""
        return self._note

    def endpoint_ref(self) -> EndpointRef | None:
        if self.endpoint is None:
            return None
        return EndpointRef(endpoint=self.endpoint, model=self.model or "", api_key_env=self.api_key_env,
                           prefect_secret=self.prefect_secret)


def folder_problem(path: Path) -> str | None:
    """Why `path` is no folder quantgate can read ("not found: ...", a symlink loop, no permission), or None."""
    try:
        st = os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"{path} is a symlink loop (it points back at itself)"
        if exc.errno == errno.ENOENT and os.path.islink(path):
            return f"{path} is a broken symlink (to {os.readlink(path)}, which does not exist)"
        return f"not found: {path}" if exc.errno == errno.ENOENT else f"{path} cannot be looked at: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is a file, not a folder"
    if not os.access(path, os.R_OK | os.X_OK):
        return f"{path} is not readable (permissions)"
    return None


def read_config(folder: Path) -> dict:
    """config.json of a checkpoint folder, as a mapping; ValueError naming the file otherwise."""
    path = folder / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"no config.json in {folder}: not a Hugging Face checkpoint folder") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    except (RecursionError, ValueError) as exc:  # the JSON parser's limits: nesting, digits
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc).split("; use sys.", 1)[0]
        raise ValueError(f"cannot read {path}: {why}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def _group_scheme(group: Mapping) -> tuple[str, str]:
    """One compressed-tensors config group -> (scheme id or EXTERNAL, what it is)."""
    w, a = group.get("weights") or {}, group.get("input_activations")
    wd = f"{w.get('type')}{w.get('num_bits')} weights"
    if a is None:
        if (w.get("type"), w.get("num_bits")) == ("int", 4):
            sym = w.get("symmetric", True)
            return ("w4a16-gptq" if sym else "w4a16-awq"), f"{'symmetric' if sym else 'asymmetric'} int4 weights, 16-bit activations"
        return EXTERNAL, f"{wd}, 16-bit activations"
    ad = f"{a.get('type')}{a.get('num_bits')} {'dynamic' if a.get('dynamic') else 'static'} activations"
    key = (w.get("type"), w.get("num_bits"), a.get("type"), a.get("num_bits"))
    if key == ("float", 8, "float", 8) and a.get("dynamic"):
        return "fp8-dynamic", f"{wd}, {ad}"
    if key == ("int", 8, "int", 8):
        return "int8-w8a8", f"{wd}, {ad}"
    if key == ("float", 4, "float", 4):
        return "nvfp4", f"{wd}, {ad}"
    return EXTERNAL, f"{wd}, {ad}"


def detect_scheme(quantization_config: Mapping | None) -> tuple[str, str]:
    """The quantgate scheme id a checkpoint's `quantization_config` carries, and why (pure). compressed-tensors
    groups map by weight and activation format: int8 W8A8 -> int8-w8a8, FP8 weights with dynamic FP8 activations
    -> fp8-dynamic, int4 weights with 16-bit activations -> w4a16-gptq (symmetric) or w4a16-awq (asymmetric, with
    zero points), FP4 W4A4 -> nvfp4. The id names the serving format (kernels, policy family), not the algorithm
    that produced the weights. Anything else, several groups that disagree, or no quantization at all: EXTERNAL."""
    if not quantization_config:
        return EXTERNAL, "config.json has no quantization_config: an unquantized checkpoint"
    method = quantization_config.get("quant_method")
    if method != "compressed-tensors":
        return EXTERNAL, f"quant_method {method!r} is not compressed-tensors: quantgate maps only compressed-tensors"
    groups = quantization_config.get("config_groups") or {}
    if not isinstance(groups, Mapping) or not groups:
        return EXTERNAL, "compressed-tensors without config_groups"
    found = {name: _group_scheme(g if isinstance(g, Mapping) else {}) for name, g in groups.items()}
    schemes = {s for s, _ in found.values()}
    what = "; ".join(f"{n}: {d}" for n, (_, d) in found.items())
    kv = quantization_config.get("kv_cache_scheme")
    tail = f"; KV cache {kv.get('type')}{kv.get('num_bits')}" if isinstance(kv, Mapping) else ""
    if len(schemes) == 1 and EXTERNAL not in schemes:
        return schemes.pop(), f"compressed-tensors {what}{tail}"
    why = "its groups use different formats" if len(schemes) > 1 else "no quantgate scheme has this format"
    return EXTERNAL, f"compressed-tensors {what}{tail}: {why}"


WEIGHTS = ("*.safetensors", "*.bin", "*.pt")  # what vLLM's `auto` load format looks for, in this order
# How each scheme's weights are stored in a compressed-tensors checkpoint (not `dense`): what, and a tensor test.
_STORED = {"int8-w8a8": ("int8 (I8) weight tensors", lambda name, dtype: dtype == "I8"),
           "fp8-dynamic": ("FP8 (F8_*) weight tensors", lambda name, dtype: dtype.startswith("F8_")),
           "w4a16-gptq": ("packed int4 tensors (*.weight_packed)", lambda name, dtype: name.endswith(".weight_packed")),
           "w4a16-awq": ("packed int4 tensors (*.weight_packed)", lambda name, dtype: name.endswith(".weight_packed")),
           "nvfp4": ("packed FP4 tensors (*.weight_packed)", lambda name, dtype: name.endswith(".weight_packed"))}


def _weights_problems(folder: Path, config: dict, scheme: str | None) -> list[str]:
    """The weights files of a checkpoint: present, every shard its index names there, safetensors headers
    readable; for a quantized `scheme`, stored in its format (safetensors headers only: no tensor data is read)."""
    files = next((sorted(folder.glob(g)) for g in WEIGHTS if list(folder.glob(g))), [])
    if not files:
        return [f"no weights files in {folder} (vLLM loads *.safetensors, *.bin or *.pt): only part of a checkpoint"]
    problems = []
    for index in sorted(folder.glob("*.index.json")):
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values())
        except (OSError, ValueError, RecursionError, AttributeError) as exc:
            problems.append(f"{index} cannot be read: {type(exc).__name__}: {exc}")
            continue
        problems += [f"{index} names {s}, which is not in {folder}" for s in sorted(shards) if not (folder / s).is_file()]
    tensors: dict[str, str] = {}
    for f in (f for f in files if f.suffix == ".safetensors"):
        try:
            tensors |= {n: str(t.get("dtype")) for n, t in read_safetensors_header(f, whole=True).items()
                        if isinstance(t, dict)}
        except (QuantgateError, OSError, ValueError, RecursionError) as exc:
            problems.append(f"{f} is no readable safetensors file: {getattr(exc, 'message', exc)}")
    qc = cast(Mapping, config.get("quantization_config")) if isinstance(config.get("quantization_config"), Mapping) else {}
    groups = cast(Mapping, qc.get("config_groups")) if isinstance(qc.get("config_groups"), Mapping) else {}
    formats = {qc.get("format")} | {g.get("format") for g in groups.values() if isinstance(g, Mapping)}
    if scheme in _STORED and tensors and not problems and "dense" not in formats:  # dense: 16-bit, quantized at load
        what, test = _STORED[scheme]
        if not any(test(n, d) for n, d in tensors.items()):
            dtypes = ", ".join(sorted(set(tensors.values())))
            problems.append(f"config.json declares {scheme} but the weights hold no {what}, only {dtypes}: "
                            "a config.json copied onto other weights?")
    return problems


def checkpoint_problems(folder: Path, scheme: str | None = None, *, weights: bool = True) -> list[str]:
    """Why `folder` is no checkpoint quantgate can serve: not there, a symlink loop, unreadable, no config.json, no
    (or unreadable) weights files, weights not stored as `scheme` says (where the safetensors headers tell). []
    when none. `weights=False`: the folder serves only its config and tokenizer (an endpoint baseline's model)."""
    why = folder_problem(Path(folder))
    if why:
        return [why]
    try:
        config = read_config(Path(folder))
    except ValueError as exc:
        return [str(exc)]
    return _weights_problems(Path(folder), config, scheme) if weights else []


def hardware_problem(hardware: str, scheme: str | None, python: Path | None = None) -> str | None:
    """Why `hardware` cannot serve a checkpoint of `scheme` (the support table and, on a CPU, the kernel probe: the
    same checks as `schemes`), or None. An EXTERNAL scheme cannot be checked: None, and the note says so."""
    if scheme is None or scheme == EXTERNAL:
        return None
    kept, why = split_schemes(hardware, [scheme], python)
    return None if kept else why.get(scheme, "does not run here")


def candidate_names(spec) -> list[str]:
    """Every candidate of a release in order: the schemes to quantize, then `candidates`."""
    return [*spec.schemes, *(c.name for c in spec.candidates)]


def external(spec, name: str) -> CandidateSpec | None:
    """The `candidates` entry called `name`, or None (a scheme id)."""
    return next((c for c in spec.candidates if c.name == name), None)


__all__ = ["EXTERNAL", "CandidateSpec", "EndpointRef", "candidate_names", "checkpoint_problems", "detect_scheme",
           "external", "folder_problem", "hardware_problem", "read_config"]
