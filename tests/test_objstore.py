"""quantgate.base.objstore against a mounted path and a real S3 API (moto's server on loopback, tests/_s3.py): a
folder pushed from one host's results root is pulled into another's byte for byte, a torn copy is refused, an
unfinished folder keeps what the pulling host already has."""

from __future__ import annotations

import json

import pytest

from _s3 import MOTO, aws_env, s3_server
from quantgate.base.errors import QuantgateError
from quantgate.base.objstore import MANIFEST, ResultStore


def _folder(root, rel="cache/variants/k1"):
    f = root / rel
    (f / "evals" / "set-1").mkdir(parents=True)
    (f / "evals" / "set-1" / "results.jsonl").write_text('{"id": "a"}\n{"id": "b"}\n')
    (f / "parity.json").write_text('{"verdict": "pass"}')
    (root / f"{rel}.lock").write_text("{}")  # a local lock beside it: never shared
    (f / "x.lock").write_text("")
    return rel


def test_a_folder_goes_through_a_mounted_path_byte_for_byte_and_a_torn_copy_is_refused(tmp_path):
    rel = _folder(tmp_path / "a")
    a, b = ResultStore(str(tmp_path / "store"), tmp_path / "a"), ResultStore(f"file://{tmp_path / 'store'}", tmp_path / "b")
    assert b.pull(rel) is None and not b.complete(rel)  # nothing pushed yet
    m = a.push(rel)
    assert sorted(m["files"]) == ["evals/set-1/results.jsonl", "parity.json"] and m["root"] == str(tmp_path / "a")
    assert b.pull(rel)["files"] == m["files"]
    for name in m["files"]:
        assert (tmp_path / "b" / rel / name).read_bytes() == (tmp_path / "a" / rel / name).read_bytes()
    # a file changed on the store behind its manifest's back: fetched twice, then refused naming the key
    (tmp_path / "store" / rel / "parity.json").write_text('{"verdict": "fail"}')
    (tmp_path / "b" / rel / "parity.json").unlink()
    with pytest.raises(QuantgateError, match="parity.json does not match its manifest"):
        b.pull(rel)
    assert not (tmp_path / "b" / rel / "parity.json").exists() and not list((tmp_path / "b").rglob("*.part"))


def test_an_unfinished_folder_is_pulled_only_on_request_and_keeps_the_local_copy(tmp_path):
    rel = _folder(tmp_path / "a")
    a, b = ResultStore(str(tmp_path / "store"), tmp_path / "a"), ResultStore(str(tmp_path / "store"), tmp_path / "b")
    a.push(rel, complete=False)
    assert b.pull(rel) is None  # a reader of results waits for a complete folder
    (tmp_path / "b" / rel / "evals" / "set-1").mkdir(parents=True)
    mine = tmp_path / "b" / rel / "evals" / "set-1" / "results.jsonl"
    mine.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "c"}\n')  # this host got further than the store
    assert b.pull(rel, partial=True) is not None
    assert mine.read_text().count("\n") == 3 and (tmp_path / "b" / rel / "parity.json").is_file()
    # pushed again complete: only what changed is uploaded, and a complete pull replaces the local copy
    (tmp_path / "a" / rel / "parity.json").write_text('{"verdict": "pass", "n": 2}')
    before = (tmp_path / "store" / rel / "evals" / "set-1" / "results.jsonl").stat().st_mtime_ns
    a.push(rel)
    assert (tmp_path / "store" / rel / "evals" / "set-1" / "results.jsonl").stat().st_mtime_ns == before
    b.pull(rel)
    assert mine.read_text().count("\n") == 2



def test_answers_appended_while_an_unfinished_folder_is_pulled_are_cut_to_its_manifest(tmp_path):
    """The writer of an unfinished folder appends answers between its manifest and a reader's fetch: the reader keeps
    the bytes the manifest names. A file that changed otherwise, or grew in a complete folder, is still refused."""
    rel = _folder(tmp_path / "a")
    a, b = ResultStore(str(tmp_path / "store"), tmp_path / "a"), ResultStore(str(tmp_path / "store"), tmp_path / "b")
    a.push(rel, complete=False)
    stored = tmp_path / "store" / rel / "evals" / "set-1" / "results.jsonl"
    stored.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "c"}\n')  # appended after the manifest was written
    assert b.pull(rel, partial=True) is not None
    assert (tmp_path / "b" / rel / "evals" / "set-1" / "results.jsonl").read_text() == '{"id": "a"}\n{"id": "b"}\n'
    stored.write_text('{"id": "x"}\n{"id": "b"}\n{"id": "c"}\n')  # rewritten, not appended to
    (tmp_path / "b" / rel / "evals" / "set-1" / "results.jsonl").unlink()
    with pytest.raises(QuantgateError, match="results.jsonl does not match its manifest"):
        b.pull(rel, partial=True)
    a.push(rel)  # complete now; then grown behind its manifest's back
    stored.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "d"}\n')  # the manifest's bytes, and one line more
    with pytest.raises(QuantgateError, match="results.jsonl does not match its manifest"):
        b.pull(rel)

@pytest.mark.skipif(not MOTO.exists(), reason="no .venv-s3 (scripts/setup.sh s3; `make test` builds it)")
def test_a_folder_goes_through_a_real_s3_api(tmp_path):
    rel = _folder(tmp_path / "a")
    with s3_server(tmp_path / "moto.log") as env, aws_env(env):
        url = f"s3://{env['QG_TEST_BUCKET']}/releases"
        ResultStore(url, tmp_path / "a").push(rel)
        b = ResultStore(url, tmp_path / "b")
        got = b.pull(rel)
        assert got is not None and got["complete"]
        assert json.loads((tmp_path / "b" / rel / "parity.json").read_text()) == {"verdict": "pass"}
        assert b.key(f"{rel}/{MANIFEST}") == f"{env['QG_TEST_BUCKET']}/releases/{rel}/{MANIFEST}"
        with pytest.raises(QuantgateError, match="cannot open the results store"):
            ResultStore("nosuchfs://x/y", tmp_path / "c")
