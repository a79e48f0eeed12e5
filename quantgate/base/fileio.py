"""Small shared helpers for files, processes and secrets (no quantgate imports beyond errors)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from quantgate.base.errors import ConfigError


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (temp file + rename): readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


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


def resolve_api_key(api_key_env: str | None = None, prefect_secret: str | None = None) -> str | None:
    """An API key from an environment variable or a Prefect Secret block (None: no key)."""
    if api_key_env and prefect_secret:
        raise ConfigError("give either an environment variable or a Prefect Secret block, not both",
                             where="--api-key-env / --prefect-secret")
    if api_key_env:
        key = os.environ.get(api_key_env)
        if not key:
            raise ConfigError(f"environment variable {api_key_env} is not set or empty", where="--api-key-env",
                                 fix=f"export {api_key_env}=... or drop --api-key-env")
        return key
    if prefect_secret:
        try:
            from prefect.blocks.system import Secret

            return Secret.load(prefect_secret).get()
        except Exception as exc:  # import error, unknown block, unreachable Prefect API
            raise ConfigError(f"cannot read Prefect Secret block {prefect_secret!r}: {exc}", where="--prefect-secret",
                                 fix="create it (prefect block create secret) and check PREFECT_API_URL") from None
    return None
