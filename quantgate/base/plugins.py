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
_lock = threading.Lock()
_loaded: list[str] = []


def load_kinds() -> list[str]:
    """Import every installed kind's module once (later calls return at once); the entry points' names."""
    with _lock:
        if not _loaded:
            _loaded.append("")  # before the imports: a kind's module that asks again is not loaded twice
            for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
                if ep.name not in _loaded:
                    _loaded.append(ep.name)
                    ep.load()
    return [n for n in _loaded if n]
