"""How a release tells Prefect its decision (adapter): one event per candidate and the flow run's final state.

- **The event** `quantgate.release.decided`, emitted for every candidate the gate decided (Prefect's event system:
  an Automation can trigger on it, e.g. post to a channel on a REJECT or start a deployment on a PROMOTE):

      resource  prefect.resource.id   quantgate.release.<release>.<candidate>
                prefect.resource.name <candidate>
                quantgate.release, quantgate.run, quantgate.candidate, quantgate.decision
      payload   decision, scheme, run, reasons, failing (the checks that failed or stayed inconclusive), figures
                (every check's measured value, limit and outcome)

  An Automation matches it with `{"match": {"prefect.resource.id": "quantgate.release.*"}, "expect":
  ["quantgate.release.decided"]}` (README, "Running it from a Prefect server").
- **The state**: a flow run that promotes nothing ends Failed, named "Rejected" or "Inconclusive" ("Publish
  failed" for a promotion that did not all go out). A Failed state's data must be an exception for Prefect (a plain
  value makes it log `TypeError: Unexpected result for failed state`): `NotPromoted` carries the summary, so
  `quantgate release` reads the same summary from either state (`summary_of`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quantgate.gate.models import Decision

EVENT = "quantgate.release.decided"


class NotPromoted(Exception):
    """The data of a release flow run that ends Failed: the run's summary (summary.json), picklable."""

    def __init__(self, message: str, summary: dict[str, Any]) -> None:
        super().__init__(message)
        self.summary = summary

    def __reduce__(self) -> tuple[Any, ...]:
        return (NotPromoted, (self.args[0], self.summary))


def summary_of(result: object) -> dict[str, Any] | None:
    """The summary a release flow run returned: its Completed value, or the NotPromoted of a Failed one."""
    if isinstance(result, NotPromoted):
        return result.summary
    return result if isinstance(result, dict) else None


def decided_event(release: str, run: Path, d: Decision) -> dict[str, Any]:
    """emit_event's arguments for one decision (the module docstring)."""
    failing = [c.name for c in d.checks if c.outcome in ("fail", "inconclusive")]
    return {
        "event": EVENT,
        "resource": {"prefect.resource.id": f"quantgate.release.{release}.{d.candidate}",
                     "prefect.resource.name": d.candidate, "quantgate.release": release, "quantgate.run": run.name,
                     "quantgate.candidate": d.candidate, "quantgate.decision": d.decision},
        "payload": {"decision": d.decision, "candidate": d.candidate, "scheme": d.scheme, "run": str(run),
                    "reasons": d.reasons, "failing": failing,
                    "figures": {c.name: {"measured": c.measured, "limit": c.limit, "outcome": c.outcome}
                                for c in d.checks}},
    }


def emit_decisions(release: str, run: Path, decisions: list[Decision]) -> int:
    """One `quantgate.release.decided` event per decision; returns how many Prefect accepted (emit_event gives
    None where events are off, e.g. no API to send them to). Prefect is imported here, not at the top: the CLI
    imports this module for summary_of and must not load Prefect for its other commands."""
    from prefect.events import emit_event

    return sum(emit_event(**decided_event(release, run, d)) is not None for d in decisions)


__all__ = ["EVENT", "NotPromoted", "decided_event", "emit_decisions", "summary_of"]
