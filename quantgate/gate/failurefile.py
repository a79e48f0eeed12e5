"""The typed form of `<run>/<candidate>/error.json`: why a candidate's measurement failed, which the gate turns into a
failed `serving` check. Two places record one (the local flow when the candidate's vLLM server could not start or
died, quantgate.release.variants.failed_evidence; the work-pools parent when the child flow run measuring it did not
finish, quantgate.pools.executor), both through `CandidateError.write`; the gate reads it with
`load_candidate_error`, and turns it into its `serving` check (`serving_failure`, `with_failure`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.fileio import write_json
from quantgate.base.runfiles import ERROR
from quantgate.base.typedfile import RunFileError, read_model
from quantgate.gate.models import Check, Decision
from quantgate.serving.logcause import root_cause

CANDIDATE_ERROR = ERROR  # <run>/<candidate>/error.json


class CandidateError(BaseModel):
    model_config = ConfigDict(extra="allow")  # a newer writer's field does not make the record unreadable

    schema_version: Literal[1] = 1
    candidate: str
    step: Literal["serve and measure"] = "serve and measure"
    phase: str = Field(description="start: the server never answered; measure: it stopped answering (or the run "
                                   "measuring it ended) part way")
    error: str = Field(description="one line: the reason the gate gives")
    detail: str = Field(description="the whole error, as raised")
    server_log: str | None = None
    log_tail: list[str] = Field(default_factory=list, description="the server log's last lines")
    root_cause: str | None = Field(None, description="the log's last exception that is not a wrapper's, read from the "
                                                     "whole log (quantgate.serving.logcause): vLLM's engine error sits "
                                                     "above the API server's traceback, often outside the tail")
    flow_run: str | None = Field(None, description="work pools: the child flow run that did not finish")

    def write(self, folder: Path) -> Path:
        path = folder / CANDIDATE_ERROR
        write_json(path, self.model_dump(mode="json", exclude_none=True))
        return path

    def last_error_line(self) -> str | None:
        """The root cause a reader looks for first: the log tail's last exception that is not a wrapper's
        (quantgate.serving.logcause), else its last line that names an error, if any."""
        return self.root_cause or root_cause("\n".join(self.log_tail)) or next(
            (ln.strip() for ln in reversed(self.log_tail) if "Error" in ln or "error" in ln), None)


def load_candidate_error(path: Path) -> CandidateError:
    return read_model(path, CandidateError, "candidate error record",
                      fix="it is written by the release when a candidate's measurement fails; re-run the release")


def serving_failure(run: Path | str, candidate: str) -> Check | None:
    """The failed `serving` check of a candidate whose server could not start or died (<run>/<candidate>/error.json,
    written by quantgate.release.variants.failed_evidence); None when there is no such file."""
    path = Path(run) / candidate / CANDIDATE_ERROR
    if not path.is_file():
        return None
    try:
        err = load_candidate_error(path)
        reason, phase, last = err.error, err.phase or "unknown", err.last_error_line()
    except RunFileError as exc:
        reason, phase, last = f"the candidate failed, and its error record is unreadable: {exc.message}", "unknown", None
    return Check(name="serving", measured=phase, limit="serves", required=True, outcome="fail", evidence_file=str(path),
                 reason=reason + (f" (log: {last})" if last and last not in reason else ""))


def with_failure(decision: Decision, failed: Check) -> Decision:
    """REJECT: the serving check first, its reason first; the other checks stay as the evidence made them."""
    checks = [failed, *decision.checks]
    reasons = [f"{c.name}: {c.reason}" for c in checks if c.outcome == "fail"]
    return decision.model_copy(update={"decision": "REJECT", "checks": checks, "reasons": reasons, "needs": None})
