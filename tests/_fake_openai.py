"""A small OpenAI-compatible server for client tests: canned answers, scripted failures (aiohttp, loopback).

`FakeServer.script[key]` is a list of actions used one per call for that key (the last user message of a chat;
"ids:1,2,3" for a /v1/completions prompt of token ids):
"ok", "500", "429", "400", "drop" (close the connection without answering) or "slow" (answer after 1 s);
after the list, `default_action`.
The answer to a prompt is `answer(prompt)` (default "echo: <prompt>"). Every request body is kept in `requests`.
`kill_when` runs a child process and SIGKILLs it half-way through writing a results file.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
import time
from collections import defaultdict
from pathlib import Path

from aiohttp import web


class FakeServer:
    def __init__(self, delay_s: float = 0.0, max_model_len: int = 4096, model: str = "fake-model",
                 max_logprobs: int = 20):
        self.delay_s, self.max_model_len, self.model, self.max_logprobs = delay_s, max_model_len, model, max_logprobs
        self.script: dict[str, list[str]] = {}
        self.default_action = "ok"
        self.answer = lambda prompt: f"echo: {prompt}"
        self.calls: dict[str, int] = defaultdict(int)
        self.requests: list[dict] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    # --- lifecycle
    def __enter__(self) -> FakeServer:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/version", self._version)
        # a client that gave up mid-request (an error-rate stop) can leave a handler waiting: stopping waits for it at
        # most 2 s instead of aiohttp's 60 (it once took longer than __exit__'s 10 s, and the test failed on that)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    # --- handlers
    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "max_model_len": self.max_model_len}]})

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "fake-1.0"})

    async def _scripted(self, request: web.Request, key: str) -> tuple[int, web.StreamResponse | None]:
        """(call number for `key`, the scripted failure of this call or None to answer)."""
        n = self.calls[key]
        self.calls[key] += 1
        plan = self.script.get(key, [])
        action = plan[n] if n < len(plan) else self.default_action
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if action == "slow":
            await asyncio.sleep(1)
        if action == "drop":
            request.transport.abort()
            return n, web.Response(status=500)
        if action in ("500", "429", "400"):
            return n, web.json_response({"error": {"message": f"scripted {action}"}}, status=int(action))
        return n, None

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        prompt = body["messages"][-1]["content"]
        n, failure = await self._scripted(request, prompt)
        if failure is not None:
            return failure
        return web.json_response({
            "id": f"cmpl-{n}", "object": "chat.completion", "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": self.answer(prompt)}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": 2, "total_tokens": len(prompt.split()) + 2},
        })

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        """Token ids in, vLLM-shaped `prompt_logprobs` out: each actual token at logprob -1 and rank 1, then k - 1
        other tokens (id + j) at -1 - j; a k above `max_logprobs` is refused as vLLM refuses it."""
        body = await request.json()
        self.requests.append(body)
        ids, k = body["prompt"], body.get("prompt_logprobs") or 1
        _, failure = await self._scripted(request, "ids:" + ",".join(map(str, ids)))
        if failure is not None:
            return failure
        if body.get("return_token_ids"):  # a sampled continuation: two tokens (the prompt's last + 1, + 2), each
            # with its logprob and as many top logprobs as asked (itself first)
            out = [ids[-1] + 1, ids[-1] + 2]
            top = [{f"token_id:{t + j}": -0.5 - j for j in range(body.get("logprobs") or 1)} for t in out]
            return web.json_response({"choices": [{"index": 0, "text": "x", "token_ids": out, "logprobs": {
                "tokens": [f"token_id:{t}" for t in out], "top_logprobs": top}}]})
        if k > self.max_logprobs:
            return web.json_response({"error": {"message": f"Requested prompt logprobs of {k}, which is greater than "
                                                           f"max allowed: {self.max_logprobs}"}}, status=400)
        rows = [None] + [{str(t + j): {"logprob": -1.0 - j, "rank": j + 1} for j in range(k)} for t in ids[1:]]
        return web.json_response({"choices": [{"index": 0, "text": "x", "prompt_logprobs": rows}]})


def kill_when(argv: list[str], path: Path, lines: int, timeout_s: float = 30.0) -> None:
    """Run `argv`, and SIGKILL it as soon as `path` holds `lines` complete lines (or after `timeout_s`)."""
    child = subprocess.Popen(argv)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (not path.exists() or path.read_bytes().count(b"\n") < lines):
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    child.wait(10)
