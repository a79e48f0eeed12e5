"""Local registry of promoted variants (adapter): results/registry/<model>/<version>/, written atomically.

An entry holds:
    manifest.json    (quantgate.publishing.registryfile.RegistryEntry) model, version, candidate, scheme, checkpoint (source, sha256 of the entry's files, the
                     evaluated sha256, how the files came in), `files` (sha256 of the entry's other files: the
                     decision, the card, the report copy), run, report, decision summary, created; written last,
                     so a folder with a manifest is complete
    decision.json    the gate's decision for this candidate (quantgate.gate.checks.Decision)
    README.md        the model card (quantgate.report.modelcard): scheme, recipe, calibration, the evidence table,
                     the decision and its reasons, the `vllm serve` line; rendered from the run folder
    report.<ext>     a copy of the release report file, when one is given (its original path is in the manifest)
    checkpoint/      the evaluated checkpoint's files: hard links where the registry shares the checkpoint's
                     filesystem (no second copy of the weights), else copies; copies always with copy_checkpoint=True
    publish.json     where the entry was published (registryfile.EntryPublishLog, appended per publish): a record
                     about the entry, not part of it (not hashed, not copied)

What an entry serves is what was evaluated: the evaluated hash (`expected_sha256`, else the Variant's content_hash in
<run>/<candidate>/evidence.json) must equal the checkpoint's hash before anything is written, and the hash of the
entry's own files, read byte for byte, must equal it before the entry is renamed into place; otherwise the
promotion is refused and the temporary folder removed. `verify_entry` re-hashes the checkpoint and every file in
`files` (the card included). Entries made before this (schema_version 1) may point at the checkpoint folder
instead (`copied: false`); schema_version 2 entries have no card and no `files`.

Atomicity: the entry is built in a hidden sibling folder `.<version>.tmp-<pid>-<random>` and renamed into place in
one step, so a crash at any point leaves no `<version>` folder. Promoting the same checkpoint under the same version
again returns the existing entry; another checkpoint under a taken version is refused.

Locks: a promotion holds the version's lock (`quantgate.base.fileio.lock`, the file
`<registry>/.locks/<model>/<version>.lock`) from its first look at the entry to the rename, so two promotions of
one version run one after the other and the second reuses or refuses the first's entry. A hidden leftover
`.<version>.tmp-*` is stale exactly when that version's lock is free (its promotion ended or died: the kernel drops
the lock with the process); the next promotion of any version of the model removes it. No decision is taken from
a process id, which would be wrong on storage shared by several hosts.

Publishing (`publish_entry`) is off by default: the entry is verified from its bytes, then copied to a folder or
an fsspec URL under <target>/<model>/<version>/ (quantgate.publishing.targets: atomically where the target can rename,
read back and compared after), or uploaded to a Hugging Face Hub repository (`hf://<owner>/<repo>`, huggingface_hub
imported only then). Release specs reach it through `publish:` (quantgate.publishing.publish), the command line
through `quantgate registry publish`.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantgate.base.runfiles import DECISION, EVIDENCE, MANIFEST
from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import is_locked, lock, write_json
from quantgate.base.paths import results_dir
from quantgate.gate.models import Decision
from quantgate.publishing import targets
from quantgate.publishing.registryfile import (SCHEMA_VERSION, EntryCheckpoint, EntryChecks, EntryPublishLog,
                                            EntryPublishRecord, EntryReport, LocatedEntry, PromotedEntry, RegistryEntry)
from quantgate.report.modelcard import CARD, card_inputs, render_card
from quantgate.target.catalogue import checkpoint_hash, sha256_file

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
STEPS = ("decision", "report", "checkpoint", "card", "manifest", "rename")
PUBLISHED = targets.RECORD  # publish.json: where the entry went; not part of it
TMP_MARK = ".tmp-"  # .<version>.tmp-<pid>-<random>: an entry being built
LOCK_TIMEOUT_S = 3600.0  # a promotion copies a checkpoint at most: a holder this slow is named in the error


def _after_step(step: str) -> None:
    """Called after each step of a promotion; tests replace it to kill the process between steps."""


def registry_root(root: Path | str | None = None) -> Path:
    return Path(root) if root else results_dir() / "registry"


def version_lock(model_dir: Path, version: str) -> Path:
    """The path whose lock guards one version of a model: <registry>/.locks/<model>/<version> (the lock file is
    that plus `.lock`; outside the model's folder, so an entry's folder holds entries only)."""
    return model_dir.parent / ".locks" / model_dir.name / version


def _clean_stale(model_dir: Path, held: str) -> list[str]:
    """Remove temporary entries whose promotion is over: their version's lock is free, or it is `held`, the version
    whose lock the caller holds (then nobody else can be building it). Returns what was removed."""
    removed = []
    for d in sorted(model_dir.glob(f".*{TMP_MARK}*")):
        version = d.name[1:].rsplit(TMP_MARK, 1)[0]
        if d.is_dir() and (version == held or not is_locked(version_lock(model_dir, version))):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    return removed


def read_entry(folder: Path | str) -> RegistryEntry | None:
    """An entry's manifest, or None when the folder is not a complete entry (no manifest, or one that is unreadable
    or does not fit RegistryEntry)."""
    return RegistryEntry.read(folder)


def list_entries(root: Path | str | None = None, model: str | None = None) -> list[LocatedEntry]:
    """Manifests of every complete entry (hidden temporary folders are not entries)."""
    base = registry_root(root)
    models = [base / model] if model else sorted(p for p in base.glob("*") if p.is_dir() and not p.name.startswith("."))
    out = []
    for m in models:
        for v in sorted(p for p in m.glob("*") if p.is_dir() and not p.name.startswith(".")):
            man = read_entry(v)
            if man is not None:
                out.append(man.located(v))
    return out


def _decision_dict(decision: Decision | Mapping[str, Any]) -> dict[str, Any]:
    d = decision.model_dump(mode="json") if isinstance(decision, Decision) else dict(decision)
    if d.get("decision") != "PROMOTE":
        raise QuantgateError(f"the decision for {d.get('candidate')!r} is {d.get('decision')!r}, not PROMOTE",
                             where="registry.promote", fix="only a candidate the gate promoted can be registered")
    return d


def _same(existing: RegistryEntry, sha: str, candidate: str | None) -> bool:
    return existing.checkpoint.sha256 == sha and existing.candidate == candidate


def evaluated_hash(run: Path | str | None, candidate: str | None) -> str | None:
    """The content hash of the weights the release evaluated for `candidate`: <run>/<candidate>/evidence.json's
    variant.content_hash. None when `run` is not a run folder; a run folder without it is refused."""
    if run is None or not candidate or not Path(run).is_dir():
        return None
    path = Path(run) / candidate / EVIDENCE
    try:
        sha = json.loads(path.read_text(encoding="utf-8"))["variant"]["content_hash"]
    except (OSError, ValueError, KeyError, TypeError):
        sha = None
    if not isinstance(sha, str) or not sha:
        raise QuantgateError(f"the run has no evaluated content hash for {candidate!r}", where=str(path),
                             fix="promote from a run whose evidence.json records the variant (re-run the release)")
    return sha


def _skip_hidden_folders(folder: str, names: list[str]) -> set[str]:
    return {n for n in names if n.startswith(".") and os.path.isdir(os.path.join(folder, n))}


def _materialize(checkpoint: Path, dest: Path, copy: bool) -> str:
    """Put the checkpoint's files into dest (hidden folders aside, as checkpoint_hash does): hard links (no second
    copy of the weights), or copies where linking fails (another filesystem) or with copy=True. Returns how."""
    used: set[str] = set()

    def link_or_copy(src: str, dst: str) -> str:
        if not copy:
            try:
                os.link(src, dst)
                used.add("hardlink")
                return dst
            except OSError:
                pass
        shutil.copy2(src, dst)
        used.add("copy")
        return dst

    shutil.copytree(checkpoint, dest, ignore=_skip_hidden_folders, copy_function=link_or_copy)
    return "+".join(sorted(used)) or "empty"


def _mismatch(what: str, got: str, want: str, where: Path) -> QuantgateError:
    return QuantgateError(f"{what} has content hash {got[:12]}..., but the weights that were evaluated have "
                          f"{want[:12]}...: refusing to promote weights that were not evaluated", where=str(where),
                          fix="restore the evaluated checkpoint, or re-run the release so the gate evaluates these weights")


def _check_inputs(d: dict, model: str, version: str, checkpoint: Path, run: Path | str | None,
                  expected_sha256: str | None) -> str | None:
    """Refuse unsafe names, a missing checkpoint or two evaluated hashes that disagree; the evaluated hash."""
    for field, value in (("model", model), ("version", version)):
        if not NAME.match(value):
            raise QuantgateError(f"{field} {value!r} is not a safe folder name", where=f"registry.promote {field}",
                                 fix="use letters, digits and . _ + - (not starting with a dot)")
    if not checkpoint.is_dir():
        raise QuantgateError("checkpoint folder not found", where=str(checkpoint), fix="give the promoted variant's folder")
    from_run = evaluated_hash(run, d.get("candidate"))
    if expected_sha256 and from_run and expected_sha256 != from_run:
        assert run is not None  # from_run is read from it
        raise _mismatch("the given evaluated hash", expected_sha256, from_run, Path(run) / str(d.get("candidate")))
    return expected_sha256 or from_run


@dataclass(frozen=True)
class _Entry:
    """One promotion's inputs, checked (promote builds it once; _build and _manifest read it)."""
    decision: dict[str, Any]
    model: str
    version: str
    checkpoint: Path
    want: str                  # the hash the entry's checkpoint must have: the evaluated one, else the source's
    evaluated: str | None      # the evaluated checkpoint's hash, when the run or the caller gave it
    report: Path | str | None
    run: Path | str | None
    copy_checkpoint: bool


def _manifest(e: _Entry, got: str, how: str, report_copy: str | None, files: dict[str, str]) -> RegistryEntry:
    d = e.decision
    return RegistryEntry(
        schema_version=SCHEMA_VERSION, model=e.model, version=e.version, candidate=d.get("candidate"),
        scheme=d.get("scheme"), family=d.get("family"),
        checkpoint=EntryCheckpoint(source=str(e.checkpoint.resolve()), sha256=got, evaluated_sha256=e.evaluated,
                                   copied=True, how=how, path="checkpoint"),
        report=EntryReport(source=str(e.report) if e.report else None, copy_name=report_copy),
        card=CARD, files=files,
        run=str(e.run) if e.run else None, policy=d.get("policy"),
        checks=EntryChecks(passed=sum(c.get("passed") is True for c in d.get("checks", [])),
                           skipped=sum(c.get("passed") is None for c in d.get("checks", []))),
        created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    )


@dataclass(frozen=True)
class Promotion:
    """What to register: the gate's PROMOTE decision (a Decision or its dict), the entry's name (model, version)
    and the checkpoint that was evaluated. `report` is copied into the entry; `run` feeds the model card and the
    evaluated hash (its evidence); `expected_sha256` gives that hash directly."""
    decision: Decision | Mapping[str, Any]
    model: str
    version: str
    checkpoint: Path | str
    report: Path | str | None = None
    run: Path | str | None = None
    expected_sha256: str | None = None


def promote(p: Promotion, *, copy_checkpoint: bool = False, root: Path | str | None = None,
            publish: str | None = None) -> PromotedEntry:
    """Register a promoted candidate; returns its manifest plus `path` and `reused` (True when it was there).

    The checkpoint's files go into the entry (<entry>/checkpoint): hard-linked, or copied where linking fails;
    copy_checkpoint=True always copies. The evaluated hash is `p.expected_sha256`, else the run's evidence
    (evaluated_hash); the checkpoint must match it before anything is written, and the entry's files, re-hashed
    from their bytes, must match it before the entry is renamed into place. Runs under the version's lock.
    `publish`: a target to copy the new entry to (publish_entry)."""
    decision, model, version, report, run = p.decision, p.model, p.version, p.report, p.run
    expected_sha256 = p.expected_sha256
    d = _decision_dict(decision)
    checkpoint = Path(p.checkpoint)
    evaluated = _check_inputs(d, model, version, checkpoint, run, expected_sha256)
    sha = checkpoint_hash(checkpoint)
    want = evaluated or sha
    model_dir = registry_root(root) / model
    target = model_dir / version
    existing = read_entry(target)
    if existing is not None:
        return _reuse(existing, target, want, d)
    if sha != want:  # refused before anything is written (the lock file included)
        raise _mismatch(f"checkpoint {checkpoint}", sha, want, checkpoint)
    with lock(version_lock(model_dir, version), timeout=LOCK_TIMEOUT_S, what=f"promote {model} {version}"):
        existing = read_entry(target)  # again: a promotion that held the lock before us may have made it
        if existing is not None:
            return _reuse(existing, target, want, d)
        model_dir.mkdir(parents=True, exist_ok=True)
        _clean_stale(model_dir, held=version)
        tmp = model_dir / f".{version}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            manifest = _build(tmp, _Entry(d, model, version, checkpoint, want, evaluated, report, run,
                                          copy_checkpoint))
            try:
                os.rename(tmp, target)
            except OSError:  # an entry appeared without taking the lock (an older quantgate): keep it if the same
                other = read_entry(target)
                if other is None:
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
                return _reuse(other, target, want, d)
            _after_step("rename")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    result = manifest.promoted(target, reused=False)
    if publish:
        result = result.model_copy(update={"published": publish_entry(target, publish)})
    return result


def _build(tmp: Path, e: _Entry) -> RegistryEntry:
    """Fill the hidden folder `tmp` with the entry: decision, report copy, checkpoint files (verified), manifest."""
    write_json(tmp / DECISION, e.decision)
    _after_step("decision")
    report_copy = None
    if e.report is not None and Path(e.report).is_file():
        report_copy = f"report{Path(e.report).suffix}"
        shutil.copy2(e.report, tmp / report_copy)
    _after_step("report")
    how = _materialize(e.checkpoint, tmp / "checkpoint", e.copy_checkpoint)
    got = checkpoint_hash(tmp / "checkpoint", use_cache=False)  # every byte, no cache: what the entry serves
    if got != e.want:
        raise _mismatch("the copied checkpoint", got, e.want, e.checkpoint)
    _after_step("checkpoint")
    card = render_card(card_inputs(e.run, str(e.decision.get("candidate")), model=e.model, version=e.version,
                                   decision=e.decision, sha256=got))
    (tmp / CARD).write_text(card, encoding="utf-8")
    _after_step("card")
    files = {name: sha256_file(tmp / name) for name in (DECISION, CARD, report_copy) if name}
    manifest = _manifest(e, got, how, report_copy, files)
    manifest.write(tmp)
    _after_step("manifest")
    return manifest


def verify_entry(entry: Path | str) -> RegistryEntry:
    """Re-hash an entry's checkpoint from its bytes against its manifest; returns the manifest or raises."""
    entry = Path(entry)
    man = read_entry(entry)
    if man is None:
        raise QuantgateError("not a complete registry entry", where=str(entry), fix="give results/registry/<model>/<version>")
    ck = man.checkpoint
    folder = (entry / ck.path if ck.copied else Path(ck.path)) if ck.path else None
    if folder is None or not folder.is_dir():
        raise QuantgateError("the entry's checkpoint folder is missing", where=str(folder or entry / MANIFEST),
                             fix="promote it again")
    got = checkpoint_hash(folder, use_cache=False)
    if got != ck.sha256:
        raise QuantgateError(f"the entry's checkpoint has content hash {got[:12]}..., its manifest says "
                             f"{str(ck.sha256)[:12]}... (modified since promotion)", where=str(folder),
                             fix="promote the evaluated checkpoint again under a new version")
    for name, sha in (man.files or {}).items():  # the decision, the card, the report copy
        path = entry / name
        now = sha256_file(path) if path.is_file() else "missing"
        if now != sha:
            raise QuantgateError(f"the entry's {name} is {'missing' if now == 'missing' else 'modified'} since promotion "
                                 f"(sha256 {now[:12]}, manifest {sha[:12]})", where=str(path),
                                 fix="promote the evaluated checkpoint again under a new version")
    return man


def _reuse(existing: RegistryEntry, target: Path, sha: str, d: dict[str, Any]) -> PromotedEntry:
    if not _same(existing, sha, d.get("candidate")):
        raise QuantgateError(f"version already registered for another checkpoint ({existing.candidate}, "
                             f"sha256 {str(existing.checkpoint.sha256)[:12]})", where=str(target),
                             fix="promote under a new version")
    return existing.promoted(target, reused=True)


def publish_entry(entry: Path | str, target: str, *, token: str | None = None, private: bool = True,
                  api: Any = None) -> EntryPublishRecord:
    """Verify the entry from its bytes, then copy it to `target`: a folder or fsspec URL (<target>/<model>/<version>,
    its manifest's model and version,
    read back and compared), or `hf://<owner>/<repo>` (uploaded with huggingface_hub; `api`: an HfApi or a stand-in,
    `token` for a new HfApi). Appends the outcome to <entry>/publish.json and returns it; raises on failure."""
    entry = Path(entry)
    man = verify_entry(entry)
    model, version = man.model, man.version
    if target.startswith(targets.HUB):
        out = targets.upload_to_hub(entry, target.removeprefix(targets.HUB), token=token, private=private, api=api,
                                    message=f"quantgate: promote {model} {version}")
    else:
        out = targets.copy_to(entry, target, model=model, version=version)
    record = EntryPublishRecord.model_validate({"target": target, **out,
                                                "published": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")})
    with lock(version_lock(entry.parent, f"{entry.name}.publish"), timeout=60.0, what=f"record publish of {entry}"):
        done = EntryPublishLog.load(entry)
        EntryPublishLog(published=[*done.published, record]).write(entry)
    return record
