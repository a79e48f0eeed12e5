"""Where a verified registry entry is copied to (adapter): a folder or any fsspec URL, or a Hugging Face Hub repo.

Folder and fsspec targets (`/srv/models`, `file:///srv/models`, `memory://models`, `s3://bucket/prefix` with s3fs
installed, ...) get the entry under <target>/<model>/<version>/:
- on a local filesystem it is written into a hidden sibling `.<version>.tmp-<pid>-<random>`, flushed to disk and
  renamed into place, so a reader sees the whole entry or none of it;
- elsewhere (object stores cannot rename a folder) every file is written in place and `manifest.json` last: as in
  the registry, a folder without its manifest is not an entry;
- afterwards every file is read back from the target and its sha256 compared with the entry's; a difference is an
  error. A target that already holds the same files is left as it is (`exists`); one that holds other files is
  refused, never overwritten.
`publish.json` (the entry's record of where it went) is not copied.

Hub targets: huggingface_hub (imported only then) creates the repository when it is missing (`private` applies
only then) and uploads the entry's folder in one commit. The Hub keeps its own hashes of what it received; quantgate
does not read the upload back.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from quantgate.base.runfiles import MANIFEST, PUBLISH
from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import fsync_path
from quantgate.target.catalogue import sha256_file

HUB = "hf://"
RECORD = PUBLISH


def entry_files(entry: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file a copy of the entry carries (its publish record aside)."""
    out = {}
    for f in sorted(p for p in Path(entry).rglob("*") if p.is_file()):
        rel = f.relative_to(entry).as_posix()
        if rel != RECORD:
            out[rel] = sha256_file(f)
    return out


def _digest(fs: Any, path: str) -> str | None:
    h = hashlib.sha256()
    try:
        with fs.open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    except FileNotFoundError:
        return None
    return h.hexdigest()


def differences(fs: Any, dest: str, want: dict[str, str]) -> list[str]:
    """What differs between the copy at `dest` and the files `want` (missing, changed or extra), read back in full."""
    found = {p[len(dest) + 1:] for p in fs.find(dest)} if fs.exists(dest) else set()
    found.discard(RECORD)
    bad = []
    for rel, sha in want.items():
        got = _digest(fs, f"{dest}/{rel}")
        if got != sha:
            bad.append(f"{rel} {'missing' if got is None else 'differs'}")
    return bad + [f"{rel} is not in the entry" for rel in sorted(found - set(want))]


def _put_all(fs: Any, entry: Path, dest: str, names: list[str]) -> None:
    """Write the files, manifest.json last."""
    for rel in sorted(names, key=lambda r: r == MANIFEST):
        parent = f"{dest}/{rel}".rsplit("/", 1)[0]
        fs.makedirs(parent, exist_ok=True)
        fs.put_file(str(entry / rel), f"{dest}/{rel}")


def _local_copy(entry: Path, dest: Path, names: list[str]) -> None:
    """Build the copy in a hidden sibling folder, flush it, and rename it into place (one step on one filesystem)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        for rel in sorted(names, key=lambda r: r == MANIFEST):
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(entry / rel, tmp / rel)
            fsync_path(tmp / rel)
        for folder in sorted({(tmp / rel).parent for rel in names}, reverse=True):
            fsync_path(folder)
        os.rename(tmp, dest)
        fsync_path(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_to(entry: Path, target: str, *, model: str, version: str) -> dict[str, Any]:
    """Copy the entry to <target>/<model>/<version> (module docstring); returns status (`published` or `exists`),
    where, verified, files. Raises QuantgateError when the target holds something else or the copy reads back wrong."""
    try:
        fs, base = fsspec.core.url_to_fs(target)
    except (ImportError, ValueError) as exc:
        raise QuantgateError(f"cannot open publish target {target!r}: {exc}", where=target,
                             fix="use a folder path or an fsspec URL whose backend is installed (e.g. s3fs for s3://)") from None
    dest = f"{base.rstrip('/')}/{model}/{version}"
    want = entry_files(entry)
    shown = dest if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(dest)
    if fs.exists(dest):
        bad = differences(fs, dest, want)
        if not bad:
            return {"status": "exists", "where": shown, "verified": True, "files": len(want)}
        raise QuantgateError(f"the publish target already holds another {model} {version}: {'; '.join(bad[:5])}",
                             where=shown, fix="publish under a new version, or remove the old copy by hand")
    if isinstance(fs, LocalFileSystem):
        _local_copy(entry, Path(dest), list(want))
    else:
        _put_all(fs, entry, dest, list(want))
    bad = differences(fs, dest, want)
    if bad:
        raise QuantgateError(f"the copy does not read back as the entry: {'; '.join(bad[:5])}", where=shown,
                             fix="check the target's storage, remove the copy and publish again")
    return {"status": "published", "where": shown, "verified": True, "files": len(want)}


def upload_to_hub(entry: Path, repo: str, *, token: str | None, private: bool, api: Any = None,
                  message: str) -> dict[str, Any]:
    """Upload the entry's folder to the Hub model repository `repo` in one commit (created when missing)."""
    if api is None:
        from huggingface_hub import HfApi  # only when publishing to the Hub

        api = HfApi(token=token)
    api.create_repo(repo, private=private, repo_type="model", exist_ok=True)
    info = api.upload_folder(repo_id=repo, folder_path=str(entry), repo_type="model", commit_message=message,
                             ignore_patterns=[RECORD])
    where = getattr(info, "commit_url", None) or f"https://huggingface.co/{repo}"
    return {"status": "published", "where": str(where), "commit": getattr(info, "oid", None), "verified": False,
            "files": len(entry_files(entry))}
