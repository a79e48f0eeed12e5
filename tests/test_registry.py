"""The promotion registry: atomic entries, one entry per version, nothing partial after a kill, publish off; an entry
holds the evaluated checkpoint's files and its hash is checked against the evaluated one (checkpoint_hash and its cache)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _gate_fixtures import checkpoint
from _quant_fixtures import fake_quantizer, llama

from quantgate.base.errors import QuantgateError
from quantgate.base.paths import REPO
from quantgate.quantize.recipes import RecipeOverrides
from quantgate.publishing import registry
from quantgate.spec.resolve import load_spec
from quantgate.spec.schema import QuantizationSpec
from quantgate.release.variants import quantize_variant
from quantgate.target import catalogue
from quantgate.target.catalogue import checkpoint_hash

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
    e = registry.promote(registry.Promotion(DECISION, model="demo", version="v1", checkpoint=ckpt, report=report, run="runs/r1"),
                         root=root)
    entry = root / "demo" / "v1"
    assert e.path == str(entry) and e.reused is False
    assert sorted(p.name for p in entry.iterdir()) == ["README.md", "checkpoint", "decision.json", "manifest.json", "report.md"]
    man = json.loads((entry / "manifest.json").read_text())
    assert man["candidate"] == "w4a16-gptq" and man["checkpoint"]["copied"] is True  # the entry holds the files
    assert man["checkpoint"]["path"] == "checkpoint" and man["checkpoint"]["source"] == str(ckpt.resolve())
    assert man["checkpoint"]["sha256"] == checkpoint_hash(ckpt) and man["checkpoint"]["how"] == "hardlink"
    assert (entry / "checkpoint" / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()
    assert man["checks"] == {"passed": 1, "skipped": 1} and man["run"] == "runs/r1"
    assert json.loads((entry / "decision.json").read_text()) == DECISION
    assert [x.version for x in registry.list_entries(root)] == ["v1"]
    assert [p.name for p in (root / "demo").iterdir()] == ["v1"]  # no temporary folder left


def test_promoting_twice_gives_one_entry(setup):
    ckpt, report, root = setup
    first = registry.promote(registry.Promotion(DECISION, model="demo", version="v1", checkpoint=ckpt, report=report),
                             root=root)
    again = registry.promote(registry.Promotion(DECISION, model="demo", version="v1", checkpoint=ckpt, report=report),
                             root=root)
    assert again.reused is True and again.created == first.created
    assert len(registry.list_entries(root)) == 1


def test_a_taken_version_refuses_another_checkpoint(setup, tmp_path):
    ckpt, _, root = setup
    registry.promote(registry.Promotion(DECISION, model="demo", version="v1", checkpoint=ckpt), root=root)
    other = checkpoint(tmp_path / "other", b"different weights")
    with pytest.raises(QuantgateError, match="already registered for another checkpoint"):
        registry.promote(registry.Promotion(DECISION, model="demo", version="v1", checkpoint=other), root=root)
    assert registry.promote(registry.Promotion(DECISION, model="demo", version="v2", checkpoint=other),
                            root=root).reused is False


@pytest.mark.parametrize("decision, kwargs, words", [
    ({**DECISION, "decision": "REJECT"}, {}, "not PROMOTE"),
    (DECISION, {"version": "../up"}, "not a safe folder name"),
    (DECISION, {"model": ".hidden"}, "not a safe folder name"),
    (DECISION, {"checkpoint": "/nonexistent/ckpt"}, "checkpoint folder not found"),
])
def test_refusals_write_nothing(setup, decision, kwargs, words):
    ckpt, _, root = setup
    args = {"model": "demo", "version": "v1", "checkpoint": ckpt, **kwargs}
    with pytest.raises(QuantgateError, match=words):
        registry.promote(registry.Promotion(decision, **args), root=root)
    assert not root.exists() or registry.list_entries(root) == []


def test_copy_checkpoint(setup):
    ckpt, _, root = setup
    e = registry.promote(registry.Promotion(DECISION, model="demo", version="v1", checkpoint=ckpt),
                         root=root, copy_checkpoint=True)
    copied = root / "demo" / "v1" / "checkpoint" / "model.safetensors"
    assert copied.read_bytes() == (ckpt / "model.safetensors").read_bytes() and e.checkpoint.path == "checkpoint"


KILL_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    from quantgate.publishing import registry as registry
    step, decision, ckpt, report, root = sys.argv[1:6]

    def hook(name):
        if name == step:
            os.kill(os.getpid(), signal.SIGKILL)  # a real, abrupt death: no finally, no cleanup
    registry._after_step = hook
    registry.promote(registry.Promotion(json.loads(open(decision).read()),
                     model="demo", version="v1", checkpoint=ckpt, report=report), root=root, copy_checkpoint=True)
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
    e = registry.promote(registry.Promotion(DECISION, model="demo", version="v1", checkpoint=ckpt, report=report),
                         root=root)
    assert e.reused is False and [d.name for d in (root / "demo").iterdir()] == ["v1"]


def test_killed_after_the_rename_leaves_the_complete_entry(setup, tmp_path):
    ckpt, report, root = setup
    decision = tmp_path / "decision.json"
    decision.write_text(json.dumps(DECISION))
    p = subprocess.run([sys.executable, "-c", KILL_SCRIPT, "rename", str(decision), str(ckpt), str(report), str(root)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == -9
    (entry,) = registry.list_entries(root)
    assert entry.version == "v1" and (root / "demo" / "v1" / "checkpoint" / "model.safetensors").is_file()


def test_an_error_part_way_cleans_up(setup, monkeypatch):
    ckpt, report, root = setup

    def boom(step):
        if step == "checkpoint":
            raise OSError("disk full")
    monkeypatch.setattr(registry, "_after_step", boom)
    with pytest.raises(OSError, match="disk full"):
        registry.promote(registry.Promotion(DECISION, model="demo", version="v1", checkpoint=ckpt, report=report),
                         root=root)
    assert list((root / "demo").iterdir()) == []


def test_a_concurrent_promotion_that_wins_the_rename_is_kept(setup, tmp_path, monkeypatch):
    ckpt, report, root = setup
    winner = registry.promote(registry.Promotion(DECISION, model="demo", version="v1", checkpoint=ckpt),
                              root=tmp_path / "other")

    def other_process_finishes_first(step):
        if step == "manifest":
            import shutil

            shutil.copytree(winner.path, root / "demo" / "v1")
    monkeypatch.setattr(registry, "_after_step", other_process_finishes_first)
    e = registry.promote(registry.Promotion(DECISION, model="demo", version="v1", checkpoint=ckpt, report=report),
                         root=root)
    assert e.reused is True and e.created == winner.created
    assert [d.name for d in (root / "demo").iterdir()] == ["v1"]


def test_publish_is_off_by_default_and_does_not_import_the_hub(setup):
    ckpt, _, root = setup
    code = ("import sys, json; from quantgate.publishing import registry; "
            f"e = registry.promote(registry.Promotion(json.loads({json.dumps(json.dumps(DECISION))}), model='demo', "
            f"version='v1', checkpoint={str(ckpt)!r}), root={str(root)!r}); "
            "print('published' in e, 'huggingface_hub' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.stdout.split() == ["False", "False"], p.stderr
    assert not (root / "demo" / "v1" / "publish.json").exists()


def test_publish_to_a_uri(setup, tmp_path):
    ckpt, report, root = setup
    target = tmp_path / "bucket"
    e = registry.promote(registry.Promotion(DECISION, model="demo", version="v1", checkpoint=ckpt, report=report),
                         root=root, copy_checkpoint=True, publish=f"file://{target}")
    dest = target / "demo" / "v1"
    assert (dest / "manifest.json").read_text() == (root / "demo" / "v1" / "manifest.json").read_text()
    assert (dest / "checkpoint" / "model.safetensors").is_file()
    assert e.published.where == str(dest)
    (record,) = json.loads((root / "demo" / "v1" / "publish.json").read_text())["published"]
    assert record["target"] == f"file://{target}" and record["status"] == "published" and record["verified"] is True
    assert not (dest / "publish.json").exists()  # the record of where it went is not part of the copy


# --- what an entry serves is what was evaluated -------------------------------------------------------------------

@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """checkpoint_hash's per-file cache in this test's own QUANTGATE_HOME."""
    monkeypatch.setenv("QUANTGATE_HOME", str(tmp_path / "home"))
    return catalogue.hash_cache_path()


def settled(folder, seconds_ago: int = 3600):
    """Give the folder's files an mtime in the past (a file written just now is hashed but not cached)."""
    t = time.time_ns() - seconds_ago * 1_000_000_000
    for f in folder.rglob("*"):
        if f.is_file():
            os.utime(f, ns=(t, t))
    return folder


def count_hashing(monkeypatch) -> list:
    calls, real = [], catalogue.sha256_file
    monkeypatch.setattr(catalogue, "sha256_file", lambda p, *a, **k: calls.append(p.name) or real(p, *a, **k))
    return calls


def rewrite_in_place(path, content: bytes):
    """Same size, same inode, the old mtime put back: what `cp -p` over a file or a careless tool can do."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.write(content)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_checkpoint_hash_reads_the_files_not_a_manifest(tmp_path, own_cache):
    ckpt = checkpoint(tmp_path / "ckpt", b"weights")
    files = {p.name: catalogue.sha256_file(p) for p in sorted(ckpt.iterdir())}
    (ckpt / catalogue.MANIFEST).write_text(json.dumps({"files": files}))
    h = checkpoint_hash(ckpt)
    assert h == hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()  # same value as before
    (ckpt / "model.safetensors").write_bytes(b"weightz")  # same size; the manifest still says the old hash
    assert checkpoint_hash(ckpt) != h
    (ckpt / "sub").mkdir()
    (ckpt / "sub" / "extra.json").write_text("{}")  # files in sub-folders count too
    changed = checkpoint_hash(ckpt)
    (ckpt / ".cache").mkdir()
    (ckpt / ".cache" / "download.lock").write_text("x")  # hidden folders (download caches) do not
    assert checkpoint_hash(ckpt) == changed


def test_the_hash_cache_is_used_and_invalidated_by_size_or_mtime(tmp_path, own_cache, monkeypatch):
    ckpt = settled(checkpoint(tmp_path / "ckpt"))
    calls = count_hashing(monkeypatch)
    h = checkpoint_hash(ckpt)
    assert sorted(calls) == ["config.json", "model.safetensors"] and own_cache.is_file()
    calls.clear()
    assert checkpoint_hash(ckpt) == h and calls == []  # unchanged: one stat per file, no reading
    weights = ckpt / "model.safetensors"
    t = weights.stat().st_mtime_ns + 1_000_000
    os.utime(weights, ns=(t, t))  # touched: read again (same bytes, same hash)
    assert checkpoint_hash(ckpt) == h and calls == ["model.safetensors"]
    calls.clear()
    weights.write_bytes(b"more weights")
    settled(ckpt)
    h2 = checkpoint_hash(ckpt)
    assert h2 != h and "model.safetensors" in calls  # another size: read again
    calls.clear()
    assert checkpoint_hash(ckpt) == h2 and calls == []
    assert checkpoint_hash(ckpt, use_cache=False) == h2 and len(calls) == 2  # the registry's check reads everything


def test_a_file_written_just_now_is_not_cached(tmp_path, own_cache, monkeypatch):
    ckpt = checkpoint(tmp_path / "ckpt")
    calls = count_hashing(monkeypatch)
    checkpoint_hash(ckpt)
    checkpoint_hash(ckpt)
    assert len(calls) == 4  # a same-size rewrite within the same mtime tick could not be told apart


def test_promotion_refuses_a_checkpoint_that_no_longer_matches_the_evaluated_hash(setup, own_cache):
    ckpt, report, root = setup
    evaluated = checkpoint_hash(ckpt)
    (ckpt / "model.safetensors").write_bytes(b"other weights, after the evaluation")
    with pytest.raises(QuantgateError, match="not evaluated") as err:
        registry.promote(registry.Promotion(DECISION, model="demo", version="v1", checkpoint=ckpt, report=report, expected_sha256=evaluated),
                         root=root)
    assert evaluated[:12] in err.value.render()
    assert not root.exists() or registry.list_entries(root) == [] and list((root / "demo").iterdir()) == []


def evidence(run, variant_name: str, content_hash: str):
    folder = run / variant_name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "evidence.json").write_text(json.dumps({"variant": {"name": variant_name, "content_hash": content_hash}}))
    return run


def test_the_evaluated_hash_comes_from_the_runs_evidence(setup, tmp_path, own_cache):
    ckpt, report, root = setup
    run = evidence(tmp_path / "runs" / "r1", "w4a16-gptq", checkpoint_hash(ckpt))
    e = registry.promote(registry.Promotion(DECISION, model="demo", version="v1", checkpoint=ckpt, run=run), root=root)
    assert e.checkpoint.evaluated_sha256 == e.checkpoint.sha256 == checkpoint_hash(ckpt)
    evidence(run, "w4a16-gptq", "0" * 64)  # the weights evaluated were others
    with pytest.raises(QuantgateError, match="not evaluated"):
        registry.promote(registry.Promotion(DECISION, model="demo", version="v2", checkpoint=ckpt, run=run), root=root)
    with pytest.raises(QuantgateError, match="no evaluated content hash"):  # a run folder without evidence
        registry.promote(registry.Promotion(DECISION, model="demo", version="v3", checkpoint=ckpt, run=tmp_path / "runs"),
                         root=root)
    assert [x.version for x in registry.list_entries(root)] == ["v1"]
    assert [d.name for d in (root / "demo").iterdir()] == ["v1"]


@pytest.mark.parametrize("copy", [False, True])
def test_the_entry_is_verified_from_its_bytes_not_the_cache(setup, own_cache, copy):
    ckpt, report, root = setup
    evaluated = checkpoint_hash(settled(ckpt))  # cached
    rewrite_in_place(ckpt / "model.safetensors", b"WEIGHTS")  # the cache cannot see this one
    assert checkpoint_hash(ckpt) == evaluated
    with pytest.raises(QuantgateError, match="the copied checkpoint has content hash"):
        registry.promote(registry.Promotion(DECISION, model="demo", version="v1", checkpoint=ckpt, report=report, expected_sha256=evaluated),
                         root=root, copy_checkpoint=copy)
    assert list((root / "demo").iterdir()) == []  # the temporary entry is gone: nothing half-written


def test_a_later_release_cannot_change_what_an_earlier_promote_entry_serves(tmp_path, own_cache, monkeypatch):
    monkeypatch.setenv("QUANTGATE_RESULTS", str(tmp_path / "results"))
    fake_quantizer(monkeypatch)
    model = llama(tmp_path / "base", hidden=576, inter=1536)
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    spec = load_spec(REPO / "releases" / "demo.yaml")
    scheme, root = spec.schemes[0], tmp_path / "registry"  # the demo's candidate (int8-w8a8)
    run = tmp_path / "results" / "runs" / "first"
    first = quantize_variant(spec, model, scheme, run, log=lambda s: None)
    assert first.path.parent == tmp_path / "results" / "checkpoints"
    assert first.path.name == f"{checkpoint_hash(model)[:12]}-{scheme}-{first.quantization['key'][:12]}"
    evidence(run, scheme, first.content_hash)
    e = registry.promote(registry.Promotion({**DECISION, "candidate": scheme}, model="demo", version="v1", checkpoint=first.path, run=run),
                         root=root)
    entry = Path(e.path) / "checkpoint"
    served = {f.name: f.read_bytes() for f in entry.iterdir()}

    # a later release with another recipe for the same scheme
    later = spec.model_copy(update={"quantization": QuantizationSpec(
        overrides={scheme: RecipeOverrides(ignore=["model.layers.1.mlp.down_proj"])},
        calibration=spec.quantization.calibration)})
    second = quantize_variant(later, model, scheme, tmp_path / "results" / "runs" / "second", log=lambda s: None)
    assert second.path != first.path and second.content_hash != first.content_hash
    assert checkpoint_hash(first.path) == first.content_hash  # the evaluated folder was not overwritten
    assert {f.name: f.read_bytes() for f in entry.iterdir()} == served
    assert registry.verify_entry(e.path).checkpoint.sha256 == first.content_hash
    # even with the quantized folder gone, the entry still holds the evaluated weights
    shutil.rmtree(first.path)
    assert registry.verify_entry(e.path).checkpoint.sha256 == first.content_hash
    assert {f.name: f.read_bytes() for f in entry.iterdir()} == served


def test_verify_entry_notices_a_modified_entry(setup, own_cache):
    ckpt, _, root = setup
    e = registry.promote(registry.Promotion(DECISION, model="demo", version="v1", checkpoint=ckpt),
                         root=root, copy_checkpoint=True)
    assert registry.verify_entry(e.path).version == "v1"
    (root / "demo" / "v1" / "checkpoint" / "model.safetensors").write_bytes(b"tampered")
    with pytest.raises(QuantgateError, match="modified since promotion"):
        registry.verify_entry(e.path)
