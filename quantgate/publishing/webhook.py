"""The decision webhook (adapter): after the gate, POST the decision as JSON to each `notify:` URL of the spec.

The body (`payload`, built from <run>/summary.json and <run>/decision.json):
    {"event": "quantgate.decision", "delivery": "<uuid>", "sent": "<UTC time>", "release": NAME, "run": RUN_ID,
     "decision": "PROMOTE" | "REJECT" | "INCONCLUSIVE", "promoted": [candidate, ...],
     "report": {"html": PATH, "markdown": PATH, "url": LINK | null},
     "candidates": {NAME: {"decision", "scheme", "reasons", "needs", "registry",
                           "scores": {"<set>/<metric>": {"n", "base_mean", "cand_mean", "delta", "ci_low", "ci_high"}},
                           "checks": [{"name", "outcome", "measured", "limit"}, ...]}},
     "publish": [the run's publish records]}
Headers: Content-Type application/json, X-Quantgate-Event, X-Quantgate-Delivery (the body's `delivery`, for
receivers that drop repeats), and with `secret_env` X-Quantgate-Signature-256: `sha256=<hex HMAC-SHA256 of the exact
body bytes under the secret>`. A receiver recomputes it over the raw body and compares in constant time.

Delivery goes through quantgate.base.http's client (post_json): one whole-request deadline per attempt, retries
with doubling delays on connection errors, timeouts, HTTP 5xx and 429. Any 2xx answer is delivered; other
statuses are not retried. Every outcome goes to <run>/notify.json (NotifyLog: url, status delivered | failed, attempts, HTTP
status, error); a failure is reported by the release (quantgate.publishing.publish), never raised here.
It is sent before the report is written (the summary, written once, holds its records), so the body's report
paths exist once the run has ended.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import hmac
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
from pydantic import Field

from quantgate.base.runfiles import DECISION, REPORT_HTML, REPORT_MD
from quantgate.base.http import Retry, post_json
from quantgate.base.typedfile import RunFileError
from quantgate.gate.decisionfile import load_run_decision
from quantgate.gate.summaryfile import NotifyRecord, Summary, as_json
from quantgate.publishing.publish import NOTIFY_FILE, NotifySpec, RecordLog

EVENT = "quantgate.decision"
SIGNATURE = "X-Quantgate-Signature-256"
SCORE_FIELDS = ("n", "base_mean", "cand_mean", "delta", "ci_low", "ci_high")


class NotifyLog(RecordLog):
    """<run>/notify.json: every webhook told of the run's decision, in the spec's order."""
    FILE = NOTIFY_FILE
    WHAT = ("notification records", "a release whose spec has `notify:` webhooks")

    records: list[NotifyRecord] = Field(default_factory=list)


def payload(summary: Mapping[str, Any], decision: Mapping[str, Any], run: Path, *, report_url: str | None,
            delivery: str, sent: str) -> dict[str, Any]:
    """The JSON body (module docstring) from the run's summary and decision documents (pure)."""
    decided = decision.get("candidates") or {}
    cands = {}
    for name, row in (summary.get("candidates") or {}).items():
        d = decided.get(name) or {}
        cands[name] = {"decision": row.get("decision"), "scheme": row.get("scheme"), "reasons": row.get("reasons", []),
                       "needs": d.get("needs"), "registry": row.get("registry"),
                       "scores": {m: {k: v.get(k) for k in SCORE_FIELDS} for m, v in (row.get("metrics") or {}).items()},
                       "checks": [{k: c.get(k) for k in ("name", "outcome", "measured", "limit")} for c in d.get("checks", [])]}
    return {"event": EVENT, "delivery": delivery, "sent": sent, "release": summary.get("release"),
            "run": summary.get("run"), "decision": summary.get("decision"), "promoted": summary.get("promoted", []),
            "report": {"html": str(run / REPORT_HTML), "markdown": str(run / REPORT_MD),
                       "url": report_url.replace("{run}", str(summary.get("run"))) if report_url else None},
            "candidates": cands, "publish": summary.get("publish", [])}


def signature(secret: str, body: bytes) -> str:
    """`sha256=<hex>`: HMAC-SHA256 of the body bytes under the secret."""
    return "sha256=" + hmac.new(secret.encode("utf-8"), body, hashlib.sha256).hexdigest()


class _Delivered(Exception):
    """A 2xx answer other than 200 (post_json hands every non-200 status to `fatal`)."""

    def __init__(self, status: int):
        self.status = status


def _fatal(status: int, text: str) -> BaseException | None:
    return _Delivered(status) if 200 <= status < 300 else None


async def _post(url: str, body: dict[str, Any], headers: dict[str, str], retry: Retry) -> tuple[int | None, Any]:
    async with httpx.AsyncClient(timeout=None, headers=headers) as client:
        try:
            answer = await post_json(client, url, body, retry, fatal=_fatal)
        except _Delivered as ok:
            return ok.status, None
    # a 200 is delivered whatever its body says; post_json reports a body that is not JSON as "malformed response"
    delivered = answer.ok or (answer.error or "").startswith("malformed response")
    return (200 if delivered else None), answer


def send(n: NotifySpec, body: dict[str, Any]) -> NotifyRecord:
    """POST one payload to one webhook, with retries; its record (never raises for the receiver's failures)."""
    # the exact bytes httpx sends for json=body: what the signature must cover
    raw = httpx.Request("POST", n.url, json=body).content
    headers = {"X-Quantgate-Event": EVENT, "X-Quantgate-Delivery": str(body.get("delivery"))}
    if n.secret_env:
        headers[SIGNATURE] = signature(os.environ.get(n.secret_env, ""), raw)
    retry = Retry(timeout_s=n.timeout_s, max_attempts=n.attempts, backoff_s=0.5, backoff_max_s=8.0)
    rec = {"url": n.url, "signed": bool(n.secret_env), "delivery": body.get("delivery")}
    try:
        status, answer = asyncio.run(_post(n.url, body, headers, retry))
    except Exception as exc:  # noqa: BLE001 - recorded: the release reports it
        return NotifyRecord(**rec, status="failed", error=f"{type(exc).__name__}: {exc}", attempts=None)
    if status is not None:
        return NotifyRecord(**rec, status="delivered", http_status=status, error=None,
                            attempts=answer.attempts if answer is not None else None)
    return NotifyRecord(**rec, status="failed", error=answer.error, attempts=answer.attempts)


def notify_run(notify: list[NotifySpec], run: Path, summary: Summary) -> list[NotifyRecord]:
    """Send the run's decision to every webhook; records in <run>/notify.json."""
    run = Path(run)
    try:
        decision = load_run_decision(run / DECISION).model_dump(mode="json")
    except RunFileError:  # missing or unreadable: the body still carries the summary's figures
        decision = {}
    records = []
    for n in notify:
        body = payload(as_json(summary), decision, run, report_url=n.report_url, delivery=str(uuid.uuid4()),
                       sent=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
        records.append(send(n, body))
    NotifyLog(run=run.name, records=records).write(run)
    return records
