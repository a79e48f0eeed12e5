"""The promotion registry: atomic entries, one entry per version, nothing partial after a kill, publish off."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from _gate_fixtures import checkpoint

from quantgate.base.errors import QuantgateError
from quantgate.base.paths import REPO
from quantgate.release import registry

DECISION = {"schema_version": 1, "decision": "PROMOTE", "candidate": "w4a16-gptq", "scheme": "w4a16-gptq",
            "family": "w4a16", "policy": {"name": "default", "version": 1},
            "checks": [{"name": "engine_parity", "passed": True}, {"name": "judge", "passed": None}], "reasons": []}


@pytest.fixture
def setup(tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt")
    report = tmp_path / "report.md"
    report.write_text("# report\n")
    return ckpt, report, tmp_path / "registry"


def test_promote_writes_a_complete_entry(setup):
    ckpt, report, root = setup
    e = registry.promote(DECISION, model="demo", version="v1", checkpoint=ckpt, report=report, run="runs/r1", root=root)
    entry = root / "demo" / "v1"
    assert e["path"] == str(entry) and e["reused"] is False
    assert sorted(p.name for p in entry.iterdir()) == ["decision.json", "manifest.json", "report.md"]
    man = json.loads((entry / "manifest.json").read_text())
    assert man["candidate"] == "w4a16-gptq" and man["checkpoint"]["copied"] is False
    assert man["checkpoint"]["path"] == str(ckpt.resolve()) and len(man["checkpoint"]["sha256"]) == 64
    assert man["checks"] == {"passed": 1, "skipped": 1} and man["run"] == "runs/r1"
    assert json.loads((entry / "decision.json").read_text()) == DECISION
    assert [x["version"] for x in registry.list_entries(root)] == ["v1"]
    assert [p.name for p in (root / "demo").iterdir()] == ["v1"]  # no temporary folder left


def test_promoting_twice_gives_one_entry(setup):
    ckpt, report, root = setup
    first = registry.promote(DECISION, model="demo", version="v1", checkpoint=ckpt, report=report, root=root)
    again = registry.promote(DECISION, model="demo", version="v1", checkpoint=ckpt, report=report, root=root)
    assert again["reused"] is True and again["created"] == first["created"]
    assert len(registry.list_entries(root)) == 1


def test_a_taken_version_refuses_another_checkpoint(setup, tmp_path):
    ckpt, _, root = setup
    registry.promote(DECISION, model="demo", version="v1", checkpoint=ckpt, root=root)
    other = checkpoint(tmp_path / "other", b"different weights")
    with pytest.raises(QuantgateError, match="already registered for another checkpoint"):
        registry.promote(DECISION, model="demo", version="v1", checkpoint=other, root=root)
    assert registry.promote(DECISION, model="demo", version="v2", checkpoint=other, root=root)["reused"] is False


@pytest.mark.parametrize("decision, kwargs, words", [
    ({**DECISION, "decision": "REJECT"}, {}, "not PROMOTE"),
    (DECISION, {"version": "../up"}, "not a safe folder name"),
    (DECISION, {"model": ".hidden"}, "not a safe folder name"),
    (DECISION, {"checkpoint": "/nonexistent/ckpt"}, "checkpoint folder not found"),
])
def test_refusals_write_nothing(setup, decision, kwargs, words):
    ckpt, _, root = setup
    args = {"model": "demo", "version": "v1", "checkpoint": ckpt, "root": root, **kwargs}
    with pytest.raises(QuantgateError, match=words):
        registry.promote(decision, **args)
    assert not root.exists() or registry.list_entries(root) == []


def test_copy_checkpoint(setup):
    ckpt, _, root = setup
    e = registry.promote(DECISION, model="demo", version="v1", checkpoint=ckpt, root=root, copy_checkpoint=True)
    copied = root / "demo" / "v1" / "checkpoint" / "model.safetensors"
    assert copied.read_bytes() == (ckpt / "model.safetensors").read_bytes() and e["checkpoint"]["path"] == "checkpoint"


KILL_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    from quantgate.release import registry as registry
    step, decision, ckpt, report, root = sys.argv[1:6]

    def hook(name):
        if name == step:
            os.kill(os.getpid(), signal.SIGKILL)  # a real, abrupt death: no finally, no cleanup
    registry._after_step = hook
    registry.promote(json.loads(open(decision).read()), model="demo", version="v1", checkpoint=ckpt, report=report,
                     root=root, copy_checkpoint=True)
    print("finished")
""")


@pytest.mark.parametrize("step", [s for s in registry.STEPS if s != "rename"])
def test_killed_between_steps_leaves_no_partial_entry(setup, tmp_path, step):
    ckpt, report, root = setup
    decision = tmp_path / "decision.json"
    decision.write_text(json.dumps(DECISION))
    p = subprocess.run([sys.executable, "-c", KILL_SCRIPT, step, str(decision), str(ckpt), str(report), str(root)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == -9 and "finished" not in p.stdout, p.stderr
    leftovers = [d.name for d in (root / "demo").iterdir()]
    assert len(leftovers) == 1 and leftovers[0].startswith(".v1.tmp-")  # it did die part-way through
    assert not (root / "demo" / "v1").exists() and registry.list_entries(root) == []
    # the next promotion completes and clears the dead process's leftovers
    e = registry.promote(DECISION, model="demo", version="v1", checkpoint=ckpt, report=report, root=root)
    assert e["reused"] is False and [d.name for d in (root / "demo").iterdir()] == ["v1"]


def test_killed_after_the_rename_leaves_the_complete_entry(setup, tmp_path):
    ckpt, report, root = setup
    decision = tmp_path / "decision.json"
    decision.write_text(json.dumps(DECISION))
    p = subprocess.run([sys.executable, "-c", KILL_SCRIPT, "rename", str(decision), str(ckpt), str(report), str(root)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == -9
    (entry,) = registry.list_entries(root)
    assert entry["version"] == "v1" and (root / "demo" / "v1" / "checkpoint" / "model.safetensors").is_file()


def test_an_error_part_way_cleans_up(setup, monkeypatch):
    ckpt, report, root = setup

    def boom(step):
        if step == "checkpoint":
            raise OSError("disk full")
    monkeypatch.setattr(registry, "_after_step", boom)
    with pytest.raises(OSError, match="disk full"):
        registry.promote(DECISION, model="demo", version="v1", checkpoint=ckpt, report=report, root=root)
    assert list((root / "demo").iterdir()) == []


def test_a_concurrent_promotion_that_wins_the_rename_is_kept(setup, tmp_path, monkeypatch):
    ckpt, report, root = setup
    winner = registry.promote(DECISION, model="demo", version="v1", checkpoint=ckpt, root=tmp_path / "other")

    def other_process_finishes_first(step):
        if step == "manifest":
            import shutil

            shutil.copytree(winner["path"], root / "demo" / "v1")
    monkeypatch.setattr(registry, "_after_step", other_process_finishes_first)
    e = registry.promote(DECISION, model="demo", version="v1", checkpoint=ckpt, report=report, root=root)
    assert e["reused"] is True and e["created"] == winner["created"]
    assert [d.name for d in (root / "demo").iterdir()] == ["v1"]


def test_publish_is_off_by_default_and_does_not_import_the_hub(setup):
    ckpt, _, root = setup
    code = ("import sys, json; from quantgate.release import registry; "
            f"e = registry.promote(json.loads({json.dumps(json.dumps(DECISION))}), model='demo', version='v1', "
            f"checkpoint={str(ckpt)!r}, root={str(root)!r}); "
            "print('published' in e, 'huggingface_hub' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.stdout.split() == ["False", "False"], p.stderr
    assert not (root / "demo" / "v1" / "publish.json").exists()


def test_publish_to_a_uri(setup, tmp_path):
    ckpt, report, root = setup
    target = tmp_path / "bucket"
    e = registry.promote(DECISION, model="demo", version="v1", checkpoint=ckpt, report=report, root=root,
                         copy_checkpoint=True, publish=f"file://{target}")
    dest = target / "demo" / "v1"
    assert (dest / "manifest.json").read_text() == (root / "demo" / "v1" / "manifest.json").read_text()
    assert (dest / "checkpoint" / "model.safetensors").is_file()
    assert e["published"]["path"].endswith("demo/v1")
    assert json.loads((root / "demo" / "v1" / "publish.json").read_text())["target"] == f"file://{target}"
