"""Token-level fidelity (pure): how far a candidate's next-token distributions are from the baseline's.

Both sides score the SAME token ids, teacher-forced, and report for every scored position the logprob of the actual
token and their top-k (token id -> logprob). The scored tokens are a continuation that the baseline *sampled* at
temperature 1 after each prompt (quantgate.fidelity.run.sample_continuations); the prompt itself is not scored.
Per scored position we compute:

- `kl`: an unbiased estimate of KL(P_base || P_cand) at that position, from exact logprobs with no truncation.
  Split the vocabulary into A, the tokens both top-k lists hold (both probabilities known exactly), and the rest:
      KL = sum_{y in A} p(y) log(p(y)/q(y))  +  sum_{y not in A} p(y) log(p(y)/q(y)).
  The first sum is computed exactly. For the second, the actual token x was drawn from P_base, so
  1[x not in A] (log p(x) - log q(x)) has exactly that sum as its expectation (A depends on the prefix only, not on
  x). Their total is unbiased, and far less noisy than the plain log-ratio log p(x) - log q(x) (also unbiased),
  whose spread covers the whole distribution. Per token it is still noisy (it can be negative); its mean over
  thousands of tokens is what the gate bounds;
- `kl_topk`: KL estimated from the two top-k lists (`kl_topk`), a diagnostic only: merging the tail into one bucket
  loses part of the KL (it is no bound), and it leans on the guess for tokens one side does not list;
- `top1_agree`: whether both sides rank the same token first;
- `dnll`: the candidate's negative log-likelihood of the actual token minus the baseline's (> 0: the candidate
  finds the text less likely). On sampled tokens it equals `kl`; it is kept under its own name for other text.

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
from quantgate.fidelity.bounds import ratio_bounds

REST_EPS = 1e-9  # floor of a "rest" bucket's probability: keeps log() finite when a side's top-k holds ~all mass
WORST_N = 10
CONTEXT_PREFIX = "context:"  # the category of a haystack prompt: context:<length> (quantgate.release.fidelity_step)


def kl_topk(base: Mapping[int, float], cand: Mapping[int, float], cand_ranked: Mapping[int, float] | None = None
            ) -> float:
    """KL(P_base || P_cand) in nats from top-k logprob dicts (token id -> logprob), over a coarse partition.

    The partition is: every token of `base`, plus one "rest" bucket for all other tokens. On it:
    - a base token that `cand` also lists takes cand's logprob;
    - a base token missing from cand's list is ranked below everything cand *ranked* (`cand_ranked`: cand's own
      top-k, default `cand`), so its probability is at most the smallest probability there. We take that bound,
      capped at an equal share of the mass cand leaves unlisted (1 - sum of cand's listed probabilities, split over
      the missing tokens), so cand's probabilities never sum above 1. The bound is the most favourable value for
      cand that agrees with its ranking: the estimate leans low rather than high. An extra token added to `cand`
      from outside its top-k (the actual token, often far down) must not set that bound: it says nothing of the
      rank of the other missing tokens, and at p ~ 1e-7 it would make every one of them look 1e5 times rarer;
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
    ranked = cand_ranked if cand_ranked else cand
    guess = min(math.exp(min(ranked.values())), unlisted / len(missing)) if missing else 0.0
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
    kl: float           # the unbiased KL estimate when x ~ P_base (exact head over shared top-k + sampled tail)
    kl_topk: float      # the top-k diagnostic
    top1_agree: bool
    dnll: float


def _argmax(top: Mapping[int, float]) -> int:
    """The first-ranked token; a tie goes to the lower token id, the same on both sides."""
    return max(top.items(), key=lambda kv: (kv[1], -kv[0]))[0]


def score_position(base_top: Mapping[int, float], cand_top: Mapping[int, float], token: int, base_lp: float,
                   cand_lp: float) -> PositionScore:
    """(kl, kl_topk, top1_agree, dnll) at one position. `token` is the actual next token, `base_lp`/`cand_lp` its
    logprobs (exact on both sides).

    For the top-k diagnostic the actual token joins both lists (it is often outside them), but the guess for the
    tokens the candidate does not list comes from the candidate's own top-k only (see kl_topk).
    """
    ratio = base_lp - cand_lp
    shared = base_top.keys() & cand_top.keys()
    head = sum(math.exp(base_top[y]) * (base_top[y] - cand_top[y]) for y in shared)
    kl = head + (0.0 if token in shared else ratio)
    topk = kl_topk({**base_top, token: base_lp}, {**cand_top, token: cand_lp}, cand_ranked=cand_top)
    return PositionScore(kl, topk, _argmax(base_top) == _argmax(cand_top), ratio)


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
    def _aligned(self) -> ScoredSample:
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
    kl_sum: float                 # sum of the per-position unbiased KL estimates (what the gate bounds)
    top1_agree: int
    dnll_sum: float
    kl_max: float                 # the largest per-position top-k KL (which position hurts most)
    kl_topk_sum: float = 0.0      # sum of the top-k KL diagnostic


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
    kl_sum = dnll_sum = kl_max = topk_sum = 0.0
    agree = 0
    for i in range(len(base.lp)):
        token = base.ids[base.score_from + i]
        (bt, bl), (ct, cl) = base.top[i], cand.top[i]
        s = score_position(dict(zip(bt, bl)), dict(zip(ct, cl)), token, base.lp[i], cand.lp[i])
        kl_sum += s.kl
        topk_sum += s.kl_topk
        kl_max = max(kl_max, s.kl_topk)
        agree += s.top1_agree
        dnll_sum += s.dnll
    return SampleFidelity(id=base.id, category=base.category, n_tokens=len(base.lp), kl_sum=kl_sum,
                          top1_agree=agree, dnll_sum=dnll_sum, kl_max=kl_max, kl_topk_sum=topk_sum)


def merge_draws(samples: Iterable[SampleFidelity], sep: str = "#") -> list[SampleFidelity]:
    """Samples whose ids share the part before `sep` (several continuations of one prompt) as one sample: their
    sums added, so that the intervals resample prompts, not draws that share a prompt. Order: by merged id."""
    groups: dict[str, list[SampleFidelity]] = {}
    for s in samples:
        groups.setdefault(s.id.split(sep, 1)[0], []).append(s)
    return [SampleFidelity(id=i, category=g[0].category, n_tokens=sum(s.n_tokens for s in g),
                           kl_sum=sum(s.kl_sum for s in g), top1_agree=sum(s.top1_agree for s in g),
                           dnll_sum=sum(s.dnll_sum for s in g), kl_max=max(s.kl_max for s in g),
                           kl_topk_sum=sum(s.kl_topk_sum for s in g)) for i, g in sorted(groups.items())]


class FidelityInterval(BaseModel):
    """A per-token mean with two one-sided bounds (quantgate.fidelity.bounds), each at (1 + level) / 2: level 0.90
    gives a 95% lower bound `low` and a 95% upper bound `high`, read separately."""
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
    kl: FidelityInterval
    top1: FidelityInterval
    dnll: FidelityInterval
    kl_topk: float | None = None  # the pooled top-k KL diagnostic (no interval: it is not what the gate bounds)


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


def _stats(samples: Sequence[SampleFidelity], n_boot: int, seed: int, level: float,
           weights: Mapping[str, float] | None = None) -> FidelityStats:
    """Ratio-of-sums means; `low` and `high` are one-sided bounds at (1 + level) / 2 each from resampling whole
    samples (the same draws for the three metrics; quantgate.fidelity.bounds, docs/fidelity-bounds.md). Both hold
    the mean. `weights` (category -> weight, 1 for the others) scale a sample's sums and tokens alike: the mean of
    a mix with the categories in other proportions; n_tokens stays the tokens scored."""
    w = np.array([(weights or {}).get(s.category, 1.0) for s in samples], dtype=np.float64)
    sums = np.array([[s.kl_sum, s.top1_agree, s.dnll_sum] for s in samples], dtype=np.float64) * w[:, None]
    tokens = np.array([s.n_tokens for s in samples], dtype=np.float64) * w
    total = tokens.sum()
    if total <= 0:
        raise QuantgateError("no scored tokens to summarize", where="fidelity summary")
    means = sums.sum(axis=0) / total
    n = len(samples)
    lo, hi = ratio_bounds(sums, tokens, level=level, n_boot=n_boot, seed=seed)
    lo[1], hi[1] = max(lo[1], 0.0), min(hi[1], 1.0)  # top-1 agreement is a share

    def interval(j: int) -> FidelityInterval:
        return FidelityInterval(mean=float(means[j]), low=float(min(lo[j], means[j])), high=float(max(hi[j], means[j])),
                                level=level)

    return FidelityStats(n_samples=n, n_tokens=sum(s.n_tokens for s in samples), kl=interval(0), top1=interval(1),
                         dnll=interval(2))


def _with_topk(stats: FidelityStats, samples: Sequence[SampleFidelity]) -> FidelityStats:
    return stats.model_copy(update={"kl_topk": sum(s.kl_topk_sum for s in samples) / stats.n_tokens})


def summarize(samples: Iterable[SampleFidelity], *, n_boot: int = 2000, seed: int = 0,
              level: float = 0.90, pooled_weights: Mapping[str, float] | None = None) -> FidelitySummary:
    """Pooled per-token KL, top-1 agreement and dNLL with cluster-bootstrap intervals, per category, and the
    WORST_N samples by mean KL. Level 0.90 by default: the gate reads `high` as a one-sided 95% upper bound.
    `pooled_weights` (category -> weight) reweights the pooled figures only (see `_stats`)."""
    samples = list(samples)
    if not samples:
        raise QuantgateError("no samples to summarize", where="fidelity summary")
    if not 0.0 < level < 1.0:
        raise QuantgateError(f"confidence level must be in (0, 1), got {level}", where="fidelity summary")
    overall = _with_topk(_stats(samples, n_boot, seed, level, pooled_weights), samples)
    cats: dict[str, list[SampleFidelity]] = {}
    for s in samples:
        cats.setdefault(s.category, []).append(s)
    by_cat = {c: _with_topk(_stats(group, n_boot, seed, level), group) for c, group in sorted(cats.items())
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
