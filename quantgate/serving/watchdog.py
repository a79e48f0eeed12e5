"""A progress watchdog for a running vLLM server: names a server that holds requests but makes no progress.

A hung server (a deadlocked engine, a worker stuck in a kernel) keeps its socket open, so a client waits for its
whole request deadline and retries: about 20 minutes per eval attempt before anything says what is wrong. The
watchdog reads what the server itself publishes, every `poll_s` seconds:
- its Prometheus metrics (`GET /metrics`): requests running and waiting, prompt and generation tokens, finished
  requests;
- the size of its log.
Progress is any change of the token or request counters; while the metrics do not answer, a growing log (the
periodic stats line vLLM logs also for a hung engine is why the log counts only then). When requests are in flight
(or the metrics do not answer at all) and nothing progressed for `stall_s`, the server is stalled: `on_stall` gets an
error naming the server's URL, pid and log tail (VLLMServer stops the server with it, so the waiting client
fails at once, and raise_if_dead raises that error). An idle server is never stalled.

`advance` is the pure decision (unit-tested); `Watchdog` is the thread that feeds it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from quantgate.base import http
from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import log_tail

# Counters whose change is progress, and gauges whose sum says requests are in flight (vLLM 0.32's names).
# iteration_tokens_total_sum also counts the prompt tokens of each prefill chunk: a long prefill is progress too.
PROGRESS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
            "vllm:iteration_tokens_total_sum")
IN_FLIGHT = ("vllm:num_requests_running", "vllm:num_requests_waiting")
# The default stall limit is sized from the clients' whole-request deadline: one engine step never takes that long
# while requests are answered, so twice that deadline without any token is a hang, not a slow request.
STALL_S = 2 * http.Retry().timeout_s


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> metric name -> value summed over its label sets (comments and bad lines skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, rest = line.rpartition("}") if "}" in line else line.partition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


@dataclass(frozen=True)
class ServerSample:
    """One look at the server: `metrics` None when /metrics did not answer."""
    t: float
    metrics: dict[str, float] | None
    log_size: int


@dataclass(frozen=True)
class State:
    since: float                        # when progress (or idleness) was last seen
    progress: tuple[float, ...] | None  # the counters then
    log_size: int


def advance(state: State | None, s: ServerSample, stall_s: float) -> tuple[State, str | None]:
    """The next state, and why the server is stalled (None: it is not). Pure."""
    counters = tuple(s.metrics.get(k, 0.0) for k in PROGRESS) if s.metrics is not None else None
    in_flight = sum(s.metrics.get(k, 0.0) for k in IN_FLIGHT) if s.metrics is not None else None
    if state is None:
        return State(s.t, counters, s.log_size), None
    # the counters decide while the metrics answer (vLLM's periodic stats line grows the log of a hung engine too);
    # the log only when they do not
    moved = counters != state.progress if counters is not None else s.log_size != state.log_size
    if moved or in_flight == 0:  # progress, or nobody waits on this server
        return State(s.t, counters if counters is not None else state.progress, s.log_size), None
    quiet = s.t - state.since
    if quiet < stall_s:
        return State(state.since, state.progress, s.log_size), None
    if in_flight is None:
        why = f"its /metrics did not answer and its log did not grow for {quiet:.0f} s"
    else:
        why = f"{in_flight:.0f} request(s) in flight and no new token or finished request for {quiet:.0f} s"
    return State(state.since, state.progress, s.log_size), why


class Watchdog:
    """Polls a server (metrics + log) in a daemon thread and calls `on_stall(error)` once when it stalls."""

    def __init__(self, base_url: str, log_path: Path, pid: int, on_stall: Callable[[QuantgateError], None], *,
                 stall_s: float = STALL_S, poll_s: float = 5.0, what: str = "vLLM server"):
        self.root = base_url.removesuffix("/v1")
        self.log_path, self.pid, self.on_stall = Path(log_path), pid, on_stall
        self.stall_s, self.poll_s, self.what = stall_s, poll_s, what
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def sample(self) -> ServerSample:
        try:
            resp = http.get(f"{self.root}/metrics", timeout_s=min(10.0, self.poll_s * 2))
            metrics = parse_metrics(resp.text) if resp.status_code == 200 else None
        except http.EndpointError:
            metrics = None
        try:
            size = self.log_path.stat().st_size
        except OSError:
            size = -1
        return ServerSample(time.monotonic(), metrics, size)

    def _run(self) -> None:
        state = None
        while not self._stop.wait(self.poll_s):
            state, why = advance(state, self.sample(), self.stall_s)
            if why and not self._stop.is_set():
                self.on_stall(QuantgateError(
                    f"{self.what} at {self.root} (pid {self.pid}) is stalled: {why}; it was stopped. Last log lines:\n"
                    f"{log_tail(self.log_path)}", where=str(self.log_path),
                    fix="read the log; a hung engine or worker (a deadlock, a stuck kernel, a swapping machine) needs a "
                        "restart: re-run to resume. Raise the server's stall_timeout_s if it is merely slow"))
                return
