"""A typer group whose commands are imported when one is first looked up, not when the program starts.

The command modules import the capability packages (pydantic models, numpy, httpx, the release spec, lm-eval's
task reader): importing all 22 took 1.2-2 s on a loaded 2-core machine before `quantgate --version` could answer.
A `LazyGroup` lists its commands from a table (name -> module, attribute, help panel) and turns an entry into a
click command, the way `app.command()` / `app.add_typer()` would have, only when click asks for it: running one
command imports its module alone, `--version` none, `--help` all (it shows each command's first docstring line).

The table names modules as strings, so the import graph tests/test_layers.py reads from import statements does not
see main -> command module edges; those are cli -> cli edges, which the dependency rule allows anyway, and
tests/test_cli_conventions.py imports every entry of the table.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any, ClassVar

import typer
from typer.core import TyperGroup
from typer.main import get_command_from_info, get_group_from_info
from typer.models import CommandInfo, TyperInfo


@dataclass(frozen=True)
class LazyCommand:
    """One command of the table: `attr` of `module` is a command function, or a typer.Typer of sub-commands."""
    module: str
    attr: str
    panel: str  # the --help panel it is listed under (typer's rich_help_panel)

    def target(self) -> Any:
        return getattr(importlib.import_module(self.module), self.attr)


class _Commands(MutableMapping[str, Any]):
    """A LazyGroup's `commands`: its table's names, each made a click command on first lookup and kept. Typer's
    group reads this mapping for everything (running, --help, a typo's "Did you mean"), so only a lookup imports."""

    def __init__(self, group: LazyGroup):
        self._group = group
        self._made: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._made:
            if name not in self._group.lazy:
                raise KeyError(name)
            self._made[name] = self._group.make(name, self._group.lazy[name])
        return self._made[name]

    def __setitem__(self, name: str, command: Any) -> None:
        self._made[name] = command

    def __delitem__(self, name: str) -> None:
        del self._made[name]

    def __iter__(self) -> Iterator[str]:
        return iter({**dict.fromkeys(self._group.lazy), **self._made})

    def __len__(self) -> int:
        return len(set(self._group.lazy) | set(self._made))


class LazyGroup(TyperGroup):
    """A TyperGroup whose commands come from the class's `lazy` table, in its order (the --help panels appear in
    the order of their first command). Subclass it with the table: `typer.Typer(cls=MyGroup)`."""

    lazy: ClassVar[dict[str, LazyCommand]] = {}

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.commands = _Commands(self)

    def make(self, name: str, entry: LazyCommand) -> Any:
        """The click command typer makes of the entry's target under `name`, as app.command(name) or
        app.add_typer(target, name=name) would (pretty exceptions are off in quantgate.cli.main, so the short
        traceback flag typer threads through is moot: its default, True)."""
        target = entry.target()
        if isinstance(target, typer.Typer):
            return get_group_from_info(TyperInfo(target, name=name, rich_help_panel=entry.panel),
                                       pretty_exceptions_short=True, suggest_commands=self.suggest_commands,
                                       rich_markup_mode=self.rich_markup_mode)
        return get_command_from_info(CommandInfo(name=name, callback=target, rich_help_panel=entry.panel),
                                     pretty_exceptions_short=True, rich_markup_mode=self.rich_markup_mode)
