"""The typed form of `<run>/<repaired candidate>/repair.json`: which decoder layers a repair keeps at 16 bits and
why. Written once by the release's repair rung (quantgate.release.repair_step) before it quantizes the repaired
candidate; the gate reads it (`repair_note`) so that the repaired candidate's decision says what was kept, and the
report and the model card show it.

A repair is chosen on the baseline's own sampled continuations of a few prompts per failing slice (the ranking
prompts). Those prompts are held out of the repaired candidate's fidelity sample, so the choice does not flatter
its gate; and the repaired candidate is judged at its share of the fidelity alpha (`alpha`), the rejected one at
the rest, so that the two looks together promote a candidate at its limit at most alpha of the time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.fileio import write_json
from quantgate.base.runfiles import REPAIR
from quantgate.base.typedfile import read_model
from quantgate.gate.models import KeptLayer, RepairNote


class LayerRanking(BaseModel):
    """How the layers were ranked: on which prompts, at what cost, and what each layer removes."""
    model_config = ConfigDict(extra="forbid")

    prompts: list[str] = Field(description="prompt ids ranked on (every draw of each); held out of the repair's gate")
    per_slice: int
    sequences: int
    scored_tokens: int
    before: dict[str, float] = Field(description="each slice's KL of the rejected candidate on these prompts")
    before_top1: dict[str, float] = Field(description="and its top-1 agreement")
    gains: dict[str, list[float]] = Field(description="slice -> per decoder layer: the KL keeping it alone removes")
    order: list[int] = Field(description="the layers by the failing limits' share they remove, largest first")
    tried: dict[int, dict[str, float]] = Field(description="k -> each slice's KL with the first k layers kept together")
    tried_top1: dict[int, dict[str, float]] = Field(description="k -> each slice's top-1 agreement with them kept")
    truth_s: float
    sets_s: float


class RepairRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = 1
    candidate: str = Field(description="the repaired candidate: <scheme>-repaired")
    repairs: str = Field(description="the candidate the gate REJECTed by fidelity")
    scheme: str
    failing: dict[str, float] = Field(description="the slices the repair must bring within (and `pooled`) -> KL limit")
    kept: list[KeptLayer]
    min_top1: dict[str, float] = Field(description="slice -> the least top-1 agreement its check allows")
    measured: dict[str, float] = Field(description="each slice's KL with the kept layers, on the ranking prompts")
    measured_top1: dict[str, float] = Field(description="and each slice's top-1 agreement")
    passes: bool = Field(description="whether `measured` is within margin x limit in every slice of `failing`, and "
                                     "the top-1 disagreement within margin x what `min_top1` allows")
    margin: float
    added_size: float = Field(description="bytes the kept layers add, as a share of the rejected candidate's")
    alpha: float = Field(description="the repaired candidate's share of the policy's fidelity alpha")
    ranking: LayerRanking

    def write(self, folder: Path) -> Path:
        path = folder / REPAIR
        write_json(path, self.model_dump(mode="json"))
        return path

    def note(self, path: Path) -> RepairNote:
        return RepairNote(repairs=self.repairs, kept=self.kept, added_size=self.added_size,
                          held_out=len(self.ranking.prompts), alpha=self.alpha, file=str(path))


def load_repair(path: Path) -> RepairRecord:
    return read_model(path, RepairRecord, "repair record",
                      fix="it is written by the release's repair rung before it quantizes; re-run the release")


def repair_note(run: Path | str, candidate: str) -> RepairNote | None:
    """What a repaired candidate keeps at 16 bits, for its decision; None for a candidate that is no repair."""
    path = Path(run) / candidate / REPAIR
    return load_repair(path).note(path) if path.is_file() else None


__all__ = ["LayerRanking", "RepairRecord", "load_repair", "repair_note"]
