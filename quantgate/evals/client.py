"""Async OpenAI-compatible chat client for eval runs: bounded concurrency, retries, resumable JSONL results.

Each finished sample is ONE `os.write` of one JSON line to a file opened with O_APPEND, so a killed process
loses nothing already answered (fsync is batched, once a second and at the end, against power loss only).
A re-run reads the file, skips ids answered without error, and retries the rest; readers take the last
record per id. httpx and rich are imported inside the functions: start-up time counts.

Record per sample: id, output, finish_reason, usage, latency_s (last attempt), elapsed_s (all attempts),
attempts, error (None when answered).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantgate.base.errors import QuantgateError


@dataclass(frozen=True)
class Request:
    id: str
    messages: list[dict[str, str]]
    max_tokens: int


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

    def decoding(self) -> dict[str, Any]:
        """Deterministic decoding sent with every request (max_tokens is per sample)."""
        return {"temperature": 0.0, "top_p": 1.0, "seed": self.seed}


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


def api_base(endpoint: str) -> str:
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def read_results(path: Path | str) -> dict[str, dict]:
    """id -> last record in a results file; a torn last line (killed mid-write) is ignored."""
    path = Path(path)
    out: dict[str, dict] = {}
    if not path.is_file():
        return out
    with path.open(encoding="utf-8") as fh:
        for raw in fh:
            if not raw.endswith("\n"):
                break
            try:
                rec = json.loads(raw)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "id" in rec:
                out[rec["id"]] = rec
    return out


def _repair_tail(path: Path) -> None:
    """Cut a torn last line so that the next append starts on a fresh line."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        with path.open("r+b") as fh:
            fh.truncate(data.rfind(b"\n") + 1)


class _Appender:
    def __init__(self, path: Path, fsync_every_s: float):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.fsync_every_s, self.last_sync = fsync_every_s, time.monotonic()

    def write(self, rec: dict) -> None:
        data = (json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8")
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        if time.monotonic() - self.last_sync >= self.fsync_every_s:
            os.fsync(self.fd)
            self.last_sync = time.monotonic()

    def close(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)


async def _ask(client, url: str, req: Request, cfg: ClientConfig) -> dict:
    import httpx

    payload = {"model": cfg.model, "messages": req.messages, "max_tokens": req.max_tokens, **cfg.decoding()}
    start, attempts, error = time.monotonic(), 0, None
    while True:
        attempts += 1
        t0 = time.monotonic()
        delay = None
        try:
            resp = await asyncio.wait_for(client.post(url, json=payload), cfg.timeout_s)
        except asyncio.TimeoutError:
            error, retry = f"no answer within {cfg.timeout_s:g} s", True
        except httpx.TransportError as exc:  # connect/read/write errors, dropped connections
            error, retry = f"{type(exc).__name__}: {exc}".rstrip(": "), True
        else:
            if resp.status_code == 200:
                try:
                    body = resp.json()
                    choice = body["choices"][0]
                    return {
                        "id": req.id, "output": choice["message"]["content"] or "",
                        "finish_reason": choice.get("finish_reason"), "usage": body.get("usage"),
                        "latency_s": round(time.monotonic() - t0, 4), "elapsed_s": round(time.monotonic() - start, 4),
                        "attempts": attempts, "error": None,
                    }
                except (ValueError, KeyError, IndexError, TypeError) as exc:
                    error, retry = f"malformed response: {type(exc).__name__}: {exc}", False
            else:
                error = f"HTTP {resp.status_code}: {resp.text[:300]}"
                retry = resp.status_code >= 500 or resp.status_code == 429
                ra = resp.headers.get("retry-after")
                delay = min(float(ra), cfg.backoff_max_s) if ra and ra.replace(".", "", 1).isdigit() else None
        if not retry or attempts >= cfg.max_attempts:
            return {
                "id": req.id, "output": None, "finish_reason": None, "usage": None,
                "latency_s": round(time.monotonic() - t0, 4), "elapsed_s": round(time.monotonic() - start, 4),
                "attempts": attempts, "error": error,
            }
        await asyncio.sleep(delay if delay is not None else min(cfg.backoff_max_s, cfg.backoff_s * 2 ** (attempts - 1)))


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
    import httpx

    path = Path(results_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _repair_tail(path)
    done = {i for i, r in read_results(path).items() if r.get("error") is None}
    pending = [r for r in requests if r.id not in done]
    stats = RunStats(total=len(requests), skipped=len(requests) - len(pending))
    queue = list(reversed(pending))
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)
    url = api_base(cfg.endpoint) + "/chat/completions"
    writer, bar = _Appender(path, cfg.fsync_every_s), _progress(len(pending), cfg.progress and bool(pending))
    task_id = bar.add_task("eval", total=len(pending), failed=0) if bar else None
    t0 = time.monotonic()

    def over_limit(final: bool) -> bool:
        finished = stats.answered + stats.failed
        enough = finished >= min(cfg.min_for_rate, len(pending)) or final
        return finished > 0 and enough and stats.failed / finished > cfg.max_error_rate

    async def worker(client) -> None:
        while queue:
            rec = await _ask(client, url, queue.pop(), cfg)
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

    try:
        if bar:
            bar.start()
        async with httpx.AsyncClient(timeout=cfg.timeout_s, limits=limits, headers=headers) as client:
            tasks = [asyncio.create_task(worker(client)) for _ in range(min(cfg.concurrency, len(pending)))]
            try:
                await asyncio.gather(*tasks)
            except _Stop:  # reported below, once every worker has stopped and the counts are final
                stats.stopped = True
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
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
