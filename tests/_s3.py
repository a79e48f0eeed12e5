"""An S3 API on loopback for the tests: moto's server mode (`moto_server`, from .venv-s3, which `make test` builds)
as a child process, with the AWS variables that point s3fs (and so quantgate's results store) at it."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from quantgate.base.paths import REPO
from quantgate.serving.server import free_port, kill_tree

MOTO = REPO / ".venv-s3" / "bin" / "moto_server"


@contextmanager
def s3_server(log: Path, bucket: str = "quantgate") -> Iterator[dict[str, str]]:
    """Start moto's S3 server, make `bucket`, yield the environment a client needs (AWS_ENDPOINT_URL, keys, region,
    and QG_TEST_BUCKET); stop it on exit."""
    port = free_port()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "QG_TEST_BUCKET": bucket}
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(MOTO), "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(env["AWS_ENDPOINT_URL"], timeout=2)
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.3)
        httpx.put(f"{env['AWS_ENDPOINT_URL']}/{bucket}", timeout=10).raise_for_status()
        yield env
    finally:
        kill_tree(proc.pid)


@contextmanager
def aws_env(env: dict[str, str]) -> Iterator[None]:
    """This process's environment with `env` set for the block. s3fs reads the AWS variables when it connects and
    fsspec keeps its filesystems by URL, so the ones made under another environment (another test's S3 server) are
    dropped on the way in and out."""
    from s3fs import S3FileSystem

    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    S3FileSystem.clear_instance_cache()
    try:
        yield
    finally:
        S3FileSystem.clear_instance_cache()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
