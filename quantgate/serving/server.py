"""Run one vLLM OpenAI-compatible server as a child process, and always clean it up.

    with VLLMServer(ServerConfig(model=path, name="baseline"), log_path=run/"server.log") as srv:
        client(srv.base_url, srv.api_key)

The server binds loopback on a free port, gets a fresh random API key (passed by environment, not argv),
and is considered up when /health answers and /v1/models lists it. If it dies while starting, the error
carries the last lines of its log. Stopping kills the whole process tree (engine core, workers), waits
until the port is free again and removes the shared-memory files (/dev/shm) its processes held: on normal exit, on
exceptions and on Ctrl-C.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
from pydantic import BaseModel, ConfigDict, Field

from quantgate.base import http
from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import child_env, log_tail
from quantgate.base.procs import TAG_VAR, group_members, guarded, leftovers, remove_shm, shm_held, tag_env, verify_gone
from quantgate.plan.commands import ONE_PROCESS
from quantgate.plan.slots import BIND, cores_of
from quantgate.serving.env import LAUNCHER, serve_python
from quantgate.serving.logcause import log_cause
from quantgate.serving.watchdog import STALL_S, Watchdog

log = logging.getLogger(__name__)
# beyond child_env's own list: a preloaded allocator or OpenMP runtime (vLLM's CPU docs suggest one)
SERVE_ENV_KEEP = ("LD_PRELOAD",)
READY_POLL_S = 0.25  # between readiness probes while a server starts (a probe is one local HTTP request)


class ServerConfig(BaseModel):
    """What to serve and how. `args` are extra `vllm serve` arguments (e.g. a plan's), `env` extra variables."""
    model_config = ConfigDict(extra="forbid")

    model: Path
    name: str = Field("model", description="--served-model-name; clients use this as `model`")
    host: str = "127.0.0.1"
    port: int | None = Field(None, description="None: pick a free port")
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    dtype: str | None = Field(None, description="the activation dtype it serves in (its --dtype), as a value; None: "
                                                "what vLLM picks from the checkpoint")
    python: Path | None = Field(None, description="serving interpreter; None: see quantgate.serving.env")
    startup_timeout_s: float = 600.0
    stall_timeout_s: float | None = Field(STALL_S, description="stop the server and name it when requests are in flight "
                                                               "and nothing progressed this long (None: no watchdog)")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def port_holder(port: int) -> str:
    """' by pid N (command)' for the process listening on `port`, or '' when none is found (or not visible)."""
    try:
        conns = psutil.net_connections("tcp")
    except psutil.Error:
        return ""
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            try:
                return f" by pid {c.pid} ({' '.join(psutil.Process(c.pid).cmdline())[:120]})"
            except psutil.Error:
                return f" by pid {c.pid}"
    return ""


def kill_tree(pid: int, grace_s: float = 15.0) -> None:
    """SIGTERM a process and all its descendants, SIGKILL what is left after `grace_s`."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def spawn(python: Path, command: list[str], env: dict[str, str], log_path: Path, prefix: list[str] | None = None) -> subprocess.Popen:
    """Start `vllm ...` (command[0] == "vllm") through the launcher, under the process guard (quantgate.base.procs:
    the server's whole group dies with this process, even a SIGKILLed one), in its own session, output to
    `log_path`. The child gets `child_env(env)`: the variables vLLM needs, not the parent's other credentials.

    `prefix` wraps the launch (e.g. `ip netns exec NS`, which execs in place, so the guard's parent stays us)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    omp = one_process_binding(env)
    full = child_env({**env, **omp, "PYTHONUNBUFFERED": "1"}, keep=SERVE_ENV_KEEP)
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(command)}\n".encode())
        if omp.get(ONE_PROCESS) == "1":
            log.write(f"# a worker process of its own ({ONE_PROCESS}=1): its cores are {env[BIND]}\n".encode())
        elif omp:
            log.write(f"# one process ({ONE_PROCESS}=0), its OpenMP thread bound by quantgate: "
                      f"{' '.join(f'{k}={v}' for k, v in omp.items())} (core ids={cores_of(env[BIND])})\n".encode())
        log.flush()
        # own session: Ctrl-C in the terminal reaches us, and we stop the server tree ourselves
        return subprocess.Popen([*(prefix or []), *guarded([str(python), str(LAUNCHER), *command[1:]], python=python)],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full,
                                start_new_session=True)


def one_process_binding(env: dict[str, str]) -> dict[str, str]:
    """What a one-worker CPU server (`env` has VLLM_ENABLE_V1_MULTIPROCESSING=0 and one core group in
    VLLM_CPU_OMP_THREADS_BIND) adds to its environment. On one core: the OpenMP variables that bind its compute
    thread there (vLLM sets them only in a worker process it spawns; OpenMP reads them when a process starts). On
    more cores: the worker process of its own again, because in one process the API server's thread is bound to
    the first core beside the compute team's, which cost 0.65x the throughput on 2 cores (docs/measurements.md).
    {} for every other server."""
    bind = env.get(BIND, "")
    if env.get(ONE_PROCESS) != "0" or not re.fullmatch(r"[\d,-]+", bind):  # not one group of core ids ('auto', '0|1')
        return {}
    cores = cores_of(bind)
    if len(cores) > 1:
        return {ONE_PROCESS: "1"}
    return {"OMP_NUM_THREADS": "1", "OMP_PLACES": f"{{{cores[0]}}}", "OMP_PROC_BIND": "close"}


def stop_group(proc: subprocess.Popen) -> None:
    """Kill a launched server's tree, then whatever is left in its process group (workers orphaned by a killed
    parent), and wait until no member is left (SIGKILLed processes take a moment)."""
    kill_tree(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(timeout=10)
    deadline = time.monotonic() + 15
    while group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)


def report_leftovers(what: str, pgid: int | None, tag: str | None, ports: list[int], raising: bool = True) -> None:
    """The end of every stop(): nothing of the server may be left (quantgate.base.procs.verify_gone). What had to
    be killed is logged; what survives SIGKILL raises, or is logged when `raising` is False (an exception is
    already on its way and must not be hidden)."""
    try:
        warning = verify_gone(what, pgid, tag, ports)
    except QuantgateError as exc:
        if raising:
            raise
        warning = exc.render()
    if warning:
        log.warning(warning)


def wait_port_free(host: str, port: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not port_is_free(host, port) and time.monotonic() < deadline:
        time.sleep(0.5)


def is_ready(endpoint: http.Endpoint) -> bool:
    """/health answers and /v1/models lists the endpoint's model (the API server is up and the engine loaded)."""
    try:
        if http.get(f"{endpoint.base.removesuffix('/v1')}/health", timeout_s=2).status_code != 200:
            return False
        return endpoint.model in http.served_models(endpoint.url, endpoint.api_key, timeout_s=5)
    except http.EndpointError:
        return False


class VLLMServer:
    def __init__(self, config: ServerConfig, log_path: Path):
        self.config = config
        self.log_path = Path(log_path)
        self.api_key = secrets.token_urlsafe(24)
        self.port = config.port or free_port(config.host)
        self.proc: subprocess.Popen | None = None
        self.tag = tag_env()  # marks the server and all it starts: stop() finds any of them left
        self.stalled: QuantgateError | None = None
        self._watchdog: Watchdog | None = None
        self._shm: set[str] = set()  # its shared-memory files, removed by stop()

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.port}/v1"

    @property
    def endpoint(self) -> http.Endpoint:
        """The served model as its clients address it."""
        return http.Endpoint(self.base_url, self.config.name, self.api_key)

    @property
    def command(self) -> list[str]:
        """The command as a user would type it (`vllm serve ...`); the launcher makes it work for vllm-cpu."""
        c = self.config
        return ["vllm", "serve", str(c.model), "--host", c.host, "--port", str(self.port), "--served-model-name", c.name, *c.args]

    def start(self) -> VLLMServer:
        python = serve_python(self.config.python)
        if not port_is_free(self.config.host, self.port):
            raise QuantgateError(f"port {self.port} on {self.config.host} is in use{port_holder(self.port)}", fix="pick another port or leave it unset for a free one")
        self.stalled = None
        self.proc = spawn(python, self.command, {**self.config.env, **self.tag, "VLLM_API_KEY": self.api_key}, self.log_path)
        try:
            self._wait_ready()
        except BaseException:
            self.stop(raising=False)  # the start-up error says more than anything left behind
            raise
        self._note_shm()
        if self.config.stall_timeout_s:
            self._watchdog = Watchdog(self.base_url, self.log_path, self.proc.pid, self._on_stall,
                                      stall_s=self.config.stall_timeout_s).start()
        return self

    def _on_stall(self, error: QuantgateError) -> None:
        """The watchdog's verdict: keep it for raise_if_dead, and kill the server so that waiting clients fail now."""
        self.stalled = error
        log.error(error.render())
        proc = self.proc
        if proc is not None:
            self._note_shm()
            stop_group(proc)

    def _wait_ready(self) -> None:
        assert self.proc is not None  # start() spawned it just before
        deadline = time.monotonic() + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                cause = log_cause(self.log_path)
                raise QuantgateError(
                    f"vLLM server for {self.config.model} exited with code {self.proc.returncode} while starting"
                    f"{'; root cause: ' + cause if cause else ''}; last log lines:\n{log_tail(self.log_path)}",
                    where=str(self.log_path),
                    fix="read the log above; a model vLLM cannot load, too little KV cache space or a busy port are the usual causes",
                )
            if is_ready(self.endpoint):
                return
            time.sleep(READY_POLL_S)
        raise QuantgateError(
            f"vLLM server did not become healthy within {self.config.startup_timeout_s:.0f} s; last log lines:\n{log_tail(self.log_path)}",
            where=str(self.log_path),
            fix="raise serving.startup_timeout_s if the machine is slow, else read the log",
        )

    def stop(self, raising: bool = True) -> None:
        """Stop the server's whole tree, then prove it: no process of its group or tag and nothing on its port is
        left (what is, is SIGKILLed; what survives that raises, or is logged when `raising` is False)."""
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self.proc is None:
            return
        pgid = self.proc.pid
        self._note_shm()
        stop_group(self.proc)
        wait_port_free(self.config.host, self.port)
        self.proc = None
        try:
            report_leftovers(f"vLLM server {self.base_url}", pgid, self.tag[TAG_VAR], [self.port], raising)
        finally:
            shm, self._shm = self._shm, set()
            if removed := remove_shm(shm):  # the guard's sweep removes them too, unless it was killed first
                log.info(f"vLLM server {self.base_url}: removed {len(removed)} shared-memory files it left in /dev/shm")

    def _note_shm(self) -> None:
        """Remember the /dev/shm files the server's processes hold now (vLLM's message queues): an engine that is
        killed never unlinks them, so stop() removes them once nobody holds them."""
        if self.proc is not None:
            self._shm |= shm_held(leftovers(self.proc.pid, self.tag[TAG_VAR]))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def raise_if_dead(self) -> None:
        """Turn a server that died (or was stopped as stalled) under load into one clear error with its log tail."""
        if self.stalled is not None:
            raise self.stalled
        if self.proc is not None and self.proc.poll() is not None:
            raise QuantgateError(
                f"vLLM server for {self.config.model} died (exit code {self.proc.returncode}); last log lines:\n{log_tail(self.log_path)}",
                where=str(self.log_path),
                fix="read the log: out of memory, a crash in a kernel, or the process was killed",
            )

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, exc_type, *exc) -> None:
        self.stop(raising=exc_type is None)  # never hide the exception that ends the block


def config_from_plan(plan, model: Path, name: str, *, replica: int = 0, dtype: str | None = None,
                     extra_args: list[str] | None = None, python: Path | None = None, startup_timeout_s: float = 600.0,
                     stall_timeout_s: float | None = STALL_S) -> ServerConfig:
    """Serve one replica of a planner Plan (quantgate.plan.planner.Plan): its vLLM arguments and environment.

    `dtype` replaces the plan's --dtype (e.g. a spec override); multi-node replicas need the multi-node manager.
    """
    rep = plan.replica_plans[replica]
    if rep.multi_node is not None:
        raise QuantgateError(f"replica {replica} spans {len(rep.nodes)} nodes", fix="serve it with the multi-node manager")
    return ServerConfig(model=model, name=name, args=plan_args(plan, dtype) + list(extra_args or []), env=dict(rep.env),
                        dtype=served_dtype(plan, dtype), python=python, startup_timeout_s=startup_timeout_s,
                        stall_timeout_s=stall_timeout_s)


def served_dtype(plan, dtype: str | None = None) -> str | None:
    """The activation dtype a server of the plan runs in: `dtype` (an override) or the plan's --dtype."""
    planned = plan.vllm_args.get("--dtype")
    return dtype or (str(planned) if planned is not None else None)


def plan_args(plan, dtype: str | None = None) -> list[str]:
    """The plan's `vllm serve` flags as argv (boolean flags without a value); `dtype` replaces --dtype."""
    args = dict(plan.vllm_args)
    if dtype:
        args["--dtype"] = dtype
    argv: list[str] = []
    for flag, value in args.items():
        if value is False:
            continue
        argv += [flag] if value is True else [flag, str(value)]
    return argv
