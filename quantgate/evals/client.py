"""Async OpenAI-compatible chat client for eval runs: bounded concurrency, retries, resumable JSONL results.

Requests, retries, the whole-request deadline and the results file are quantgate.base.http's: each finished
sample is ONE `os.write` of one JSON line to a file opened with O_APPEND, so a killed process loses nothing already
answered (fsync is batched, once a second and at the end, against power loss only). A re-run cuts a torn last line,
skips ids answered without error, and retries the rest; readers take the last record per id. rich is imported
inside a function: start-up time counts.

Record per sample: id, output, finish_reason, usage, latency_s (last attempt), elapsed_s (all attempts),
attempts, error (None when answered).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from quantgate.base.errors import QuantgateError
from quantgate.base.http import JsonlAppender, Retry, api_base, for_each, post_json, read_results

__all__ = ["ClientConfig", "ErrorRateExceeded", "Request", "RunStats", "api_base", "read_results", "run", "run_async"]


@dataclass(frozen=True)
class Request:
    id: str
    messages: list[dict[str, str]]
    max_tokens: int


class Decoding(TypedDict):
    """The decoding settings sent with every request."""
    temperature: float
    top_p: float
    seed: int


@dataclass(frozen=True)
class ClientConfig:
    endpoint: str  # http://host:port or http://host:port/v1
    model: str
    api_key: str | None = None
    concurrency: int = 16
    timeout_s: float = 120.0  # whole request, per attempt
    max_attempts: int = 5
    backoff_s: float = 0.5  # first retry delay; doubles per attempt, capped at backoff_max_s
    backoff_max_s: float = 8.0
    seed: int = 0
    max_error_rate: float = 0.05  # share of failed samples above which the run stops
    min_for_rate: int = 20  # the share is judged once this many samples finished (and always at the end)
    progress: bool = True
    fsync_every_s: float = 1.0

    def decoding(self) -> Decoding:
        """Deterministic decoding sent with every request (max_tokens is per sample)."""
        return {"temperature": 0.0, "top_p": 1.0, "seed": self.seed}

    def retry(self) -> Retry:
        return Retry(self.timeout_s, self.max_attempts, self.backoff_s, self.backoff_max_s)


class _Stop(Exception):
    """A worker saw the error rate pass the limit."""


class ErrorRateExceeded(QuantgateError):
    def __init__(self, failed: int, finished: int, limit: float, last_error: str | None):
        self.failed, self.finished, self.share = failed, finished, failed / max(finished, 1)
        super().__init__(
            f"{failed} of {finished} requests failed ({self.share:.1%}), above the limit of {limit:.1%};"
            f" last error: {last_error}",
            where="eval client", fix="check the server's health and logs; re-run to resume (answered samples are kept)",
        )


@dataclass
class RunStats:
    total: int
    skipped: int  # already answered in the results file
    answered: int = 0
    failed: int = 0
    elapsed_s: float = 0.0
    last_error: str | None = None
    stopped: bool = False  # stopped early by the error-rate limit


def _choice(body: dict) -> tuple[str, str | None, dict | None]:
    """(output, finish_reason, usage) of a chat completion."""
    choice = body["choices"][0]
    return choice["message"]["content"] or "", choice.get("finish_reason"), body.get("usage")


async def _ask(client, url: str, req: Request, cfg: ClientConfig) -> dict:
    payload = {"model": cfg.model, "messages": req.messages, "max_tokens": req.max_tokens, **cfg.decoding()}
    ans = await post_json(client, url, payload, cfg.retry(), parse=_choice)
    output, finish_reason, usage = ans.value if ans.ok else (None, None, None)
    return {"id": req.id, "output": output, "finish_reason": finish_reason, "usage": usage, "latency_s": ans.latency_s,
            "elapsed_s": ans.elapsed_s, "attempts": ans.attempts, "error": ans.error}


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)
    from rich.text import Text

    class Rate(ProgressColumn):
        def render(self, task):
            return Text(f"{task.speed:.1f} req/s" if task.speed else "-- req/s")

    return Progress(TextColumn("eval"), BarColumn(), MofNCompleteColumn(), Rate(), TextColumn("{task.fields[failed]} failed"),
                    TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=Console(stderr=True))


async def run_async(requests: Sequence[Request], results_path: Path | str, cfg: ClientConfig) -> RunStats:
    """Answer every request not yet answered in `results_path`; raise ErrorRateExceeded past the limit."""
    path = Path(results_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = {i for i, r in read_results(path).items() if r.get("error") is None}
    pending = [r for r in requests if r.id not in done]
    stats = RunStats(total=len(requests), skipped=len(requests) - len(pending))
    url = api_base(cfg.endpoint) + "/chat/completions"
    bar = _progress(len(pending), cfg.progress and bool(pending))
    task_id = bar.add_task("eval", total=len(pending), failed=0) if bar else None
    t0 = time.monotonic()

    def over_limit(final: bool) -> bool:
        finished = stats.answered + stats.failed
        enough = finished >= min(cfg.min_for_rate, len(pending)) or final
        return finished > 0 and enough and stats.failed / finished > cfg.max_error_rate

    async def answer(client, req: Request) -> None:
        rec = await _ask(client, url, req, cfg)
        writer.write(rec)
        if rec["error"] is None:
            stats.answered += 1
        else:
            stats.failed += 1
            stats.last_error = rec["error"]
        if bar:
            bar.update(task_id, advance=1, failed=stats.failed)
        if over_limit(final=False):
            raise _Stop

    writer = JsonlAppender(path, cfg.fsync_every_s)  # cuts a torn last line first
    try:
        if bar:
            bar.start()
        await for_each(pending, answer, concurrency=cfg.concurrency, api_key=cfg.api_key)
    except _Stop:  # reported below, once every worker has stopped and the counts are final
        stats.stopped = True
    finally:
        if bar:
            bar.stop()
        writer.close()
        stats.elapsed_s = time.monotonic() - t0
    if stats.stopped or over_limit(final=True):
        raise ErrorRateExceeded(stats.failed, stats.answered + stats.failed, cfg.max_error_rate, stats.last_error)
    return stats


def run(requests: Sequence[Request], results_path: Path | str, cfg: ClientConfig) -> RunStats:
    return asyncio.run(run_async(requests, results_path, cfg))
