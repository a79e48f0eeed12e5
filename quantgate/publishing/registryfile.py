"""The typed files of a registry entry (quantgate.publishing.registry) and of a promotion in a run folder.

    <entry>/manifest.json           RegistryEntry: what the entry holds (schema_version 3; 1 and 2 read as written)
    <entry>/publish.json            EntryPublishLog: where the entry was published, one EntryPublishRecord per publish
    <run>/<candidate>/promotion.json   PromotedEntry (the manifest plus `path` and `reused`), or NoEntry for an
                                    endpoint, which has no checkpoint to register; read with `load_promotion`

Every file is written with the fields its writer set (None included) in the order it always had, so the bytes are
those of the plain dicts written before; unknown keys of a newer writer are kept (`extra="allow"`).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import (BaseModel, ConfigDict, Field, RootModel, SerializerFunctionWrapHandler, ValidationError,
                      model_serializer)

from quantgate.base.fileio import write_json
from quantgate.base.runfiles import MANIFEST, PROMOTION, PUBLISH
from quantgate.base.typedfile import read_model

SCHEMA_VERSION = 3
_OPEN = ConfigDict(extra="allow", populate_by_name=True)


def _as_json(m: BaseModel) -> dict[str, object]:
    """The fields the writer set, in the file's order, JSON types."""
    return m.model_dump(mode="json", by_alias=True, exclude_unset=True)


class EntryCheckpoint(BaseModel):
    """The entry's checkpoint: where it came from, its hash and how its files came into the entry."""
    model_config = _OPEN

    source: str | None = Field(None, description="the evaluated checkpoint's folder")
    sha256: str | None = Field(None, description="content hash of the entry's checkpoint files")
    evaluated_sha256: str | None = Field(None, description="the hash the release evaluated (None: not known)")
    copied: bool | None = Field(None, description="the files are in the entry (schema 1 could point elsewhere)")
    how: str | None = Field(None, description="hardlink, copy, both (copy+hardlink) or empty")
    path: str | None = Field(None, description="the checkpoint folder, relative to the entry when copied")


class EntryReport(BaseModel):
    """The release report the entry was promoted with."""
    model_config = _OPEN

    source: str | None = Field(None, description="the report file's original path")
    copy_name: str | None = Field(None, alias="copy", description="its copy in the entry (report.<ext>), if any")


class EntryChecks(BaseModel):
    """How many of the decision's checks passed and how many were skipped."""
    model_config = _OPEN

    passed: int = 0
    skipped: int = 0


class RegistryEntry(BaseModel):
    """An entry's manifest.json, written last: a folder with one is a complete entry."""
    model_config = _OPEN

    schema_version: int = SCHEMA_VERSION
    model: str
    version: str
    candidate: str | None = None
    scheme: str | None = None
    family: str | None = None
    checkpoint: EntryCheckpoint = Field(default_factory=EntryCheckpoint)
    report: EntryReport | None = None
    card: str | None = Field(None, description="the model card's file name (schema 3)")
    files: dict[str, str] | None = Field(None, description="sha256 of the entry's other files (schema 3)")
    run: str | None = Field(None, description="the run folder it was promoted from")
    policy: dict[str, object] | None = None
    checks: EntryChecks | None = None
    created: str | None = Field(None, description="UTC time of the promotion")

    def write(self, folder: Path) -> None:
        """<folder>/manifest.json (folder: the entry being built)."""
        write_json(Path(folder) / MANIFEST, _as_json(self))

    @classmethod
    def read(cls, folder: Path | str) -> RegistryEntry | None:
        """The folder's manifest, or None when it is missing or unreadable (then the folder is no complete entry)."""
        try:
            return cls.model_validate_json((Path(folder) / MANIFEST).read_bytes())
        except (OSError, ValidationError):
            return None

    def located(self, path: Path | str) -> LocatedEntry:
        return LocatedEntry.model_validate(_as_json(self) | {"path": str(path)})

    def promoted(self, path: Path | str, *, reused: bool) -> PromotedEntry:
        return PromotedEntry.model_validate(_as_json(self) | {"path": str(path), "reused": reused})


class LocatedEntry(RegistryEntry):
    """An entry's manifest and its folder (registry.list_entries)."""

    path: str = Field(description="the entry's folder")

    @model_serializer(mode="wrap")
    def _manifest_first(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        d = handler(self)
        tail = {k: d.pop(k) for k in ("path", "reused", "published") if k in d}
        return d | tail  # the manifest's keys first (a newer writer's included), then these, as the file had them


class EntryPublishRecord(BaseModel):
    """One publish of the entry (registry.publish_entry): the target, the outcome and when."""
    model_config = _OPEN

    target: str | None = None
    status: str | None = Field(None, description="published or exists")
    where: str | None = Field(None, description="the copy's folder or URL, or the Hub commit's page")
    commit: str | None = Field(None, description="Hub uploads: the commit id")
    verified: bool | None = Field(None, description="the copy was read back and compared")
    files: int | None = Field(None, description="how many files the entry has")
    published: str | None = Field(None, description="UTC time of the publish")


class EntryPublishLog(BaseModel):
    """<entry>/publish.json: every publish of the entry, oldest first; not part of the entry (not hashed or copied)."""
    model_config = _OPEN

    published: list[EntryPublishRecord] = Field(default_factory=list)

    @classmethod
    def load(cls, entry: Path) -> EntryPublishLog:
        """The entry's publish log; an empty one when there is none yet (a corrupt one raises RunFileError)."""
        path = Path(entry) / PUBLISH
        if not path.is_file():
            return cls()
        return read_model(path, cls, "registry entry's publish record",
                          fix="repair or remove the entry's publish.json (it is a log, not part of the entry)")

    def write(self, entry: Path) -> None:
        write_json(Path(entry) / PUBLISH, _as_json(self))


class PromotedEntry(LocatedEntry):
    """What registry.promote returns and <run>/<candidate>/promotion.json holds: the manifest, the folder, whether
    the entry was already there, and where it was published (only when promote was told to)."""

    reused: bool = Field(description="the entry was there already (same checkpoint, same version)")
    published: EntryPublishRecord | None = None

    def write_promotion(self, folder: Path) -> None:
        """<folder>/promotion.json (folder: <run>/<candidate>)."""
        write_json(Path(folder) / PROMOTION, _as_json(self))


class NoEntry(BaseModel):
    """promotion.json of a candidate with no registry entry (an endpoint: no checkpoint here to register)."""
    model_config = ConfigDict(extra="allow")

    registry: None = None
    reason: str

    def write_promotion(self, folder: Path) -> None:
        write_json(Path(folder) / PROMOTION, self.model_dump(mode="json"))


class PromotionFile(RootModel[PromotedEntry | NoEntry]):
    """Either shape of promotion.json."""


def load_promotion(folder: Path | str) -> PromotedEntry | NoEntry:
    """<folder>/promotion.json (folder: <run>/<candidate>); raises RunFileError when missing or malformed."""
    return read_model(Path(folder) / PROMOTION, PromotionFile, "promotion record",
                      fix="it is written when the gate promotes the candidate; re-run the release").root
