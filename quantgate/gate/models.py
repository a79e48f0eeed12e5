"""What the gate reads and writes (pure, typed): one candidate's evidence, each check's row, and the decision.

A check ends in one of four outcomes:
- pass: the evidence shows the candidate within the limit;
- fail: harm was detected (a drop beyond the limit or a significant drop, a failed requirement): REJECT;
- inconclusive: the evidence cannot tell (too few samples, missing or unreliable evidence, a noise floor that eats
  the limit, a confidence interval across the limit): not promoted, but not harm either;
- skipped: an optional check without evidence.
The decision is REJECT when any check failed, else INCONCLUSIVE when any check is inconclusive, else PROMOTE when
at least one check passed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

from quantgate.base.pairedstat import PairedStat
from quantgate.fidelity.record import StreamLook
from quantgate.perf.models import PayOffFigures

SCHEMA = 2
Outcome = Literal["pass", "fail", "inconclusive", "skipped"]
Verdict = Literal["PROMOTE", "REJECT", "INCONCLUSIVE"]
Bound = Literal["ci", "point"]
# Exit codes of `quantgate gate` and `quantgate release` (2: bad input, 1: a step failed).
EXIT_CODES: dict[str, int] = {"PROMOTE": 0, "REJECT": 3, "INCONCLUSIVE": 4}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Interval(_Model):
    mean: float
    low: float
    high: float
    level: float = Field(gt=0, lt=1, description="two-sided level: each end is a one-sided (1+level)/2 bound")


class FidelityEvidence(_Model):
    """Teacher-forced fidelity of the candidate against the baseline (or of the baseline against itself: the floor)."""

    n_samples: int = Field(ge=0)
    n_tokens: int = Field(ge=0)
    kl: Interval                          # mean per-token KL(baseline || candidate), nats
    top1: Interval                        # share of positions whose most likely token agrees
    dnll: Interval | None = None          # mean per-token NLL increase of the baseline's tokens
    kl_topk: float | None = None          # the top-k KL diagnostic (no bound)
    estimator: str = "topk"               # what `kl` is: "sampled-logratio" (unbiased), or "topk" (older runs)
    by_category: dict[str, FidelityEvidence] = Field(default_factory=dict)
    file: str | None = None


class JudgeEvidence(_Model):
    counts_as_evidence: bool
    reason: str | None = None          # why calibration failed, when it did
    not_stronger: str | None = None    # why the judge is not known to be stronger, when it is not
    n: int = Field(0, ge=0)            # pairs with a valid verdict (identical answers count as ties)
    judged: int = Field(0, ge=0)       # pairs sent to the judge
    invalid: int = Field(0, ge=0)      # of those, pairs without a valid verdict (unparsable in either order)
    net: float | None = None           # win rate - loss rate
    lower_bound: float | None = None   # one-sided lower confidence bound of net
    file: str | None = None


class ParityEvidence(_Model):
    verdict: str
    reason: str = ""
    file: str | None = None


class RateEvidence(_Model):
    name: str                          # "<variant>/<eval set>"
    rate: float | None
    n: int = Field(0, ge=0)
    file: str | None = None


class Ratio(_Model):
    value: float | None
    file: str | None = None


class Gap(_Model):
    """Evidence that could not be used: why, and the file concerned. `not_applicable`: it cannot exist for this
    candidate (an endpoint has no checkpoint files, an endpoint baseline no local weights for engine parity); the
    policy's `not_applicable` says whether that is accepted. `decided_early`: the release skipped the step on purpose
    because fidelity had already decided a REJECT (quantgate.release.early); see gate.checks.decided_early."""

    reason: str
    file: str | None = None
    not_applicable: bool = False
    decided_early: bool = False


class KvCacheChange(_Model):
    """The candidate was served with another KV cache dtype than the baseline (--kv-cache-dtype of each server)."""

    baseline: str
    candidate: str
    file: str | None = None


class KindComparison(_Model):
    """<run>/<candidate>/<name>.json: a registered measurement kind's paired comparison of the candidate with the
    baseline (quantgate.gate.kinds), written by the kind's `compare` in the release, read by the gate and the report."""

    kind: str
    stat: PairedStat                             # paired over `unit`s; delta = candidate - baseline
    unit: str                                    # what one paired unit is ("passage")
    quantity: str = ""                           # what stat's means are ("mean NLL per token, lower is better")
    level: float = Field(0.95, gt=0, lt=1)       # the two-sided level of stat's interval
    figures: dict[str, float] = Field(default_factory=dict)  # shown beside it (e.g. each side's perplexity)


class GateEvidence(_Model):
    """Everything the gate looks at for one candidate. Slots left empty explain themselves in `gaps`."""

    candidate: str
    scheme: str | None = None
    metrics: dict[str, dict[str, PairedStat]] = Field(default_factory=dict, description="eval set -> metric -> overall")
    categories: dict[str, dict[str, dict[str, PairedStat]]] = Field(default_factory=dict,
                                                                    description="eval set -> category -> metric")
    pooled: dict[str, PairedStat] = Field(default_factory=dict, description="eval set -> one binary measure per sample")
    recall: dict[str, PairedStat] = Field(default_factory=dict, description="'recall' and/or 'exact' -> overall")
    recall_by_length: dict[str, PairedStat] = Field(default_factory=dict, description="context length -> recall there")
    fidelity: FidelityEvidence | None = None
    floor: FidelityEvidence | None = None
    stream: StreamLook | None = Field(None, description="the streaming look whose prefix `fidelity` holds, when one "
                                      "decided the REJECT (quantgate.gate.stream)")
    judge: JudgeEvidence | None = None
    parity: ParityEvidence | None = None
    error_rates: list[RateEvidence] = Field(default_factory=list)
    size_ratio: Ratio | None = None
    throughput_ratio: Ratio | None = None
    pay_off: PayOffFigures | None = Field(None, description="the probe's workload profile and its pay-off figures "
                                          "with intervals (quantgate.perf.compare)")
    kv_cache: KvCacheChange | None = Field(None, description="set when the KV cache dtype differs from the "
                                          "baseline's: the recall check is then required")
    kinds: dict[str, KindComparison] = Field(default_factory=dict, description="registered kind -> its comparison "
                                             "(quantgate.gate.kinds)")
    gaps: dict[str, Gap] = Field(default_factory=dict, description="slot (compare, recall, fidelity, judge, parity, "
                                 "error_rate, size, throughput) -> why it is empty or incomplete")


class Power(_Model):
    """What a statistical check could see at its sample size."""

    n: int
    alpha: float                       # the one-sided level its harm test was run at (after multiplicity control)
    mdd: float | None                  # minimum detectable drop at that level and `power`, in the limit's units
    power: float
    discordance: float | None = None   # binary measures: share of samples that changed either way
    p_harm: float | None = None
    role: Literal["non-inferiority", "harm"]  # non-inferiority when mdd <= limit; else the check only detects harm
    limit_below_mdd: bool = False
    needs_samples: int | None = None   # paired samples for mdd to reach the limit


class Check(_Model):
    name: str
    measured: float | str | None
    limit: float | str | None
    bound: Bound | None = None
    required: bool
    outcome: Outcome
    evidence_file: str | None = None
    reason: str
    power: Power | None = None

    @model_validator(mode="before")
    @classmethod
    def _passed_is_derived(cls, data: Any) -> Any:
        """A decision file's check carries `passed` (written from `outcome`): read back, it is derived again."""
        return {k: v for k, v in data.items() if k != "passed"} if isinstance(data, dict) else data

    @computed_field  # type: ignore[prop-decorator]
    @property
    def passed(self) -> bool | None:
        """True (pass), False (fail or inconclusive: not shown to be within the limit) or None (skipped)."""
        return {"pass": True, "skipped": None}.get(self.outcome, False)


class OperatingCharacteristics(_Model):
    """The error rates the policy's settings guarantee for this decision, in words a release engineer can check."""

    false_reject_bound: float          # P(REJECT | lossless candidate) at most this (harm tests, Holm + fidelity)
    false_promote_at_limit: float      # P(PROMOTE | fidelity exactly at its limit) at most this
    power: float                       # the power at which minimum detectable drops are stated
    note: str


class Look(_Model):
    """One look of a sequential design: the fidelity bounds of look `index` (of `of`) are judged at `alpha`, its
    share of the policy's alpha (quantgate.gate.looks); the shares of every planned look add up to the policy's."""

    index: int = Field(ge=1)
    of: int = Field(ge=1)
    alpha: float = Field(gt=0, lt=0.5)
    spent: float = Field(gt=0, lt=0.5, description="alpha spent by this look and every one before it")
    planned: list[int] = Field(default_factory=list, description="fidelity samples planned at each look")
    shares: list[float] = Field(default_factory=list, description="alpha of each planned look")

    @property
    def growth(self) -> float:
        """How many times this look's eval prompts the last planned look will hold (1.0 at the last look): an
        interim pooled estimate weights each eval prompt by it, so that it estimates the final sample's pooled
        quantity (the haystacks are the same at every look; quantgate.gate.fidelityevidence)."""
        return self.planned[-1] / self.planned[self.index - 1] if self.planned else 1.0


class KeptLayer(_Model):
    """A decoder layer a repair keeps at 16 bits: its `ignore` pattern, the KL it removed alone from each failing
    slice on the ranking prompts, and the bytes it adds."""
    layer: int
    modules: str
    removes: dict[str, float]
    added_bytes: int


class RepairNote(_Model):
    """A repaired candidate's decision says what it keeps and why (quantgate.gate.repairfile)."""
    repairs: str = Field(description="the candidate REJECTed by fidelity that this one repairs")
    kept: list[KeptLayer]
    added_size: float = Field(description="bytes the kept layers add, as a share of the rejected candidate's")
    held_out: int = Field(description="prompts that ranked the layers, left out of this candidate's fidelity sample")
    alpha: float = Field(description="this candidate's share of the policy's fidelity alpha")
    file: str


class Decision(_Model):
    schema_version: int = SCHEMA
    decision: Verdict
    candidate: str
    scheme: str | None
    family: str | None
    policy: dict[str, str | int]
    checks: list[Check]
    reasons: list[str] = Field(description="why not PROMOTE: the failed checks' reasons, else the inconclusive ones")
    needs: str | None = Field(None, description="INCONCLUSIVE: what more evidence would decide")
    operating: OperatingCharacteristics | None = None
    workload: str | None = Field(None, description="the workload profile the pay-off checks applied")
    look: Look | None = Field(None, description="which look of a sequential design this decision is, and the "
                              "fidelity level it spent")
    stream: StreamLook | None = Field(None, description="the streaming look that decided this REJECT: prompts read of "
                                      "the full sample, per slice, its alpha and the time from the release's start")
    repair: RepairNote | None = Field(None, description="a repaired candidate: the layers it keeps at 16 bits, and why")

    @property
    def promoted(self) -> bool:
        return self.decision == "PROMOTE"
