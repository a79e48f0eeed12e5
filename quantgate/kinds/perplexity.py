"""Perplexity on a held-out text: a measurement kind written as one module end to end.

Every variant's server scores the passages of a held-out text (blocks separated by blank lines; by default the
bundled eval_sets/fidelity_corpus.txt) through prompt logprobs, with fidelity's scoring (quantgate.fidelity.run:
each passage tokenized as plain text, every position from the second scored by /v1/completions). A passage's
negative log-likelihood per token is paired between the baseline and the candidate; the gate bounds the candidate's
perplexity increase, exp(mean paired difference) - 1, by the upper end of its t interval over the passages.

    spec:    measure: {perplexity: {text: held_out.txt, max_tokens: 512}}
    policy:  kinds: {perplexity: {max_relative_increase: 0.05, required: false}}

One name on every floor: the spec's `measure.perplexity` (PerplexitySpec) -> the variant's cache folder
perplexity/<digest>/ (a fidelity dump folder, done when its manifest says complete) -> the step "perplexity" (a
REJECT decided early skips it) -> evidence.json's `kinds.perplexity` -> <run>/<candidate>/perplexity.json (a
gate.kinds.KindComparison) -> the policy's `kinds.perplexity` (PerplexityPolicy) -> the check "perplexity" -> the
report's measurements table. Registered below, and found through its entry point in pyproject.toml.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from quantgate.base.fileio import write_json
from quantgate.base.paths import EVAL_SETS
from quantgate.fidelity.bounds import t_quantile
from quantgate.fidelity.run import build_sequences, is_complete, load_dump, score_sequences
from quantgate.gate.kinds import KindComparison, KindPolicy, comparison_file, missing
from quantgate.base.pairedstat import PairedStat
from quantgate.gate.models import Check, Gap
from quantgate.kinds import register
from quantgate.release.early import EarlyDecision
from quantgate.release.measurements import Recorded, VariantJob
from quantgate.release.replicas import Step
from quantgate.release.variants import Evidence
from quantgate.spec.kinds import KindSpec
from quantgate.spec.sections import resolve_path

NAME = "perplexity"
LEVEL = 0.95  # two-sided: the upper end is a one-sided 97.5% bound


class PerplexitySpec(KindSpec):
    """The spec's `measure.perplexity`: the held-out text and how much of each passage is scored."""

    text: Path = Field(EVAL_SETS / "fidelity_corpus.txt", description="held-out text: passages separated by blank "
                       "lines (relative paths are relative to the spec file's folder)")
    max_tokens: int = Field(512, ge=8, description="tokens scored per passage at most (keep under the context)")

    @field_validator("text")
    @classmethod
    def _exists(cls, v: Path, info: ValidationInfo) -> Path:
        path = resolve_path(v, info)  # against the spec file's folder, as every path of a spec
        if not path.is_file():
            raise ValueError(f"not a file: {path}")
        return path


class PerplexityPolicy(KindPolicy):
    """The policy's `kinds.perplexity`: the largest perplexity increase a candidate may show."""

    max_relative_increase: float = Field(0.05, gt=0, description="limit on exp(mean NLL difference) - 1, judged at "
                                         "the upper end of its 95% interval")


def _section(job: VariantJob) -> PerplexitySpec | None:
    section = job.spec.measure.get(NAME)
    return section if isinstance(section, PerplexitySpec) else None


class Perplexity:
    """The release's side (quantgate.release.measurements.Measurement)."""
    name = NAME

    def folders(self, job: VariantJob) -> dict[str, Path]:
        section = _section(job)
        if section is None:
            return {}
        key = hashlib.sha256(section.text.read_bytes() + f"|{section.max_tokens}".encode()).hexdigest()[:12]
        return {NAME: job.cache / NAME / key}

    def pending(self, job: VariantJob, folders: dict[str, Path]) -> list[str]:
        return [k for k, d in folders.items() if not is_complete(d, None)]

    def steps(self, job: VariantJob, folders: dict[str, Path], pending: list[str],
              early: EarlyDecision | None) -> list[Step]:
        section = _section(job)
        if not pending or section is None:
            return []

        def score(srv: Any) -> None:
            if job.skips(NAME, early):
                return
            job.log(f"{job.variant.name}: perplexity on {section.text.name}")
            sequences = build_sequences([], job.tokenizer, corpus=section.text, max_len=section.max_tokens)
            score_sequences(srv.endpoint, sequences, folders[NAME], top_k=1,
                            concurrency=job.spec.eval.concurrency)
        return [Step(NAME, score)]

    def phase(self, job: VariantJob, early: EarlyDecision | None) -> float:
        return 2  # with the recall grid and the perf probe: after the eval sets (and an early decision)

    def record(self, folders: dict[str, Path], skipped: Mapping[str, str]) -> Recorded:
        return {"kinds": {} if NAME in skipped else folders}

    def compare(self, run: Path, base: Evidence, cand: Evidence) -> None:
        """<run>/<candidate>/perplexity.json: the paired per-passage NLL difference and each side's perplexity."""
        if NAME in base.kinds and NAME in cand.kinds:
            stat = paired_nll(_nll(base.kinds[NAME]), _nll(cand.kinds[NAME]))
            figures = {} if stat.base_mean is None or stat.cand_mean is None else \
                {"baseline_perplexity": math.exp(stat.base_mean), "candidate_perplexity": math.exp(stat.cand_mean)}
            path = comparison_file(run, cand.variant.name, NAME)
            out = KindComparison(kind=NAME, stat=stat.model_copy(update={"file": str(path)}),
                                 unit="passage", level=LEVEL, figures=figures,
                                 quantity="mean NLL per token (nats), lower is better")
            write_json(path, out.model_dump(mode="json"))


def _nll(folder: Path) -> dict[str, float]:
    """Passage id -> its mean negative log-likelihood per scored token."""
    return {i: -sum(s.lp) / len(s.lp) for i, s in load_dump(folder).items() if s.lp}


def paired_nll(base: Mapping[str, float], cand: Mapping[str, float], level: float = LEVEL) -> PairedStat:
    """The candidate's NLL minus the baseline's, paired by passage: the mean, its t interval at `level`."""
    ids = sorted(set(base) & set(cand))
    diffs = [cand[i] - base[i] for i in ids]
    n = len(diffs)
    if n == 0:
        return PairedStat(n=0, higher_is_better=False)
    mean = sum(diffs) / n
    b, c = sum(base[i] for i in ids) / n, sum(cand[i] for i in ids) / n
    if n < 2:
        return PairedStat(n=n, base_mean=b, cand_mean=c, delta=mean, higher_is_better=False)
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    half = t_quantile((1 + level) / 2, n - 1) * sd / math.sqrt(n)
    return PairedStat(n=n, base_mean=b, cand_mean=c, delta=mean, ci_low=mean - half, ci_high=mean + half,
                      higher_is_better=False, sd_diff=sd)


class PerplexityGate:
    """The gate's side (quantgate.gate.kinds.GateKind)."""
    name = NAME
    policy_model: type[KindPolicy] = PerplexityPolicy
    spec_field = f"measure.{NAME}"

    def checks(self, section: KindPolicy, comparison: KindComparison | None, gap: Gap | None) -> list[Check]:
        assert isinstance(section, PerplexityPolicy)
        stat = comparison.stat if comparison is not None else None
        if stat is None or stat.delta is None:
            return [missing(NAME, section, gap)]
        limit, rise = section.max_relative_increase, math.expm1(stat.delta)
        said = f"perplexity {rise:+.2%} over {stat.n} passages"
        if stat.ci_high is None or stat.ci_low is None:
            outcome, why = "inconclusive", f"{said}: too few passages for an interval (2 or more)"
        else:
            low, high = math.expm1(stat.ci_low), math.expm1(stat.ci_high)
            said += f" ({LEVEL:.0%} interval {low:+.2%} to {high:+.2%}); limit {limit:+.2%}"
            outcome = "pass" if high <= limit else "fail" if low > limit else "inconclusive"
            why = {"pass": f"{said}: within the limit (the whole interval)",
                   "fail": f"{said}: beyond the limit (the whole interval)",
                   "inconclusive": f"{said}: the interval crosses the limit"}[outcome]
        return [Check(name=NAME, measured=round(rise, 6), limit=limit, bound="ci", required=section.required,
                      outcome=outcome, evidence_file=stat.file, reason=why)]


register(NAME, PerplexitySpec, Perplexity(), PerplexityGate())
