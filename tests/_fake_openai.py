"""A small OpenAI-compatible chat server for client tests: canned answers, scripted failures (aiohttp, loopback).

`FakeServer.script[prompt]` is a list of actions used one per call for that prompt (last user message):
"ok", "500", "429", "400", "drop" (close the connection without answering) or "slow" (answer after 1 s);
after the list, `default_action`.
The answer to a prompt is `answer(prompt)` (default "echo: <prompt>"). Every request body is kept in `requests`.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict

from aiohttp import web


class FakeServer:
    def __init__(self, delay_s: float = 0.0, max_model_len: int = 4096, model: str = "fake-model"):
        self.delay_s, self.max_model_len, self.model = delay_s, max_model_len, model
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
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/version", self._version)
        self._runner = web.AppRunner(app, access_log=None)
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

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        prompt = body["messages"][-1]["content"]
        n = self.calls[prompt]
        self.calls[prompt] += 1
        plan = self.script.get(prompt, [])
        action = plan[n] if n < len(plan) else self.default_action
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if action == "slow":
            await asyncio.sleep(1)
        if action == "drop":
            request.transport.abort()
            return web.Response(status=500)
        if action in ("500", "429", "400"):
            return web.json_response({"error": {"message": f"scripted {action}"}}, status=int(action))
        return web.json_response({
            "id": f"cmpl-{n}", "object": "chat.completion", "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": self.answer(prompt)}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": 2, "total_tokens": len(prompt.split()) + 2},
        })
