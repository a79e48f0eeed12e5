"""quantgate.base.http against local servers on 127.0.0.1: retries, the whole-request deadline (a server that drips
bytes), bounded concurrency, the /v1/models probe, and the append-and-repair JSONL file."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from _fake_openai import FakeServer, kill_when

from quantgate.base.errors import QuantgateError
from quantgate.base.http import (Endpoint, EndpointError, JsonlAppender, Retry, api_base, for_each, get, model_entry,
                                 post_json, read_results, repair_tail, served_models)

FAST = dict(backoff_s=0.005, backoff_max_s=0.02)


def content(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


def ask(url: str, prompts: list[str], retry: Retry, *, concurrency: int = 1, **kw) -> dict:
    """prompt -> Answer, each prompt POSTed to <url>/v1/chat/completions through for_each and post_json."""
    out = {}

    async def one(client, prompt: str) -> None:
        payload = {"model": "fake-model", "messages": [{"role": "user", "content": prompt}]}
        out[prompt] = await post_json(client, api_base(url) + "/chat/completions", payload, retry, **kw)

    asyncio.run(for_each(prompts, one, concurrency=concurrency))
    return out


@pytest.fixture
def server():
    with FakeServer() as s:
        yield s


# --- retries ------------------------------------------------------------------------------------------------------

# (scripted actions, attempts expected, error expected (substring) or None)
RETRIES = [
    (["500", "ok"], 2, None),
    (["429", "500", "429", "ok"], 4, None),
    (["drop", "ok"], 2, None),  # connection closed without an answer
    (["500"] * 4, 4, "HTTP 500"),  # gives up after max_attempts
    (["429"] * 4, 4, "HTTP 429"),
    (["400"], 1, "HTTP 400"),  # other 4xx: no retry
    (["slow", "ok"], 2, None),  # past the deadline: retried
]


@pytest.mark.parametrize("script,attempts,error", RETRIES)
def test_retry_paths(server, script, attempts, error):
    server.script = {"p": script}
    ans = ask(server.url, ["p"], Retry(timeout_s=0.3, max_attempts=4, **FAST), parse=content)["p"]
    assert ans.attempts == attempts == server.calls["p"]
    if error is None:
        assert ans.ok and ans.value == "echo: p"
    else:
        assert error in ans.error and ans.value is None
    assert ans.elapsed_s >= ans.latency_s > 0


def test_a_body_that_does_not_parse_is_not_retried(server):
    ans = ask(server.url, ["p"], Retry(max_attempts=3, **FAST), parse=lambda body: body["no-such-key"])["p"]
    assert ans.attempts == 1 and ans.error.startswith("malformed response: KeyError")


def test_a_fatal_status_is_raised_at_once(server):
    server.script = {"p": ["400", "ok"]}
    with pytest.raises(QuantgateError, match="refused"):
        ask(server.url, ["p"], Retry(max_attempts=3, **FAST),
            fatal=lambda status, text: QuantgateError("refused") if status == 400 else None)
    assert server.calls["p"] == 1


@pytest.mark.parametrize("attempts,retry_after,delay", [
    (1, None, 0.5), (2, None, 1.0), (4, None, 4.0), (6, None, 8.0),  # doubles, capped at backoff_max_s
    (1, "2", 2.0), (1, "0.25", 0.25), (1, "60", 8.0),  # a numeric Retry-After wins, capped too
    (2, "Wed, 21 Oct 2015 07:28:00 GMT", 1.0), (1, "", 0.5),  # a date is not read
])
def test_backoff(attempts, retry_after, delay):
    assert Retry().delay(attempts, retry_after) == delay


# --- the whole-request deadline -----------------------------------------------------------------------------------

class _Drip(BaseHTTPRequestHandler):
    """Answers 200 with a 64-byte JSON body, one byte every half second: no single read ever waits long."""

    def _drip(self) -> None:
        body = json.dumps({"data": [], "pad": "x" * 40}).ljust(64).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            for i in range(len(body)):
                self.wfile.write(body[i:i + 1])
                self.wfile.flush()
                time.sleep(0.5)
        except OSError:  # the client gave up
            pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._drip()

    def do_GET(self) -> None:
        self._drip()

    def log_message(self, *args) -> None:
        pass


class _Local:
    """A ThreadingHTTPServer on 127.0.0.1 with the given handler, for the life of a `with` block."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> _Local:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_server_that_drips_bytes_still_times_out():
    with _Local(_Drip) as srv:
        t0 = time.monotonic()
        ans = ask(srv.url, ["p"], Retry(timeout_s=1.2, max_attempts=2, **FAST))["p"]
        took = time.monotonic() - t0
    assert ans.error == "ReadTimeout: no answer within 1.2 s" and ans.attempts == 2
    assert 2.4 <= took < 5, took  # two attempts of 1.2 s each, not 32 s of dripping


def test_the_probe_has_the_same_deadline():
    with _Local(_Drip) as srv:
        t0 = time.monotonic()
        with pytest.raises(EndpointError) as err:
            served_models(srv.url, timeout_s=1.0)
        assert time.monotonic() - t0 < 3
    assert err.value.reason == "unreachable" and "ReadTimeout: no answer within 1 s" in err.value.message


# --- bounded concurrency ------------------------------------------------------------------------------------------

class _Counting(FakeServer):
    """Counts the chat requests in flight and the most at once."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.inflight = self.peak = 0

    async def _chat(self, request):
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        try:
            return await super()._chat(request)
        finally:
            self.inflight -= 1


def test_at_most_concurrency_requests_are_in_flight():
    prompts = [f"p{k}" for k in range(12)]
    with _Counting(delay_s=0.05) as srv:
        answers = ask(srv.url, prompts, Retry(**FAST), concurrency=3, parse=content)
    assert [answers[p].value for p in prompts] == [f"echo: {p}" for p in prompts]
    assert srv.peak == 3


def test_the_first_exception_stops_every_worker(server):
    server.delay_s = 0.05
    seen: list[str] = []

    async def handle(client, item: str) -> None:
        seen.append(item)
        await post_json(client, api_base(server.url) + "/chat/completions",
                        {"model": "fake-model", "messages": [{"role": "user", "content": item}]}, Retry(**FAST))
        if item == "p1":
            raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        asyncio.run(for_each([f"p{k}" for k in range(40)], handle, concurrency=2))
    assert len(seen) < 10


# --- the /v1/models probe ------------------------------------------------------------------------------------------

class _Odd(BaseHTTPRequestHandler):
    """GET /v1/models answers 401 without the key 's3cret', else a body that is not JSON; /bad-list a non-list."""

    def do_GET(self) -> None:
        if self.path == "/bad/v1/models":
            status, body = 200, b'{"data": [{"name": "no id"}]}'
        elif self.headers.get("Authorization") != "Bearer s3cret":
            status, body = 401, b'{"error": "unauthorised"}'
        else:
            status, body = 200, b"<html>not json</html>"
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_models_probe_finds_the_model_and_names_what_is_served():
    with FakeServer(model="demo", max_model_len=2048) as srv:
        assert served_models(srv.url) == {"demo": {"id": "demo", "max_model_len": 2048}}
        assert model_entry(Endpoint(srv.url + "/v1/", "demo"))["max_model_len"] == 2048
        with pytest.raises(EndpointError) as err:
            model_entry(Endpoint(srv.url, "other"), where="--model")
    e = err.value
    assert (e.reason, e.served, e.where) == ("not_served", ["demo"], "--model")
    assert e.message == "model 'other' is not served; served: demo"


@pytest.mark.parametrize("path,key,reason,words", [
    ("", None, "status", ["HTTP 401", "unauthorised"]),
    ("", "s3cret", "invalid", ["did not answer JSON"]),
    ("/bad", None, "invalid", ["did not answer an OpenAI model list"]),
])
def test_models_probe_failures(path, key, reason, words):
    with _Local(_Odd) as srv:
        with pytest.raises(EndpointError) as err:
            served_models(srv.url + path, key)
    assert err.value.reason == reason and all(w in err.value.message for w in words), err.value.message


def test_models_probe_of_a_closed_port():
    with pytest.raises(EndpointError) as err:
        model_entry(Endpoint("http://127.0.0.1:9", "demo"), where="--endpoint")
    e = err.value
    assert e.reason == "unreachable" and e.message.startswith("cannot reach the server at http://127.0.0.1:9/v1/models")
    assert e.where == "--endpoint" and e.fix


def test_get_returns_any_status(server):
    assert get(server.url + "/version").json() == {"version": "fake-1.0"}
    assert get(server.url + "/nothing").status_code == 404


# --- JSONL: append, repair, last record wins ----------------------------------------------------------------------

def test_append_repair_and_last_record_wins(tmp_path):
    path = tmp_path / "r.jsonl"
    with JsonlAppender(path) as w:
        w.write({"id": "a", "v": 1})
        w.write({"id": "b", "v": 1, "text": "naïve 漢字"})
    with path.open("a") as fh:
        fh.write('{"id": "c", "v": ')  # a write cut by a kill
    assert set(read_results(path)) == {"a", "b"}  # readers skip the torn line
    with JsonlAppender(path) as w:  # opening cuts it
        assert path.read_text(encoding="utf-8").endswith("}\n")
        w.write({"id": "a", "v": 2})
        w.write({"id": "c", "v": 1})
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(ln)["id"] for ln in lines] == ["a", "b", "a", "c"]
    recs = read_results(path)
    assert recs["a"]["v"] == 2 and recs["b"]["text"] == "naïve 漢字" and recs["c"]["v"] == 1


@pytest.mark.parametrize("content,after", [
    ("", ""), ("no newline at all", ""), ('{"id": 1}\n', '{"id": 1}\n'), ('{"id": 1}\n{"id"', '{"id": 1}\n'),
])
def test_repair_tail(tmp_path, content, after):
    path = tmp_path / "r.jsonl"
    path.write_text(content)
    repair_tail(path)
    assert path.read_text() == after
    repair_tail(tmp_path / "missing.jsonl")  # nothing to repair
    assert not (tmp_path / "missing.jsonl").exists()


def test_a_record_that_is_not_an_object_with_an_id_is_ignored(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('[1, 2]\n{"no": "id"}\nnot json\n{"id": "x"}\n')
    assert read_results(path) == {"x": {"id": "x"}}


WRITER = """
import sys
from quantgate.base.http import JsonlAppender
with JsonlAppender(sys.argv[1]) as w:
    for k in range(20_000):  # 60 MB at most
        w.write({"id": f"r{k}", "pad": "x" * 3000})
"""


def test_a_killed_writer_leaves_complete_records_only(tmp_path):
    path = tmp_path / "r.jsonl"
    kill_when([sys.executable, "-c", WRITER, str(path)], path, 100)
    with JsonlAppender(path) as w:
        w.write({"id": "after"})
    ids = [json.loads(ln)["id"] for ln in path.read_text().splitlines()]  # every line parses
    assert ids[-1] == "after" and len(ids) > 50 and Counter(ids).most_common(1)[0][1] == 1
