"""How a release tells Prefect its decision (adapter): one event per candidate and the flow run's final state.

- **The event** `quantgate.release.decided`, emitted for every candidate the gate decided (Prefect's event system:
  an Automation can trigger on it, e.g. post to a channel on a REJECT or start a deployment on a PROMOTE):

      resource  prefect.resource.id   quantgate.release.<release>.<candidate>
                prefect.resource.name <candidate>
                quantgate.release, quantgate.run, quantgate.candidate, quantgate.decision
      payload   decision, scheme, run, reasons, failing (the checks that failed or stayed inconclusive), figures
                (every check's measured value, limit and outcome)

  An Automation matches it with `{"match": {"prefect.resource.id": "quantgate.release.*"}, "expect":
  ["quantgate.release.decided"]}` (docs/prefect.md, "The decision as an event").
- **The artifacts**, beside the report's markdown: a link to `<run>/report.html` and a table of every candidate's
  checks (candidate, check, outcome, measured, limit, reason), which the Prefect UI shows on the flow run.
- **The state**: a flow run that promotes nothing ends, by the flow's `not_promoted` parameter (`EndAs`):
  - `failed` (the default): Failed, named "Rejected" or "Inconclusive". A failed-run notification fires and
    `prefect deployment run --watch` exits non-zero; Prefect's engine logs the exception once, with its traceback
    (it re-raises a Failed run's data in the worker's subprocess), and its message opens with the decision and the
    deciding checks in one line (`headline`). A Failed state's data must be an exception for Prefect (a plain value
    makes it log `TypeError: Unexpected result for failed state`): `NotPromoted` carries the summary;
  - `completed`: Completed, named "Rejected" or "Inconclusive", its data the summary: no ERROR line and no
    traceback in the worker's log (a decided outcome is a result), `--watch` exits 0, and a pipeline branches on
    the result, the `quantgate.release.decided` event or the artifacts.
  "Publish failed" (a promotion that did not all go out) is Failed in both. `quantgate release` reads the same
  summary from any of these states (`summary_of`) and exits by the decision (3, 4).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from quantgate.base.runfiles import REPORT_HTML
from quantgate.gate.models import Decision

EVENT = "quantgate.release.decided"
EndAs = Literal["failed", "completed"]  # how a decided REJECT / INCONCLUSIVE ends the flow run (module docstring)


class NotPromoted(Exception):
    """The data of a release flow run that ends Failed: the run's summary (summary.json), picklable."""

    def __init__(self, message: str, summary: dict[str, object]) -> None:
        super().__init__(message)
        self.summary = summary

    def __reduce__(self) -> tuple[Any, ...]:
        return (NotPromoted, (self.args[0], self.summary))


def summary_of(result: object) -> dict[str, object] | None:
    """The summary a release flow run returned: its Completed value, or the NotPromoted of a Failed one."""
    if isinstance(result, NotPromoted):
        return result.summary
    return result if isinstance(result, dict) else None


def headline(decision: str, decisions: list[Decision]) -> str:
    """The decision and each candidate's, with the deciding checks, one line: 'REJECT: int8-w8a8 REJECT by
    fidelity:kl, fidelity:top1, fidelity:kl:multilingual and 7 more' (the failed checks of a REJECT, the inconclusive
    ones of an INCONCLUSIVE; a PROMOTE has none)."""
    parts = []
    for d in decisions:
        deciding = [] if d.promoted else [c.name for c in d.checks
                                          if c.outcome == ("fail" if d.decision == "REJECT" else "inconclusive")]
        more = f" and {len(deciding) - 3} more" if len(deciding) > 3 else ""
        parts.append(f"{d.candidate} {d.decision}" + (f" by {', '.join(deciding[:3])}{more}" if deciding else ""))
    return f"{decision}: {'; '.join(parts)}"


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


def artifact_key(release: str, part: str = "") -> str:
    """A Prefect artifact key for the release: lowercase letters, digits and dashes only (Prefect refuses any other
    key, and a spec name may hold capitals, dots and underscores)."""
    return re.sub(r"[^a-z0-9-]+", "-", f"release-{release}{'-' + part if part else ''}".lower()).strip("-")


def check_rows(decisions: list[Decision]) -> list[dict[str, str | float | None]]:
    """One table row per check of every decision, for the flow run's table artifact."""
    return [{"candidate": d.candidate, "decision": d.decision, "check": c.name, "outcome": c.outcome,
             "measured": c.measured, "limit": c.limit, "reason": c.reason} for d in decisions for c in d.checks]


def create_artifacts(release: str, run: Path, decisions: list[Decision]) -> None:
    """The link to the report and the checks' table (the module docstring); Prefect imported here, as above."""
    from prefect.artifacts import create_link_artifact, create_table_artifact

    create_link_artifact(key=artifact_key(release, "report"), link=(run / REPORT_HTML).resolve().as_uri(),
                         link_text=f"{release}: report.html of run {run.name}",
                         description=f"quantgate release {release}, run {run.name}: the full report")
    if decisions:
        create_table_artifact(key=artifact_key(release, "checks"), table=check_rows(decisions),
                              description=f"quantgate release {release}, run {run.name}: every check of every "
                                          "candidate (decision.json has their evidence files)")


__all__ = ["EVENT", "EndAs", "NotPromoted", "artifact_key", "check_rows", "create_artifacts", "decided_event", "emit_decisions", "headline", "summary_of"]
