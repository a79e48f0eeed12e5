"""One error type for problems a user can fix: what is wrong, where, and the command or edit that fixes it."""

from __future__ import annotations


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
