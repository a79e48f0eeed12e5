"""What goes out after a decision: `publish:` and `notify:` in the spec (validated at load with file, line and field),
copies of a verified entry to folders and fsspec URLs (atomic where the target renames, read back after), the Hub
through an injected stand-in, and the decision webhook against a real local HTTP receiver (http.server on a thread).

The Hugging Face Hub cannot be reached from here: its tests inject a fake HfApi that records the calls quantgate makes
(create_repo, upload_folder) and answers like huggingface_hub does; everything else is real (files, fsspec, HTTP).
A real release that publishes and notifies is tests/test_release_e2e.py's first run (it promotes)."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import fsspec
import pytest
import yaml
from _publish_fixtures import CAND, Receiver, gated_run
from prefect.events.schemas.automations import AutomationCore
from typer.testing import CliRunner

from quantgate.gate.summaryfile import Summary, as_json, write_summary
from quantgate.base.errors import ConfigError, QuantgateError
from quantgate.base.paths import REPO
from quantgate.cli.main import app
from quantgate.gate.models import EXIT_CODES
from quantgate.publishing import publish as publishing, registry, targets, webhook
from quantgate.publishing.publish import NotifySpec, PublishTarget
from quantgate.spec.resolve import load_spec

GOOD = """\
version: 1
name: mine
model: demo
hardware: x86-cpu
workload: latency
schemes: [w4a16-gptq]
"""


# --- the spec -------------------------------------------------------------------------------------------------------

def spec_file(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(GOOD + extra)
    return path


def test_publish_and_notify_load_with_paths_relative_to_the_spec(tmp_path):
    spec = load_spec(spec_file(tmp_path, "publish:\n  - folder: out\n  - url: memory://bucket\n"
                                         "  - {hf_repo: org/demo-w4a16, private: false}\n"
                                         "notify:\n  - {url: http://127.0.0.1:9/hook, secret_env: HOOK_KEY}\n"))
    assert [t.label for t in spec.publish] == [str(tmp_path / "out"), "memory://bucket", "hf://org/demo-w4a16"]
    assert spec.publish[2].private is False and spec.notify[0].attempts == 5
    assert load_spec(spec_file(tmp_path, "")).publish == [] == load_spec(spec_file(tmp_path, "")).notify


@pytest.mark.parametrize("extra, line, field, words", [
    ("publish:\n  - {folder: a, url: memory://b}\n", 8, "publish.0", "exactly one of folder, url or hf_repo"),
    ("publish:\n  - {}\n", 8, "publish.0", "exactly one of"),
    ("publish:\n  - url: nosuch://x\n", 8, "publish.0.url", "fsspec knows no protocol 'nosuch'"),
    ("publish:\n  - url: some/dir\n", 8, "publish.0.url", "write `folder: some/dir`"),
    ("publish:\n  - url: hf://org/x\n", 8, "publish.0.url", "hf_repo"),
    ("publish:\n  - {folder: a, token_env: HF_TOKEN}\n", 8, "publish.0", "hf_repo targets only"),
    ("publish:\n  - hf_repo: not-a-repo\n", 8, "publish.0.hf_repo", "should match pattern"),
    ("publish:\n  - {hf_repo: o/n, token_env: 1BAD}\n", 8, "publish.0.token_env", "should match pattern"),
    ("publish:\n  - {folder: a, privat: true}\n", 8, "publish.0.privat", "Extra inputs"),
    ("notify:\n  - url: ftp://x/hook\n", 8, "notify.0.url", "should match pattern"),
    ("notify:\n  - {url: http://x, attempts: 0}\n", 8, "notify.0.attempts", "greater than or equal to 1"),
    ("notify:\n  - {url: http://x, secret_env: my-secret}\n", 8, "notify.0.secret_env", "should match pattern"),
])
def test_mistakes_name_the_file_line_and_field(tmp_path, extra, line, field, words):
    path = spec_file(tmp_path, extra)
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    text = err.value.render()
    assert f"{path}:{line}" in text and f"field '{field}'" in text and words in text, text


def test_a_missing_webhook_secret_stops_the_release_before_any_work(monkeypatch):
    monkeypatch.delenv("QG_TEST_HOOK_KEY", raising=False)
    with pytest.raises(QuantgateError, match=r"notify\[0\].secret_env names QG_TEST_HOOK_KEY, which is not set"):
        publishing.check_env([NotifySpec(url="http://127.0.0.1:9", secret_env="QG_TEST_HOOK_KEY")])
    monkeypatch.setenv("QG_TEST_HOOK_KEY", "k")
    publishing.check_env([NotifySpec(url="http://127.0.0.1:9", secret_env="QG_TEST_HOOK_KEY")])


# --- targets --------------------------------------------------------------------------------------------------------

@pytest.fixture
def entry(tmp_path):
    """A real promoted entry of a gated run (card, decision, hard-linked checkpoint)."""
    run, ckpt, (d,) = gated_run(tmp_path / "work")
    e = registry.promote(registry.Promotion(d, model="demo", version="v1", checkpoint=ckpt, run=run),
                         root=tmp_path / "registry")
    return Path(e.path)


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_folder_publish_copies_the_verified_entry_and_reads_it_back(entry, tmp_path):
    rec = registry.publish_entry(entry, str(tmp_path / "shelf"))
    dest = tmp_path / "shelf" / "demo" / "v1"
    assert rec.status == "published" and rec.where == str(dest) and rec.verified is True
    assert tree(dest) == {k: v for k, v in tree(entry).items() if k != "publish.json"}
    assert registry.verify_entry(dest).version == "v1"  # the copy is itself a verifiable entry, card included
    assert [p.name for p in (tmp_path / "shelf" / "demo").iterdir()] == ["v1"]  # no temporary folder left
    assert (dest / "checkpoint" / "model.safetensors").stat().st_ino != (entry / "checkpoint" / "model.safetensors").stat().st_ino
    again = registry.publish_entry(entry, f"file://{tmp_path / 'shelf'}")
    assert again.status == "exists" and again.verified is True
    history = json.loads((entry / "publish.json").read_text())["published"]
    assert [h["status"] for h in history] == ["published", "exists"]


def test_a_copy_that_fails_part_way_leaves_nothing_at_the_target(entry, tmp_path, monkeypatch):
    real, calls = shutil.copy2, []

    def copy_then_fail(src, dst, *a, **k):
        calls.append(dst)
        if len(calls) == 3:
            raise OSError("disk full")
        return real(src, dst, *a, **k)
    monkeypatch.setattr(targets.shutil, "copy2", copy_then_fail)
    with pytest.raises(OSError, match="disk full"):
        registry.publish_entry(entry, str(tmp_path / "shelf"))
    assert list((tmp_path / "shelf" / "demo").iterdir()) == []  # neither v1 nor the hidden temporary folder


def test_a_target_holding_another_entry_is_refused_not_overwritten(entry, tmp_path):
    registry.publish_entry(entry, str(tmp_path / "shelf"))
    card = tmp_path / "shelf" / "demo" / "v1" / "README.md"
    card.write_text("someone else's card")
    with pytest.raises(QuantgateError, match="already holds another demo v1: README.md differs"):
        registry.publish_entry(entry, str(tmp_path / "shelf"))
    assert card.read_text() == "someone else's card"


def test_memory_url_publish_writes_the_manifest_last_and_verifies(entry, monkeypatch):
    fs = fsspec.filesystem("memory")
    order, real = [], fs.put_file
    monkeypatch.setattr(type(fs), "put_file", lambda self, lpath, rpath, **k: order.append(Path(rpath).name) or real(lpath, rpath, **k))
    rec = registry.publish_entry(entry, "memory://shelf-a")
    try:
        assert rec.status == "published" and rec.where == "memory:///shelf-a/demo/v1"
        assert order[-1] == "manifest.json" and len(order) == rec.files
        assert fs.cat_file("/shelf-a/demo/v1/README.md") == (entry / "README.md").read_bytes()
    finally:
        fs.rm("/shelf-a", recursive=True)


def test_a_copy_that_reads_back_wrong_is_an_error(entry, monkeypatch):
    fs = fsspec.filesystem("memory")
    real = targets._put_all

    def corrupt(fs_, entry_, dest, names):
        real(fs_, entry_, dest, names)
        fs_.pipe_file(f"{dest}/decision.json", b"{}")
    monkeypatch.setattr(targets, "_put_all", corrupt)
    try:
        with pytest.raises(QuantgateError, match="does not read back as the entry: decision.json differs"):
            registry.publish_entry(entry, "memory://shelf-b")
    finally:
        fs.rm("/shelf-b", recursive=True)


def test_a_modified_entry_is_not_published(entry, tmp_path):
    (entry / "README.md").write_text("edited after promotion")
    with pytest.raises(QuantgateError, match="modified since promotion"):
        registry.publish_entry(entry, str(tmp_path / "shelf"))
    assert not (tmp_path / "shelf").exists()


class FakeHub:
    """Stands in for huggingface_hub.HfApi (the Hub is unreachable here): records the calls, answers like it."""

    def __init__(self, fail: str | None = None):
        self.calls, self.fail = [], fail

    def create_repo(self, repo_id, **kw):
        self.calls.append(("create_repo", repo_id, kw))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, **kw):
        self.calls.append(("upload_folder", kw["repo_id"], kw))
        if self.fail:
            raise RuntimeError(self.fail)
        return SimpleNamespace(oid="c0ffee", commit_url=f"https://huggingface.co/{kw['repo_id']}/commit/c0ffee")


def test_hub_upload_creates_a_private_repo_and_uploads_the_entry(entry, monkeypatch):
    monkeypatch.setenv("QG_TEST_HF", "hf_x")
    hub = FakeHub()
    rec = as_json(publishing.publish_one(entry, PublishTarget(hf_repo="org/demo", token_env="QG_TEST_HF"), candidate=CAND, api=hub))
    assert rec["status"] == "published" and rec["where"].endswith("/commit/c0ffee") and rec["commit"] == "c0ffee"
    (_, repo, create), (_, _, upload) = hub.calls
    assert repo == "org/demo" and create == {"private": True, "repo_type": "model", "exist_ok": True}
    assert upload["folder_path"] == str(entry) and upload["ignore_patterns"] == ["publish.json"]


def test_hub_without_a_token_is_a_failed_publish_not_a_skip(entry, monkeypatch):
    monkeypatch.delenv("QG_TEST_HF", raising=False)
    hub = FakeHub()
    rec = as_json(publishing.publish_one(entry, PublishTarget(hf_repo="org/demo", token_env="QG_TEST_HF"), candidate=CAND, api=hub))
    assert rec["status"] == "failed" and "QG_TEST_HF is not set" in rec["error"] and hub.calls == []
    assert "quantgate registry publish" in rec["error"]  # how to finish it by hand


def test_a_failed_upload_is_recorded(entry, monkeypatch):
    monkeypatch.setenv("QG_TEST_HF", "hf_x")
    rec = as_json(publishing.publish_one(entry, PublishTarget(hf_repo="org/demo", token_env="QG_TEST_HF"), candidate=CAND,
                                       api=FakeHub(fail="403 Forbidden")))
    assert rec["status"] == "failed" and rec["error"] == "RuntimeError: 403 Forbidden"


# --- the webhook ------------------------------------------------------------------------------------------------------

@pytest.fixture
def receiver():
    made = []

    def make(statuses, body=b'{"ok": true}'):
        made.append(Receiver(statuses, body))
        return made[-1]
    yield make
    for r in made:
        r.close()


def _summary(run: Path) -> Summary:
    """summary.json as finish_run writes it, the parts the webhook reads (this fixture's run has no baseline evidence)."""
    cmp_ = json.loads((run / "compare" / f"{CAND}.json").read_text())["default"]["metrics"]
    doc = json.loads((run / "decision.json").read_text())
    summary = {"release": "mine", "run": run.name, "decision": doc["decision"], "promoted": [doc["promoted"]],
               "candidates": {CAND: {"scheme": CAND, "decision": doc["decision"], "reasons": [], "registry": None,
                                     "metrics": {f"default/{m}": v["overall"] for m, v in cmp_.items()}}}, "notes": []}
    (run / "summary.json").write_text(json.dumps(summary))
    return Summary.model_validate(summary)


def test_the_decision_is_posted_signed_and_retried(tmp_path, receiver, monkeypatch):
    run, _, _ = gated_run(tmp_path)
    rx = receiver([503, 200])  # one failure, then accepted: retried by base.http's client
    monkeypatch.setenv("QG_TEST_HOOK_KEY", "s3cret")
    n = NotifySpec(url=rx.url, secret_env="QG_TEST_HOOK_KEY", report_url="https://ci/runs/{run}/report.html")
    (rec,) = map(as_json, webhook.notify_run([n], run, _summary(run)))
    assert rec["status"] == "delivered" and rec["attempts"] == 2 and len(rx.got) == 2
    headers, raw = rx.got[-1]
    want = "sha256=" + hmac.new(b"s3cret", raw, hashlib.sha256).hexdigest()  # over the bytes that arrived
    assert hmac.compare_digest(headers["X-Quantgate-Signature-256"], want)
    body = json.loads(raw)
    assert body["event"] == "quantgate.decision" and body["run"] == run.name and body["decision"] == "PROMOTE"
    assert body["delivery"] == headers["X-Quantgate-Delivery"] == rec["delivery"]
    cand = body["candidates"][CAND]
    assert cand["decision"] == "PROMOTE" and cand["scores"]["default/exact_match"]["delta"] == 0
    decided = json.loads((run / "decision.json").read_text())["candidates"][CAND]["checks"]
    assert [c["name"] for c in cand["checks"]] == [c["name"] for c in decided]
    assert body["report"] == {"html": str(run / "report.html"), "markdown": str(run / "report.md"),
                              "url": f"https://ci/runs/{run.name}/report.html"}
    assert json.loads((run / "notify.json").read_text())["records"] == [rec]


@pytest.mark.parametrize("statuses, body, status, attempts", [
    ([204], b"", "delivered", None),           # any 2xx is delivered
    ([200], b"thanks", "delivered", 1),        # a 200 whose body is not JSON too
    ([404], b"no", "failed", 1),               # a 4xx is not retried
    ([500, 500, 500], b"", "failed", 3),       # 5xx retried until the attempts run out
])
def test_receiver_answers(tmp_path, receiver, statuses, body, status, attempts):
    rx = receiver(statuses, body)
    rec = as_json(webhook.send(NotifySpec(url=rx.url, attempts=3, timeout_s=5), {"delivery": "d1", "decision": "REJECT"}))
    assert rec["status"] == status and rec["attempts"] == attempts and len(rx.got) == len(statuses)
    assert "X-Quantgate-Signature-256" not in rx.got[0][0] and rec["signed"] is False


def test_an_unreachable_webhook_is_a_failed_record_not_an_exception(tmp_path):
    rx = Receiver([])
    url = rx.url
    rx.close()  # nothing listens there now
    rec = as_json(webhook.send(NotifySpec(url=url, attempts=2, timeout_s=2), {"delivery": "d1"}))
    assert rec["status"] == "failed" and rec["attempts"] == 2 and "Connect" in rec["error"]


# --- a release's publishing, end to end on a real promoted entry -------------------------------------------------------

def test_promoted_entry_with_card_published_to_a_folder_and_the_receiver_told(tmp_path, receiver, monkeypatch):
    """The flow's tail on a gated run: promote (card in the entry), publish to a folder and a tokenless Hub target,
    summary and exit code, then the webhook to a real receiver."""
    monkeypatch.setenv("QUANTGATE_RESULTS", str(tmp_path / "results"))
    monkeypatch.delenv("QG_TEST_HF", raising=False)
    run, ckpt, (d,) = gated_run(tmp_path / "work")
    rx = receiver([200])
    spec = load_spec(spec_file(tmp_path, f"publish:\n  - folder: shelf\n  - {{hf_repo: org/demo, token_env: QG_TEST_HF}}\n"
                                         f"notify:\n  - url: {rx.url}\n"))
    e = registry.promote(registry.Promotion(d, model="demo", version="v1", checkpoint=ckpt, run=run))
    records = publishing.publish_run(spec.publish, run, {CAND: Path(e.path)})
    assert [r.status for r in records] == ["published", "failed"]  # the Hub target has no token
    copy = tmp_path / "shelf" / "demo" / "v1"
    assert (copy / "README.md").read_text() == (Path(e.path) / "README.md").read_text()
    assert "## Serving with vLLM" in (copy / "README.md").read_text() and registry.verify_entry(copy)
    assert json.loads((run / "publish.json").read_text())["records"] == [as_json(r) for r in records]
    summary = publishing.with_records(_summary(run), "publish", records)
    assert publishing.exit_code(summary, 0) == publishing.OUTBOUND_FAILED == 5  # a PROMOTE that did not ship
    summary = publishing.with_records(summary, "notify", webhook.notify_run(spec.notify, run, summary))
    assert summary.notify[0].status == "delivered"
    write_summary(run, summary)  # once, with both records (as the flow does)
    written = json.loads((run / "summary.json").read_text())
    assert written["publish"] == [as_json(r) for r in records] and written["notify"] == as_json(summary)["notify"]
    body = json.loads(rx.got[0][1])
    assert body["decision"] == "PROMOTE" and [p["status"] for p in body["publish"]] == ["published", "failed"]


def test_a_failed_publish_is_reported_and_keeps_the_promotion(tmp_path, entry):
    blocker = tmp_path / "shelf-file"
    blocker.write_text("a file where the target folder should be")
    records = publishing.publish_run([PublishTarget(folder=blocker)], tmp_path, {CAND: Path(entry)})
    assert records[0].status == "failed" and records[0].error
    summary = publishing.with_records(Summary(decision="PROMOTE", notes=["kept"]), "publish", records)
    assert publishing.exit_code(summary, 0) == publishing.OUTBOUND_FAILED
    assert publishing.exit_code(summary, 3) == 3  # a REJECT keeps its code; the failure is still in the record
    assert summary.notes[0] == "kept" and summary.notes[1].startswith(f"publish of {CAND} to {blocker} failed")
    assert registry.verify_entry(entry).version == "v1"  # still promoted, unchanged


def test_registry_publish_command(entry, tmp_path, monkeypatch):
    res = CliRunner().invoke(app, ["registry", "publish", str(entry), str(tmp_path / "shelf")])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["status"] == "published" and (tmp_path / "shelf" / "demo" / "v1" / "README.md").is_file()
    monkeypatch.delenv("QG_TEST_HF", raising=False)
    res = CliRunner().invoke(app, ["registry", "publish", str(entry), "hf://org/demo", "--token-env", "QG_TEST_HF"])
    assert res.exit_code == 2 and "QG_TEST_HF is not set" in res.output
    res = CliRunner().invoke(app, ["registry", "publish", str(entry), "nosuch://x"])
    assert res.exit_code == 2 and "fsspec knows no protocol" in res.output
    (tmp_path / "shelf" / "demo" / "v1" / "README.md").write_text("changed")
    res = CliRunner().invoke(app, ["registry", "publish", str(entry), str(tmp_path / "shelf")])
    assert res.exit_code == 1 and json.loads(res.stdout)["status"] == "failed"
    res = CliRunner().invoke(app, ["registry", "verify", str(entry)])
    assert res.exit_code == 0 and "2 other files" in res.output


# --- the documented examples ------------------------------------------------------------------------------------------

def test_the_example_spec_passes_release_check(monkeypatch):
    example = REPO / "tests" / "data" / "publish_release.yaml"
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("QUANTGATE_WEBHOOK_SECRET", raising=False)
    res = CliRunner().invoke(app, ["release", str(example), "--check"])
    assert res.exit_code == 0, res.output
    assert "note: publish: hf://my-org/demo-int8 would fail (exit 5): HF_TOKEN is not set" in res.output
    assert "note: notify[0]: QUANTGATE_WEBHOOK_SECRET is not set" in res.output
    monkeypatch.setenv("HF_TOKEN", "x")
    monkeypatch.setenv("QUANTGATE_WEBHOOK_SECRET", "y")
    assert "note:" not in CliRunner().invoke(app, ["release", str(example), "--check"]).output
    spec = load_spec(example)
    assert [t.label for t in spec.publish][1:] == ["memory://quantgate-published", "hf://my-org/demo-int8"]
    assert spec.notify[0].secret_env == "QUANTGATE_WEBHOOK_SECRET"


def _doc_blocks() -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", (REPO / "docs" / "publishing.md").read_text(), re.S)


def test_the_documented_prefect_automation_is_valid_for_prefect():
    (automation,) = [yaml.safe_load(b) for b in _doc_blocks() if b.startswith("# prefect automation create")]
    a = AutomationCore.model_validate(automation)
    assert a.trigger.expect == {"prefect.flow-run.Failed", "prefect.flow-run.Crashed"}


def test_the_documented_ci_jobs_branch_on_the_real_exit_codes():
    jobs = [b for b in _doc_blocks() if "quantgate release releases/demo.yaml" in b]
    assert len(jobs) == 2  # GitHub Actions and GitLab CI
    codes = {str(c) for c in (*EXIT_CODES.values(), publishing.OUTBOUND_FAILED)}
    for text in jobs:
        yaml.safe_load(text)
        assert "decision.junit.xml" in text and set(re.findall(r"^\s+(\d)\)", text, re.M)) == codes
