"""What a release on work pools needs around it, for the tests and bench/pools.py: a Prefect server, "hosts" (process
workers pinned to cores, each with its own results folder and QUANTGATE_HOME) and the process tree of a host."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil

from quantgate.base.objstore import ResultStore
from quantgate.base.paths import REPO, home
from quantgate.serving.server import free_port, kill_tree

PREFECT = Path(sys.executable).with_name("prefect")


def wait_healthy(api: str, proc: subprocess.Popen, log: Path, seconds: float = 300) -> None:
    """Wait for the Prefect server `proc` (its output in `log`) to answer GET `api`/health."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"Prefect server not healthy after {seconds} s:\n{log.read_text()[-3000:]}")


@contextmanager
def prefect_server(folder: Path) -> Iterator[str]:
    """`prefect server start` on loopback (UI off, its database in `folder`): its API URL; stopped on exit."""
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(folder), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_ENABLED": "false", "PREFECT_API_URL": api}
    log = folder / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(PREFECT), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(api, proc, log)
        yield api
    finally:
        kill_tree(proc.pid)


def worker(name: str, core: int, root: Path, env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
    """A "host": `prefect worker start --pool <name>` pinned to one core, with its own results folder and
    QUANTGATE_HOME (the environments and model cache linked in: a second copy of the weights would only cost time).
    Returns the worker and its log."""
    host_home = root / name / "home"
    host_home.mkdir(parents=True)
    for shared in ("envs", "models"):
        (host_home / shared).symlink_to(home() / shared)
    host_env = {**env, "QUANTGATE_HOST": name, "QUANTGATE_RESULTS": str(root / name / "results"),
                "QUANTGATE_HOME": str(host_home), "QUANTGATE_REPO": str(REPO),
                # a scheduled child is picked up within 2 s instead of Prefect's 10 (its default poll)
                "PREFECT_WORKER_QUERY_SECONDS": "2"}
    log = root / f"{name}-worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["taskset", "-c", str(core), str(PREFECT), "worker", "start", "--pool", name,
                                 "--type", "process"], stdout=out, stderr=subprocess.STDOUT, env=host_env, cwd=REPO,
                                start_new_session=True)
    return proc, log


def host_processes(proc: subprocess.Popen) -> list[psutil.Process]:
    """Everything running on a "host": its worker and every process under it (flow runs, their vLLM servers)."""
    try:
        root = psutil.Process(proc.pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def serving(proc: subprocess.Popen) -> bool:
    """Whether a vLLM server runs on the host."""
    out = False
    for p in host_processes(proc):
        try:
            out = out or "vllm" in " ".join(p.cmdline())
        except psutil.Error:
            pass
    return out


def lose_host(proc: subprocess.Popen) -> list[psutil.Process]:
    """The host is lost: SIGKILL to every process of it at once (no process can clean up after another). Returns them."""
    doomed = host_processes(proc)
    for p in doomed:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    return doomed


def stored_answers(store: ResultStore, root: Path) -> tuple[str, list[str]]:
    """The eval answers of the one unfinished cache folder on the store (the candidate being measured): the key of
    its results.jsonl and its lines, as pulled into `root`; ("", []) before there is one."""
    shutil.rmtree(root, ignore_errors=True)  # pulled afresh each time (an unfinished pull keeps local files)
    store._fs.invalidate_cache()  # s3fs keeps listings: ask the server
    for key in store._fs.find(store.key("cache/variants")):
        if not (key.endswith("/results.jsonl") and "/evals/" in key):
            continue
        rel = key[len(store.key("")):]
        folder = rel.rsplit("/evals/", 1)[0]
        manifest = store.manifest(folder)
        if manifest is not None and not manifest["complete"] and store.pull(folder, partial=True) is not None:
            return rel, (root / rel).read_text().splitlines()
    return "", []
