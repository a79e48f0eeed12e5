"""Token-level fidelity (pure): how far a candidate's next-token distributions are from the baseline's.

Both sides score the SAME token ids, teacher-forced (the baseline's answers, fed as prompts), and report for every
scored position the logprob of the actual token and their top-k (token id -> logprob). Per position we compute:

- `kl`: KL(P_base || P_cand) in nats, estimated from the two top-k lists (`kl_topk`);
- `top1_agree`: whether both sides rank the same token first;
- `dnll`: the candidate's negative log-likelihood of the actual token minus the baseline's (> 0: the candidate
  finds the text less likely).

A sample keeps sums, not means, so a pooled per-token mean is an exact ratio of sums. `summarize` gives the pooled
means with confidence intervals from a cluster bootstrap over samples: tokens of one sample are not independent,
whole samples are resampled. No I/O here; the adapter `quantgate.fidelity.run` reads the dumps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from quantgate.base.errors import QuantgateError

REST_EPS = 1e-9  # floor of a "rest" bucket's probability: keeps log() finite when a side's top-k holds ~all mass
WORST_N = 10


def kl_topk(base: Mapping[int, float], cand: Mapping[int, float]) -> float:
    """KL(P_base || P_cand) in nats from top-k logprob dicts (token id -> logprob), over a coarse partition.

    The partition is: every token of `base`, plus one "rest" bucket for all other tokens. On it:
    - a base token that `cand` also lists takes cand's logprob;
    - a base token missing from cand's list is ranked below everything cand lists, so its probability is at most
      the smallest probability cand lists. We take that bound, capped at an equal share of the mass cand leaves
      unlisted (1 - sum of cand's listed probabilities, split over the missing tokens), so cand's probabilities
      never sum above 1. The bound is the most favourable value for cand that agrees with its ranking: the
      estimate leans low rather than high;
    - "rest" is 1 - the known probability mass of each side, floored at REST_EPS; both sides are then renormalized.

    Both sides are proper distributions over the same buckets, so the result is >= 0, and exactly 0 when the
    inputs are identical. Merging tokens into buckets can only lower KL, so this never overstates the full KL
    beyond what the missing-token estimate adds.
    """
    if not base or not cand:
        raise QuantgateError("kl_topk needs at least one logprob on each side", where="fidelity.core.kl_topk")
    p = [math.exp(lp) for lp in base.values()]
    cand_probs = {t: math.exp(lp) for t, lp in cand.items()}
    missing = [t for t in base if t not in cand_probs]
    unlisted = max(0.0, 1.0 - sum(cand_probs.values()))
    guess = min(min(cand_probs.values()), unlisted / len(missing)) if missing else 0.0
    q = [cand_probs.get(t, guess) for t in base]
    p.append(max(REST_EPS, 1.0 - sum(p)))
    q.append(max(REST_EPS, 1.0 - sum(q)))
    sp, sq = sum(p), sum(q)
    kl = 0.0
    for pi, qi in zip(p, q):
        pi, qi = pi / sp, qi / sq
        if pi > 0.0:
            kl += pi * (math.log(pi) - math.log(max(qi, REST_EPS * 1e-3)))
    return max(0.0, kl)


class PositionScore(NamedTuple):
    kl: float
    top1_agree: bool
    dnll: float


def _argmax(top: Mapping[int, float]) -> int:
    """The first-ranked token; a tie goes to the lower token id, the same on both sides."""
    return max(top.items(), key=lambda kv: (kv[1], -kv[0]))[0]


def score_position(base_top: Mapping[int, float], cand_top: Mapping[int, float], token: int, base_lp: float,
                   cand_lp: float) -> PositionScore:
    """(kl, top1_agree, dnll) at one position. `token` is the actual next token, `base_lp`/`cand_lp` its logprobs.

    The actual token's logprob is known exactly on both sides, so it joins both top-k lists before the KL
    (it is often outside them: the text was written by the baseline, sampled greedily, or is a corpus passage).
    """
    kl = kl_topk({**base_top, token: base_lp}, {**cand_top, token: cand_lp})
    return PositionScore(kl, _argmax(base_top) == _argmax(cand_top), (-cand_lp) - (-base_lp))


class ScoredSample(BaseModel):
    """One sample as an endpoint scored it: `ids` is the whole token sequence; position i >= score_from has
    `lp[i - score_from]` (logprob of ids[i]) and `top[i - score_from]` ([token ids], [logprobs]) of the top-k."""
    model_config = ConfigDict(extra="ignore")

    id: str
    category: str
    ids: list[int]
    score_from: int = Field(1, ge=1)
    lp: list[float]
    top: list[tuple[list[int], list[float]]]

    @model_validator(mode="after")
    def _aligned(self) -> "ScoredSample":
        n = len(self.ids) - self.score_from
        if len(self.lp) != n or len(self.top) != n:
            raise ValueError(f"sample {self.id}: {len(self.ids)} ids from position {self.score_from} need {max(n, 0)}"
                             f" scored positions, got lp {len(self.lp)} and top {len(self.top)}")
        return self


class SampleFidelity(BaseModel):
    """Sums over one sample's scored positions (means are sums / n_tokens)."""
    model_config = ConfigDict(extra="forbid")

    id: str
    category: str
    n_tokens: int
    kl_sum: float
    top1_agree: int
    dnll_sum: float
    kl_max: float


def compare_sample(base: ScoredSample, cand: ScoredSample) -> SampleFidelity:
    """Fidelity of one sample; both sides must have scored the same token ids from the same position."""
    if base.id != cand.id:
        raise QuantgateError(f"cannot compare sample {base.id!r} with sample {cand.id!r}", where="fidelity")
    if base.ids != cand.ids or base.score_from != cand.score_from:
        first = next((i for i, (a, b) in enumerate(zip(base.ids, cand.ids)) if a != b), min(len(base.ids), len(cand.ids)))
        raise QuantgateError(
            f"sample {base.id!r}: baseline and candidate scored different token ids (first difference at position"
            f" {first}; {len(base.ids)} vs {len(cand.ids)} tokens, scored from {base.score_from} vs {cand.score_from})",
            where=f"sample {base.id}", fix="score both variants from the same sequences (the baseline's answers)")
    kl_sum = dnll_sum = kl_max = 0.0
    agree = 0
    for i in range(len(base.lp)):
        token = base.ids[base.score_from + i]
        (bt, bl), (ct, cl) = base.top[i], cand.top[i]
        s = score_position(dict(zip(bt, bl)), dict(zip(ct, cl)), token, base.lp[i], cand.lp[i])
        kl_sum += s.kl
        kl_max = max(kl_max, s.kl)
        agree += s.top1_agree
        dnll_sum += s.dnll
    return SampleFidelity(id=base.id, category=base.category, n_tokens=len(base.lp), kl_sum=kl_sum,
                          top1_agree=agree, dnll_sum=dnll_sum, kl_max=kl_max)


class Interval(BaseModel):
    """A per-token mean with a two-sided bootstrap interval at `level`; `high` is also a one-sided bound at
    (1 + level) / 2 (level 0.90: a one-sided 95% upper bound)."""
    model_config = ConfigDict(extra="forbid")

    mean: float
    low: float
    high: float
    level: float


class FidelityStats(BaseModel):
    """Pooled per-token means of a group of samples."""
    model_config = ConfigDict(extra="forbid")

    n_samples: int
    n_tokens: int
    kl: Interval
    top1: Interval
    dnll: Interval


class WorstSample(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    category: str
    n_tokens: int
    kl_mean: float
    kl_max: float
    top1: float
    dnll_mean: float


class FidelitySummary(FidelityStats):
    """All samples, each category, and the samples with the highest mean KL."""
    by_category: dict[str, FidelityStats]
    worst: list[WorstSample]


def _stats(samples: Sequence[SampleFidelity], n_boot: int, seed: int, level: float) -> FidelityStats:
    """Ratio-of-sums means, percentile intervals from resampling whole samples (the same draws for the three
    metrics); an interval is widened to hold its mean when a skewed bootstrap would leave it out."""
    sums = np.array([[s.kl_sum, s.top1_agree, s.dnll_sum] for s in samples], dtype=np.float64)
    tokens = np.array([s.n_tokens for s in samples], dtype=np.float64)
    total = tokens.sum()
    if total <= 0:
        raise QuantgateError("no scored tokens to summarize", where="fidelity summary")
    means = sums.sum(axis=0) / total
    n, rng = len(samples), np.random.default_rng(seed)
    boots = []
    for start in range(0, n_boot, 256):  # chunks bound the memory: 256 x n indices at a time
        idx = rng.integers(0, n, size=(min(256, n_boot - start), n))
        tok = tokens[idx].sum(axis=1)
        boots.append(sums[idx].sum(axis=1) / np.where(tok > 0, tok, np.nan)[:, None])
    draws = np.concatenate(boots) if boots else np.empty((0, 3))
    alpha = (1.0 - level) / 2.0
    lo, hi = (np.nanquantile(draws, [alpha, 1.0 - alpha], axis=0) if len(draws) else (means, means))

    def interval(j: int) -> Interval:
        return Interval(mean=float(means[j]), low=float(min(lo[j], means[j])), high=float(max(hi[j], means[j])),
                        level=level)

    return FidelityStats(n_samples=n, n_tokens=int(total), kl=interval(0), top1=interval(1), dnll=interval(2))


def summarize(samples: Iterable[SampleFidelity], *, n_boot: int = 2000, seed: int = 0,
              level: float = 0.90) -> FidelitySummary:
    """Pooled per-token KL, top-1 agreement and dNLL with cluster-bootstrap intervals, per category, and the
    WORST_N samples by mean KL. Level 0.90 by default: the gate reads `high` as a one-sided 95% upper bound."""
    samples = list(samples)
    if not samples:
        raise QuantgateError("no samples to summarize", where="fidelity summary")
    if not 0.0 < level < 1.0:
        raise QuantgateError(f"confidence level must be in (0, 1), got {level}", where="fidelity summary")
    overall = _stats(samples, n_boot, seed, level)
    cats: dict[str, list[SampleFidelity]] = {}
    for s in samples:
        cats.setdefault(s.category, []).append(s)
    by_cat = {c: _stats(group, n_boot, seed, level) for c, group in sorted(cats.items())
              if sum(s.n_tokens for s in group) > 0}
    scored = [s for s in samples if s.n_tokens > 0]
    scored.sort(key=lambda s: (-s.kl_sum / s.n_tokens, s.id))
    worst = [WorstSample(id=s.id, category=s.category, n_tokens=s.n_tokens, kl_mean=s.kl_sum / s.n_tokens,
                         kl_max=s.kl_max, top1=s.top1_agree / s.n_tokens, dnll_mean=s.dnll_sum / s.n_tokens)
             for s in scored[:WORST_N]]
    return FidelitySummary(**overall.model_dump(), by_category=by_cat, worst=worst)


def needed_samples(summary: FidelityStats, limit: float) -> int | None:
    """Roughly how many samples would bring the KL interval's upper end under `limit`, or None when the mean
    itself is at or above the limit (more samples cannot help).

    Interval width shrinks like 1/sqrt(n), so n_needed ~ n * (upper half-width / gap)^2, where the upper
    half-width is high - mean (the end the gate reads) and gap = limit - mean. A result <= n_samples means the
    current samples already suffice. A rough guide: it assumes the new samples look like the current ones.
    """
    kl = summary.kl
    gap = limit - kl.mean
    if gap <= 0:
        return None
    half = kl.high - kl.mean
    return max(1, math.ceil(round(summary.n_samples * (half / gap) ** 2, 6)))  # round: 25.0000001 is 25
