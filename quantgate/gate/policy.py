"""Gate policies (releases/policies/*.yaml): which checks a candidate must pass, with which limits. Data only.

Load with `load_policy(path)`; unknown keys, wrong types and limits out of range are refused with the file, line
and field. The checks themselves are in `quantgate.gate.checks`. Schema, in short:

    version: 1
    name: default
    source: where the limits come from (practice, not law)
    bound: ci | point          # default for statistical checks: the CI's worst end, or the point estimate
    min_samples: 10            # fewer paired samples than this is insufficient evidence
    primary: {metrics: [...], families: {fp8: {schemes: [...], max_relative_drop: 0.01}, ...}}
    categories: {arithmetic_numbers: {metric: numeric_match, max_relative_drop: 0.05}, ...}
    recall: {measure: recall, max_absolute_drop: 0.05}
    judge: {margin: 0.05}
    error_rate: {max: 0.02}
    engine_parity: {}
    pay_off: {max_size_ratio: 0.75, min_throughput_ratio: 1.0}

Every check has `required` (missing or unreliable evidence: REJECT when true, skipped when false); present
evidence is always enforced. Omit a section (or set it to null) to turn the check off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from quantgate.base.paths import RELEASES
from quantgate.base.yamlconfig import load_model
from quantgate.evals.dataset import load_categories
from quantgate.evals.metrics import load_table

DEFAULT_POLICY = RELEASES / "policies" / "default.yaml"
Bound = Literal["ci", "point"]
Fraction = Annotated[float, Field(ge=0, le=1)]


def _known_metric(name: str) -> str:
    table = load_table()
    if name not in table:
        raise ValueError(f"unknown metric {name!r}; quantgate/evals/metrics/table.yaml has: {', '.join(sorted(table))}")
    return name


def _known_category(name: str) -> str:
    known = load_categories()
    if name not in known:
        raise ValueError(f"unknown category {name!r}; eval_sets/categories.yaml has: {', '.join(sorted(known))}")
    return name


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


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


class Family(DropLimit):
    """A scheme family (fp8, int8, w4a16, ...): the schemes in it and its limit on the primary metrics."""
    schemes: list[str] = Field(min_length=1)


class PrimaryCheck(_Strict):
    metrics: list[str] = Field(min_length=1, description="metric names (quantgate/evals/metrics/table.yaml) in any eval set")
    families: dict[str, Family] = Field(min_length=1)
    required: bool = True
    bound: Bound | None = None

    @field_validator("families")
    @classmethod
    def _one_family_per_scheme(cls, v: dict[str, Family]) -> dict[str, Family]:
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
        return [_known_metric(m) for m in v]

    def family_of(self, scheme: str | None) -> str | None:
        return next((n for n, f in self.families.items() if scheme in f.schemes), None)


class CategoryCheck(DropLimit):
    """A limit on one category of the eval sets (eval_sets/categories.yaml), measured with one metric."""
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


class RecallCheck(DropLimit):
    """Long-context exact recall (quantgate recall with --baseline): candidate minus baseline over paired prompts."""
    measure: Literal["recall", "exact"] = "recall"
    required: bool = True
    bound: Bound | None = None


class JudgeCheck(_Strict):
    """Pairwise judge non-inferiority: (win - loss) must stay above -margin. Counts only for a calibrated judge."""
    margin: float = Field(0.05, ge=0, le=1)
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


class PayOffCheck(_Strict):
    """Quantization must buy something: a smaller checkpoint and/or more throughput than the baseline."""
    max_size_ratio: float | None = Field(None, gt=0, le=1, description="candidate size / baseline size at most this")
    min_throughput_ratio: float | None = Field(None, gt=0, le=100, description="candidate / baseline tokens/s")
    required: bool = False


class GatePolicy(_Strict):
    version: Literal[1]
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    source: str = Field(min_length=1, description="where the limits come from")
    bound: Bound = "ci"
    min_samples: int = Field(10, ge=1, le=100000)
    primary: PrimaryCheck | None = None
    categories: dict[Annotated[str, AfterValidator(_known_category)], CategoryCheck] = Field(default_factory=dict)
    recall: RecallCheck | None = None
    judge: JudgeCheck | None = None
    error_rate: ErrorRateCheck | None = None
    engine_parity: ParityCheck | None = None
    pay_off: PayOffCheck | None = None

    @model_validator(mode="after")
    def _families_known(self):
        families = set(self.primary.families) if self.primary else set()
        for c, v in self.categories.items():
            if set(v.by_family) - families:
                raise ValueError(f"categories.{c}.by_family: {sorted(set(v.by_family) - families)} are not in primary.families")
        return self

    def bound_of(self, check: PrimaryCheck | CategoryCheck | RecallCheck | JudgeCheck) -> Bound:
        return check.bound or self.bound


def load_policy(path: Path | str = DEFAULT_POLICY) -> GatePolicy:
    """Read and validate a policy file; errors name the file, line and field."""
    return load_model(Path(path), GatePolicy)
