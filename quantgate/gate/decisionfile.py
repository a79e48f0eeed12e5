"""The decision files of a gated run (adapter): <run>/decision.json with every candidate's decision, each
candidate's own <run>/<candidate>/decision.json, and the run's overall verdict. `quantgate gate`
(quantgate.gate.evidence.gate_run) and the release's last gate (quantgate.release.steps.record_decisions) write them."""

from __future__ import annotations

import datetime as dt
import hashlib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.fileio import write_json
from quantgate.base.runfiles import DECISION
from quantgate.base.typedfile import read_model
from quantgate.gate.models import Decision


def policy_ref(path: Path | str) -> dict[str, str]:
    """How a decision names its policy: the file and its sha256."""
    path = Path(path)
    return {"file": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def overall(verdicts: list[str]) -> str:
    """A run's decision from its candidates': PROMOTE when one was promoted, else INCONCLUSIVE when one could not be
    decided (more evidence might promote it), else REJECT."""
    if "PROMOTE" in verdicts:
        return "PROMOTE"
    return "INCONCLUSIVE" if "INCONCLUSIVE" in verdicts else "REJECT"


class RunDecision(BaseModel):
    """<run>/decision.json: the run's verdict and every candidate's decision (a ladder's rungs too, when it has one)."""
    model_config = ConfigDict(extra="allow")  # a newer writer's field does not make the file unreadable

    schema_version: int = Field(description="the candidates' Decision schema")
    decision: str = Field(description="PROMOTE, INCONCLUSIVE or REJECT: overall() of the candidates'")
    promoted: str | None = Field(description="the first promoted candidate, in the given order")
    run: str
    policy: dict[str, str | int] | None
    created: str
    candidates: dict[str, Decision]
    ladder: list[dict[str, object]] | None = Field(None, description="with `ladder: true`: every rung, tried or not")

    def write(self, path: Path) -> None:
        doc = self.model_dump(mode="json")  # the candidates' decisions whole (unset defaults included)
        if self.ladder is None:
            del doc["ladder"]
        write_json(path, doc)


def load_run_decision(path: Path | str) -> RunDecision:
    return read_model(path, RunDecision, "gate decision", fix="it is written by the gate; re-run `quantgate gate` "
                      "or the release")


def write_decision(run: Path | str, decisions: list[Decision], out: Path | str | None = None, *,
                   ladder: list[dict] | None = None) -> Path:
    """Write <run>/decision.json (or `out`): PROMOTE when some candidate is promoted (the first, in the given order),
    with every candidate's checks (and a ladder's rungs, `ladder`); and each candidate's own decision in
    <run>/<candidate>/decision.json."""
    run = Path(run)
    promoted = next((d.candidate for d in decisions if d.promoted), None)
    doc = RunDecision(schema_version=decisions[0].schema_version if decisions else 1,
                      decision=overall([d.decision for d in decisions]), promoted=promoted, run=str(run),
                      policy=decisions[0].policy if decisions else None,
                      created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                      candidates={d.candidate: d for d in decisions})
    if ladder is not None:
        doc.ladder = ladder
    target = Path(out) if out else run / DECISION
    doc.write(target)
    if out is None:
        for d in decisions:
            if (run / d.candidate).is_dir():
                write_json(run / d.candidate / DECISION, d.model_dump(mode="json"))
    return target
