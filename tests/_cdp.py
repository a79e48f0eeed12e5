"""A headless Chromium driven over the DevTools protocol (websockets, synchronous): open a page, collect console
errors, exceptions and failed loads, evaluate JavaScript, take a screenshot. Test helper only."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-port=0", "--window-size=1280,1600"]


def chromium() -> str | None:
    return shutil.which("chromium") or (str(Path("/usr/bin/chromium")) if Path("/usr/bin/chromium").exists() else None)


class Browser:
    def __init__(self, binary: str, profile: Path, timeout: float = 60.0):
        from websockets.sync.client import connect

        self.timeout = timeout
        self.proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        url, seen, end = None, [], time.monotonic() + timeout
        while url is None and time.monotonic() < end:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                break
            seen.append(line)
            m = re.search(r"DevTools listening on (ws://\S+)", line)
            url = m.group(1) if m else None
        if url is None:
            self.close()
            raise RuntimeError("chromium did not start:\n" + "".join(seen[-20:]))
        self.ws = connect(url, max_size=64 * 2**20, open_timeout=timeout)
        self.next_id, self.events, self.session = 0, [], None

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session or self.session:
            msg["sessionId"] = session or self.session
        self.ws.send(json.dumps(msg))
        while True:
            reply = json.loads(self.ws.recv(timeout=self.timeout))
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, timeout: float | None = None) -> dict:
        end = time.monotonic() + (timeout or self.timeout)
        for e in self.events:
            if e.get("method") == method:
                return e
        while time.monotonic() < end:
            e = json.loads(self.ws.recv(timeout=max(0.1, end - time.monotonic())))
            self.events.append(e)
            if e.get("method") == method:
                return e
        raise TimeoutError(method)

    def open(self, url: str) -> None:
        """A fresh tab at `url`, waited for until loaded; events recorded from before navigation."""
        target = self.send("Target.createTarget", {"url": "about:blank"}, session="")["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.events = []
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable")
        self.send("Page.navigate", {"url": url})
        self.wait_for("Page.loadEventFired")
        self.evaluate("new Promise(r => requestAnimationFrame(() => setTimeout(r, 100)))")

    def problems(self) -> list[str]:
        """Console errors/warnings, uncaught exceptions, log errors, failed or non-2xx loads since open()."""
        out = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.exceptionThrown":
                out.append(f"exception: {p['exceptionDetails'].get('text')} {p['exceptionDetails'].get('exception', {}).get('description', '')}")
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "warning", "assert"):
                out.append(f"console.{p['type']}: {[a.get('value', a.get('description')) for a in p.get('args', [])]}")
            elif m == "Log.entryAdded" and p["entry"].get("level") in ("error", "warning"):
                out.append(f"log {p['entry']['level']}: {p['entry'].get('text')} {p['entry'].get('url', '')}")
            elif m == "Network.loadingFailed":
                out.append(f"load failed: {p.get('errorText')}")
            elif m == "Network.responseReceived" and p["response"].get("status", 200) >= 400:
                out.append(f"HTTP {p['response']['status']}: {p['response'].get('url')}")
        return out

    def evaluate(self, expression: str):
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def screenshot(self) -> bytes:
        return base64.b64decode(self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": False})["data"])

    def close(self) -> None:
        try:
            if getattr(self, "ws", None):
                self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A headless Chromium for a test module (imported by the browser tests); skipped where it is not installed."""
    binary = chromium()
    if binary is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    b = Browser(binary, tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()
