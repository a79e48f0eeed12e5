"""The one progress reporter: its line (pure), lines through a log inside a `reporting` block, nothing outside one,
the shared request loop counting every finished item, and `watch` for work another process does."""

from __future__ import annotations

import asyncio
import threading
import time

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
