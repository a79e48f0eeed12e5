"""The typed form of a release's fidelity comparison files: `<run>/fidelity/<candidate>.json` (the candidate against
the baseline) and `<run>/fidelity/floor.json` (the baseline against itself on another execution path, the noise
floor). quantgate.release.fidelity_step writes them through `FidelityRecord.write`; the gate
(quantgate.gate.evidence) and the MLflow export read them through `load_fidelity_record`.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.fileio import write_json
from quantgate.base.typedfile import read_model
from quantgate.fidelity.core import FidelitySummary, SampleFidelity

TOPK = "topk"  # the estimator of a record that names none (written before the sampled estimator existed)


class SubsetDraw(BaseModel):
    """How the compared prompts were drawn (quantgate.base.subsets): the rule, its seed, and the prompt ids in draw
    order (a subset of size L, or a look at L samples, reads the first L)."""
    model_config = ConfigDict(extra="forbid")

    rule: str
    seed: int
    order: list[str]


POOLED = "pooled"  # a streaming look's scope when it judged the pooled checks


class StreamLook(BaseModel):
    """The streaming look at which a candidate's fidelity REJECT was decided (quantgate.gate.stream): the first `n`
    prompts of `total` in the stream order (`SubsetDraw.order`; for a slice's look, that order within the slice),
    judged at this look's share `alpha` of the policy's fidelity alpha (one-sided; `spent`: this look's and every
    earlier one's of the same scope)."""
    model_config = ConfigDict(extra="forbid")

    scope: str = Field(POOLED, description="what the look judged: the pooled checks on a prefix of the whole stream, "
                       "or one slice's (a category or context length) on a prefix of that slice's own order")
    index: int = Field(ge=1, description="this look, of the `of` planned before the full sample")
    of: int = Field(ge=1)
    n: int = Field(ge=1, description="prompts read: a prefix of the stream order (of the slice's, for a slice)")
    total: int = Field(ge=1, description="prompts the full sample holds (the slice's, for a slice)")
    alpha: float = Field(gt=0, lt=0.5)
    spent: float = Field(gt=0, lt=0.5)
    by_category: dict[str, int] = Field(default_factory=dict, description="slice -> prompts read at this look")
    elapsed_s: float | None = Field(None, description="seconds from the release's start to this look")
    scored_tokens: int | None = Field(None, description="the candidate's scored tokens in the look")


class FidelityRecord(BaseModel):
    """A fidelity comparison: its summary, the KL estimator, the per-sample sums the gate bounds, and the dump
    folders it was computed from. Fields in the file's order; a newer writer's keys are kept."""
    model_config = ConfigDict(extra="allow")

    summary: FidelitySummary = Field(description="pooled means with intervals, by category, worst samples")
    estimator: str | None = Field(None, description="what the KL figures estimate (None: top-k, an older file)")
    samples: list[SampleFidelity] = Field(description="one per prompt, its draws merged")
    dumps: dict[str, str] = Field(default_factory=dict, description="path name -> the dump folder compared")
    draw: SubsetDraw | None = Field(None, description="how the prompts were drawn (None: a file from before the "
                                    "seeded draw)")

    stream: StreamLook | None = Field(None, description="set when a streaming look decided the REJECT: the samples "
                                      "are that look's prefix, judged at its share of alpha")

    @property
    def kl_estimator(self) -> str:
        return self.estimator or TOPK

    def write(self, path: Path) -> None:
        """Every field, None included (but `stream`: only a look's record has one), in the file's order (quantgate.base.fileio.write_json)."""
        write_json(path, self.model_dump(mode="json", exclude={"stream"} if self.stream is None else None))


def load_fidelity_record(path: Path | str) -> FidelityRecord:
    """A fidelity comparison file, validated; RunFileError naming the file and field when it does not fit."""
    return read_model(path, FidelityRecord, "fidelity record",
                      "re-run the release (its fidelity step rewrites the comparison from the cached dumps)")
