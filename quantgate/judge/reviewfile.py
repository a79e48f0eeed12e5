"""The blinded human review's two files (quantgate.judge.review):

- `review_key.json` (`ReviewKey`): which pair each review id is and which side answer A shows; written by
  `export_review`, read by `load_key` (`quantgate review import`, `quantgate check --review-key`). Kept from reviewers.
- `human.json` (`HumanReview`): the human win/tie/loss rates and agreement with the judge; written by `import_review`
  into the judge directory (the same dict goes into report.json's `human`).

Both are written with every field set, in this order; keys a newer writer adds are kept.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.fileio import write_json
from quantgate.base.typedfile import SetFields
from quantgate.judge.reportfile import Rate

_OPEN = ConfigDict(extra="allow")


class ReviewItem(BaseModel):
    """One review id: the judged pair it is, and which side answer A shows."""
    model_config = _OPEN

    pair_id: str
    a: Literal["baseline", "candidate"]


class ReviewKey(SetFields):
    """<judge-dir>/review_key.json (or where `--key` put it)."""

    schema_: int | None = Field(None, alias="schema")
    seed: int | None = Field(None, description="the seed of the sample and of the A/B order")
    items: dict[str, ReviewItem] = Field(description="review id -> pair and side shown as A")
    pairs_sha256: str | None = Field(None, description="the pairs.jsonl the sample was drawn from")

    def write(self, path: Path) -> None:
        """As json.dumps(indent=2) writes it (non-ASCII escaped), with a final newline."""
        path.write_text(json.dumps(self.dump(), indent=2) + "\n",
                        encoding="utf-8")


class HumanJudgeAgreement(BaseModel):
    """How often the human and the judge preferred the same side, over the pairs both decided."""
    model_config = _OPEN

    n: int = 0
    agree: int = 0
    rate: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None


class HumanRates(BaseModel):
    """The candidate's win, tie and loss rates as the reviewers saw them."""
    model_config = _OPEN

    win: Rate = Field(default_factory=Rate)
    tie: Rate = Field(default_factory=Rate)
    loss: Rate = Field(default_factory=Rate)


class HumanReview(BaseModel):
    """<judge-dir>/human.json."""
    model_config = _OPEN

    n_exported: int = Field(0, description="rows in the key")
    n_reviewed: int = Field(0, description="rows with a choice")
    n_blank: int = Field(0, description="rows left blank")
    rates: HumanRates = Field(default_factory=HumanRates)
    agreement: HumanJudgeAgreement = Field(default_factory=HumanJudgeAgreement)

    def dump(self) -> dict[str, object]:
        """The file's content (NaN rates stay NaN, as json.dumps writes them)."""
        return self.model_dump()

    def write(self, path: Path) -> None:
        write_json(path, self.dump())
