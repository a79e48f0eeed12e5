"""The one progress reporter: its line (pure), lines through a log inside a `reporting` block, nothing outside one,
the shared request loop counting every finished item, and `watch` for work another process does."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from quantgate.base import progress
from quantgate.base.http import for_each


def test_line_counts_rate_and_eta():
    assert progress.line("baseline: eval", 120, 300, 40.0) == "baseline: eval: 120/300 (40%), 3.00/s, ETA 60 s"
    assert progress.line("x", 300, 300, 100.0) == "x: 300/300 (100%), 3.00/s, done"
    assert progress.line("x", 0, 10, 0.0) == "x: 0/10 (0%), 0.00/s"
    assert progress.line("x", 10, 1000, 5.0).endswith("ETA 8.2 min")  # 990 left at 2/s: 495 s


def test_a_loop_counted_in_units_says_them():
    assert progress.line("c: fidelity", 41200, 87300, 400.0, "tokens") == \
        "c: fidelity: 41200/87300 tokens (47%), 103.00 tokens/s, ETA 7.5 min"


def test_items_of_unequal_cost_advance_by_their_cost():
    """A few long items among many short ones (haystacks among eval prompts): counted by cost, the share done and
    the ETA follow the work, not the item count."""
    lines: list[str] = []
    sizes = [1] * 9 + [91]  # the long one last (for_each takes them in order)

    async def handle(client, item) -> None:
        return None

    with progress.reporting("x", log=lines.append, every_s=0.0):
        asyncio.run(for_each(sizes, handle, concurrency=1, cost=("tokens", lambda n: n)))
    assert lines[-2].startswith("x: 9/100 tokens (9%)")  # 9 of 10 items, but 9% of the work
    assert lines[-1].startswith("x: 100/100 tokens (100%)") and lines[-1].endswith("done")


def _loop(n: int, delay: float = 0.0) -> None:
    async def handle(client, item) -> None:
        await asyncio.sleep(delay)

    asyncio.run(for_each(list(range(n)), handle, concurrency=4))


def test_the_request_loop_reports_inside_a_block_only():
    lines: list[str] = []
    _loop(5)  # no reporting block: nothing is said, nothing fails
    with progress.reporting("candidate: fidelity", log=lines.append, every_s=0.0):
        _loop(5)
    assert lines[-1].startswith("candidate: fidelity: 5/5 (100%)") and lines[-1].endswith("done")
    assert len(lines) == 5  # four periodic lines (every_s=0) and the final one
    assert all(ln.startswith("candidate: fidelity: ") for ln in lines)


def test_periodic_lines_are_throttled():
    lines: list[str] = []
    with progress.reporting("x", log=lines.append, every_s=3600):
        _loop(20)
    assert len(lines) == 1  # only the final line within an hour


def test_concurrent_variants_keep_their_own_labels():
    lines: list[str] = []
    lock = threading.Lock()

    def variant(name: str) -> None:
        def say(text: str) -> None:
            with lock:
                lines.append(text)

        with progress.reporting(name, log=say, every_s=3600):
            _loop(8, delay=0.01)

    threads = [threading.Thread(target=variant, args=(n,)) for n in ("baseline", "w4a16")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(lines) == 2
    assert {ln.split(":")[0] for ln in lines} == {"baseline", "w4a16"}
    assert all("8/8" in ln for ln in lines)


def test_watch_counts_what_another_process_finished():
    lines: list[str] = []
    done = [0]

    def work() -> None:
        for _ in range(3):
            time.sleep(0.05)
            done[0] += 1

    with progress.reporting("perf", log=lines.append, every_s=0.0):
        with progress.watch(3, lambda: done[0], poll_s=0.02):
            work()
    assert lines[-1].startswith("perf: 3/3 (100%)")


def _simulated_sampling(items: list[tuple[int, int]], concurrency: int, prefill_s: float, decode_s: float,
                        lines: list[str]) -> tuple[float, list[float]]:
    """The baseline's sampling against a simulated server: the client keeps `concurrency` requests in flight, in
    the order given; each server step prefills up to 512 prompt tokens, first come first served, and decodes one
    token of every sequence past its prefill, taking 0.02 s + prefill_s per prompt token + decode_s per sequence.
    Items cost prompt + sampled tokens, as fidelity.sampling counts them. The run's end and when each line was said."""
    now = [0.0]
    counter = progress.Counter(progress._Sink("baseline: fidelity", lines.append, 30.0),
                               sum(p + s for p, s in items), "prompt+sampled tokens", clock=lambda: now[0])
    queue, live, said = list(items), [], []
    while queue or live:
        while queue and len(live) < concurrency:
            p, s = queue.pop(0)
            live.append([counter.begin(p + s), p, s])
        budget, prefilled, decoding = 512, 0, 0
        for r in live:
            if r[1]:
                take = min(budget, r[1])
                r[1], budget, prefilled = r[1] - take, budget - take, prefilled + take
            elif r[2]:
                r[2], decoding = r[2] - 1, decoding + 1
        now[0] += 0.02 + prefill_s * prefilled + decode_s * decoding
        for r in [r for r in live if not r[1] and not r[2]]:
            live.remove(r)
            counter.end(r[0])
            said += [now[0]] * (len(lines) - len(said))
    return now[0], said


def _eta_s(text: str) -> float:
    value, unit = text.rsplit("ETA ", 1)[1].split()
    return float(value) * (60 if unit == "min" else 1)


@pytest.mark.parametrize("prefill_s", [0.0004, 0.002])  # prefill 7.5x and 1.5x cheaper a token than a decode step
def test_the_first_eta_of_long_then_short_requests_is_within_2x_of_the_truth(prefill_s):
    """The demo's sampling shape: 36 haystacks (12 each of 2048, 1024 and 512 prompt tokens, 256 sampled) first,
    then 600 eval prompts (80 tokens, 64 sampled), 64 in flight. Counting finished work only, the first line's ETA
    was over 50 times the time left (the "ETA 1607.4 min" of a 10-minute job); with the work in flight, within 2x."""
    items = [(n, 256) for n in (2048, 1024, 512) for _ in range(12)] + [(80, 64)] * 600
    lines: list[str] = []
    end, said = _simulated_sampling(items, 64, prefill_s, 0.003, lines)
    first, at = lines[0], said[0]
    assert "prompt+sampled tokens" in first and "more in flight" in first, first
    assert 0.5 <= _eta_s(first) / (end - at) <= 2.0, (first, end - at)
    done, total = (int(x) for x in first.removeprefix("baseline: fidelity: ").split()[0].split("/"))
    finished_only = progress.line("x", done, total, at, "tokens")
    assert _eta_s(finished_only) / (end - at) > 50, finished_only
