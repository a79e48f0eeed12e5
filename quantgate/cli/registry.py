"""`quantgate registry ...`: list, verify and publish promoted entries (results/registry/<model>/<version>/).

`publish ENTRY TARGET` is what a spec's `publish:` does for one target: TARGET is a folder, an fsspec URL
(file://, memory://, s3://...) or hf://OWNER/NAME (Hugging Face Hub, token from --token-env). Exit codes: 0 published
(or already there, identical), 1 the publish failed (the entry is unchanged), 2 bad input (not an entry, an unknown
URL scheme, no Hub token).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from quantgate.gate.summaryfile import as_json
from quantgate.publishing import registry
from quantgate.publishing.publish import HF_TOKEN, PublishTarget, publish_one
from quantgate.publishing.targets import HUB

registry_app = typer.Typer(help="Promoted entries: list, verify, publish.", no_args_is_help=True)


@registry_app.command("list")
def list_cmd(model: Annotated[str | None, typer.Option(help="only this model")] = None,
             root: Annotated[Path | None, typer.Option(help="registry folder (default results/registry)")] = None) -> None:
    """One line per complete entry: model, version, candidate, scheme, path."""
    entries = registry.list_entries(root, model)
    if not entries:
        print(f"no promoted entries{f' of {model}' if model else ''} in {registry.registry_root(root)}")
    for e in entries:
        print(f"{e.model}  {e.version}  {e.candidate}  {e.scheme}  {e.path}")


@registry_app.command("verify")
def verify_cmd(entry: Annotated[Path, typer.Argument(help="results/registry/<model>/<version>")]) -> None:
    """Re-hash the entry's checkpoint and files (its card included) from their bytes against its manifest."""
    man = registry.verify_entry(entry)
    print(f"ok {entry}: checkpoint sha256 {man.checkpoint.sha256}, {len(man.files or {})} other files")


def _target(target: str, token_env: str, public: bool) -> PublishTarget:
    if target.startswith(HUB):
        return PublishTarget(hf_repo=target.removeprefix(HUB), token_env=token_env, private=not public)
    if "://" in target:
        return PublishTarget(url=target)
    return PublishTarget(folder=Path(target).resolve())


@registry_app.command("publish")
def publish_cmd(
    entry: Annotated[Path, typer.Argument(help="results/registry/<model>/<version>")],
    target: Annotated[str, typer.Argument(help="a folder, an fsspec URL, or hf://OWNER/NAME")],
    token_env: Annotated[str, typer.Option(help="hf:// targets: the variable holding the Hub token")] = HF_TOKEN,
    public: Annotated[bool, typer.Option(help="hf:// targets: create the repository public (default private)")] = False,
) -> None:
    """Verify the entry, copy it to TARGET/<model>/<version> (or upload it to the Hub), read the copy back; the
    record is printed and appended to the entry's publish.json."""
    try:
        where = _target(target, token_env, public)
    except ValidationError as exc:
        print(f"error: TARGET {target!r}: {exc.errors()[0]['msg']}", file=sys.stderr)
        raise typer.Exit(2) from None
    man = registry.read_entry(entry)
    if man is None:
        print(f"error: {entry}: not a complete registry entry (no manifest.json)", file=sys.stderr)
        raise typer.Exit(2)
    if where.hf_repo is not None and not os.environ.get(where.token_env or HF_TOKEN):  # nothing to try with
        print(f"error: {where.token_env or HF_TOKEN} is not set: a Hub upload needs a token with write access "
              f"(export it, or name another variable with --token-env)", file=sys.stderr)
        raise typer.Exit(2)
    rec = publish_one(entry, where, candidate=str(man.candidate))  # verifies the entry from its bytes first
    print(json.dumps(as_json(rec), indent=2))
    raise typer.Exit(1 if rec.status == "failed" else 0)
