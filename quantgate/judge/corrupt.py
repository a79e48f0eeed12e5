"""Known-answer pairs for judge calibration, pure: a sample's reference against a corrupted copy of it.

Corruptions (each deterministic for a seed; a type that does not fit a reference returns None):
  number    one number in the reference changed (e.g. 1653 -> 1658)
  name      one proper noun swapped for another proper noun found in the eval set's references
  truncate  cut to its first half (words, or characters for a single word)
  language  for samples that ask for a translation: the untranslated source text from the prompt
Settings live in judges/calibration.yaml.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from quantgate.judge.core import PairItem

TYPES = ("number", "name", "truncate", "language")
NUMBER = re.compile(r"\d+(?:\.\d+)?")
CAPWORD = re.compile(r"\b[A-Z][a-z]+(?:-[A-Z][a-z]+)?\b")


class CalibrationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seed: int = 0
    per_type: int = Field(default=10, ge=1)
    bar: float = Field(default=0.8, ge=0.0, le=1.0)
    types: list[str] = Field(default_factory=lambda: list(TYPES))
    language_categories: list[str] = Field(default_factory=lambda: ["multilingual"])

    def model_post_init(self, _) -> None:
        bad = [t for t in self.types if t not in TYPES]
        if bad:
            raise ValueError(f"unknown corruption type(s) {bad}; known: {', '.join(TYPES)}")


def _rng(seed: int, *parts: str) -> random.Random:
    return random.Random(zlib.crc32("\x1f".join([str(seed), *parts]).encode()))


def change_number(ref: str, rng: random.Random) -> str | None:
    found = list(NUMBER.finditer(ref))
    if not found:
        return None
    m = rng.choice(found)
    text = m.group()
    if "." in text:
        new = f"{float(text) + rng.randint(1, 9):.{len(text.split('.')[1])}f}"
    else:
        new = str(int(text) + rng.choice([-1, 1]) * rng.randint(1, 9))
        if new.startswith("-") or new == text:
            new = str(int(text) + rng.randint(1, 9))
    return ref[:m.start()] + new + ref[m.end():]


def proper_nouns(ref: str) -> list[re.Match]:
    """Capitalized words that are names: not the first word of a sentence, unless the whole reference is a name."""
    words = ref.split()
    if words and len(words) <= 3 and all(CAPWORD.fullmatch(w.strip(".,!?")) for w in words):
        return list(CAPWORD.finditer(ref))
    out = []
    for m in CAPWORD.finditer(ref):
        before = ref[:m.start()].rstrip()
        if before and before[-1] not in ".!?:":
            out.append(m)
    return out


def swap_name(ref: str, pool: Sequence[str], rng: random.Random) -> str | None:
    found = proper_nouns(ref)
    if not found:
        return None
    m = rng.choice(found)
    choices = sorted({p for p in pool if p != m.group() and p.lower() != m.group().lower()})
    if not choices:
        return None
    return ref[:m.start()] + rng.choice(choices) + ref[m.end():]


def truncate(ref: str) -> str | None:
    words = ref.split()
    if len(words) >= 2:
        return " ".join(words[: max(1, len(words) // 2)])
    if len(ref.strip()) >= 3:
        return ref.strip()[: len(ref.strip()) // 2]
    return None


def untranslated(prompt: str, ref: str) -> str | None:
    """The text a translation prompt quotes (after the last ': ' of its last line), if it differs from the reference."""
    last = prompt.strip().splitlines()[-1] if prompt.strip() else ""
    if ": " not in last:
        return None
    source = last.rsplit(": ", 1)[1].strip()
    return source if source and source.casefold() != ref.strip().casefold() else None


def corrupt(kind: str, ref: str, *, prompt: str, category: str, pool: Sequence[str], cfg: CalibrationConfig,
            rng: random.Random) -> str | None:
    if kind == "number":
        return change_number(ref, rng)
    if kind == "name":
        return swap_name(ref, pool, rng)
    if kind == "truncate":
        return truncate(ref)
    if kind == "language":
        return untranslated(prompt, ref) if category in cfg.language_categories else None
    raise ValueError(f"unknown corruption type {kind!r}")


def calibration_pairs(samples: Sequence, cfg: CalibrationConfig) -> list[PairItem]:
    """Up to `per_type` pairs per corruption type, samples drawn in a seeded order, each sample used at most once.

    `samples` are eval-set samples (id, category, references, criteria, prompt_text())."""
    pool = sorted({m.group() for s in samples for m in proper_nouns(s.references[0])})
    order = sorted(samples, key=lambda s: _rng(cfg.seed, "order", s.id).random())
    used: set[str] = set()
    out: list[PairItem] = []
    for _ in range(cfg.per_type):  # round-robin over the types, so that early types do not take every sample
        for kind in cfg.types:
            for s in order:
                if s.id in used:
                    continue
                ref = s.references[0]
                bad = corrupt(kind, ref, prompt=s.prompt_text(), category=s.category, pool=pool, cfg=cfg,
                              rng=_rng(cfg.seed, kind, s.id))
                if bad is None or bad.strip() == ref.strip():
                    continue
                used.add(s.id)
                out.append(PairItem(pair_id=f"cal:{kind}:{s.id}", category=s.category, question=s.prompt_text(),
                                    first=ref, second=bad, reference=ref, criteria=s.criteria, kind="calibration",
                                    corruption=kind))
                break
    return out
