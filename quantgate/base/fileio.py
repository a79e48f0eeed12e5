"""Small shared helpers for files, processes and secrets (no quantgate imports beyond errors).

- `write_json` / `write_text`: atomic and durable (temp file + fsync + rename + fsync of the folder).
- `lock(path)`: an exclusive `flock` on `<path>.lock`, which names its holder (pid, host, thread) while held.
- `child_env`: the environment a child process gets: the variables it needs, not every secret of the parent.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypedDict

from quantgate.base.errors import QuantgateError, SettingError


def fsync_path(path: Path) -> None:
    """Make a file's data, or a rename or new entry in a folder, survive a crash (no-op where it cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder
        pass
    finally:
        os.close(fd)


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically and durably (write_text).
    The text is made before any file is touched, so data that does not serialize leaves the old file alone."""
    write_text(path, json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n")


def json_object(path: Path | str) -> dict[str, object]:
    """A JSON object file leniently: {} when it is missing, unreadable, not JSON or not an object (for optional
    files whose absence means "nothing recorded": a cache, a checkpoint's config)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def write_text(path: Path | str, text: str) -> None:
    """Write a text file atomically and durably: readers see the old file or the new one, never half of one, and after
    a crash the new one is there once this returned.

    The temp file is private to this call (pid, thread id and a random suffix in its name), so threads and processes
    writing the same file never write into each other's temp file; the last rename wins. A temp file is removed when
    the write fails; only a killed process leaves one (`.<name>.<pid>.<thread>.<random>.tmp`, never read)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


class LockHolder(TypedDict, total=False):
    """What a lock file names while held (`lock`); read back as written, so any key may be missing."""
    pid: int
    host: str
    thread: int
    what: str
    since: str


def lock_path(path: Path | str) -> Path:
    """The lock file of `path`: `<path>.lock` beside it."""
    return Path(f"{path}.lock")


def lock_holder(path: Path | str) -> LockHolder | None:
    """Who holds (or last took) the lock of `path`, as written into its lock file; None when nothing is written."""
    try:
        text = lock_path(path).read_text(encoding="utf-8")
        holder: LockHolder | None = json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _describe(holder: LockHolder | None) -> str:
    if not holder:
        return "another process (it has not written its name yet)"
    return (f"pid {holder.get('pid')} on host {holder.get('host')}"
            + (f" ({holder['what']})" if holder.get("what") else "") + f" since {holder.get('since')}")


def is_locked(path: Path | str) -> bool:
    """Whether someone holds the lock of `path` now (asked of the lock itself, not of a pid: right across hosts
    that share the folder and after pid reuse). Stale temp files are stale when this is False."""
    lp = lock_path(path)
    try:
        fd = os.open(lp, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the shared lock taken on success
    return False


@contextmanager
def lock(path: Path | str, *, timeout: float | None = 600.0, what: str = "", poll_s: float = 0.05) -> Iterator[Path]:
    """Hold an exclusive lock on `path` (an `flock` on `<path>.lock`) for the block; yields the lock file.

    Blocks until the lock is free, at most `timeout` seconds (None: no limit), then raises a QuantgateError naming
    the holder. While held, the lock file names the holder: {"pid", "host", "thread", "what", "since"}. The lock
    follows the open file, not the process: threads of one process exclude each other too, and a holder that dies
    releases it at once (the kernel drops the lock with its files). Not reentrant: taking it again in the same
    thread waits for the timeout. The lock file is kept (removing it would let two holders lock two files)."""
    lp = lock_path(path)
    lp.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lp, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise QuantgateError(f"still locked after {timeout:g} s by {_describe(lock_holder(path))}",
                                         where=str(lp),
                                         fix="wait for that process to finish, or stop it; if it runs on no host any "
                                             "more, the lock is already free (the kernel releases it with the process)"
                                         ) from None
                time.sleep(poll_s)
        holder: LockHolder = {"pid": os.getpid(), "host": socket.gethostname(), "thread": threading.get_ident(), "what": what,
                  "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        try:
            yield lp
        finally:
            os.ftruncate(fd, 0)  # released: the file names nobody
    finally:
        os.close(fd)  # drops the flock


def log_tail(path: Path, lines: int = 25) -> str:
    """The last lines of a log file, for error messages ('(no log)' when it cannot be read)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def resolve_api_key(api_key_env: str | None = None) -> str | None:
    """An API key from an environment variable (None: no variable named). A Prefect Secret block is read by the
    release layer (quantgate.release.secrets), which calls this for the variable."""
    if not api_key_env:
        return None
    key = os.environ.get(api_key_env)
    if not key:
        raise SettingError(f"environment variable {api_key_env} is not set or empty", setting="api_key_env",
                           fix=f"export {api_key_env}=..., or leave `api_key_env` out")
    return key


# Environment of child processes (vLLM servers, the quantization child, benchmark clients): what they need to run
# (paths, locale, Python, the ML libraries' settings and device selection), not the parent's other credentials.
CHILD_ENV_NAMES = frozenset({"PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR", "TMP",
                             "TEMP", "LD_LIBRARY_PATH", "XDG_CACHE_HOME", "SSL_CERT_FILE", "SSL_CERT_DIR",
                             "VIRTUAL_ENV"})
CHILD_ENV_PREFIXES = ("LC_", "PYTHON", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "VLLM_", "OMP_", "KMP_",
                      "MKL_", "CUDA_", "NCCL_", "GLOO_", "HIP_", "ROCR_", "TORCH_", "TORCHINDUCTOR_", "TRITON_",
                      "QUANTGATE_")
# Credentials are passed only by name (`keep`) or value (`extra`), even under a prefix above (HF_TOKEN, ...).
SECRET_NAME = re.compile(r"(API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?)$|^(AWS|AZURE|GOOGLE|GCP)_", re.I)


def child_env(extra: Mapping[str, str] | None = None, keep: tuple[str, ...] = (),
              environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process: from `environ` (default: os.environ) PATH, HOME, locale (LANG, LC_*),
    temp folders, PYTHON*, and the HF_/TRANSFORMERS_/VLLM_/OMP_/CUDA_/TORCH_ ... variables (CHILD_ENV_NAMES,
    CHILD_ENV_PREFIXES), except credential-like names (SECRET_NAME: *_API_KEY, *_TOKEN, AWS_* ...); plus the
    variables named in `keep` (exact names, or prefixes ending in '*'), credentials included; then `extra` on top."""
    src = os.environ if environ is None else environ
    names = {k for k in keep if not k.endswith("*")}
    prefixes = tuple(k[:-1] for k in keep if k.endswith("*"))

    def wanted(name: str) -> bool:
        if name in names or (prefixes and name.startswith(prefixes)):
            return True
        return (name in CHILD_ENV_NAMES or name.startswith(CHILD_ENV_PREFIXES)) and not SECRET_NAME.search(name)

    out = {k: v for k, v in src.items() if wanted(k)}
    out.update({k: str(v) for k, v in (extra or {}).items()})
    return out


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """The sha256 of a file's bytes, read in chunks (checkpoints, registry entries and the results store use it)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
