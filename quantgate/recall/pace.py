"""Pacing of the recall requests (pure): how much prompt work may be in flight, and each request's deadline, from
the prefill rate measured on the same server during the run. Times are passed in; nothing here sleeps or sends.

A server works on every request it holds at once. A client that sends more long prompts than the server can
prefill within the deadline sees prompts time out while they only wait, and re-sends them to start over: the
waste grows with the queue. The pacer keeps the work in flight (prompt tokens the server must compute: a whole
haystack for the first question over it, the question's tail for the others, which the prefix cache serves)
within `rate x budget_s / SAFETY`, so what is admitted finishes in about budget_s / SAFETY at the measured rate.
Each request gets the deadline SAFETY x (work in flight + its own work) / rate, never under budget_s: a server
slower than measured (a shared machine, decode steps the prompt-token rate does not see) still has twice the time
it needs. A single request larger than the budget is admitted alone, with the deadline its own size needs.

The rate starts unknown: one request at a time until the first answer. It is then the work of the answered
requests per second during which the server held at least one of ours (decode time included, so it is an
underestimate: the safe side). Each timed-out request halves it, since the server is slower than measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SAFETY = 2.0


@dataclass
class Pacer:
    budget_s: float = 300.0  # the work in flight finishes within half of this at the measured rate; least deadline
    max_requests: int = 8  # requests in flight, whatever their size
    done_tokens: int = 0
    busy_s: float = 0.0
    penalty: float = 1.0  # halved by every timeout
    inflight: dict[str, int] = field(default_factory=dict)  # request id -> its work (tokens)
    _busy_since: float | None = None

    @property
    def rate(self) -> float | None:
        """Measured prompt tokens per busy second, or None before the first answer."""
        busy = self.busy_s
        if self.done_tokens <= 0 or busy <= 0:
            return None
        return self.penalty * self.done_tokens / busy

    @property
    def inflight_tokens(self) -> int:
        return sum(self.inflight.values())

    def budget_tokens(self) -> float | None:
        rate = self.rate
        return None if rate is None else rate * self.budget_s / SAFETY

    def admit(self, tokens: int) -> bool:
        """May a request of `tokens` work be sent now?"""
        if not self.inflight:
            return True
        budget = self.budget_tokens()
        if budget is None or len(self.inflight) >= self.max_requests:
            return False
        return self.inflight_tokens + tokens <= budget

    def deadline(self, tokens: int) -> float:
        """Seconds the request may take, from its sending to the last byte of its answer."""
        rate = self.rate
        if rate is None:
            return self.budget_s
        return max(self.budget_s, SAFETY * (self.inflight_tokens + tokens) / rate)

    def start(self, request: str, tokens: int, now: float) -> None:
        if not self.inflight:
            self._busy_since = now
        self.inflight[request] = tokens

    def finish(self, request: str, now: float, *, ok: bool, timed_out: bool = False) -> None:
        tokens = self.inflight.pop(request)
        if self._busy_since is not None:
            self.busy_s += now - self._busy_since
            self._busy_since = now if self.inflight else None
        if ok:
            self.done_tokens += tokens
        if timed_out:
            self.penalty /= 2
