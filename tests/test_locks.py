"""Files shared by concurrent writers: write_json is atomic and durable across threads, lock() excludes other
processes and threads and names its holder, and child processes get only the environment they need."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import child_env, is_locked, lock, lock_holder, lock_path, write_json

REPO = Path(__file__).resolve().parents[1]


def test_two_threads_writing_one_file_never_tear_or_lose_it(tmp_path):
    path = tmp_path / "state.json"
    big = {"rows": list(range(5000))}  # large enough that a write is not one syscall's worth
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(tag: str) -> None:
        try:
            for i in range(150):
                write_json(path, {"writer": tag, "i": i, **big})
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    seen = []

    def reader() -> None:
        while not stop.is_set():
            try:
                seen.append(json.loads(path.read_text())["writer"])
            except FileNotFoundError:
                if seen:  # once written, the file is always there
                    errors.append(AssertionError("the file went missing"))
            except ValueError as exc:
                errors.append(AssertionError(f"torn file: {exc}"))

    threads = [threading.Thread(target=writer, args=(t,)) for t in "ab"]
    watch = threading.Thread(target=reader)
    watch.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watch.join()
    assert not errors, errors[:3]
    final = json.loads(path.read_text())
    assert final["writer"] in "ab" and final["i"] == 149 and final["rows"] == big["rows"]
    assert seen, "the reader never saw the file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"], "temp files left behind"


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "x.json"
    write_json(path, {"v": 1})
    with pytest.raises(TypeError):
        write_json(path, {("not", "a", "key"): 1})  # not JSON: fails before any file is made
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk gone")))
    with pytest.raises(OSError, match="disk gone"):
        write_json(path, {"v": 2})  # fails after the temp file was written
    assert json.loads(path.read_text()) == {"v": 1} and [p.name for p in tmp_path.iterdir()] == ["x.json"]


HOLD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from quantgate.base.fileio import lock
    target, ready, release = (Path(a) for a in sys.argv[1:4])
    with lock(target, what="test holder"):
        ready.write_text("held")
        while not release.exists():
            time.sleep(0.02)
        time.sleep(0.3)  # the parent must still be waiting now
        Path(str(target) + ".held-until").write_text(repr(time.time()))
""")


def _hold_in_child(tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    target, ready, release = tmp_path / "registry.json", tmp_path / "ready", tmp_path / "release"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(target), str(ready), str(release)], env=env)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None, "the child died before it took the lock"
        assert time.monotonic() < deadline, "the child never took the lock"
        time.sleep(0.02)
    return proc, target, release


def test_a_second_process_waits_for_a_held_lock_and_gets_it_after_release(tmp_path):
    proc, target, release = _hold_in_child(tmp_path)
    try:
        holder = lock_holder(target)  # the lock file names its holder
        assert holder is not None and holder["pid"] == proc.pid and holder["host"] == socket.gethostname()
        assert holder["what"] == "test holder" and holder["since"]
        assert is_locked(target)
        with pytest.raises(QuantgateError) as err:
            with lock(target, timeout=0.3):
                pass
        text = err.value.render()
        assert f"pid {proc.pid} on host {socket.gethostname()}" in text and str(lock_path(target)) in text
        release.write_text("go")
        with lock(target, timeout=60):
            got = time.time()
            assert lock_holder(target)["pid"] == os.getpid()
        held_until = float(Path(str(target) + ".held-until").read_text())
        assert got >= held_until, "the lock was taken while the child still held it"
        assert proc.wait(timeout=30) == 0
    finally:
        release.write_text("go")
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not is_locked(target) and lock_holder(target) is None  # released: the file names nobody


def test_a_dead_holder_releases_the_lock(tmp_path):
    proc, target, release = _hold_in_child(tmp_path)
    proc.kill()
    proc.wait()
    with lock(target, timeout=10):  # the kernel dropped the lock with the process
        pass


def test_threads_of_one_process_exclude_each_other(tmp_path):
    target = tmp_path / "counter.json"
    write_json(target, {"n": 0})

    def bump() -> None:
        for _ in range(30):
            with lock(target, timeout=60):
                n = json.loads(target.read_text())["n"]
                time.sleep(0.001)
                write_json(target, {"n": n + 1})

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert json.loads(target.read_text())["n"] == 120  # no lost update


def test_child_env_keeps_what_children_need_and_drops_other_secrets():
    parent = {
        "PATH": "/usr/bin", "HOME": "/home/u", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TMPDIR": "/tmp/x",
        "PYTHONPATH": "/repo", "PYTHONHASHSEED": "0", "HF_HOME": "/hf", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "4", "OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": "0,1", "TORCH_HOME": "/t",
        "OPENAI_API_KEY": "sk-1", "JUDGE_API_KEY": "k", "GITHUB_TOKEN": "g", "AWS_ACCESS_KEY_ID": "a",
        "AWS_SECRET_ACCESS_KEY": "s", "HF_TOKEN": "hf", "VLLM_API_KEY": "v", "DATABASE_URL": "postgres://u:p@h/db",
        "PREFECT_API_URL": "http://x", "SSH_AUTH_SOCK": "/s",
    }
    env = child_env({"QUANTGATE_PARENT_PID": 42, "OPENAI_API_KEY": "server-key"}, environ=parent)
    assert env == {
        "PATH": "/usr/bin", "HOME": "/home/u", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TMPDIR": "/tmp/x",
        "PYTHONPATH": "/repo", "PYTHONHASHSEED": "0", "HF_HOME": "/hf", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "4", "OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": "0,1", "TORCH_HOME": "/t",
        "QUANTGATE_PARENT_PID": "42", "OPENAI_API_KEY": "server-key",  # extras, as text, over the parent's
    }
    kept = child_env(keep=("HF_TOKEN", "PREFECT_*"), environ=parent)
    assert kept["HF_TOKEN"] == "hf" and kept["PREFECT_API_URL"] == "http://x" and "GITHUB_TOKEN" not in kept


def test_child_env_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("SOME_SERVICE_TOKEN", "x")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    env = child_env()
    assert "SOME_SERVICE_TOKEN" not in env and env["VLLM_LOGGING_LEVEL"] == "DEBUG" and env["PATH"] == os.environ["PATH"]
