"""Gate policies (releases/policies/*.yaml): which checks a candidate must pass, with which limits. Data only.

Load with `load_policy(path)`; unknown keys (with the closest known name suggested), wrong types, limits out of
range, scheme ids that quant_recipes/schemes.yaml does not know, and a policy that enables no check at all are
refused with the file, line and field. The checks themselves are in `quantgate.gate.checks`. Schema, in short:

    version: 1
    name: default
    source: where the limits come from (practice, not law)
    bound: ci | point          # default for statistical checks: the CI's worst end, or the point estimate
    min_samples: 10            # fewer paired samples than this is insufficient evidence
    primary: {metrics: [...], families: {fp8: {schemes: [...], max_relative_drop: 0.01}, ...}}
    categories: {arithmetic_numbers: {metric: numeric_match, max_relative_drop: 0.05}, ...}
    own_categories: {max_relative_drop: 0.05}   # every other category a set declares, with its own metric
    recall: {measure: recall, max_absolute_drop: 0.05}
    judge: {margin: 0.05, max_invalid_rate: 0.1}   # more invalid verdicts than that: INCONCLUSIVE
    error_rate: {max: 0.02}
    engine_parity: {}
    pay_off: {max_size_ratio: 0.75, workloads: {latency: {min_speedup: 1.0}, fit: {min_speedup: 0.9}}}
    statistics: {false_reject: 0.05, pooled_share: 0.6, power: 0.8}
    pooled: {required: true}   # one paired harm test over every binary-scored sample of a set
    fidelity: {families: {fp8: {max_kl: 0.01, min_top1: 0.95}, ...}, alpha: 0.05, max_floor_share: 0.5}
    not_applicable: {engine_parity: skip, size_ratio: skip}   # default: missing (fail-closed)

Every check has `required` (missing or unreliable evidence: INCONCLUSIVE when true, skipped when false); present
evidence is always enforced. Evidence that cannot exist for a candidate (an endpoint baseline has no local weights
for engine parity, an endpoint no checkpoint files for the size ratio) is handled by `not_applicable`: `missing`
(default: as missing evidence, INCONCLUSIVE when required), `skip` (accepted) or `fail` (REJECT). Omit a section (or set it to null) to turn the check off. `statistics` says how the
task checks' harm tests share their false-alarm budget (quantgate.gate.statistical).
"""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, field_validator, model_validator

from quantgate.base.errors import ConfigError, did_you_mean
from quantgate.base.paths import RELEASES
from quantgate.base.yamlconfig import item_error, load_model, read_yaml
from quantgate.evals.metrics import load_table
from quantgate.fidelity.core import CONTEXT_PREFIX
from quantgate.gate.kinds import KindPolicy, policy_section
from quantgate.gate.models import Bound
from quantgate.quantize.schemes import known_scheme_ids

DEFAULT_POLICY = RELEASES / "policies" / "default.yaml"
Fraction = Annotated[float, Field(ge=0, le=1)]


def _known(name: str, what: str, known, source: str) -> str:
    if name not in known:
        raise ValueError(f"unknown {what} {name!r}{did_you_mean(name, known)}; {source} has: {', '.join(sorted(known))}")
    return name


def _known_metric(name: str) -> str:
    return _known(name, "metric", load_table(), "quantgate/evals/metrics/table.yaml")


class _Strict(BaseModel):
    """No unknown key, and no NaN or infinity for a number: every limit compares false with NaN, so a `.nan` limit
    would pass or fail every candidate without a word."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class DropLimit(_Strict):
    """How far the candidate may fall below the baseline: relative to the baseline mean, or in absolute units."""
    max_relative_drop: float | None = Field(None, ge=0, le=1, description="(base - cand) / base, e.g. 0.01 = 1%")
    max_absolute_drop: float | None = Field(None, ge=0, le=1, description="base - cand, in the metric's units")

    @model_validator(mode="after")
    def _exactly_one(self):
        if (self.max_relative_drop is None) == (self.max_absolute_drop is None):
            raise ValueError("give exactly one of max_relative_drop or max_absolute_drop")
        return self

    @property
    def kind(self) -> Literal["relative", "absolute"]:
        return "relative" if self.max_relative_drop is not None else "absolute"

    @property
    def value(self) -> float:
        return self.max_relative_drop if self.max_relative_drop is not None else self.max_absolute_drop  # type: ignore[return-value]


class SchemeFamily(DropLimit):
    """A scheme family (fp8, int8, w4a16, ...): the schemes in it and its limit on the primary metrics."""
    schemes: list[str] = Field(min_length=1, description="scheme ids of quant_recipes/schemes.yaml")

    @field_validator("schemes")
    @classmethod
    def _schemes_known(cls, v: list[str]) -> list[str]:
        return known_scheme_ids(v)


class PrimaryCheck(_Strict):
    metrics: list[str] = Field(min_length=1, description="metric names (quantgate/evals/metrics/table.yaml) in any eval set")
    families: dict[str, SchemeFamily] = Field(min_length=1)
    required: bool = True
    bound: Bound | None = None

    @field_validator("families")
    @classmethod
    def _one_family_per_scheme(cls, v: dict[str, SchemeFamily]) -> dict[str, SchemeFamily]:
        seen: dict[str, str] = {}
        for name, fam in v.items():
            for s in fam.schemes:
                if s in seen:
                    raise ValueError(f"scheme {s!r} is in two families: {seen[s]} and {name}")
                seen[s] = name
        return v

    @field_validator("metrics")
    @classmethod
    def _metrics_known(cls, v: list[str]) -> list[str]:
        for i, m in enumerate(v):
            try:
                _known_metric(m)
            except ValueError as exc:
                raise item_error(i, str(exc)) from None  # at the item's own line
        return v

    def family_of(self, scheme: str | None) -> str | None:
        return next((n for n, f in self.families.items() if scheme in f.schemes), None)


class CategoryCheck(DropLimit):
    """A limit on one category of the eval sets (as the sets' samples name it), measured with one metric. Where no
    set of a release has the category the check does not apply; written out, `required: true` demands the category
    of the sets: `check` and the release refuse a spec whose sets have none (quantgate.cli.checkspec)."""
    metric: str
    by_family: dict[str, Fraction] = Field(default_factory=dict, description="family -> limit overriding the default")
    required: bool = True
    bound: Bound | None = None

    @field_validator("metric")
    @classmethod
    def _metric_known(cls, v: str) -> str:
        return _known_metric(v)

    def limit_for(self, family: str | None) -> float:
        return self.by_family.get(family, self.value) if family else self.value


class OwnCategories(DropLimit):
    """The limit for every category an eval set declares that `categories` does not name (a team's own: billing,
    refunds, ...), each measured with its own metric (`own_metric`). The default policy's named categories keep their
    limits. Left out (or null), only the named categories are checked."""
    by_family: dict[str, Fraction] = Field(default_factory=dict, description="family -> limit overriding the default")
    required: bool = True
    bound: Bound | None = None

    def limit_for(self, family: str | None) -> float:
        return self.by_family.get(family, self.value) if family else self.value


def own_metric(scored: Mapping[str, int], preferred: Sequence[str] = ()) -> str | None:
    """The metric a category's check reads: the one that scores most of its samples; a tie goes to the first of
    `preferred` (the policy's primary metrics), then to the first name in order. None when nothing is scored."""
    if not scored:
        return None
    rank = {m: i for i, m in enumerate(preferred)}
    return min(scored, key=lambda m: (-scored[m], rank.get(m, len(rank)), m))


class RecallCheck(DropLimit):
    """Long-context exact recall (quantgate recall with --baseline): candidate minus baseline over paired prompts.
    `required` is treated as true for a candidate served with another KV cache dtype than the baseline (gate.checks);
    without this section such a candidate is INCONCLUSIVE."""
    measure: Literal["recall", "exact"] = "recall"
    required: bool = True
    bound: Bound | None = None


class JudgeCheck(_Strict):
    """Pairwise judge non-inferiority: (win - loss) must stay above -margin. Counts only for a calibrated judge
    whose verdicts were mostly readable: above `max_invalid_rate` of the judged pairs without a valid verdict, the
    valid rest is no fair sample and the check is INCONCLUSIVE."""
    margin: float = Field(0.05, ge=0, le=1)
    max_invalid_rate: float = Field(0.1, ge=0, le=1, description="share of judged pairs without a valid verdict "
                                                                 "(unparsable in either order) above which the "
                                                                 "check cannot decide")
    accept_not_stronger: bool = Field(False, description="accept a judge that is not stronger than the judged model")
    required: bool = False
    bound: Bound | None = None


class ErrorRateCheck(_Strict):
    """Share of requests that failed (errors, timeouts) in every eval set of the baseline and the candidate."""
    max: float = Field(ge=0, le=1)
    required: bool = True


class ParityCheck(_Strict):
    """The served baseline must match a transformers reference (quantgate.parity.core) before any comparison counts."""
    required: bool = True


class WorkloadDemand(_Strict):
    """What pay-off demands under one workload profile (quant_recipes/workloads.yaml; checks: quantgate.gate.payoff)."""
    min_speedup: float | None = Field(None, gt=0, le=100, description="each pay-off figure of the profile: the "
                                      "candidate at least this many times as fast as the baseline (1.0: shown not "
                                      "slower; 0.9: at most 10% slower); None: no speed demanded")
    min_kv_tokens_ratio: float | None = Field(None, gt=0, le=100, description="KV cache tokens candidate / baseline")


class PayOffCheck(_Strict):
    """Quantization must buy something: a smaller checkpoint, and speed where the workload needs it."""
    max_size_ratio: float | None = Field(None, gt=0, le=1, description="candidate size / baseline size at most this")
    min_throughput_ratio: float | None = Field(None, gt=0, le=100, description="candidate / baseline tokens/s at the "
                                               "highest common level, point value (older form; see `workloads`)")
    workloads: dict[Literal["latency", "throughput", "fit"], WorkloadDemand] = Field(
        default_factory=dict, description="workload profile the probe ran -> its speed demand")
    required: bool = False
    bound: Bound | None = Field(None, description="speed figures: the interval's worst end (ci) or the point ratio")


class Statistics(_Strict):
    """How the task checks' harm tests spend their false-alarm budget, and the power at which minimum detectable
    drops are stated."""
    false_reject: float = Field(0.05, gt=0, lt=0.5, description="P(a lossless candidate is rejected by a task "
                                "check) at most this, across all task checks (Holm)")
    pooled_share: float = Field(0.6, ge=0, le=1, description="share of false_reject given to the pooled harm test")
    recall_share: float = Field(0.0, ge=0, le=1, description="share of false_reject given to the recall checks "
                                "(overall and per context length) as a family of their own; 0: they share the rest "
                                "with the other task checks")
    power: float = Field(0.8, ge=0.5, lt=1)

    @model_validator(mode="after")
    def _shares_fit(self) -> Statistics:
        if self.pooled_share + self.recall_share > 1:
            raise ValueError(f"pooled_share {self.pooled_share} + recall_share {self.recall_share} > 1: the shares "
                             "of false_reject must add up to at most 1")
        return self


class PooledCheck(_Strict):
    """One paired harm test per eval set over every sample scored with a binary metric (quantgate.evals.compare):
    the most sensitive task check at a few hundred samples. Its limit is the family's primary limit."""
    required: bool = True


class FidelityLimit(_Strict):
    max_kl: float = Field(gt=0, le=10, description="mean per-token KL(baseline || candidate), nats")
    min_top1: Fraction | None = Field(None, description="share of positions with the same most likely token")


class FidelityCheck(_Strict):
    """Teacher-forced fidelity (quantgate.fidelity): per-family limits on KL and top-1 agreement, each judged on a
    one-sided bound at level `alpha`, pooled and (`per_category`) in every category of the fidelity sample, each
    category against its own limit (`categories`, default: the family's). PROMOTE needs every one within its limit:
    an intersection-union test, so the level stays `alpha` without a multiplicity penalty. A category with fewer
    than `min_category_samples` samples cannot be judged (INCONCLUSIVE, naming the samples it needs). A noise floor
    above `max_floor_share` of the KL limit makes the check inconclusive (the gate cannot tell quantization from
    engine noise). Over several looks (adaptive widening) `alpha` is spent across them (quantgate.gate.looks)."""
    families: dict[str, FidelityLimit] = Field(min_length=1)
    alpha: float = Field(0.05, gt=0, lt=0.5, description="P(PROMOTE | fidelity exactly at its limit) at most this, "
                                                          "over every look together")
    max_floor_share: float = Field(0.5, gt=0, le=1)
    per_category: bool = Field(True, description="judge every category of the fidelity sample as well")
    categories: dict[str, FidelityLimit] = Field(default_factory=dict, description="a category's own limits "
                                                 "(default: the family's)")
    min_category_samples: int = Field(10, ge=2, description="fewer samples in a category: INCONCLUSIVE")
    context_factor: float = Field(1.0, ge=1, le=10, description="a context length's slice (context:<length>) is "
                                  "held to the family's limits widened by this factor: KL times it, top-1 "
                                  "disagreement times it (a category named in `categories` keeps its own)")
    required: bool = True

    def limit_for(self, family: str, category: str | None = None) -> FidelityLimit:
        if category in self.categories:
            return self.categories[category]
        lim = self.families[family]
        if category is None or not category.startswith(CONTEXT_PREFIX) or self.context_factor == 1.0:
            return lim
        k = self.context_factor  # derived from validated limits: not re-validated (a lenient 10 nats widens to 20)
        return FidelityLimit.model_construct(max_kl=lim.max_kl * k, min_top1=None if lim.min_top1 is None else
                                             max(0.0, 1.0 - k * (1.0 - lim.min_top1)))


NotApplicable = Literal["missing", "skip", "fail"]


class NotApplicableRules(_Strict):
    """What a check does when its evidence cannot exist for the candidate (quantgate.gate.checks): `missing` treats
    it as missing evidence (INCONCLUSIVE when the check is required: fail-closed), `skip` accepts it (the check is
    skipped, its reason says why), `fail` rejects the candidate."""
    engine_parity: NotApplicable = Field("missing", description="the baseline is an endpoint: no local weights")
    size_ratio: NotApplicable = Field("missing", description="pay_off.max_size_ratio when the baseline or the "
                                      "candidate is an endpoint: no checkpoint files")


class GatePolicy(_Strict):
    version: Literal[1]
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    source: str = Field(min_length=1, description="where the limits come from")
    bound: Bound = "ci"
    min_samples: int = Field(10, ge=1, le=100000)
    primary: PrimaryCheck | None = None
    categories: dict[Annotated[str, Field(min_length=1)], CategoryCheck] = Field(
        default_factory=dict, description="category -> its limit; applies where a release's eval sets have that "
                                          "category (`check` warns about a name no set has)")
    own_categories: OwnCategories | None = Field(None, description="the limit for the categories an eval set "
                                                 "declares that `categories` does not name")
    recall: RecallCheck | None = None
    judge: JudgeCheck | None = None
    error_rate: ErrorRateCheck | None = None
    engine_parity: ParityCheck | None = None
    pay_off: PayOffCheck | None = None
    statistics: Statistics = Field(default_factory=Statistics)
    pooled: PooledCheck | None = None
    fidelity: FidelityCheck | None = None
    not_applicable: NotApplicableRules = Field(default_factory=NotApplicableRules)
    kinds: dict[str, SerializeAsAny[KindPolicy]] = Field(default_factory=dict, description="registered "
                                                               "measurement kind (quantgate/kinds/) -> its limits")

    @field_validator("kinds", mode="before")
    @classmethod
    def _kinds_known(cls, v: object) -> object:
        """Each `kinds` entry by its kind's own model (quantgate.gate.kinds)."""
        return {name: policy_section(name, raw) for name, raw in v.items()} if isinstance(v, dict) else v

    @field_validator("categories")
    @classmethod
    def _categories_nfc(cls, v: dict[str, CategoryCheck]) -> dict[str, CategoryCheck]:
        """Category names in NFC, as the eval sets' samples have them (quantgate.evals.dataset.Sample): a name typed
        with combining accents (NFD) is the same category."""
        out: dict[str, CategoryCheck] = {}
        for name, check in v.items():
            if (key := unicodedata.normalize("NFC", name)) in out:
                raise ValueError(f"category {name!r} is given twice: once composed (NFC) and once with combining "
                                 "accents (NFD), which look the same; keep one")
            out[key] = check
        return out

    @model_validator(mode="after")
    def _families_known(self):
        families = set(self.primary.families) if self.primary else set()
        if self.fidelity and set(self.fidelity.families) - families:
            raise ValueError(f"fidelity.families: {sorted(set(self.fidelity.families) - families)} are not in "
                             "primary.families")
        for c, v in self.categories.items():
            if set(v.by_family) - families:
                raise ValueError(f"categories.{c}.by_family: {sorted(set(v.by_family) - families)} are not in primary.families")
        if self.own_categories and set(self.own_categories.by_family) - families:
            raise ValueError(f"own_categories.by_family: {sorted(set(self.own_categories.by_family) - families)} are "
                             "not in primary.families")
        return self

    def bound_of(self, check: PrimaryCheck | CategoryCheck | OwnCategories | RecallCheck | JudgeCheck) -> Bound:
        return check.bound or self.bound


def _is_check(annotation) -> bool:
    """A check section: a model with a `required` flag (or a mapping of them, like `categories`)."""
    return any(isinstance(t, type) and issubclass(t, BaseModel) and "required" in t.model_fields
               for t in (annotation, *get_args(annotation)))


CHECK_SECTIONS = tuple(n for n, f in GatePolicy.model_fields.items() if _is_check(f.annotation))


def enabled_checks(policy: GatePolicy) -> list[str]:
    """The check sections the policy turns on (present and not null/empty)."""
    return [n for n in CHECK_SECTIONS if getattr(policy, n)]


_VALIDATED: dict[tuple[str, str], GatePolicy] = {}  # (resolved path, sha256 of its bytes) -> the policy


def load_policy(path: Path | str = DEFAULT_POLICY) -> GatePolicy:
    """Read and validate a policy file; errors name the file, line and field. A policy that enables no check
    is refused: it could never reject a candidate.

    Validated once per content: a release asks for its policy at its start, in its warnings, at every streaming look,
    in the judge and at the gate; each gets its own copy of the one validated, and a file edited since is read anew."""
    path = Path(path)
    try:
        key = (str(path.resolve()), hashlib.sha256(path.read_bytes()).hexdigest())
    except OSError:
        key = None  # load_model names the file that cannot be read
    if key is not None and key in _VALIDATED:
        return _VALIDATED[key].model_copy(deep=True)
    policy = load_model(path, GatePolicy)
    if not enabled_checks(policy):
        _, lines = read_yaml(path)
        raise ConfigError(f"the policy enables no check: none of the check fields {', '.join(CHECK_SECTIONS)} is "
                          "set, so it could never reject a candidate", where=f"{path}:{lines.get((), 1)}",
                          fix="add a check section, e.g. `error_rate: {max: 0.02}` (see releases/policies/default.yaml)")
    if key is not None:
        _VALIDATED[key] = policy.model_copy(deep=True)
    return policy
