"""Sending the recall requests (adapter): paced by quantgate.recall.pace, the haystack's first question before
its others, answers appended to a resumable JSONL file (quantgate.base.http).

Order: the first pending question over each haystack is queued; the others wait until it is answered and then go
to the front of the queue, so they reach the server while the haystack is in its prefix cache. A re-run skips
requests answered without error and asks the rest (failed ones included). Record per request: id, output,
finish_reason, usage, latency_s, elapsed_s, attempts, deadline_s, error (None when answered).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from quantgate.base import progress
from quantgate.base.http import JsonlAppender, api_base, auth_headers, post_json, read_results
from quantgate.evals.client import ClientConfig, ErrorRateExceeded
from quantgate.recall.pace import Pacer


@dataclass(frozen=True)
class Job:
    id: str
    messages: list[dict]
    max_tokens: int
    tokens: int  # prompt tokens the server computes when the haystack's prefix is cached: the request's own tail
    group: str  # the haystack
    prompt_tokens: int  # the whole prompt: the work of the first request sent over the haystack


@dataclass
class SendStats:
    total: int
    skipped: int  # answered in an earlier run
    answered: int = 0
    failed: int = 0
    timeouts: int = 0
    elapsed_s: float = 0.0
    most_in_flight: int = 0
    most_tokens_in_flight: int = 0
    rate: float | None = None  # the pacer's last measured prompt tokens per second
    last_error: str | None = None


def _parse(body: dict) -> tuple[str, str | None, dict | None]:
    choice = body["choices"][0]
    return choice["message"]["content"] or "", choice.get("finish_reason"), body.get("usage")


async def _ask(client: httpx.AsyncClient, url: str, job: Job, deadline: float, cfg: ClientConfig) -> dict:
    payload = {"model": cfg.model, "messages": job.messages, "max_tokens": job.max_tokens, **cfg.decoding()}
    ans = await post_json(client, url, payload, replace(cfg, timeout_s=deadline).retry(), parse=_parse)
    output, finish_reason, usage = ans.value if ans.ok else (None, None, None)
    return {"id": job.id, "output": output, "finish_reason": finish_reason, "usage": usage, "latency_s": ans.latency_s,
            "elapsed_s": ans.elapsed_s, "attempts": ans.attempts, "deadline_s": round(deadline, 1), "error": ans.error}


def queues(jobs: Sequence[Job], done: set[str]) -> tuple[deque[Job], dict[str, list[Job]]]:
    """(ready: the first pending request of each haystack, whose work is its whole prompt; waiting: the others, by
    haystack). On a resumed run the first pending one may be any of a haystack's requests: the cache is cold."""
    ready: deque[Job] = deque()
    waiting: dict[str, list[Job]] = {}
    for job in jobs:
        if job.id in done:
            continue
        if job.group in waiting:
            waiting[job.group].append(job)
        else:
            waiting[job.group] = []
            ready.append(replace(job, tokens=job.prompt_tokens))
    return ready, {g: js for g, js in waiting.items() if js}


def cost(job: Job) -> int:
    """A request's work for the progress line and its ETA: the prompt tokens the server computes for it (a
    haystack's first request its whole prompt, the others their own tail) and the tokens it may sample."""
    return job.tokens + job.max_tokens


def _send_ready(ready: deque[Job], running: dict, pacer: Pacer, stats: SendStats, ask, advance: progress.Advance
                ) -> None:
    """Start every ready job the pacer admits, in queue order (a job that does not fit yet holds the queue)."""
    while ready and pacer.admit(ready[0].tokens):
        job = ready.popleft()
        deadline = pacer.deadline(job.tokens)
        pacer.start(job.id, job.tokens, time.monotonic())
        running[asyncio.create_task(ask(job, deadline))] = (job, advance.begin(cost(job)))
        stats.most_in_flight = max(stats.most_in_flight, len(running))
        stats.most_tokens_in_flight = max(stats.most_tokens_in_flight, pacer.inflight_tokens)


def _note(stats: SendStats, rec: dict) -> None:
    if rec["error"] is None:
        stats.answered += 1
        return
    stats.failed += 1
    stats.last_error = rec["error"]
    stats.timeouts += "no answer within" in rec["error"]


async def send_all(jobs: Sequence[Job], results: Path, cfg: ClientConfig, pacer: Pacer,
                   log: Callable[[str], None] | None = None) -> SendStats:
    """Ask every job not yet answered in `results`; ErrorRateExceeded past cfg.max_error_rate (answers are kept)."""
    results.parent.mkdir(parents=True, exist_ok=True)
    done = {i for i, r in read_results(results).items() if r.get("error") is None}
    ready, waiting = queues(jobs, done)
    stats = SendStats(total=len(jobs), skipped=len(done & {j.id for j in jobs}))
    todo, url, t0, shown = stats.total - stats.skipped, api_base(cfg.endpoint) + "/chat/completions", time.monotonic(), 0
    work = sum(cost(j) for j in ready) + sum(cost(j) for js in waiting.values() for j in js)
    running: dict[asyncio.Task, tuple[Job, int]] = {}  # a request in flight: its job and its progress handle
    limits = httpx.Limits(max_connections=pacer.max_requests, max_keepalive_connections=pacer.max_requests)
    writer = JsonlAppender(results, cfg.fsync_every_s)
    try:
        # the caller's progress display, if it has one (quantgate.base.progress), in tokens: a haystack's first
        # request is most of its work: a count of requests said "ETA 46.5 min" at 2 of 120, "4.9 min" 30 s later
        with progress.loop(work, unit="prompt+sampled tokens") as advance:
            async with httpx.AsyncClient(timeout=None, limits=limits, headers=auth_headers(cfg.api_key)) as client:
                while ready or running:
                    _send_ready(ready, running, pacer, stats, lambda job, deadline: _ask(client, url, job, deadline, cfg),
                                advance)
                    finished, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                    for task in finished:
                        (job, handle), rec = running.pop(task), task.result()
                        writer.write(rec)
                        _note(stats, rec)
                        pacer.finish(job.id, time.monotonic(), ok=rec["error"] is None,
                                     timed_out="no answer within" in (rec["error"] or ""))
                        ready.extendleft(reversed(waiting.pop(job.group, [])))
                        advance.end(handle)
                    n = stats.answered + stats.failed
                    if n >= min(cfg.min_for_rate, todo) and stats.failed / n > cfg.max_error_rate:
                        raise ErrorRateExceeded(stats.failed, n, cfg.max_error_rate, stats.last_error)
                    if log and (n - shown >= max(1, todo // 10) or n == todo):
                        shown = n
                        log(_progress(stats, n, todo, time.monotonic() - t0, pacer))
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        writer.close()
        stats.elapsed_s, stats.rate = round(time.monotonic() - t0, 2), pacer.rate
    return stats


def _progress(stats: SendStats, finished: int, todo: int, elapsed: float, pacer: Pacer) -> str:
    rate = f"{pacer.rate:.0f} prompt tok/s" if pacer.rate else "rate unknown"
    eta = f", ETA {elapsed / finished * (todo - finished):.0f} s" if finished else ""
    return (f"recall: {finished}/{todo} requests ({stats.failed} failed), {elapsed:.0f} s, {rate}, "
            f"{len(pacer.inflight)} in flight{eta}")


def run(jobs: Sequence[Job], results: Path, cfg: ClientConfig, pacer: Pacer,
        log: Callable[[str], None] | None = None) -> SendStats:
    return asyncio.run(send_all(jobs, results, cfg, pacer, log))
