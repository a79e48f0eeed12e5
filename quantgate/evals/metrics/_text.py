"""Pure scoring functions behind the metric modules: normalization, tokens, LCS, number and choice extraction.

No I/O and no third-party imports, so the rules are unit-tested directly and the `evaluate` modules stay thin.
Every per-pair function returns a float in [0, 1]; `best` takes the maximum over several references.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
# one token per CJK character (Han, Hiragana, Katakana, Hangul), otherwise runs of word characters
_TOKEN = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]|[^\W_]+")
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]")
# a number: optional sign (not glued to a word or a preceding number), thousands groups or plain digits, decimals
_NUMBER = re.compile(r"(?<![\w.,])[-\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\w.])[-\u2212]?\.\d+")


def _strip_punct(text: str) -> str:
    return "".join(" " if unicodedata.category(ch).startswith(("P", "S")) else ch for ch in text)


def normalize(text: str, *, drop_articles: bool = True) -> str:
    """NFKC, lower case, punctuation and symbols to spaces, English articles dropped, whitespace collapsed."""
    text = _strip_punct(unicodedata.normalize("NFKC", text).lower())
    if drop_articles:
        text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def tokens(text: str, *, drop_articles: bool = True) -> list[str]:
    """Normalized word tokens; each CJK character is a token of its own."""
    return _TOKEN.findall(normalize(text, drop_articles=drop_articles))


def has_cjk(text: str) -> bool:
    return bool(_CJK.search(text))


def exact_match(pred: str, ref: str) -> float:
    return float(normalize(pred) == normalize(ref))


def contains(pred: str, ref: str) -> float:
    """1 when the normalized reference appears in the normalized prediction as whole tokens (substring for CJK)."""
    if has_cjk(ref):
        return float(normalize(ref).replace(" ", "") in normalize(pred).replace(" ", ""))
    want = " ".join(tokens(ref))
    return float(bool(want) and f" {want} " in f" {' '.join(tokens(pred))} ")


def token_f1(pred: str, ref: str) -> float:
    """Harmonic mean of token precision and recall over the multiset of normalized tokens."""
    p, r = tokens(pred), tokens(ref)
    if not p or not r:
        return float(p == r)
    same = sum((Counter(p) & Counter(r)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(r)
    return 2 * precision * recall / (precision + recall)


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence (dynamic programming, one row kept)."""
    if len(a) < len(b):
        a, b = b, a
    row = [0] * (len(b) + 1)
    for x in a:
        prev_diag = 0
        for j, y in enumerate(b, start=1):
            keep = row[j]
            row[j] = prev_diag + 1 if x == y else max(row[j], row[j - 1])
            prev_diag = keep
    return row[-1]


def rouge_l(pred: str, ref: str, beta: float = 1.0) -> float:
    """ROUGE-L F-measure on tokens (articles kept): LCS-based precision and recall."""
    p, r = tokens(pred, drop_articles=False), tokens(ref, drop_articles=False)
    if not p or not r:
        return float(p == r)
    lcs = lcs_length(p, r)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(p), lcs / len(r)
    return (1 + beta**2) * precision * recall / (recall + beta**2 * precision)


def numbers(text: str) -> list[float]:
    """Numbers in reading order; '1,234.5' is 1234.5, the Unicode minus counts as a sign."""
    found = []
    for m in _NUMBER.finditer(text):
        found.append(float(m.group().replace(",", "").replace("\u2212", "-")))
    return found


def numeric_match(pred: str, ref: str, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> float:
    """1 when the LAST number in the prediction equals the reference's number within tolerance."""
    got, want = numbers(pred), numbers(ref)
    if not got or not want:
        return 0.0
    return float(math.isclose(got[-1], want[0], rel_tol=rel_tol, abs_tol=abs_tol))


def choice_letter(text: str, letters: str = "ABCDEFGH") -> str | None:
    """The choice letter a reply gives, or None. Tried in order: the whole reply is one letter (any case);
    it starts with 'B)', 'B.', 'B:' or '(B)'; 'answer is B' / 'answer: B'; the first '(B)' or 'B)' anywhere;
    a capital letter alone at the very end ('... so B.')."""
    cls = f"[{re.escape(letters)}]"
    stripped = text.strip()
    if re.fullmatch(rf"[\s(\[*]*({cls})[\s)\].*]*", stripped.upper()):
        found = re.search(cls, stripped.upper())
        assert found is not None  # the full match above holds one of the letters
        return found.group()
    for pattern in (
        rf"^[\s(\[*]*({cls})(?:[).:\]]|\s*$)",
        rf"(?i:answer)(?:\s+is)?\s*[:\-]?\s*[(\[*]*({cls})\b",
        rf"[(\[]({cls})[)\]]|\b({cls})\)",
        rf"(?<![\w'])({cls})[.!]?$",
    ):
        m = re.search(pattern, stripped)
        if m:
            return next(g for g in m.groups() if g).upper()
    return None


def choice_accuracy(pred: str, ref: str, letters: str = "ABCDEFGH") -> float:
    want = choice_letter(ref, letters)
    return float(want is not None and choice_letter(pred, letters) == want)


def best(fn: Callable[..., float], pred: str, refs: Sequence[str], **kwargs) -> float:
    """The best score of `pred` over the references (0.0 when there are none)."""
    return max((fn(pred, r, **kwargs) for r in refs), default=0.0)
