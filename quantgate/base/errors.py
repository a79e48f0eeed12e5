"""One error type for problems a user can fix: what is wrong, where, and the command or edit that fixes it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class QuantgateError(Exception):
    """A user-facing failure. `where` names the file/field/line, `fix` says what to do about it."""
    def __init__(self, message: str, *, where: str | None = None, fix: str | None = None):
        self.message = message
        self.where = where
        self.fix = fix
        super().__init__(self.render())

    def render(self) -> str:
        head = f"{self.where}: {self.message}" if self.where else self.message
        return f"{head}\n  fix: {self.fix}" if self.fix else head


class ConfigError(QuantgateError):
    """A configuration file (YAML/JSONL) that does not validate."""


def did_you_mean(name: object, known: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the known name closest to `name`, or '' when none is close (difflib)."""
    close = difflib.get_close_matches(str(name), [str(k) for k in known], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
