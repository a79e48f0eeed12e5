"""Needle-in-a-haystack prompts (pure): seeded haystacks of the project's filler, needles at token depths.

A prompt is the chat messages of `NeedleData.system`/`.user` around a document of filler sentences with the
needle fact(s) inserted at a sentence boundary. Lengths and positions are counted with the model's own
tokenizer, passed in as a `TokenCounter`; nothing here reads files or talks to a server.

- length: tokens of the whole chat prompt (template included), filled up to, never over, the target.
- depth d%: the needle block starts at d/100 x (document tokens - needle tokens), within
  `depth_tolerance_tokens` (checked on every prompt, measured, never assumed).
- kinds: number (a code), name (an invented proper noun), multilingual (fact and question in fr/de/es/zh,
  value an invented name), multi (n similar facts in the document, the question asks for k of them; the k
  asked facts form the block at the depth, the others sit at seeded random boundaries).
- answer cap: a request's max_tokens is what its needle needs (`answer_cap`): the tokens of the asked fact(s),
  a model that repeats the whole sentence included, plus `ANSWER_SLACK`, never above max_answer_tokens.

This module builds the "single" layout (one needle per haystack); quantgate.recall.haystack packs several needles
into one haystack and shares it between requests.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from quantgate.base.errors import QuantgateError, SettingError

KINDS = ("number", "name", "multilingual", "multi")
ANSWER_SLACK = 8  # answer tokens beyond the asked fact(s): a lead-in ("The code is"), punctuation, end of turn


# --- data (eval_sets/recall_needles.yaml)
class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    fact: str
    question: str
    subjects: list[str] = Field(min_length=1)


class NumberSpec(_Spec):
    digits: int = Field(ge=4, le=12)


class NameSpec(_Spec):
    syllables: list[str] = Field(min_length=4)


class LangSpec(_Spec):
    syllables: list[str] = []  # alphabetic languages: a name from syllables
    family: list[str] = []  # languages written without spaces: family character + two given characters
    given: list[str] = []

    @model_validator(mode="after")
    def _one_way(self) -> LangSpec:
        if not self.syllables and not (self.family and self.given):
            raise ValueError("give `syllables`, or `family` and `given` characters, to build names")
        return self


class MultiSpec(NumberSpec):
    n: int = Field(ge=2)
    k: int = Field(ge=1)

    @model_validator(mode="after")
    def _k_of_n(self) -> MultiSpec:
        if self.k > self.n or self.n > len(self.subjects):
            raise ValueError(f"need k <= n <= number of subjects (k={self.k}, n={self.n}, subjects={len(self.subjects)})")
        return self


class NeedleData(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int
    depth_tolerance_tokens: int = Field(ge=1)
    system: str
    user: str
    number: NumberSpec
    name: NameSpec
    multilingual: dict[str, LangSpec] = Field(min_length=1)
    multi: MultiSpec
    together: str = Field(description="one question asking every needle of a haystack: {questions}, one a line")

    @field_validator("user")
    @classmethod
    def _placeholders(cls, v: str) -> str:
        if "{document}" not in v or "{question}" not in v:
            raise ValueError("the user template needs both {document} and {question}")
        if v.index("{document}") > v.index("{question}"):
            raise ValueError("the user template must put {document} before {question}: the document is the prefix "
                             "that the questions over one haystack share (prefix caching)")
        return v

    @field_validator("together")
    @classmethod
    def _questions(cls, v: str) -> str:
        if "{questions}" not in v:
            raise ValueError("the `together` template needs {questions}")
        return v


# --- tokenizer, passed in
@dataclass(frozen=True)
class TokenCounter:
    text: Callable[[str], int]  # tokens of plain text, no special tokens
    chat: Callable[[list[dict]], int]  # tokens of chat messages rendered with the template + generation prompt


@dataclass(frozen=True)
class Needle:
    kind: str
    lang: str
    facts: tuple[str, ...]  # the asked fact(s): one block at the depth
    question: str
    expected: tuple[str, ...]
    others: tuple[str, ...] = ()  # multi: facts not asked about, elsewhere in the document
    other_values: tuple[str, ...] = ()


@dataclass(frozen=True)
class RecallPrompt:
    """One needle (one paired observation) and the request that asks it. Several needles may share a request
    (layout "together") and several requests a haystack (layouts "turns" and "together")."""
    id: str
    length: int
    depth: int
    kind: str
    sample: int
    lang: str
    messages: list[dict] = field(repr=False)
    expected: tuple[str, ...]
    other_values: tuple[str, ...]
    prompt_tokens: int  # whole chat prompt, as the server will count it
    doc_tokens: int
    needle_tokens: int
    needle_token_start: int  # document tokens before the needle block
    target_token_start: int
    request: str = ""  # id of the request that asks this needle ("" : the needle's own id)
    haystack: str = ""  # id of the document the request is built on ("" : the needle's own id)
    max_tokens: int = 32  # answer cap of the request
    shared_tokens: int = 0  # prompt tokens shared with the haystack's other requests (an estimate, for pacing)

    def __post_init__(self) -> None:
        if not self.request:
            object.__setattr__(self, "request", self.id)
        if not self.haystack:
            object.__setattr__(self, "haystack", self.id)

    def record(self) -> dict:
        return asdict(self)


def _code(rng: random.Random, digits: int) -> str:
    return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


def _word(rng: random.Random, syllables: Sequence[str], lo: int, hi: int) -> str:
    return "".join(rng.choice(syllables) for _ in range(rng.randint(lo, hi))).capitalize()


def make_needle(kind: str, rng: random.Random, data: NeedleData) -> Needle:
    s: _Spec  # each kind's own spec class
    if kind == "number":
        s, subject = data.number, rng.choice(data.number.subjects)
        value = _code(rng, s.digits)
        return Needle(kind, "en", (s.fact.format(subject=subject, value=value),), s.question.format(subject=subject), (value,))
    if kind == "name":
        s, subject = data.name, rng.choice(data.name.subjects)
        value = f"{_word(rng, s.syllables, 2, 2)} {_word(rng, s.syllables, 2, 3)}"
        return Needle(kind, "en", (s.fact.format(subject=subject, value=value),), s.question.format(subject=subject), (value,))
    if kind == "multilingual":
        lang = rng.choice(sorted(data.multilingual))
        s = data.multilingual[lang]
        subject = rng.choice(s.subjects)
        if s.syllables:
            value = f"{_word(rng, s.syllables, 2, 2)} {_word(rng, s.syllables, 2, 3)}"
        else:
            value = rng.choice(s.family) + "".join(rng.sample(s.given, 2))
        return Needle(kind, lang, (s.fact.format(subject=subject, value=value),), s.question.format(subject=subject), (value,))
    if kind == "multi":
        s = data.multi
        subjects = rng.sample(s.subjects, s.n)
        values: list[str] = []
        while len(values) < s.n:
            v = _code(rng, s.digits)
            if v not in values:
                values.append(v)
        facts = [s.fact.format(subject=a, value=v) for a, v in zip(subjects, values)]
        k = s.k
        return Needle(kind, "en", tuple(facts[:k]), s.question.format(subjects=" and the ".join(subjects[:k])),
                      tuple(values[:k]), tuple(facts[k:]), tuple(values[k:]))
    raise QuantgateError(f"unknown needle kind {kind!r}", where="kinds", fix=f"use some of: {', '.join(KINDS)}")


def parse_kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise SettingError(f"unknown needle kind(s): {', '.join(bad) or '(none given)'}", setting="recall.kinds",
                             fix=f"use a comma-separated subset of: {','.join(KINDS)}")
    return list(dict.fromkeys(kinds))


def parse_ints(text: str, option: str, lo: int, hi: int | None = None) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise QuantgateError(f"not a comma-separated list of integers: {text!r}", where=option, fix=f"e.g. {option} 0,50,100") from None
    bad = [v for v in vals if v < lo or (hi is not None and v > hi)]
    if bad or not vals:
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise QuantgateError(f"values out of range ({rng}): {bad or '(none given)'}", where=option, fix=f"give integers in {rng}")
    return sorted(set(vals))


def check_lengths(lengths: Sequence[int], max_model_len: int, max_answer_tokens: int, source: str) -> None:
    """Refuse target lengths that leave no room for the answer within `max_model_len` (named by `source`)."""
    limit = max_model_len - max_answer_tokens
    bad = [n for n in lengths if n > limit]
    if bad:
        raise SettingError(
            f"length(s) {', '.join(map(str, bad))} + {max_answer_tokens} answer tokens exceed the context of"
            f" {max_model_len} tokens ({source})", setting="recall.lengths",
            fix=f"use lengths up to {limit}, or serve with a larger --max-model-len (>= {max(bad) + max_answer_tokens})")


def check_fits(prompts: Sequence[RecallPrompt], max_model_len: int) -> None:
    """Refuse the grid if any prompt + its answer cap would not fit the served context: nothing is truncated."""
    over = [p for p in prompts if p.prompt_tokens + p.max_tokens > max_model_len]
    if over:
        worst = max(over, key=lambda p: p.prompt_tokens + p.max_tokens)
        need = worst.prompt_tokens + worst.max_tokens
        raise QuantgateError(
            f"{len(over)} of {len(prompts)} prompts would not fit the served context: e.g. {worst.id} has"
            f" {worst.prompt_tokens} prompt tokens + {worst.max_tokens} answer tokens > max_model_len {max_model_len}",
            where="recall grid", fix=f"use shorter lengths (by {need - max_model_len} tokens), or serve with"
                                     f" --max-model-len >= {need}")


def answer_cap(facts: Sequence[str], max_answer_tokens: int, counter: TokenCounter) -> int:
    """max_tokens for one needle: its asked fact(s) as tokens plus ANSWER_SLACK, at most max_answer_tokens."""
    return min(max_answer_tokens, counter.text(" ".join(facts)) + ANSWER_SLACK)


def _filler_stream(filler: Sequence[str], rng: random.Random) -> Iterator[str]:
    while True:
        order = list(filler)
        rng.shuffle(order)
        yield from order


def _units(filler: Sequence[str], key: str, budget: int, others: list[tuple[str, int]], counter: TokenCounter,
           sizes: dict[str, int]) -> list[tuple[str, int]]:
    """(sentence, tokens) of the document without the needle block: seeded filler up to `budget` tokens, the other
    facts (multi) at seeded random boundaries. `sizes` caches the filler sentences' token counts."""
    chosen, used = [], 0
    for s in _filler_stream(filler, random.Random(key + ":filler")):
        t = sizes.setdefault(s, counter.text(" " + s))
        if used + t > budget:
            break
        chosen.append((s, t))
        used += t
    units = list(chosen)
    place = random.Random(key + ":place")
    for fact in others:
        units.insert(place.randint(0, len(units)), fact)
    return units


def _insert(units: list[tuple[str, int]], block: str, depth: int) -> tuple[str, str]:
    """(document, text before the block): the block at the sentence boundary nearest depth% of the units' tokens."""
    target_est = depth / 100 * sum(t for _, t in units)
    cum, best = 0, (abs(target_est), 0)
    for i, (_, t) in enumerate(units, 1):
        cum += t
        best = min(best, (abs(cum - target_est), i))
    pos = best[1]
    before = " ".join(s for s, _ in units[:pos])
    after = " ".join(s for s, _ in units[pos:])
    return " ".join(x for x in (before, block, after) if x), before


def _placement(doc: str, before: str, block: str, depth: int, kind: str, tolerance: int,
               counter: TokenCounter) -> tuple[int, int, int, int]:
    """(needle start, needle tokens, document tokens, target start), measured; refused beyond `tolerance`."""
    start = counter.text(before) if before else 0
    needle_tokens = counter.text(doc[: len(before) + (1 if before else 0) + len(block)]) - start
    doc_tokens = counter.text(doc)
    target = round(depth / 100 * (doc_tokens - needle_tokens))
    if abs(start - target) > tolerance:
        raise QuantgateError(
            f"needle for {kind} at depth {depth}% starts at token {start}, target {target}: off by more than"
            f" {tolerance}", where="recall filler",
            fix="shorten the longest filler sentences (each should be well under twice the tolerance)")
    return start, needle_tokens, doc_tokens, target


def build_prompt(length: int, depth: int, kind: str, sample: int, *, seed: int, data: NeedleData,
                 filler: Sequence[str], counter: TokenCounter, max_answer_tokens: int = 32) -> RecallPrompt:
    """One prompt of about `length` chat tokens (never more) with the needle block at `depth` percent."""
    if not 0 <= depth <= 100:
        raise SettingError(f"depth {depth} is outside 0..100", setting="recall.depths", fix="give depths in percent, 0..100")
    if not filler:
        raise QuantgateError("no filler sentences", where="recall filler", fix="give the filler file at least one sentence")
    key = f"quantgate-recall:{seed}:{length}:{depth}:{kind}:{sample}"
    needle = make_needle(kind, random.Random(key + ":needle"), data)

    def messages(doc: str) -> list[dict]:
        return [{"role": "system", "content": data.system},
                {"role": "user", "content": data.user.format(document=doc, question=needle.question)}]

    block = " ".join(needle.facts)
    others = [(f, counter.text(" " + f)) for f in needle.others]
    budget = length - counter.chat(messages("")) - counter.text(" " + block) - sum(t for _, t in others)
    if budget < 0:
        raise SettingError(f"length {length} is too short for a {kind} needle ({length - budget} tokens without filler)",
                             setting="recall.lengths", fix=f"use lengths of at least {2 * (length - budget)}")
    sizes: dict[str, int] = {}
    for _ in range(8):  # token counts of joined sentences are nearly additive; trim until the whole prompt fits
        doc, before = _insert(_units(filler, key, budget, others, counter, sizes), block, depth)
        msgs = messages(doc)
        prompt_tokens = counter.chat(msgs)
        if prompt_tokens <= length:
            break
        budget -= prompt_tokens - length
    else:
        raise QuantgateError(f"could not fit a {kind} prompt into {length} tokens", where="recall grid",
                             fix="report this: the tokenizer's counts are far from additive")
    start, needle_tokens, doc_tokens, target = _placement(doc, before, block, depth, kind, data.depth_tolerance_tokens,
                                                          counter)
    digest = hashlib.sha256(json.dumps(msgs, ensure_ascii=False, sort_keys=True).encode()).hexdigest()[:10]
    return RecallPrompt(
        id=f"L{length}-d{depth}-{kind}-{sample}-{digest}", length=length, depth=depth, kind=kind, sample=sample,
        lang=needle.lang, messages=msgs, expected=needle.expected, other_values=needle.other_values,
        prompt_tokens=prompt_tokens, doc_tokens=doc_tokens, needle_tokens=needle_tokens,
        needle_token_start=start, target_token_start=target, max_tokens=answer_cap(needle.facts, max_answer_tokens, counter))


def build_grid(lengths: Sequence[int], depths: Sequence[int], kinds: Sequence[str], samples: int, *, seed: int,
               data: NeedleData, filler: Sequence[str], counter: TokenCounter, max_answer_tokens: int = 32) -> list[RecallPrompt]:
    """The single layout: one haystack, one needle and one request per (length, depth, kind, sample)."""
    return [build_prompt(n, d, k, i, seed=seed, data=data, filler=filler, counter=counter,
                         max_answer_tokens=max_answer_tokens)
            for n in lengths for d in depths for k in kinds for i in range(samples)]
