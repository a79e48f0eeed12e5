"""The registry's typed files (quantgate.publishing.registryfile) and the run's publish/notify logs: each written through
its model with the keys, order and values the plain dicts had, read back through it (leniently where a missing or
corrupt file is tolerated)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _gate_fixtures import checkpoint

from quantgate.base.fileio import write_json
from quantgate.base.typedfile import RunFileError
from quantgate.gate.summaryfile import NotifyRecord, PublishRecord, as_json
from quantgate.publishing import registry
from quantgate.publishing.publish import PublishLog
from quantgate.publishing.registryfile import (EntryPublishLog, EntryPublishRecord, NoEntry, PromotedEntry, RegistryEntry,
                                            load_promotion)
from quantgate.publishing.webhook import NotifyLog

DECISION = {"schema_version": 1, "decision": "PROMOTE", "candidate": "w4a16-gptq", "scheme": "w4a16-gptq",
            "family": "w4a16", "policy": {"name": "default", "version": 1},
            "checks": [{"name": "engine_parity", "passed": True}, {"name": "judge", "passed": None}], "reasons": []}
MANIFEST_KEYS = ["schema_version", "model", "version", "candidate", "scheme", "family", "checkpoint", "report", "card",
                 "files", "run", "policy", "checks", "created"]


def _legacy(folder: Path, sha: str) -> dict:
    """A schema 2 manifest (no card, no files) with a key this quantgate does not know."""
    doc = {"schema_version": 2, "model": "demo", "version": folder.name, "candidate": "w4a16-gptq", "scheme": "w4a16-gptq",
           "family": None, "checkpoint": {"source": "/x", "sha256": sha, "copied": True, "path": "checkpoint"},
           "report": {"source": None, "copy": None}, "run": None, "policy": None, "checks": {"passed": 1, "skipped": 0},
           "created": "2026-01-01T00:00:00+00:00", "from_a_newer_writer": {"a": [1, 2]}}
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps(doc))
    return doc


def test_a_new_entry_and_its_promotion_record_keep_their_keys_in_order(tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt")
    e = registry.promote(registry.Promotion(DECISION, model="demo", version="v1", checkpoint=ckpt),
                         root=tmp_path / "registry")
    assert isinstance(e, PromotedEntry) and e.reused is False and e.published is None
    man = json.loads((Path(e.path) / "manifest.json").read_text())
    assert list(man) == MANIFEST_KEYS and list(man["checkpoint"]) == ["source", "sha256", "evaluated_sha256", "copied",
                                                                      "how", "path"]
    assert man["report"] == {"source": None, "copy": None} and man["checks"] == {"passed": 1, "skipped": 1}
    e.write_promotion(tmp_path / "run" / "cand")
    text = (tmp_path / "run" / "cand" / "promotion.json").read_text()
    assert json.loads(text) == man | {"path": e.path, "reused": False}  # the manifest, then path and reused
    assert list(json.loads(text))[-2:] == ["path", "reused"] and text.endswith("}\n")
    back = load_promotion(tmp_path / "run" / "cand")
    assert isinstance(back, PromotedEntry) and back == e
    (listed,) = registry.list_entries(tmp_path / "registry")
    assert listed.path == e.path and listed.checkpoint.sha256 == e.checkpoint.sha256


def test_a_legacy_entry_is_reused_with_its_own_keys_and_a_newer_writers(tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt")
    root = tmp_path / "registry"
    doc = _legacy(root / "demo" / "v0", registry.checkpoint_hash(ckpt))
    e = registry.promote(registry.Promotion(DECISION, model="demo", version="v0", checkpoint=ckpt), root=root)
    e.write_promotion(tmp_path)
    text = (tmp_path / "promotion.json").read_text()
    want = doc | {"path": str(root / "demo" / "v0"), "reused": True}  # what `manifest | {...}` wrote before
    assert text == json.dumps(want, indent=2, ensure_ascii=False) + "\n"
    assert e.schema_version == 2 and e.files is None and e.model_extra == {"from_a_newer_writer": {"a": [1, 2]}}


@pytest.mark.parametrize("content", [None, "{not json", "[1, 2]", '{"model": "demo"}', '{"model": 1, "version": "v"}'])
def test_a_folder_without_a_readable_manifest_is_no_entry(tmp_path, content):
    if content is not None:
        (tmp_path / "manifest.json").write_text(content)
    assert registry.read_entry(tmp_path) is None and RegistryEntry.read(tmp_path) is None


def test_an_endpoints_promotion_record(tmp_path):
    NoEntry(reason="not applicable: endpoint: http://h/v1 serves it").write_promotion(tmp_path)
    assert (tmp_path / "promotion.json").read_text() == (
        '{\n  "registry": null,\n  "reason": "not applicable: endpoint: http://h/v1 serves it"\n}\n')
    back = load_promotion(tmp_path)
    assert isinstance(back, NoEntry) and back.registry is None
    (tmp_path / "promotion.json").write_text('{"registry": "x"}')
    with pytest.raises(RunFileError, match="promotion record"):
        load_promotion(tmp_path)


def test_the_entry_publish_log_appends_in_order_and_refuses_a_corrupt_one(tmp_path):
    assert EntryPublishLog.load(tmp_path).published == []
    hub = {"target": "hf://o/r", "status": "published", "where": "https://hf/c", "commit": "c0", "verified": False,
           "files": 3, "published": "2027-01-01T00:00:00+00:00"}
    local = {"target": "/shelf", "status": "exists", "where": "/shelf/demo/v1", "verified": True, "files": 3,
             "published": "2027-01-01T00:00:01+00:00"}
    EntryPublishLog(published=[EntryPublishRecord.model_validate(hub)]).write(tmp_path)
    done = EntryPublishLog.load(tmp_path)
    EntryPublishLog(published=[*done.published, EntryPublishRecord.model_validate(local)]).write(tmp_path)
    assert (tmp_path / "publish.json").read_text() == json.dumps({"published": [hub, local]}, indent=2) + "\n"
    (tmp_path / "publish.json").write_text("{")
    with pytest.raises(RunFileError, match="corrupt JSON"):
        EntryPublishLog.load(tmp_path)


def test_the_runs_publish_and_notify_logs_write_what_the_dicts_did(tmp_path):
    pub = [PublishRecord(candidate="c", entry="/e", target="/t", status="published", where="/t/demo/v1", error=None,
                         verified=True, files=3, published="2027", seconds=0.5),
           PublishRecord(candidate="c", entry="/e", target="hf://o/r", status="failed", where=None, error="no token")]
    note = [NotifyRecord(url="http://a", signed=False, delivery="d", status="failed", error="x", attempts=2)]
    PublishLog(run=tmp_path.name, records=pub).write(tmp_path)
    NotifyLog(run=tmp_path.name, records=note).write(tmp_path)
    write_json(tmp_path / "want-publish.json", {"run": tmp_path.name, "records": [as_json(r) for r in pub]})
    write_json(tmp_path / "want-notify.json", {"run": tmp_path.name, "records": [as_json(r) for r in note]})
    assert (tmp_path / "publish.json").read_bytes() == (tmp_path / "want-publish.json").read_bytes()
    assert (tmp_path / "notify.json").read_bytes() == (tmp_path / "want-notify.json").read_bytes()
    assert PublishLog.load(tmp_path).records == pub and NotifyLog.load(tmp_path).records == note
