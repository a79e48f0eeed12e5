"""Where the test suite's time goes: each test's wall time and the share of the machine's CPU that was busy meanwhile.

As a pytest plugin it appends one JSON line per test (setup, call and teardown together) to $SUITE_PROFILE
(default results/suite-profile.jsonl):

    PYTHONPATH=bench .venv/bin/python -m pytest -m slow -p suite_profile

Run as a script it prints the modules by wall time with their busy share, the whole pass's busy share, and, given
a second profile of the same tests (`--against`: e.g. the same pass run with `-n 2`), each module's wall time there
and the ratio, over the tests both profiles hold:

    .venv/bin/python bench/suite_profile.py results/suite-profile.jsonl [--against other.jsonl] [--top 20]

The busy share is over every core (from /proc/stat: 1.0 is all of them busy), so on 2 cores a test that keeps one
core busy shows 0.5. A pass whose share is well below 1 has room to overlap tests; one near 1 has none.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

from quantgate.perf.machine import busy_jiffies
from quantgate.serving.kernel_probe import cpuinfo

OUT = Path(os.environ.get("SUITE_PROFILE", "results/suite-profile.jsonl"))


CORES = list(range(os.cpu_count() or 1))


def _cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of all cores since boot (quantgate.perf.machine, as the speed window reads its slot)."""
    return busy_jiffies(CORES) or (0.0, 0.0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    busy0, total0 = _cpu_times()
    start = time.monotonic()
    yield
    busy1, total1 = _cpu_times()
    row = {"test": item.nodeid, "wall": round(time.monotonic() - start, 1),
           "busy": round((busy1 - busy0) / max(1, total1 - total0), 3)}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("a") as f:
        f.write(json.dumps(row) + "\n")


def rows(path: Path) -> dict[str, dict]:
    """test id -> its row (the last one, where a test ran twice)."""
    return {r["test"]: r for r in map(json.loads, path.read_text().splitlines())}


def by_module(tests: dict[str, dict], only: set[str] | None = None) -> dict[str, tuple[float, float, int]]:
    """module -> (wall seconds, busy share weighted by wall, tests), over the tests in `only` when given."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for test, row in tests.items():
        if only is not None and test not in only:
            continue
        a = acc[test.split("::")[0]]
        a[0] += row["wall"]
        a[1] += row["wall"] * row["busy"]
        a[2] += 1
    return {m: (w, b / w if w else 0.0, int(n)) for m, (w, b, n) in acc.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", type=Path)
    ap.add_argument("--against", type=Path, help="a second profile of the same tests, compared module by module")
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    mine = rows(a.profile)
    mods = by_module(mine)
    other: dict[str, tuple[float, float, int]] = {}
    if a.against:  # module by module over the tests both profiles hold (a pass stopped early holds fewer)
        theirs = rows(a.against)
        both = set(mine) & set(theirs)
        mods, other = by_module(mine, both), by_module(theirs, both)
    wall = sum(w for w, _, _ in mods.values())
    busy = sum(w * b for w, b, _ in mods.values()) / wall if wall else 0.0
    print(f"{sum(n for *_, n in mods.values())} tests, {wall:.0f} s of test time, busy share {busy:.2f}; {cpuinfo()[0]} ({os.cpu_count()} cores)")
    for m, (w, b, n) in sorted(mods.items(), key=lambda kv: -kv[1][0])[:a.top]:
        there = f"  {other[m][0]:7.1f} s there ({other[m][0] / w:.2f}x)" if m in other else ""
        print(f"{w:8.1f} s  busy {b:.2f}  {n:3d} tests  {m}{there}")


if __name__ == "__main__":
    main()
