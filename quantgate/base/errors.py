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


class SettingError(ConfigError):
    """A bad value of one setting, raised by library code in the setting's own name (`recall.lengths`,
    `api_key_env`): the name of the release spec field where there is one. It renders as that field; a caller
    that took the value from elsewhere names it in its own terms (`in_terms`): the CLI as its flag (`--lengths`)."""

    def __init__(self, message: str, *, setting: str, fix: str | None = None, where: str | None = None):
        self.setting = setting
        super().__init__(message, where=where or setting, fix=fix)

    def in_terms(self, name: str) -> SettingError:
        """The same error, its setting called `name` (a flag, a field with its file and line)."""
        return SettingError(self.message, setting=self.setting, fix=self.fix, where=name)


def as_flag(setting: str) -> str:
    """A setting's command-line flag: its last part, dashed (`recall.lengths` -> `--lengths`, `api_key_env` ->
    `--api-key-env`); several settings joined by ' / ' stay joined."""
    return " / ".join("--" + part.strip().rsplit(".", 1)[-1].replace("_", "-") for part in setting.split("/"))


def did_you_mean(name: object, known: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the known name closest to `name`, or '' when none is close (difflib). Case is
    ignored in the comparison: `INT8-W8A8` is closest to `int8-w8a8`, which difflib alone finds too far."""
    folded = {str(k).casefold(): str(k) for k in known}
    close = difflib.get_close_matches(str(name).casefold(), list(folded), n=1, cutoff=0.6)
    return f" (did you mean {folded[close[0]]!r}?)" if close else ""
