"""Packed recall haystacks (pure): several needles in one haystack, and the requests that share it.

Layouts of a grid (`build_grid`):
- single: one haystack, one needle, one request per (length, depth, kind, sample) (quantgate.recall.needle).
- turns: one haystack per (length, kind, sample) holding one needle per depth, each with its own key (subject) and
  value; one request per needle. The requests differ only in their question, which follows the document, so a
  server with prefix caching computes the haystack once and each further question costs its own tokens.
- together: the same haystack, one request asking every needle's question (numbered, one a line).
Every needle stays one observation, scored on its own value, whatever request asked it.

The filler of a haystack depends on (seed, length, sample) only: the haystacks of every kind at one length share
their text up to the first needle. Depth d% places a needle block so that it starts at d/100 x (document tokens -
its own tokens), measured in the final document and checked against `depth_tolerance_tokens` like the single
layout. Values of the other needles of a haystack are the needle's `other_values` (reported when an answer gives
them, not penalized); a multi haystack adds n - k unasked facts of the same form at seeded random boundaries.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from typing import Any, Literal

from quantgate.base.errors import QuantgateError, SettingError
from quantgate.recall import needle as nd
from quantgate.recall.needle import Needle, NeedleData, RecallPrompt, TokenCounter

Ask = Literal["single", "turns", "together"]
ASK = ("single", "turns", "together")
_HEADER_TOKENS = 8  # template tokens after the question (end of turn, assistant header): not part of the shared prefix


def _pick(rng: random.Random, pool: Sequence, count: int, what: str):
    if len(pool) < count:
        raise QuantgateError(f"{count} distinct {what} are needed for one haystack, the needle data has {len(pool)}",
                             where="recall depths", fix=f"use at most {len(pool)} depths for this kind, or add "
                                                        f"{what} to eval_sets/recall_needles.yaml")
    return rng.sample(list(pool), count)


def _distinct(draw, count: int, what: str) -> list[str]:
    """`count` distinct values from `draw()` (a seeded generator)."""
    out: list[str] = []
    for _ in range(100 * count):
        v = draw()
        if v not in out:
            out.append(v)
        if len(out) == count:
            return out
    raise QuantgateError(f"cannot draw {count} distinct {what}", where="eval_sets/recall_needles.yaml",
                         fix=f"add syllables or characters for {what}")


def _name(rng: random.Random, s) -> str:
    """An invented name: two words of syllables, or (languages without spaces) a family and two given characters."""
    if s.syllables:
        return f"{nd._word(rng, s.syllables, 2, 2)} {nd._word(rng, s.syllables, 2, 3)}"
    return rng.choice(s.family) + "".join(rng.sample(s.given, 2))


def _simple(kind: str, count: int, rng: random.Random, data: NeedleData) -> list[Needle]:
    """`count` number or name needles with distinct subjects and values."""
    s = data.number if kind == "number" else data.name
    subjects = _pick(rng, s.subjects, count, f"{kind} subjects")
    if kind == "number":
        values = _distinct(lambda: nd._code(rng, data.number.digits), count, "codes")
    else:
        values = _distinct(lambda: _name(rng, data.name), count, "names")
    return [Needle(kind, "en", (s.fact.format(subject=a, value=v),), s.question.format(subject=a), (v,))
            for a, v in zip(subjects, values)]


def _multilingual(count: int, rng: random.Random, data: NeedleData) -> list[Needle]:
    """`count` needles, each in a seeded language, with distinct (language, subject) keys and distinct values."""
    pairs = _pick(rng, [(lang, subj) for lang in sorted(data.multilingual) for subj in data.multilingual[lang].subjects],
                  count, "multilingual subjects")
    out: list[Needle] = []
    for lang, subj in pairs:
        s = data.multilingual[lang]
        used = {n.expected[0] for n in out}
        value = next((v for v in (_name(rng, s) for _ in range(200)) if v not in used), None)
        if value is None:
            raise QuantgateError(f"cannot draw distinct {lang} names", where="eval_sets/recall_needles.yaml",
                                 fix=f"add syllables or characters for {lang}")
        out.append(Needle("multilingual", lang, (s.fact.format(subject=subj, value=value),),
                          s.question.format(subject=subj), (value,)))
    return out


def _multi(count: int, rng: random.Random, data: NeedleData) -> tuple[list[Needle], list[str], list[str]]:
    """`count` multi needles (k asked facts each) and the haystack's n - k unasked facts and their values."""
    s = data.multi
    subjects = _pick(rng, s.subjects, count * s.k + s.n - s.k, "multi subjects")
    values = _distinct(lambda: nd._code(rng, s.digits), len(subjects), "codes")
    facts = [s.fact.format(subject=a, value=v) for a, v in zip(subjects, values)]
    needles = [Needle("multi", "en", tuple(facts[i * s.k:(i + 1) * s.k]),
                      s.question.format(subjects=" and the ".join(subjects[i * s.k:(i + 1) * s.k])),
                      tuple(values[i * s.k:(i + 1) * s.k])) for i in range(count)]
    return needles, facts[count * s.k:], values[count * s.k:]


def make_needles(kind: str, count: int, rng: random.Random, data: NeedleData) -> tuple[list[Needle], list[str], list[str]]:
    """(needles, unasked facts, their values) of one haystack: `count` needles with distinct keys and values."""
    if kind in ("number", "name"):
        return _simple(kind, count, rng, data), [], []
    if kind == "multilingual":
        return _multilingual(count, rng, data), [], []
    if kind == "multi":
        return _multi(count, rng, data)
    raise QuantgateError(f"unknown needle kind {kind!r}", where="kinds", fix=f"use some of: {', '.join(nd.KINDS)}")


def place(units: list[tuple[str, int]], blocks: list[tuple[int, str, int]]) -> tuple[str, list[str]]:
    """(document, text before each block): blocks (depth, text, tokens), in depth order, each at the sentence
    boundary nearest its depth in the final document, never before the block placed before it."""
    total = sum(t for _, t in units) + sum(t for _, _, t in blocks)
    at: list[int] = []
    for depth, _, tokens in blocks:
        target = depth / 100 * (total - tokens)
        first = at[-1] if at else 0
        placed = sum(t for _, _, t in blocks[:len(at)])
        cum = [sum(t for _, t in units[:j]) + placed for j in range(first, len(units) + 1)]
        at.append(first + min(range(len(cum)), key=lambda j: (abs(cum[j] - target), j)))
    parts: list[str] = []
    befores: list[str] = []
    for j in range(len(units) + 1):
        for pos, (_, text, _) in zip(at, blocks):
            if pos == j:
                befores.append(" ".join(parts))
                parts.append(text)
        if j < len(units):
            parts.append(units[j][0])
    return " ".join(parts), befores


def _questions(needles: Sequence[Needle], ask: Ask, data: NeedleData) -> list[str]:
    if ask == "together":
        return [data.together.format(questions="\n".join(f"{i}. {n.question}" for i, n in enumerate(needles, 1)))]
    return [n.question for n in needles]


def _messages(data: NeedleData, doc: str, question: str) -> list[dict]:
    return [{"role": "system", "content": data.system},
            {"role": "user", "content": data.user.format(document=doc, question=question)}]


def _fill(length: int, kind: str, key: str, needles: Sequence[Needle], questions: list[str], others: list[str], *,
          data: NeedleData, filler: Sequence[str], counter: TokenCounter,
          blocks: list[tuple[int, str, int]]) -> tuple[str, list[str], list[int]]:
    """(document, text before each block, prompt tokens per question): filled up to, never over, `length`."""
    extra = [(f, counter.text(" " + f)) for f in others]
    fixed = max(counter.chat(_messages(data, "", q)) for q in questions) + sum(t for *_, t in blocks) + \
        sum(t for _, t in extra)
    budget = length - fixed
    if budget < 0:
        raise SettingError(f"length {length} is too short for {len(needles)} {kind} needles ({fixed} tokens "
                             "without filler)", setting="recall.lengths", fix=f"use lengths of at least {2 * fixed}, or fewer depths")
    sizes: dict[str, int] = {}
    for _ in range(8):  # token counts of joined sentences are nearly additive; trim until every prompt fits
        units = nd._units(filler, key, budget, [], counter, sizes)  # the same filler for every kind
        spot = random.Random(f"{key}:{kind}:place")
        for fact in extra:
            units.insert(spot.randint(0, len(units)), fact)
        doc, befores = place(units, blocks)
        tokens = [counter.chat(_messages(data, doc, q)) for q in questions]
        if max(tokens) <= length:
            return doc, befores, tokens
        budget -= max(tokens) - length
    raise QuantgateError(f"could not fit a {kind} haystack into {length} tokens", where="recall grid",
                         fix="report this: the tokenizer's counts are far from additive")


def build_haystack(length: int, depths: Sequence[int], kind: str, sample: int, *, seed: int, ask: Ask, data: NeedleData,
                   filler: Sequence[str], counter: TokenCounter, max_answer_tokens: int = 32) -> list[RecallPrompt]:
    """One haystack of about `length` chat tokens (never more) with a needle at each depth: one RecallPrompt per
    needle, whose request is its own question (turns) or the haystack's one question (together)."""
    depths = sorted(depths)
    key = f"quantgate-recall:{seed}:{length}:{sample}"
    needles, others, other_values = make_needles(kind, len(depths), random.Random(f"{key}:{kind}:needles"), data)
    questions = _questions(needles, ask, data)
    blocks = [(d, " ".join(n.facts), counter.text(" " + " ".join(n.facts))) for d, n in zip(depths, needles)]
    doc, befores, tokens = _fill(length, kind, key, needles, questions, others, data=data, filler=filler,
                                 counter=counter, blocks=blocks)
    messages = [_messages(data, doc, q) for q in questions]
    digest = hashlib.sha256(json.dumps(messages, ensure_ascii=False, sort_keys=True).encode()).hexdigest()[:10]
    hay = f"L{length}-{kind}-{sample}-{digest}"
    shared = counter.chat(_messages(data, doc, "")) - _HEADER_TOKENS
    caps = [nd.answer_cap(n.facts, max_answer_tokens, counter) for n in needles]
    out = []
    for i, ((depth, block, _), needle, before) in enumerate(zip(blocks, needles, befores)):
        start, needle_tokens, doc_tokens, target = nd._placement(doc, before, block, depth, kind,
                                                                 data.depth_tolerance_tokens, counter)
        q = 0 if ask == "together" else i
        out.append(RecallPrompt(
            id=f"{hay}-d{depth}", length=length, depth=depth, kind=kind, sample=sample, lang=needle.lang,
            messages=messages[q], expected=needle.expected,
            other_values=tuple(v for m in needles if m is not needle for v in m.expected) + tuple(other_values),
            prompt_tokens=tokens[q], doc_tokens=doc_tokens, needle_tokens=needle_tokens, needle_token_start=start,
            target_token_start=target, request=f"{hay}-all" if ask == "together" else f"{hay}-d{depth}", haystack=hay,
            max_tokens=sum(caps) + 2 * len(caps) if ask == "together" else caps[i], shared_tokens=shared))
    return out


def build_grid(lengths: Sequence[int], depths: Sequence[int], kinds: Sequence[str], samples: int, *, seed: int,
               ask: Ask, data: NeedleData, filler: Sequence[str], counter: TokenCounter,
               max_answer_tokens: int = 32) -> list[RecallPrompt]:
    """Every needle of the grid in the given layout (module docstring), one RecallPrompt per needle."""
    if ask not in ASK:
        raise QuantgateError(f"unknown layout {ask!r}", where="ask", fix=f"use one of: {', '.join(ASK)}")
    if len(set(depths)) != len(depths):
        raise QuantgateError(f"repeated depths: {list(depths)}", where="depths", fix="give each depth once")
    kw: dict[str, Any] = dict(seed=seed, data=data, filler=filler, counter=counter, max_answer_tokens=max_answer_tokens)
    if ask == "single":
        return nd.build_grid(lengths, depths, kinds, samples, **kw)
    return [p for n in lengths for k in kinds for i in range(samples)
            for p in build_haystack(n, depths, k, i, ask=ask, **kw)]


def cost(prompts: Sequence[RecallPrompt]) -> dict:
    """What a grid costs a server: cells, haystacks, requests, needles (observations), prompt tokens sent, and the
    prompt tokens a prefix cache leaves to compute (each haystack's shared prefix once; an estimate)."""
    requests = {p.request: p for p in prompts}
    first: dict[str, str] = {}
    for p in requests.values():
        first.setdefault(p.haystack, p.request)
    computed = sum(p.prompt_tokens if first[p.haystack] == r else p.prompt_tokens - p.shared_tokens
                   for r, p in requests.items())
    return {"cells": len({(p.length, p.depth, p.kind) for p in prompts}), "haystacks": len(first),
            "requests": len(requests), "needles": len(prompts),
            "prompt_tokens": sum(p.prompt_tokens for p in requests.values()), "prompt_tokens_computed": computed,
            "max_answer_tokens": sum(p.max_tokens for p in requests.values())}
