"""The measurement kinds added as modules of their own, found through the `quantgate.kinds` entry points
(pyproject.toml) and imported once, on first need.

Importing a kind's module registers it on every floor: the spec (quantgate.spec.kinds), the release
(quantgate.release.measurements) and the gate (quantgate.gate.kinds). Each of those registries asks for the kinds
here before it answers, so any process that reads a spec or a policy naming a kind finds it, whoever started it
(the CLI, a flow, a test, a library user), and a package of another team can add a kind by installing an entry point.
"""

from __future__ import annotations

import threading
from importlib.metadata import entry_points

GROUP = "quantgate.kinds"
_lock = threading.RLock()  # re-entrant: a kind's module that asks for the kinds while it loads gets the list so far
_names: list[str] | None = None  # the entry points loaded, once loading began


def load_kinds() -> list[str]:
    """Import every installed kind's module once (later calls return at once); the entry points' names."""
    global _names
    with _lock:
        if _names is None:
            _names = []
            for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
                if ep.name not in _names:  # one checkout's package found twice on the path loads once
                    _names.append(ep.name)
                    ep.load()
        return list(_names)
