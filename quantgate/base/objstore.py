"""Results on shared storage: folders of a host's results root copied to and from an fsspec URL.

A release spread over several hosts (quantgate.pools.executor) keeps working in each host's own results folder, as a
one-host release does, and shares what the others need through a store: `s3://bucket/prefix`, `gs://...`, or a path
every host mounts. A folder is shared whole, under the same relative name it has in the results root
(`cache/variants/<key>`, `checkpoints/<name>`, `runs/<run>/<variant>`):

    push  uploads the folder's files, then its manifest `_quantgate_manifest.json` (every file's sha256 and size, the
          writer's host and results root, whether the folder is complete): the manifest is the commit point. An object
          store's PUT is atomic; on a mounted path it is written beside and renamed. Readers trust nothing a manifest
          does not list.
    pull  reads the manifest, fetches each listed file whose local copy differs, checks its sha256 and renames it into
          place; a file that does not match (its folder was pushed again meanwhile) is fetched once more against the
          new manifest, then refused, naming the store key. In an unfinished folder, a file that has only grown
          since its manifest (answers appended by a writer still at work) is kept up to the manifest's size.

A folder pushed again replaces its manifest (only the files that changed are uploaded): a variant's cache folder
grows as later releases measure more under its key. A checkpoint, named by its quantization key, is pushed once.
A `partial` push (complete false) shares unfinished work, such as the answers a
server gave before its host was lost, so that a re-run elsewhere asks only for the rest.

Credentials and endpoints come from the filesystem's usual places (for S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_ENDPOINT_URL, ~/.aws), never from a release spec.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from quantgate.base.errors import ConfigError, QuantgateError, did_you_mean
from quantgate.base.fileio import sha256_file

MANIFEST = "_quantgate_manifest.json"
OBJECT_STORES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "memory")  # a PUT is atomic: no write-then-rename
_SKIP_SUFFIXES = (".lock", ".part")  # lock files name a local holder; .part files are downloads in progress


class FileEntry(TypedDict):
    """A shared file in a manifest: its sha256 and size."""
    sha256: str
    size: int


class StoreManifest(TypedDict):
    """`_quantgate_manifest.json`: the folder's files, whether it is complete, who pushed it from where, when."""
    files: dict[str, FileEntry]
    complete: bool
    host: str
    root: str
    written: float


def local_files(folder: Path) -> dict[str, FileEntry]:
    """The files a push shares: relative name -> sha256 and size (lock files and downloads in progress left out)."""
    out: dict[str, FileEntry] = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not p.name.endswith(_SKIP_SUFFIXES) and p.name != MANIFEST:
            out[p.relative_to(folder).as_posix()] = {"sha256": sha256_file(p), "size": p.stat().st_size}
    return out


def _cut_to(part: Path, meta: FileEntry) -> bool:
    """True when `part` starts with exactly the manifest's bytes, and cut to them: an unfinished folder's writer
    appends to its answers while a reader pulls, so the file it fetched may have grown since the manifest."""
    if part.stat().st_size <= meta["size"]:
        return False
    with part.open("rb") as f:
        head = f.read(meta["size"])
    if hashlib.sha256(head).hexdigest() != meta["sha256"]:
        return False
    part.write_bytes(head)
    return True


def _cannot_open(url: str, exc: Exception) -> ConfigError:
    """Why fsspec cannot open `url`, with the schemes the store takes: an unknown scheme (`sftpx://`) with the
    closest one fsspec knows, a known one whose filesystem is not installed with the package it needs."""
    from fsspec import available_protocols

    scheme, known = url.split("://", 1)[0] if "://" in url else "", available_protocols()
    hint = did_you_mean(scheme, known) if scheme and scheme not in known else ""
    return ConfigError(f"cannot open the results store {url}: {exc}{hint}; the store takes "
                       f"{', '.join(f'{s}://' for s in OBJECT_STORES)} (object stores), another fsspec URL whose "
                       "filesystem is installed, or a path every host mounts", where="executor.store",
                       fix="give one of those (s3:// needs s3fs, gs:// gcsfs; `python -c 'import fsspec; "
                           "print(fsspec.available_protocols())'` lists every scheme fsspec knows)")


@dataclass
class ResultStore:
    """The store at `url`, mirrored into this host's results root `local` (quantgate.base.paths.results_dir)."""

    url: str
    local: Path
    _fs: Any = field(default=None, init=False, repr=False)
    _root: str = field(default="", init=False, repr=False)

    def __post_init__(self) -> None:
        from fsspec.core import url_to_fs  # imported here: only a release that names a store needs it

        try:
            self._fs, self._root = url_to_fs(self.url)
        except (ImportError, ValueError) as exc:
            raise _cannot_open(self.url, exc) from exc
        self._root = self._root.rstrip("/")

    @property
    def atomic_put(self) -> bool:
        protocol = self._fs.protocol
        return bool(set([protocol] if isinstance(protocol, str) else protocol) & set(OBJECT_STORES))

    def key(self, rel: str) -> str:
        return f"{self._root}/{rel}" if self._root else rel

    def manifest(self, rel: str) -> StoreManifest | None:
        """The folder's manifest on the store; None when it was never pushed."""
        try:
            return json.loads(self._fs.cat_file(self.key(f"{rel}/{MANIFEST}")))
        except FileNotFoundError:
            return None

    def complete(self, rel: str) -> bool:
        m = self.manifest(rel)
        return m is not None and bool(m.get("complete"))

    def push(self, rel: str, *, complete: bool = True, source: Path | None = None) -> StoreManifest:
        """Upload `<local>/<rel>` (or a snapshot of it, `source`): the files that differ from the store's manifest,
        then the new manifest. A content-addressed folder that is complete on the store need not be pushed again:
        callers ask `complete()` first."""
        folder = source or self.local / rel
        if not folder.is_dir():
            raise QuantgateError(f"nothing to push: {folder} is not a folder", where=str(folder),
                                 fix="a bug in the caller: push what was measured, after it was measured")
        files = local_files(folder)
        prev = self.manifest(rel)
        had = prev.get("files", {}) if prev else {}
        for name, meta in files.items():
            if (old := had.get(name)) is None or old.get("sha256") != meta["sha256"]:
                self._fs.makedirs(posixpath.dirname(self.key(f"{rel}/{name}")), exist_ok=True)
                self._fs.put_file(str(folder / name), self.key(f"{rel}/{name}"))
        manifest: StoreManifest = {"files": files, "complete": complete, "host": socket.gethostname(), "root": str(self.local),
                    "written": time.time()}
        self._write_manifest(rel, json.dumps(manifest, indent=1).encode())
        return manifest

    def _write_manifest(self, rel: str, data: bytes) -> None:
        final = self.key(f"{rel}/{MANIFEST}")
        if self.atomic_put:
            self._fs.pipe_file(final, data)
            return
        tmp = f"{final}.{os.getpid()}.part"
        self._fs.pipe_file(tmp, data)
        self._fs.mv(tmp, final)

    def pull(self, rel: str, *, partial: bool = False) -> StoreManifest | None:
        """Fetch the folder into `<local>/<rel>`, every file checked against the manifest; None when the store has
        no complete folder there (`partial`: any pushed folder). Returns the manifest."""
        for attempt in (1, 2):
            m = self.manifest(rel)
            if m is None or not (m.get("complete") or partial):
                return None
            bad = self._fetch(rel, m, keep_local=not m.get("complete"))
            if bad is None:
                return m
            if attempt == 2:
                raise QuantgateError(f"{self.key(f'{rel}/{bad}')} does not match its manifest's sha256 twice in a row",
                                     where=self.url, fix="the folder is being pushed again while it is read: run "
                                     "again when its writer has finished; if it persists, delete the folder there")
        return None

    def _fetch(self, rel: str, m: StoreManifest, keep_local: bool) -> str | None:
        """The manifest's files into place; the name of the first one whose bytes do not match, else None.
        `keep_local`: a file this host has already is kept (an unfinished folder: this host's copy is as new)."""
        folder = self.local / rel
        for name, meta in m["files"].items():
            dest = folder / name
            if keep_local and dest.is_file():
                continue
            if dest.is_file() and dest.stat().st_size == meta["size"] and sha256_file(dest) == meta["sha256"]:
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            part = dest.with_name(dest.name + ".part")
            try:
                self._fs.get_file(self.key(f"{rel}/{name}"), str(part))
            except FileNotFoundError:
                return name
            if sha256_file(part) != meta["sha256"] and not (keep_local and _cut_to(part, meta)):
                part.unlink(missing_ok=True)
                return name
            os.replace(part, dest)
        return None

    def wait(self, rel: str, *, timeout_s: float, poll_s: float = 2.0, what: str = "") -> StoreManifest:
        """Pull the folder as soon as it is complete on the store; a QuantgateError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while (m := self.pull(rel)) is None:
            if time.monotonic() > deadline:
                raise QuantgateError(f"{what or rel} did not appear complete in {self.url} within {timeout_s:g} s",
                                     where=self.key(rel), fix="see its writer's flow run in Prefect; its failure "
                                     "is the cause")
            time.sleep(poll_s)
        return m
