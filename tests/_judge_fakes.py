"""Helpers for the judge tests: run directories as `quantgate eval` writes them, and a scripted fake judge."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

from aiohttp import web

from tests._fake_openai import FakeServer

ANSWERS = re.compile(r"## Answer A\n(.*?)\n\n## Answer B\n(.*?)\n\n## Your reply", re.S)


def write_run(run_dir: Path, es, outputs: dict[str, str], model: str, scores: dict[str, dict] | None = None) -> Path:
    """A finished run directory (manifest, results, scores) with the given outputs for eval set `es`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    by_id = {s.id: s for s in es.samples}
    (run_dir / "manifest.json").write_text(json.dumps({
        "status": "complete", "model": model, "model_hash": None, "cache_key": f"key-{model}",
        "evalset": {"path": str(es.path), "name": es.meta.name, "version": es.meta.version, "sha256": es.sha256}}))
    (run_dir / "results.jsonl").write_text("".join(
        json.dumps({"id": i, "output": o, "error": None}) + "\n" for i, o in outputs.items()))
    (run_dir / "scores.jsonl").write_text("".join(json.dumps({
        "id": i, "category": by_id[i].category, "scores": (scores or {}).get(i, {}),
        "references": by_id[i].references}) + "\n" for i in outputs))
    return run_dir


class FakeJudge(FakeServer):
    """Answers judge prompts with `decide(prompt_text, call_no) -> reply`; failures still come from `script`."""

    def __init__(self, decide, **kw):
        super().__init__(**kw)
        self.decide = decide

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["messages"][-1]["content"]
        plan = self.script.get(prompt, [])
        n = self.calls[prompt]
        if n < len(plan) and plan[n] != "ok":
            return await super()._chat(_Replay(request, body))
        self.calls[prompt] += 1
        self.requests.append(body)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        text = self.decide(body["messages"], n)
        return web.json_response({"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                               "finish_reason": "stop"}]})


class _Replay:
    """Lets FakeServer._chat read a body we already consumed."""

    def __init__(self, request, body):
        self._request, self._body = request, body
        self.transport = request.transport

    async def json(self):
        return self._body


def prefer(bad: set[str]):
    """A perfect pairwise judge: picks the answer NOT found in `bad`, TIE when both or neither are."""
    def decide(messages, n):
        m = ANSWERS.search(messages[0]["content"])
        a, b = (m.group(1).strip() not in bad, m.group(2).strip() not in bad) if m else (False, False)
        return "Reasoning.\nVERDICT: " + ("A" if a and not b else "B" if b and not a else "TIE")
    return decide
