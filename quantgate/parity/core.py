"""Engine parity (pure): greedy token sequences of a served engine vs a reference, prompt by prompt.

Token ids in, no I/O: the caller strips special tokens the same way on both sides. The thresholds are data
(releases/policies/engine_parity.yaml, loaded with `quantgate.base.yamlconfig.load_model(path, ParityPolicy)`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.errors import QuantgateError
from quantgate.base.paths import RELEASES

POLICY_FILE = RELEASES / "policies" / "engine_parity.yaml"


class ParityPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = 1
    agree_prefix_tokens: int = Field(ge=1, description="identical leading tokens that count as agreement")
    min_agree_share: float = Field(ge=0, le=1)


class PromptParity(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str
    served_tokens: int
    reference_tokens: int
    matching_prefix: int
    first_divergence: int | None = Field(description="index of the first differing token; None when identical")
    identical: bool
    agrees: bool


class ParityReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompts: int
    identical_share: float
    agree_share: float
    mean_matching_prefix: float
    verdict: Literal["pass", "fail"]
    reason: str
    per_prompt: list[PromptParity]


def compare_sequences(served: Sequence[int], reference: Sequence[int]) -> tuple[int, int | None]:
    """(matching prefix length, first divergence index or None). A shorter side that is a prefix diverges at its end."""
    n = 0
    for a, b in zip(served, reference):
        if a != b:
            return n, n
        n += 1
    return n, (None if len(served) == len(reference) else n)


def check_parity(served: Sequence[Sequence[int]], reference: Sequence[Sequence[int]], policy: ParityPolicy,
                 prompt_ids: Sequence[str] | None = None) -> ParityReport:
    """Compare per prompt; fail when fewer than policy.min_agree_share of prompts agree (an engine problem)."""
    if len(served) != len(reference):
        raise QuantgateError(f"{len(served)} served outputs vs {len(reference)} reference outputs",
                             where="parity", fix="generate both sides for the same prompt list")
    if not served:
        raise QuantgateError("no prompts to compare", where="parity", fix="give the parity check at least one prompt")
    ids = list(prompt_ids) if prompt_ids is not None else [str(i) for i in range(len(served))]
    rows = []
    for pid, s, r in zip(ids, served, reference):
        prefix, div = compare_sequences(s, r)
        same = div is None
        agrees = same or prefix >= policy.agree_prefix_tokens
        rows.append(PromptParity(prompt=pid, served_tokens=len(s), reference_tokens=len(r), matching_prefix=prefix,
                                 first_divergence=div, identical=same, agrees=agrees))
    n = len(rows)
    identical = sum(r.identical for r in rows) / n
    agree = sum(r.agrees for r in rows) / n
    ok = agree >= policy.min_agree_share
    bad = [r for r in rows if not r.agrees][:5]
    detail = "; ".join(f"prompt {r.prompt} diverges at token {r.first_divergence}" for r in bad)
    reason = (f"{agree:.0%} of {n} prompts agree (identical, or the first {policy.agree_prefix_tokens} tokens match), "
              f"limit {policy.min_agree_share:.0%}; {identical:.0%} identical")
    if not ok:
        reason = f"engine problem, not quantization: {reason}" + (f". {detail}" if detail else "")
    return ParityReport(prompts=n, identical_share=round(identical, 4), agree_share=round(agree, 4),
                        mean_matching_prefix=round(sum(r.matching_prefix for r in rows) / n, 2),
                        verdict="pass" if ok else "fail", reason=reason, per_prompt=rows)
