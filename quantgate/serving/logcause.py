"""The root cause of a failure, read from a log: the last exception line that is not a wrapper's.

vLLM's engine core prints its traceback and then the API server adds "Engine core initialization failed. See root
cause above."; llmcompressor's child ends with the exception that stopped it. The cause a person wants is the last
`SomethingError: message` line that is not one of those wrappers, without the process prefix vLLM puts on each line.
"""

from __future__ import annotations

import re
from pathlib import Path

_EXC = re.compile(r"((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)(?:: .*)?)$")
_PREFIX = re.compile(r"^(\(\w+ pid=\d+\)\s*)?(\w+ \d\d-\d\d [\d:.]+ \[[^\]]+\]\s*)?")
# wrappers: lines that point at the cause instead of naming it (vLLM's API server and engine core say so)
_WRAPPERS = ("root cause", "Engine core initialization failed", "engine core", "EngineDeadError", "Traceback")


def root_cause(text: str, limit: int = 300) -> str | None:
    """The last exception line of `text` that is not a wrapper's (at most `limit` characters); None if none."""
    found = None
    for raw in text.splitlines():
        line = _PREFIX.sub("", raw.strip())
        m = _EXC.search(line)
        if m and not any(w.lower() in line.lower() for w in _WRAPPERS):
            found = m.group(1).strip()
    if found is None:
        return None
    return found if len(found) <= limit else found[: limit - 3] + "..."


def log_cause(path: Path | str, limit: int = 300) -> str | None:
    """root_cause of a log file (None when the file is missing)."""
    try:
        return root_cause(Path(path).read_text(encoding="utf-8", errors="replace"), limit)
    except OSError:
        return None
