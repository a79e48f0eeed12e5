"""Ask an OpenAI-compatible judge: bounded concurrency, retries on 5xx/429/connection errors and timeouts,
temperature 0, one follow-up when the verdict is unparsable. Resumable JSONL of judgements, one line per job.

Record: id ("<pair_id>#<slot>"), pair_id, slot, messages (the prompt), replies (raw, one per attempt at a verdict),
label, parsed ("strict" | "tolerant" | "invalid"), reason, verdict_retry (bool), http_attempts, error (None when
the judge answered). A re-run skips ids with error None, so judged pairs are never judged again. Requests and the
file are quantgate.base.http's: a whole-request deadline per attempt, and one os.write per record to an O_APPEND
file whose torn last line is cut on resume, so a kill loses no judgement and leaves no broken line.

API key: an environment variable (`api_key_env`) or, optionally, a Prefect Secret block (`prefect_secret`,
needs `prefect` installed and a reachable Prefect API).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NotRequired, TypedDict

from quantgate.base.errors import QuantgateError
from quantgate.base.http import JsonlAppender, Retry, api_base, for_each, post_json, read_results
from quantgate.judge.core import Parsed


@dataclass(frozen=True)
class JudgeJob:
    id: str
    pair_id: str
    slot: str
    messages: list[dict[str, str]]


@dataclass(frozen=True)
class JudgeClientConfig:
    endpoint: str
    model: str
    api_key: str | None = None
    concurrency: int = 8
    timeout_s: float = 120.0
    max_attempts: int = 4
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    max_tokens: int = 192
    seed: int = 0
    max_consecutive_failures: int = 5  # judge unreachable or timing out: stop early

    def retry(self) -> Retry:
        return Retry(self.timeout_s, self.max_attempts, self.backoff_s, self.backoff_max_s)


def _reply(body: dict) -> str:
    return body["choices"][0]["message"]["content"] or ""


class Judged(TypedDict):
    """One line of judgements.jsonl: the job, the judge's replies and the verdict parsed from the last one."""
    id: str
    pair_id: str
    slot: str
    messages: list[dict[str, str]]
    replies: list[str]
    label: str | None
    parsed: str | None
    reason: str | None
    verdict_retry: bool
    http_attempts: int
    error: str | None


class JudgeStats(TypedDict):
    total: int
    skipped: int
    judged: int
    failed: int
    last_error: str | None
    elapsed_s: NotRequired[float]


async def judge_one(client, url: str, job: JudgeJob, cfg: JudgeClientConfig, parse: Callable[[str | None], Parsed],
                    retry_text: str) -> Judged:
    base = {"model": cfg.model, "max_tokens": cfg.max_tokens, "temperature": 0.0, "top_p": 1.0, "seed": cfg.seed}
    rec: Judged = {"id": job.id, "pair_id": job.pair_id, "slot": job.slot, "messages": job.messages, "replies": [],
           "label": None, "parsed": None, "reason": None, "verdict_retry": False, "http_attempts": 0, "error": None}
    messages = list(job.messages)
    for turn in range(2):
        ans = await post_json(client, url, {**base, "messages": messages}, cfg.retry(), parse=_reply)
        text = ans.value
        rec["http_attempts"] += ans.attempts
        if not ans.ok:
            rec["error"] = ans.error
            return rec
        rec["replies"].append(text)
        p = parse(text)
        rec["label"], rec["parsed"], rec["reason"] = p.label, p.how, p.reason
        if p.label is not None or turn == 1:
            return rec
        rec["verdict_retry"] = True
        messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": retry_text}]
    return rec


async def judge_all_async(jobs: Sequence[JudgeJob], path: Path | str, cfg: JudgeClientConfig,
                          parse: Callable[[str | None], Parsed], retry_text: str) -> JudgeStats:
    """Judge every job not already judged in `path`; raise QuantgateError when the judge keeps failing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = {i for i, r in read_results(path).items() if r.get("error") is None}
    pending = [j for j in jobs if j.id not in done]
    stats: JudgeStats = {"total": len(jobs), "skipped": len(jobs) - len(pending), "judged": 0, "failed": 0, "last_error": None}
    consecutive = 0
    url = api_base(cfg.endpoint) + "/chat/completions"
    t0 = time.monotonic()

    async def judge(client, job: JudgeJob) -> None:
        nonlocal consecutive
        rec = await judge_one(client, url, job, cfg, parse, retry_text)
        writer.write(rec)
        if rec["error"] is None:
            stats["judged"] += 1
            consecutive = 0
            return
        stats["failed"] += 1
        stats["last_error"] = rec["error"]
        consecutive += 1
        if consecutive >= cfg.max_consecutive_failures:
            raise QuantgateError(f"the judge failed {consecutive} requests in a row; last error: {rec['error']}",
                                 where=cfg.endpoint, fix="check that the judge server is up and not overloaded "
                                 "(raise --timeout); re-run to resume: judged pairs are kept")

    with JsonlAppender(path) as writer:  # cuts a torn last line first
        await for_each(pending, judge, concurrency=cfg.concurrency, api_key=cfg.api_key)
    stats["elapsed_s"] = round(time.monotonic() - t0, 3)
    if stats["failed"]:
        raise QuantgateError(f"{stats['failed']} of {len(pending)} judge requests failed; last error: "
                             f"{stats['last_error']}", where=cfg.endpoint,
                             fix="re-run the same command to resume: judged pairs are kept and not re-judged")
    return stats


def judge_all(jobs, path, cfg, parse, retry_text) -> JudgeStats:
    return asyncio.run(judge_all_async(jobs, path, cfg, parse, retry_text))
