"""OpenAI-compatible HTTP plumbing: JSON requests with retries under a whole-request deadline, bounded concurrency,
the `GET /v1/models` probe, and the append-only JSONL file that makes a run resumable.

Requests (async; sync callers wrap them in asyncio.run):
  for_each(items, handle, concurrency=, api_key=)   handle(client, item) for every item, at most `concurrency` at
                                                    once over one connection pool that sends the bearer key
  post_json(client, url, payload, retry, parse=, fatal=) -> Answer
  One attempt is bounded by ONE deadline, `retry.timeout_s`, from the moment it is sent to the last byte of the
  answer (a server that drips bytes still times out); the error names the step it was in, as httpx does
  ("ReadTimeout: no answer within 30 s"). Retried: connection errors, timeouts, HTTP 5xx and 429 (Retry-After is
  honoured up to backoff_max_s); the delay doubles from backoff_s up to backoff_max_s. Not retried: other
  statuses, a 200 whose body `parse` cannot read, and any status `fatal` turns into an exception (raised at once).

An `Endpoint` is one served model as its clients address it: URL, model name, API key.

Probe (sync): get / get_json / served_models / model_entry; every failure is an EndpointError whose `reason` is
"unreachable", "status", "invalid" or "not_served", so that a caller may word it for its own users.

Results files: JsonlAppender writes one record per os.write loop to a file opened with O_APPEND, after cutting a
torn last line (a process killed mid-write), so a kill loses no finished record and leaves no broken line; fsync is
batched (once a second and at close: against power loss only). read_results takes the last record per id.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from quantgate.base import progress
from quantgate.base.errors import QuantgateError

T = TypeVar("T")


def api_base(endpoint: str) -> str:
    """'http://h:p', 'http://h:p/' or 'http://h:p/v1' -> 'http://h:p/v1'."""
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server as a client addresses it: its URL (with or without /v1), the model name it serves
    and its API key (None: no key is sent; never in repr). Every client of a served model takes one; a running
    server hands out its own (`.endpoint` of quantgate.serving's servers)."""
    url: str
    model: str
    api_key: str | None = field(default=None, repr=False)

    @property
    def base(self) -> str:
        """The URL ending in /v1."""
        return api_base(self.url)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# --- requests -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Retry:
    timeout_s: float = 120.0  # whole request, per attempt
    max_attempts: int = 5
    backoff_s: float = 0.5  # first retry delay; doubles per attempt, capped at backoff_max_s
    backoff_max_s: float = 8.0

    def delay(self, attempts: int, retry_after: str | None = None) -> float:
        """Seconds to wait after `attempts` failed attempts; a numeric Retry-After wins, capped at backoff_max_s."""
        if retry_after and retry_after.replace(".", "", 1).isdigit():
            return min(float(retry_after), self.backoff_max_s)
        return min(self.backoff_max_s, self.backoff_s * 2 ** (attempts - 1))


@dataclass(frozen=True)
class Answer:
    """What a request came to after its retries: `value` (the parsed 200 body) or `error`."""
    value: Any
    error: str | None
    attempts: int
    latency_s: float  # the last attempt
    elapsed_s: float  # every attempt and the waits between them

    @property
    def ok(self) -> bool:
        return self.error is None


class _NoAnswer(Exception):
    """An attempt got no HTTP answer: connection error or deadline."""


# httpcore's trace steps -> the name httpx gives a timeout in that step
_STEP_TIMEOUT: dict[str | None, str] = {
    "connect_tcp": "ConnectTimeout", "start_tls": "ConnectTimeout", "send_request_headers": "WriteTimeout",
    "send_request_body": "WriteTimeout", "receive_response_headers": "ReadTimeout",
    "receive_response_body": "ReadTimeout"}


class _Step:
    """The step a request is in (from httpcore's trace events), to name a deadline that passed in it."""
    def __init__(self) -> None:
        self.timeout = "PoolTimeout"  # no event yet: waiting for a connection

    async def __call__(self, event: str, info: dict) -> None:
        step = event.rsplit(".", 2)[-2] if event.endswith(".started") else None
        self.timeout = _STEP_TIMEOUT.get(step, self.timeout)


async def _send(client: httpx.AsyncClient, method: str, url: str, payload: Any, timeout_s: float) -> httpx.Response:
    """One attempt, the whole of it (connect, send, wait, read the body) within `timeout_s`."""
    step = _Step()
    try:
        return await asyncio.wait_for(client.request(method, url, json=payload, extensions={"trace": step}), timeout_s)
    except TimeoutError:
        raise _NoAnswer(f"{step.timeout}: no answer within {timeout_s:g} s") from None
    except httpx.TransportError as exc:  # connect/read/write errors, dropped connections
        raise _NoAnswer(f"{type(exc).__name__}: {exc}".rstrip(": ")) from None


def _parsed(resp: httpx.Response, parse: Callable[[Any], Any] | None) -> tuple[Any, str | None]:
    try:
        body = resp.json()
        return (body if parse is None else parse(body)), None
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return None, f"malformed response: {type(exc).__name__}: {exc}"


async def post_json(client: httpx.AsyncClient, url: str, payload: Any, retry: Retry, *,
                    parse: Callable[[Any], Any] | None = None,
                    fatal: Callable[[int, str], BaseException | None] | None = None) -> Answer:
    """POST `payload` as JSON with retries (module docstring); `parse` reads a 200's JSON body into Answer.value."""
    start, attempts = time.monotonic(), 0
    error: str | None
    while True:
        attempts += 1
        t0, retry_after = time.monotonic(), None
        try:
            resp = await _send(client, "POST", url, payload, retry.timeout_s)
        except _NoAnswer as exc:
            error, again = str(exc), True
        else:
            if resp.status_code == 200:
                value, error = _parsed(resp, parse)
                return Answer(value, error, attempts, round(time.monotonic() - t0, 4), round(time.monotonic() - start, 4))
            problem = fatal(resp.status_code, resp.text) if fatal else None
            if problem is not None:
                raise problem
            error = f"HTTP {resp.status_code}: {resp.text[:300]}"
            again = resp.status_code >= 500 or resp.status_code == 429
            retry_after = resp.headers.get("retry-after")
        if not again or attempts >= retry.max_attempts:
            return Answer(None, error, attempts, round(time.monotonic() - t0, 4), round(time.monotonic() - start, 4))
        await asyncio.sleep(retry.delay(attempts, retry_after))


class Stopped(Exception):
    """for_each was told to stop (its `stop()` said so): the items not finished were not handled."""


STOP_POLL_S = 0.5  # how often for_each asks its `stop()`


async def for_each(items: Sequence[T], handle: Callable[[httpx.AsyncClient, T], Awaitable[None]], *,
                   concurrency: int, api_key: str | None = None, cost: tuple[str, Callable[[T], int]] | None = None,
                   stop: Callable[[], bool] | None = None) -> None:
    """handle(client, item) for every item, in order, at most `concurrency` at once; the first exception a handler
    raises stops every worker and is raised here. Deadlines are post_json's: the client itself has none. Finished
    items count towards the caller's progress display (quantgate.base.progress; nothing without one), or with
    `cost` = (unit, cost of an item) their cost: items of very different sizes (a haystack prompt and a short one)
    then get an honest rate and ETA. Items in flight count too (quantgate.base.progress.Counter: the rate is
    measured on finished items' time in flight, and the work in flight is credited by it). With `stop`, asked every
    STOP_POLL_S: once it is true, the requests in flight are cancelled (their connections closed: the server aborts
    them) and Stopped is raised."""
    queue = list(reversed(items))
    width = max(1, concurrency)
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    unit, of = cost if cost is not None else ("", lambda _: 1)

    with progress.loop(sum(of(it) for it in queue), unit) as tally:
        async with httpx.AsyncClient(timeout=None, limits=limits, headers=auth_headers(api_key)) as client:
            async def worker() -> None:
                while queue:
                    item = queue.pop()
                    sent = tally.begin(of(item))  # in flight from now: counted towards the rate and ETA
                    await handle(client, item)
                    tally.end(sent)

            async def watch() -> None:
                while stop is not None:
                    if stop():
                        raise Stopped()
                    await asyncio.sleep(STOP_POLL_S)

            tasks = [asyncio.create_task(worker()) for _ in range(min(width, len(queue)))]
            watcher = asyncio.create_task(watch())
            workers = asyncio.gather(*tasks)  # the first worker's failure fails it
            try:
                await asyncio.wait([workers, watcher], return_when=asyncio.FIRST_COMPLETED)  # type: ignore[type-var]
                if watcher.done():
                    watcher.result()  # raises Stopped
                await workers
            finally:
                workers.cancel()  # and every worker with it
                watcher.cancel()
                await asyncio.gather(workers, watcher, return_exceptions=True)


# --- the probe ----------------------------------------------------------------------------------------------------

class EndpointError(QuantgateError):
    """An endpoint that cannot be used; `reason`: "unreachable", "status", "invalid" or "not_served"."""
    def __init__(self, reason: str, message: str, *, url: str, where: str, fix: str, detail: str = "",
                 status: int | None = None, served: Sequence[str] = ()):
        self.reason, self.url, self.detail, self.status, self.served = reason, url, detail, status, list(served)
        super().__init__(message, where=where, fix=fix)


def get(url: str, api_key: str | None = None, timeout_s: float = 10.0, *, where: str | None = None) -> httpx.Response:
    """One GET within a whole-request deadline, no retry; EndpointError("unreachable") when nothing answers."""
    async def once() -> httpx.Response:
        async with httpx.AsyncClient(timeout=None, headers=auth_headers(api_key)) as client:
            return await _send(client, "GET", url, None, timeout_s)

    try:
        return asyncio.run(once())
    except _NoAnswer as exc:
        raise EndpointError("unreachable", f"cannot reach the server at {url}: {exc}", url=url, detail=str(exc),
                            where=where or url, fix="start the server, or correct the endpoint's host and port") from None


def get_json(url: str, api_key: str | None = None, timeout_s: float = 10.0, *, where: str | None = None) -> Any:
    """The JSON body of a GET that answers 200; EndpointError otherwise."""
    resp = get(url, api_key, timeout_s, where=where)
    if resp.status_code != 200:
        refused = resp.status_code in (401, 403)
        raise EndpointError("status", f"GET {url} answered HTTP {resp.status_code}: {resp.text[:200]}", url=url,
                            status=resp.status_code, where=where or url,
                            fix="check the API key the request sends" if refused else
                            "check that the endpoint is an OpenAI-compatible server")
    try:
        return resp.json()
    except ValueError:
        raise EndpointError("invalid", f"GET {url} did not answer JSON: {resp.text[:200]}", url=url, status=200,
                            where=where or url, fix="check that the endpoint is an OpenAI-compatible server") from None


def served_models(endpoint: str, api_key: str | None = None, timeout_s: float = 10.0, *,
                  where: str | None = None) -> dict[str, dict]:
    """id -> entry of every model in `GET <endpoint>/v1/models` (vLLM adds max_model_len and root)."""
    url = api_base(endpoint) + "/models"
    body = get_json(url, api_key, timeout_s, where=where or endpoint)
    try:
        return {m["id"]: m for m in body.get("data", [])}
    except (KeyError, TypeError, AttributeError):
        raise EndpointError("invalid", f"GET {url} did not answer an OpenAI model list", url=url, status=200,
                            where=where or endpoint, fix="check that the endpoint is an OpenAI-compatible server") from None


def model_entry(endpoint: Endpoint, timeout_s: float = 10.0, *, where: str | None = None) -> dict:
    """The `/v1/models` entry of the endpoint's model; EndpointError("not_served") naming what is served when it is
    not there."""
    served = served_models(endpoint.url, endpoint.api_key, timeout_s, where=where)
    if endpoint.model not in served:
        raise EndpointError("not_served", f"model {endpoint.model!r} is not served; served: "
                            f"{', '.join(map(str, served)) or 'none'}", url=endpoint.base + "/models",
                            served=sorted(map(str, served)), where=where or endpoint.url,
                            fix="use one of the served model names")
    return served[endpoint.model]


# --- results files ------------------------------------------------------------------------------------------------

def repair_tail(path: Path | str) -> None:
    """Cut a torn last line (a write cut by a kill) so that the next append starts on a fresh line."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        with path.open("r+b") as fh:
            fh.truncate(data.rfind(b"\n") + 1)


def read_results(path: Path | str) -> dict[str, dict]:
    """id -> last record in a JSONL file; a torn last line and lines that are not records are ignored."""
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


class JsonlAppender:
    """Append records to a JSONL file, one os.write loop each on an O_APPEND descriptor; a torn last line left by
    an earlier kill is cut first. fsync at most every `fsync_every_s` seconds, and at close."""

    def __init__(self, path: Path | str, fsync_every_s: float = 1.0):
        repair_tail(path)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.fsync_every_s, self.last_sync = fsync_every_s, time.monotonic()

    def write(self, rec: Mapping[str, object]) -> None:
        view = memoryview((json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8"))
        while view:
            view = view[os.write(self.fd, view):]
        if time.monotonic() - self.last_sync >= self.fsync_every_s:
            os.fsync(self.fd)
            self.last_sync = time.monotonic()

    def close(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
