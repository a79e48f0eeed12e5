"""The release spec: one YAML file in `releases/` saying what to release, for which hardware, checked how.

    version: 1                      # schema version of this file
    name: demo                      # run ids and registry entries start with it
    model: demo                     # catalogue id (releases/models.yaml) or a checkpoint folder
    license: apache-2.0             # the model card's license; default: the catalogue's or the checkpoint's own
    hardware: x86-cpu               # profile id in quant_recipes/hardware.yaml, or auto (this machine's CPU profile)
    workload: latency               # latency | throughput | fit
    schemes: [w4a16-gptq]           # candidate schemes, each must run on the hardware; or `auto` / {auto: N}: the
                                    # top 1 / N of `quantgate schemes`'s ranking for hardware, workload and model size
    candidates:                     # existing variants besides (or instead of) `schemes`: a checkpoint folder, its
      - {name: ext-int8, checkpoint: ckpts/int8}      # scheme read from config.json; or an endpoint quantgate
      - {name: prod, endpoint: https://host/v1, model: NAME, api_key_env: VAR}  # never starts (prefect_secret: BLOCK)
    baseline: {endpoint: https://host/v1, model: NAME, api_key_env: VAR}  # default: `model` served by quantgate;
                                    # `model` stays required: the tokenizer of recall, perf and fidelity comes from it
    skip_unsupported: false         # true: drop (and log) the schemes this machine's serving build cannot run
    allow_unsupported_family: false # true: try a model family x scheme the support matrix says fails here
    ladder: false                   # true: try the schemes in order, stop at the first PROMOTE
    eval_sets: [../eval_sets/default.jsonl]
    lm_eval: {tasks: [qg_numbers], limit: 20}  # lm-evaluation-harness tasks, each one more eval set `lm_eval:<task>`:
                                    # include_path (default eval_sets/lm_eval), limit, num_fewshot, concurrency,
                                    # max_error_rate; only generate_until tasks scored by a metric quantgate knows
    judge: {serve: demo, limit: 50} # or {endpoint: https://host/v1, model: NAME, api_key_env: VAR}
    policy: policies/default.yaml
    quantization: {calibration: {samples: 64, max_seq_length: 256}}
    serving: {startup_timeout_s: 900}
    # serving knobs (quantgate.plan.knobs), checked against the hardware profile at load:
    #   kv_cache_dtype (auto|fp8|fp8_e4m3|fp8_e5m2, candidates only; needs `recall`: the gate then requires it),
    #   gpu_memory_utilization (GPU profiles only), max_num_batched_tokens, max_num_seqs (>= concurrency),
    #   enable_prefix_caching, enforce_eager, cudagraph_mode (GPU profiles only)
    eval: {limit: 50}
    perf: {slo: {ttft_ms: 500}}     # the `workload` profile's probe (quant_recipes/workloads.yaml); fields override it
    publish: [{folder: ../published}, {hf_repo: org/name, token_env: HF_TOKEN}]  # where each PROMOTE entry goes
                                    # after promotion: folder, url (fsspec) or hf_repo (quantgate.publishing.publish)
    notify: [{url: https://ci.example/hook, secret_env: HOOK_SECRET}]  # the decision POSTed after the gate, HMAC-signed

Relative paths are relative to the spec file's folder. This model checks what the file says (the hardware profile
exists, referenced files exist, cross-field rules) without looking at the machine; quantgate.spec.resolve then
decides what depends on it (`auto`, the kernel probe, which schemes run here). Both name the field and line.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, SerializeAsAny, ValidationInfo, field_validator,
                      model_validator)

from quantgate.base.errors import QuantgateError
from quantgate.base.runinfo import ResolvedRelease
from quantgate.base.yamlconfig import field_error, item_error, load_model
from quantgate.gate.policy import DEFAULT_POLICY
from quantgate.evals.lmeval_tasks import LmEvalSpec
from quantgate.evals.setsource import SameName, set_names
from quantgate.quantize.schemes import known_scheme_ids
from quantgate.spec.autoschemes import auto_count
from quantgate.spec import kinds
from quantgate.spec.external import CandidateSpec, EndpointRef, folder_problem
from quantgate.publishing.publish import NotifySpec, PublishTarget
from quantgate.spec.sections import (AdaptiveSpec, EvalSpec, ExecutorSpec, FidelitySpec, JudgeSpec, PerfSpec,
                                             QuantizationSpec, RecallSpec, RepairSpec, ServingSpec, resolve_path)
from quantgate.target.catalogue import load_catalogue
from quantgate.target.hardware import AUTO, get_profile

__all__ = ["AdaptiveSpec", "EvalSpec", "ExecutorSpec", "FidelitySpec", "JudgeSpec", "PerfSpec", "QuantizationSpec", "RecallSpec",
           "ReleaseSpec", "ServingSpec", "load_written_spec"]


class ReleaseSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = Field(description="schema version of release specs")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=100,
                      description="run ids (<name>-<time>-<random>, at most 128 characters) start with it")
    model: str = Field(description="catalogue id or checkpoint folder")
    license: str | None = Field(None, description="the model's license as the Hub spells it (apache-2.0, llama3.1, "
                                "other): the model card's `license`, before the catalogue's and what the checkpoint's "
                                "README.md or config.json states")
    serving: ServingSpec = Field(default_factory=ServingSpec)
    hardware: str = Field(description="profile id in quant_recipes/hardware.yaml, or `auto`: the profile of this "
                                      "machine's CPU as its serving build runs it (quantgate.serving.cpu_kernels)")
    gpus: int | None = Field(None, ge=1, description="devices to use per node; default: all of the profile's")
    nodes: int = Field(1, ge=1)
    workload: Literal["latency", "throughput", "fit"] = "latency"
    context: int = Field(4096, ge=128, description="tokens per request for the capacity estimate")
    concurrency: int = Field(8, ge=1, description="concurrent requests the deployment must hold")
    skip_unsupported: bool = Field(False, description="true: schemes this machine's serving build cannot run (the "
                                   "kernel probe, for CPU profiles) are dropped with a logged reason; false: refused")
    allow_unsupported_family: bool = Field(False, description="true: release a model family x scheme that the support "
                                           "matrix (docs/support-matrix.md) measured to fail on this platform, with a "
                                           "logged warning; false: refused before any work")
    candidates: list[CandidateSpec] = Field(default_factory=list, description="existing checkpoints and endpoints, "
                                            "gated like the schemes (quantgate.spec.external)")
    schemes: list[str] = Field(default_factory=list, validate_default=True, description="schemes to quantize; "
                               "may be empty when `candidates` lists at least one")
    baseline: EndpointRef | None = Field(None, description="an endpoint as the baseline (parity and size are then not "
                                         "applicable); null: `model` served by quantgate")
    ladder: bool = Field(False, description="true: `schemes` is a preference order; try one at a time, stop at the "
                                            "first PROMOTE. false: evaluate and gate every scheme")
    decide_early: bool = Field(True, description="true: a candidate whose fidelity already fails its limit (the gate's "
                               "own check at the first look's share of alpha) skips the eval sets it has not run, its "
                               "recall grid, perf probe and judge: the REJECT is decided. false: measure everything (the full picture)")
    junit_inconclusive: Literal["failure", "skipped"] = Field(
        "failure", description="how decision.junit.xml shows an INCONCLUSIVE candidate and its inconclusive checks: "
        "failure (CI shows that nothing was promoted) or skipped")
    eval_sets: list[Path] = Field(default_factory=list)
    lm_eval: LmEvalSpec | None = Field(None, description="lm-evaluation-harness tasks as eval sets (quantgate.evals.lmeval)")
    judge: JudgeSpec | None = Field(None, description="LLM judge step; null: none (a policy requiring it rejects)")
    policy: Path | None = None
    quantization: QuantizationSpec = Field(default_factory=QuantizationSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    recall: RecallSpec | None = Field(default_factory=RecallSpec, description="null: no recall run (a policy requiring it rejects)")
    perf: PerfSpec | None = Field(default_factory=PerfSpec, description="null: no performance probe")
    fidelity: FidelitySpec | None = Field(default_factory=FidelitySpec, description="null: no fidelity scoring (a "
                                          "policy requiring fidelity is then inconclusive)")
    measure: dict[str, SerializeAsAny[kinds.KindSpec]] = Field(default_factory=dict, description="registered "
                                                               "measurement kinds (quantgate/kinds/) -> their section")
    adaptive: AdaptiveSpec | None = Field(None, description="more samples for INCONCLUSIVE candidates; null: none")
    repair: RepairSpec | None = Field(None, description="after a REJECT by fidelity, the scheme again with its most "
                                      "sensitive layers kept at 16 bits, gated like any candidate; null: none")
    publish: list[PublishTarget] = Field(default_factory=list, description="where every PROMOTE entry is copied after promotion")
    notify: list[NotifySpec] = Field(default_factory=list, description="webhooks told of the decision after the gate")
    executor: ExecutorSpec = Field(default_factory=ExecutorSpec, description="where variants are served: this host "
                                   "(local) or Prefect work pools with results on shared storage (pools)")

    @field_validator("measure", mode="before")
    @classmethod
    def _kinds_known(cls, v: object, info: ValidationInfo) -> object:
        """Each `measure` entry by its kind's own model (quantgate.spec.kinds)."""
        if not isinstance(v, dict):
            return v
        return {name: kinds.section(name, raw, info) for name, raw in v.items()}

    @field_validator("eval_sets")
    @classmethod
    def _eval_sets_exist(cls, v: list[Path], info: ValidationInfo) -> list[Path]:
        out = []
        for i, p in enumerate(v):
            try:
                out.append(resolve_path(p, info))
            except ValueError as exc:
                raise item_error(i, str(exc)) from None  # at the item's own line
        try:
            set_names(out)  # the name each set's evidence is filed under: one per set
        except SameName as exc:
            raise item_error(exc.index, str(exc)) from None
        return out

    @field_validator("policy")
    @classmethod
    def _file_exists(cls, v: Path | None, info: ValidationInfo) -> Path | None:
        return resolve_path(v, info)

    @field_validator("model")
    @classmethod
    def _model_can_be_there(cls, v: str) -> str:
        """A model folder may be fetched after the spec loads (`quantgate check` requires it now); one that is there
        but can never serve (a symlink loop, a file, no permission) is refused at load."""
        path = Path(v).expanduser()
        why = folder_problem(path) if v not in load_catalogue() and os.path.lexists(path) else None
        if why:
            raise ValueError(f"model folder {why}: give a catalogue id or a Hugging Face checkpoint folder")
        return v

    @field_validator("license")
    @classmethod
    def _license_is_a_hub_id(cls, v: str | None) -> str | None:
        """The card's front matter is read by the Hub, which knows licenses by id: `Apache 2.0` would not match one."""
        if v is not None and not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", v):
            raise ValueError(f"'{v}' is not a license id as the Hub spells it: write it in lower case without spaces "
                             "(apache-2.0, mit, llama3.1, cc-by-4.0; `other` for a license of its own)")
        return v

    @field_validator("judge", mode="before")
    @classmethod
    def _judge_is_a_mapping(cls, v):
        if isinstance(v, (str, Path)):
            raise ValueError(f"a bare template path ({v}) names no judge model: write `judge: {{template: {v}, "
                             "endpoint: URL, model: NAME}` for a remote judge or `judge: {template: "
                             f"{v}, serve: MODEL}}` for one quantgate serves")
        return v

    @field_validator("judge")
    @classmethod
    def _judge_has_answers(cls, v: JudgeSpec | None, info: ValidationInfo) -> JudgeSpec | None:
        if v is not None and "eval_sets" in info.data and not info.data["eval_sets"]:
            raise ValueError("the judge compares answers to the first of `eval_sets`: list at least one eval set")
        return v

    _machine: list[str] = PrivateAttr(default_factory=list)  # notes: the spec's own, and (resolve) the machine's
    _auto: int | None = PrivateAttr(None)  # `schemes: auto` / {auto: N}: N (quantgate.spec.autoschemes)
    _written: dict[str, Any] = PrivateAttr(default_factory=dict)  # `hardware` and `schemes` as the file gave them

    @property
    def auto_schemes(self) -> int | None:
        """N when `schemes` was given as `auto` (1) or {auto: N}: the flow ranks them again with the model in hand."""
        return self._auto

    @property
    def machine_notes(self) -> list[str]:
        """The spec's own notes and, once resolved (quantgate.spec.resolve), what `hardware: auto`, `schemes: auto`
        and skip_unsupported decided, each with its reason."""
        return list(self._machine)

    @model_validator(mode="wrap")
    @classmethod
    def _note_written(cls, data, handler):
        """What the file said for `hardware` and `schemes` (run.json records it beside what was decided), the N of
        `schemes: auto`, and the spec's own notes; quantgate.spec.resolve adds the machine's decisions."""
        spec = handler(data)
        raw = data if isinstance(data, dict) else {}
        spec._auto = auto_count(raw.get("schemes"))
        if not spec.schemes and not spec.candidates and not spec._auto:
            raise field_error(("schemes",), "List should have at least 1 item: give `schemes` to quantize, "
                              "`candidates` (existing checkpoints or endpoints), or both")
        notes = [c.note for c in spec.candidates if c.note]
        if spec.serving.enable_prefix_caching is False and spec.recall is not None and spec.recall.ask != "single":
            notes.append(f"serving.enable_prefix_caching is false: the recall grid (ask: {spec.recall.ask}) sends each "
                         "haystack's shared prefix again for every question, computed anew each time")
        spec._machine = notes
        spec._written = {k: raw.get(k) for k in ("hardware", "schemes")}
        return spec

    def resolved(self, python: Path | None) -> ResolvedRelease:
        """What this machine decided for the spec, beside what it said (run.json's `resolved`); `python`: the serving
        interpreter (None where there is none)."""
        given = self._written.get("schemes")
        hardware = self._written.get("hardware")
        return ResolvedRelease(hardware=self.hardware, hardware_written=None if hardware is None else str(hardware),
                               schemes=list(self.schemes), schemes_written=given,
                               dropped=[x for x in given if x not in self.schemes] if isinstance(given, list) else [],
                               candidates=[c.name for c in self.candidates],
                               serving_python=None if python is None else str(python), notes=self.machine_notes)

    @field_validator("hardware")
    @classmethod
    def _known_hardware(cls, v: str) -> str:
        """A profile id, or `auto` (quantgate.spec.resolve decides it on this machine)."""
        if v.strip().lower() == AUTO:
            return AUTO
        try:
            return get_profile(v).id
        except QuantgateError as exc:
            raise ValueError(f"{exc.message}; {exc.fix}") from None

    @field_validator("schemes", mode="before")
    @classmethod
    def _auto_schemes(cls, v):
        """`auto` / {auto: N}: none listed here; quantgate.spec.resolve picks the top N of the ranking."""
        return [] if auto_count(v) is not None else v

    @field_validator("candidates")
    @classmethod
    def _candidate_names(cls, v: list[CandidateSpec]) -> list[CandidateSpec]:
        names = [c.name for c in v]
        for i, c in enumerate(v):
            if c.name == "baseline" or c.name in names[:i]:
                raise item_error(i, f"candidate name {c.name!r} is {'reserved' if c.name == 'baseline' else 'used twice'}: "
                                    "each candidate needs its own name (its folder in the run)")
        return v

    @field_validator("schemes")
    @classmethod
    def _schemes_named_once(cls, v: list[str], info: ValidationInfo) -> list[str]:
        """Each scheme once, and no candidate of the same name (whether each runs on the hardware: resolve)."""
        clash = [s for s in v if s in {c.name for c in info.data.get("candidates", [])}]
        if clash:
            raise item_error(v.index(clash[0]), f"{clash[0]!r} is also a candidate's name: rename the candidate")
        twice = sorted({s for s in v if v.count(s) > 1})
        if twice:
            raise item_error(v.index(twice[0], v.index(twice[0]) + 1), f"{twice} listed more than once")
        return v

    @field_validator("schemes")
    @classmethod
    def _schemes_known(cls, v: list[str]) -> list[str]:
        """Each scheme an id of quant_recipes/schemes.yaml, checked after _schemes_named_once (a candidate's name
        listed there is told as that): a misspelling (`INT8-W8A8`) is no scheme that 'does not run' on the
        hardware, and is refused as unknown, with the id meant."""
        return known_scheme_ids(v)

    @model_validator(mode="after")
    def _kv_cache_needs_recall(self) -> ReleaseSpec:
        """An FP8 KV cache only with a recall grid, whose evidence the gate then requires."""
        if self.serving.kv_cache_dtype not in (None, "auto") and self.recall is None:
            raise field_error(("serving", "kv_cache_dtype"), f"KV cache dtype {self.serving.kv_cache_dtype} changes the "
                              "candidates' KV cache, which must pass long-context recall before it ships (the gate "
                              "requires the recall check), but `recall` is null: set a recall grid")
        return self

    @model_validator(mode="after")
    def _recall_fits_context(self) -> ReleaseSpec:
        if self.recall is not None:
            need = max(self.recall.lengths) + self.recall.max_answer_tokens
            if need > self.context:
                raise ValueError(f"recall.lengths up to {max(self.recall.lengths)} + {self.recall.max_answer_tokens} answer tokens "
                                 f"= {need} do not fit context {self.context}: raise `context` or shorten recall.lengths")
        f = self.fidelity
        if f is not None and self.recall is not None and f.context_prompts:  # haystacks continued for fidelity
            need = max(self.recall.lengths) + f.context_new_tokens
            if need > self.context:
                raise field_error(("fidelity", "context_new_tokens"), f"recall.lengths up to "
                                  f"{max(self.recall.lengths)} + {f.context_new_tokens} sampled tokens = {need} do not "
                                  f"fit context {self.context}: lower fidelity.context_new_tokens, raise `context`, or "
                                  "set fidelity.context_prompts: 0")
        return self


    @model_validator(mode="after")
    def _repair_can_run(self) -> ReleaseSpec:
        """A repair ranks on the baseline's fidelity samples and splits the fidelity alpha with its scheme's own gate:
        it needs fidelity, and neither the adaptive design's looks nor work pools (which it does not plan for yet). It
        repairs quantized schemes only: `candidates` (checkpoints made elsewhere, endpoints) are gated as they are."""
        if self.repair is None:
            return self
        why = ("fidelity is null: a repair ranks layers on the baseline's fidelity samples; set `fidelity`"
               if self.fidelity is None else
               "`adaptive` is set: a repair's alpha is not planned with the adaptive design's looks; drop one of them"
               if self.adaptive is not None else
               "executor.kind is pools: the repair rung runs on this host only; drop `repair` or use the local executor"
               if self.executor.kind != "local" else None)
        taken = [c.name for c in self.candidates if any(c.name == s + RepairSpec.SUFFIX for s in self.schemes)]
        if taken and why is None:
            why = (f"a candidate is named {taken[0]!r}, the name the repair of a scheme is measured under (its folder "
                   "in the run): rename the candidate")
        if why:
            raise field_error(("repair",), why)
        return self


def load_written_spec(path: Path | str) -> ReleaseSpec:
    """The spec as its file says it, checked without looking at the machine (`hardware` may be `auto`, `schemes`
    empty for `auto`); quantgate.spec.resolve.load_spec resolves it for this machine."""
    return load_model(Path(path), ReleaseSpec)


def in_window(spec: ReleaseSpec) -> bool:
    """Whether the release probes speed in its side-by-side window (quantgate.release.perf_window) instead of on
    each variant's own server: `perf.rounds` set, on this host (not work pools), no endpoint among the variants."""
    p = spec.perf
    endpoints = spec.baseline is not None or any(c.endpoint is not None for c in spec.candidates)
    return p is not None and p.rounds is not None and spec.executor.kind == "local" and not endpoints


def policy_path(spec: ReleaseSpec) -> Path:
    """The gate policy file the release is judged by: the spec's `policy`, or the default policy."""
    return spec.policy or DEFAULT_POLICY
