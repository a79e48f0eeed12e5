"""Executors other than this host's slots, by the spec's `executor.kind`.

`executor: local` is the flow's own: its variants are measured on this host's slots (quantgate.release.flow). Any
other kind is a package above `release` that measures each variant elsewhere and registers itself here when it is
imported: `executor: pools` is quantgate.pools (child flow runs on Prefect work pools), which imports the release's
steps for its children and so cannot be imported by the flow. The entry points import it: `quantgate release`
(quantgate.cli.release) and the deployments' flows/release.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from quantgate.base.errors import QuantgateError
from quantgate.release.variants import Evidence, Log, Variant
from quantgate.spec.schema import ReleaseSpec


class Executor(Protocol):
    """What the flow asks of an executor that measures the variants elsewhere and shares the run through a store."""

    def measure(self, spec: ReleaseSpec, run: Path, candidates: list, log: Log, baseline: bool = True
                ) -> tuple[Evidence | None, list[Evidence]]: ...

    def share_run(self, spec: ReleaseSpec, run: Path) -> None: ...

    def pull_checkpoint(self, spec: ReleaseSpec, variant: Variant) -> None: ...

    def share_entry(self, spec: ReleaseSpec, entry: Path) -> None: ...


_REGISTERED: dict[str, Executor] = {}


def register(kind: str, executor: Executor) -> None:
    _REGISTERED[kind] = executor


def remote(kind: str) -> Executor:
    """The executor registered for `kind`; a clear error where its package was not imported by the entry point."""
    if kind not in _REGISTERED:
        raise QuantgateError(f"executor: {kind} is not available in this process: run the release with `quantgate "
                             f"release` or flows/release.py, which load it (quantgate.{kind})")
    return _REGISTERED[kind]
