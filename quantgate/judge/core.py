"""LLM-as-judge core, pure (no I/O): judge specs, prompt rendering, verdict parsing, both-order combination,
calibration scoring and the statistics of a pairwise comparison.

Vocabulary: a *pair* has a `first` and a `second` answer (comparison: baseline, candidate; calibration: reference,
corrupted copy). Each pair is judged in two *slots*: pairwise judges see it as (A=first, B=second) in slot "ab" and
(A=second, B=first) in slot "ba"; reference judges grade `first` and `second` alone in slots "first" and "second".
A pair's winner is "first", "second" or "tie", or None when a slot's verdict was invalid.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Literal, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
FIELDS = {"pairwise": {"question", "answer_a", "answer_b", "reference", "criteria"},
          "reference": {"question", "answer", "reference", "criteria"}}
SLOTS = {"pairwise": ("ab", "ba"), "reference": ("first", "second")}


class JudgeSidecar(BaseModel):
    """The sidecar `judges/<name>.yaml` of a prompt template `judges/<name>.md` (see judges/README.md)."""
    model_config = ConfigDict(extra="forbid")
    name: str
    version: int = Field(ge=1)
    kind: Literal["pairwise", "reference"]
    labels: list[str] = Field(min_length=2)
    grade_regex: str
    max_tokens: int = Field(default=192, ge=1)
    use_reference: bool = True
    calibration_shows_reference: bool = False
    system: str | None = None
    sections: dict[str, str] = Field(default_factory=dict)
    retry: str

    @field_validator("grade_regex")
    @classmethod
    def _one_group(cls, v: str) -> str:
        try:
            rx = re.compile(v)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        if rx.groups != 1:
            raise ValueError(f"needs exactly one capture group (the label), has {rx.groups}")
        return v

    @model_validator(mode="after")
    def _labels_fit_kind(self) -> JudgeSidecar:
        want = {"pairwise": ["A", "B", "TIE"], "reference": ["CORRECT", "INCORRECT"]}[self.kind]
        if sorted(self.labels) != sorted(want):
            raise ValueError(f"a {self.kind} judge has labels {want}, not {self.labels}")
        return self


@dataclass(frozen=True)
class Judge:
    spec: JudgeSidecar
    template: str
    sha256: str = ""

    @property
    def regex(self) -> re.Pattern:
        return re.compile(self.spec.grade_regex)


def template_problems(spec: JudgeSidecar, template: str) -> list[str]:
    """Placeholders in the template and its sections that this kind of judge cannot fill."""
    known = FIELDS[spec.kind] | set(spec.sections)
    out = [f"template: unknown placeholder {{{{{n}}}}}" for n in PLACEHOLDER.findall(template) if n not in known]
    for name, text in spec.sections.items():
        out += [f"sections.{name}: unknown placeholder {{{{{n}}}}}" for n in PLACEHOLDER.findall(text)
                if n not in FIELDS[spec.kind]]
    return out


@dataclass(frozen=True)
class PairItem:
    pair_id: str
    category: str
    question: str
    first: str
    second: str
    reference: str | None = None
    criteria: str | None = None
    kind: str = "comparison"  # or "calibration"
    corruption: str | None = None  # calibration only

    @property
    def identical(self) -> bool:
        return self.first.strip() == self.second.strip()


def _fill(text: str, values: Mapping[str, str]) -> str:
    return PLACEHOLDER.sub(lambda m: values.get(m.group(1), ""), text)


def render(judge: Judge, item: PairItem, slot: str, *, show_reference: bool) -> list[dict[str, str]]:
    """Chat messages asking the judge about one slot of a pair."""
    spec = judge.spec
    values = {"question": item.question, "reference": "", "criteria": item.criteria or ""}
    if show_reference and item.reference:
        values["reference"] = item.reference
    if spec.kind == "pairwise":
        a, b = (item.first, item.second) if slot == "ab" else (item.second, item.first)
        values |= {"answer_a": a, "answer_b": b}
    else:
        values["answer"] = item.first if slot == "first" else item.second
    for name, text in spec.sections.items():
        needed = [n for n in PLACEHOLDER.findall(text)]
        values[name] = _fill(text, values) if all(values.get(n) for n in needed) else ""
    msgs = [{"role": "system", "content": spec.system}] if spec.system else []
    return msgs + [{"role": "user", "content": _fill(judge.template, values)}]


@dataclass(frozen=True)
class Parsed:
    label: str | None
    how: Literal["strict", "tolerant", "invalid"]
    reason: str | None = None


def parse_verdict(judge: Judge, text: str | None) -> Parsed:
    """Strict: the last non-empty line matches the grade regex. Tolerant: a 'verdict' mention or a bare label,
    any case and markup. Conflicting verdicts (e.g. an echo of the options list) are invalid, not guessed."""
    labels = judge.spec.labels
    if not text or not text.strip():
        return Parsed(None, "invalid", "empty reply")
    alt = "|".join(re.escape(x) for x in sorted(labels, key=len, reverse=True))
    loose = re.compile(rf"verdict(?:\s+is)?[\s:=*_#>\-]{{0,6}}({alt})(?=[\s*_.)\]\"'`!,;]*$)", re.I | re.M)
    mentioned = {m.upper() for m in loose.findall(text)}
    if len(mentioned) > 1:
        return Parsed(None, "invalid", f"conflicting verdicts: {', '.join(sorted(mentioned))}")
    last = [ln.strip() for ln in text.strip().splitlines() if ln.strip()][-1]
    m = judge.regex.match(last)
    if m and m.group(1) in labels:
        return Parsed(m.group(1), "strict")
    if mentioned:
        return Parsed(mentioned.pop(), "tolerant")
    bare = re.sub(r"[\W_]+", "", last).upper()
    if bare in labels:
        return Parsed(bare, "tolerant")
    return Parsed(None, "invalid", "no verdict found")


Winner = Literal["first", "second", "tie"]


def slot_vote(kind: str, slot: str, label: str) -> Winner | bool:
    """Pairwise: which answer the label picks in that slot. Reference: whether the graded answer is correct."""
    if kind == "reference":
        return label == "CORRECT"
    if label == "TIE":
        return "tie"
    return ("first" if label == "A" else "second") if slot == "ab" else ("second" if label == "A" else "first")


def combine(kind: str, labels: Mapping[str, str | None]) -> tuple[Winner | None, bool | None]:
    """(winner, position_consistent) of a pair from its two slot labels; None winner when any is invalid.
    Pairwise: a side wins only when both orders pick it, otherwise tie."""
    s1, s2 = SLOTS[kind]
    l1, l2 = labels.get(s1), labels.get(s2)
    if l1 is None or l2 is None:
        return None, None
    v1, v2 = slot_vote(kind, s1, l1), slot_vote(kind, s2, l2)
    if kind == "reference":
        return ("first" if v1 and not v2 else "second" if v2 and not v1 else "tie"), None
    return (cast(Winner, v1) if v1 == v2 else "tie"), v1 == v2  # pairwise votes are winners


@dataclass
class PairOutcome:
    item: PairItem
    winner: Winner | None  # None: invalid
    consistent: bool | None = None
    labels: dict[str, str | None] = field(default_factory=dict)
    judged: bool = True  # False: identical answers, a tie without asking


def outcomes(kind: str, items: Iterable[PairItem], labels: Mapping[str, Mapping[str, str | None]]) -> list[PairOutcome]:
    """A PairOutcome per pair; `labels[pair_id][slot]`. Identical answers are ties and are not judged."""
    out = []
    for it in items:
        if it.identical:
            out.append(PairOutcome(it, "tie", None, {}, judged=False))
            continue
        got = dict(labels.get(it.pair_id, {}))
        winner, consistent = combine(kind, got)
        out.append(PairOutcome(it, winner, consistent, got))
    return out


# --- statistics -------------------------------------------------------------------------------------------

def wilson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a proportion k/n."""
    if n == 0:
        return (math.nan, math.nan)
    z = NormalDist().inv_cdf(1 - (1 - level) / 2)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (0.0 if k == 0 else max(0.0, centre - half), 1.0 if k == n else min(1.0, centre + half))


def non_inferiority(wins: int, ties: int, losses: int, margin: float, alpha: float = 0.05) -> dict:
    """One-sided test of H0: win rate - loss rate <= -margin, on per-pair scores +1/0/-1 (normal approximation).
    Non-inferior when the lower confidence bound of (win - loss) lies above -margin."""
    n = wins + ties + losses
    if n == 0:
        return {"n": 0, "net": math.nan, "lower_bound": math.nan, "margin": margin, "p_value": math.nan,
                "alpha": alpha, "non_inferior": False}
    net = (wins - losses) / n
    se = math.sqrt(max((wins + losses) / n - net * net, 0.0) / n)
    if se == 0:
        lower, p = net, (0.0 if net > -margin else 1.0)
    else:
        lower = net - NormalDist().inv_cdf(1 - alpha) * se
        p = 1 - NormalDist().cdf((net + margin) / se)
    return {"n": n, "net": net, "lower_bound": lower, "margin": margin, "p_value": p, "alpha": alpha,
            "non_inferior": lower > -margin}


def rates(outs: Sequence[PairOutcome], level: float = 0.95) -> dict:
    """Candidate (= second) win/tie/loss counts and rates with Wilson CIs over the valid pairs."""
    valid = [o for o in outs if o.winner is not None]
    n = len(valid)
    counts = {"win": sum(o.winner == "second" for o in valid), "tie": sum(o.winner == "tie" for o in valid),
              "loss": sum(o.winner == "first" for o in valid)}
    out: dict[str, int | dict[str, float]] = {"n": n, "invalid": len(outs) - n}
    for name, k in counts.items():
        lo, hi = wilson(k, n, level)
        out[name] = {"count": k, "rate": k / n if n else math.nan, "ci_low": lo, "ci_high": hi}
    return out


def summarize_comparison(outs: Sequence[PairOutcome], *, margin: float, level: float = 0.95, alpha: float = 0.05,
                         score_drop: Mapping[str, float] | None = None, worst: int = 10) -> dict:
    """Overall and per-category rates, non-inferiority, position consistency, invalid share, worst losses."""
    judged = [o for o in outs if o.judged]
    both_valid = [o for o in judged if o.consistent is not None]
    overall = rates(outs, level)
    overall["non_inferiority"] = non_inferiority(overall["win"]["count"], overall["tie"]["count"],
                                                 overall["loss"]["count"], margin, alpha)
    cats = sorted({o.item.category for o in outs})
    drop = score_drop or {}
    losses = sorted((o for o in outs if o.winner == "first"),
                    key=lambda o: (-drop.get(o.item.pair_id, 0.0), o.item.pair_id))
    return {
        "n_pairs": len(outs), "n_identical": len(outs) - len(judged), "n_judged": len(judged),
        "invalid_pairs": sum(o.winner is None for o in outs),
        "invalid_rate": sum(o.winner is None for o in judged) / len(judged) if judged else 0.0,
        "position_consistency": (sum(cast(bool, o.consistent) for o in both_valid) / len(both_valid))
        if both_valid else math.nan,
        "overall": overall,
        "winners": {o.item.pair_id: o.winner for o in outs},
        "by_category": {c: rates([o for o in outs if o.item.category == c], level) for c in cats},
        "worst_losses": [{"pair_id": o.item.pair_id, "category": o.item.category, "question": o.item.question,
                          "reference": o.item.reference, "baseline": o.item.first, "candidate": o.item.second,
                          "labels": o.labels, "score_drop": drop.get(o.item.pair_id)} for o in losses[:worst]],
    }


def summarize_calibration(outs: Sequence[PairOutcome], bar: float) -> dict:
    """Accuracy = share of calibration pairs whose combined verdict picks the reference (invalid counts as wrong)."""
    def acc(group: Sequence[PairOutcome]) -> dict:
        k = sum(o.winner == "first" for o in group)
        lo, hi = wilson(k, len(group))
        return {"n": len(group), "correct": k, "accuracy": k / len(group) if group else math.nan,
                "ci_low": lo, "ci_high": hi, "invalid": sum(o.winner is None for o in group)}
    overall = acc(outs)
    types = sorted({o.item.corruption or "?" for o in outs})
    reliable = overall["n"] > 0 and overall["accuracy"] >= bar
    return {**overall, "bar": bar, "reliable": reliable,
            "by_type": {t: acc([o for o in outs if o.item.corruption == t]) for t in types},
            "reason": None if reliable else ("no calibration pairs" if not outs else
                                             f"accuracy {overall['accuracy']:.1%} is below the bar of {bar:.0%}")}
