"""Ask an OpenAI-compatible judge: bounded concurrency, retries on 5xx/429/connection errors and timeouts,
temperature 0, one follow-up when the verdict is unparsable. Resumable JSONL of judgements, one line per job.

Record: id ("<pair_id>#<slot>"), pair_id, slot, messages (the prompt), replies (raw, one per attempt at a verdict),
label, parsed ("strict" | "tolerant" | "invalid"), reason, verdict_retry (bool), http_attempts, error (None when
the judge answered). A re-run skips ids with error None, so judged pairs are never judged again.

API key: an environment variable (`api_key_env`) or, optionally, a Prefect Secret block (`prefect_secret`,
needs `prefect` installed and a reachable Prefect API).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from quantgate.base.errors import QuantgateError
from quantgate.evals.client import api_base, read_results
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


async def _post(client, url: str, payload: dict, cfg: JudgeClientConfig) -> tuple[str | None, int, str | None]:
    """(reply text, attempts, error)."""
    import httpx

    attempts = 0
    while True:
        attempts += 1
        delay = None
        try:
            resp = await client.post(url, json=payload)
        except httpx.TransportError as exc:
            error, retry = f"{type(exc).__name__}: {exc}".rstrip(": "), True
        else:
            if resp.status_code == 200:
                try:
                    return resp.json()["choices"][0]["message"]["content"] or "", attempts, None
                except (ValueError, KeyError, IndexError, TypeError) as exc:
                    return None, attempts, f"malformed response: {type(exc).__name__}: {exc}"
            error = f"HTTP {resp.status_code}: {resp.text[:300]}"
            retry = resp.status_code >= 500 or resp.status_code == 429
            ra = resp.headers.get("retry-after", "")
            delay = min(float(ra), cfg.backoff_max_s) if ra.replace(".", "", 1).isdigit() else None
        if not retry or attempts >= cfg.max_attempts:
            return None, attempts, error
        await asyncio.sleep(delay if delay is not None else min(cfg.backoff_max_s, cfg.backoff_s * 2 ** (attempts - 1)))


async def judge_one(client, url: str, job: JudgeJob, cfg: JudgeClientConfig, parse: Callable[[str | None], Parsed],
                    retry_text: str) -> dict:
    base = {"model": cfg.model, "max_tokens": cfg.max_tokens, "temperature": 0.0, "top_p": 1.0, "seed": cfg.seed}
    rec = {"id": job.id, "pair_id": job.pair_id, "slot": job.slot, "messages": job.messages, "replies": [],
           "label": None, "parsed": None, "reason": None, "verdict_retry": False, "http_attempts": 0, "error": None}
    messages = list(job.messages)
    for turn in range(2):
        text, attempts, error = await _post(client, url, {**base, "messages": messages}, cfg)
        rec["http_attempts"] += attempts
        if error is not None:
            rec["error"] = error
            return rec
        rec["replies"].append(text)
        p = parse(text)
        rec.update(label=p.label, parsed=p.how, reason=p.reason)
        if p.label is not None or turn == 1:
            return rec
        rec["verdict_retry"] = True
        messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": retry_text}]
    return rec


async def judge_all_async(jobs: Sequence[JudgeJob], path: Path | str, cfg: JudgeClientConfig,
                          parse: Callable[[str | None], Parsed], retry_text: str) -> dict:
    """Judge every job not already judged in `path`; raise QuantgateError when the judge keeps failing."""
    import httpx

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = {i for i, r in read_results(path).items() if r.get("error") is None}
    pending = [j for j in jobs if j.id not in done]
    stats = {"total": len(jobs), "skipped": len(jobs) - len(pending), "judged": 0, "failed": 0, "last_error": None}
    queue = list(reversed(pending))
    consecutive = 0
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    url = api_base(cfg.endpoint) + "/chat/completions"
    t0 = time.monotonic()
    with path.open("a", encoding="utf-8") as fh:
        async def worker(client) -> None:
            nonlocal consecutive
            while queue:
                rec = await judge_one(client, url, queue.pop(), cfg, parse, retry_text)
                fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
                fh.flush()
                if rec["error"] is None:
                    stats["judged"] += 1
                    consecutive = 0
                else:
                    stats["failed"] += 1
                    stats["last_error"] = rec["error"]
                    consecutive += 1
                    if consecutive >= cfg.max_consecutive_failures:
                        raise QuantgateError(
                            f"the judge failed {consecutive} requests in a row; last error: {rec['error']}",
                            where=cfg.endpoint, fix="check that the judge server is up and not overloaded "
                            "(raise --timeout); re-run to resume: judged pairs are kept")

        limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)
        async with httpx.AsyncClient(timeout=cfg.timeout_s, limits=limits, headers=headers) as client:
            tasks = [asyncio.create_task(worker(client)) for _ in range(min(cfg.concurrency, len(pending)))]
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    stats["elapsed_s"] = round(time.monotonic() - t0, 3)
    if stats["failed"]:
        raise QuantgateError(f"{stats['failed']} of {len(pending)} judge requests failed; last error: "
                             f"{stats['last_error']}", where=cfg.endpoint,
                             fix="re-run the same command to resume: judged pairs are kept and not re-judged")
    return stats


def judge_all(jobs, path, cfg, parse, retry_text) -> dict:
    return asyncio.run(judge_all_async(jobs, path, cfg, parse, retry_text))
