"""Serve one replica that spans nodes with vLLM's native multi-node mode, and always clean every node up.

    config = multinode_config_from_plan(plan, model_dir, "baseline")     # the plan's per-node `vllm serve` lines
    with MultiNodeServer(config, log_dir=run / "baseline") as srv:      # head + headless workers, all local
        client(srv.base_url, srv.api_key)

Each node is one `vllm serve ... --nnodes N --node-rank R --master-addr A --master-port P` process group (workers
`--headless`); the head also serves the OpenAI API. The commands are the plan's own (what `quantgate plan` prints
for the user's launcher), with only the local serving flags added to the head (--host, --port,
--served-model-name). "Local" means the node processes run on this host: tests, or one big host with a process
per node group; a node may be wrapped by a `prefix` such as `ip netns exec NS` to sit behind its own network
interface. Remote nodes are not launched here: `quantgate plan` renders their commands.

Watching: a node joined when its log shows its rank assigned in the world (vLLM logs "rank R in world size W is
assigned as ..." once the process group formed). Start-up fails with the node's name and log tail when a node
exits, and with a reachability probe of its master address when it has not joined by `join_timeout_s` (at once
when the head's store answers but a worker points at another address where nothing listens). Once up,
a watcher stops every other node when one dies (the head would otherwise hang on the next request) and
`raise_if_dead` reports which node it was.
"""

from __future__ import annotations

import re
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base import http
from quantgate.base.errors import QuantgateError, SettingError
from quantgate.base.fileio import child_env, log_tail
from quantgate.base.procs import TAG_VAR, tag_env
from quantgate.serving.env import serve_python
from quantgate.serving.server import (free_port, is_ready, plan_args, port_holder, port_is_free, report_leftovers,
                                      served_dtype, spawn, stop_group, wait_port_free)
from quantgate.serving.watchdog import STALL_S, Watchdog

JOINED = re.compile(r"\brank (\d+) in world size (\d+) is assigned as")
ADDR_FLAGS = ("--master-addr", "--data-parallel-address")
PORT_FLAGS = ("--master-port", "--data-parallel-rpc-port")


class NodeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rank: int
    role: Literal["head", "worker"]
    argv: list[str] = Field(description="`vllm serve ...` as planned (the head's serving flags are added at start)")
    env: dict[str, str] = Field(default_factory=dict)
    prefix: list[str] = Field(default_factory=list, description="wraps the launch, e.g. ['ip', 'netns', 'exec', 'ns1']")

    @property
    def label(self) -> str:
        return f"node {self.rank} ({self.role})"


class MultiNodeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Path
    name: str = "model"
    host: str = "127.0.0.1"
    port: int | None = Field(None, description="the head's API port; None: a free one")
    nodes: list[NodeSpec]
    args: list[str] = Field(default_factory=list, description="engine flags every node shares (cache keys, reports)")
    dtype: str | None = Field(None, description="the activation dtype it serves in (its --dtype), as a value; None: "
                                                "what vLLM picks from the checkpoint")
    python: Path | None = None
    startup_timeout_s: float = 900.0
    join_timeout_s: float = 300.0
    stall_timeout_s: float | None = Field(STALL_S, description="stop every node and name the head when requests are in "
                                                               "flight and nothing progressed this long (None: off)")

    @property
    def env(self) -> dict[str, str]:
        return self.nodes[0].env


def flag_value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


def set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """argv with `flag value` replaced, or appended when the flag is absent."""
    if flag in argv[:-1]:
        i = argv.index(flag)
        return [*argv[: i + 1], value, *argv[i + 2:]]
    return [*argv, flag, value]


def master_of(argv: list[str]) -> tuple[str | None, int | None]:
    addr = next((v for f in ADDR_FLAGS if (v := flag_value(argv, f))), None)
    port = next((v for f in PORT_FLAGS if (v := flag_value(argv, f))), None)
    return addr, int(port) if port and port.isdigit() else None


def multinode_config_from_plan(plan, model: Path, name: str, *, replica: int = 0, dtype: str | None = None,
                               extra_args: list[str] | None = None, python: Path | None = None,
                               master_addr: str = "127.0.0.1", master_port: int | None = None,
                               startup_timeout_s: float = 900.0, join_timeout_s: float = 300.0) -> MultiNodeConfig:
    """The plan's native per-node commands for one replica, to run locally: the checkpoint folder as the model,
    `master_addr` and `master_port` (None: a free port) filled in, `dtype` and `extra_args` applied to every node."""
    rep = plan.replica_plans[replica]
    if rep.multi_node is None:
        raise QuantgateError(f"replica {replica} runs on one node", fix="serve it with VLLMServer (config_from_plan)")
    port = str(master_port or free_port(master_addr))
    nodes = []
    for n in rep.multi_node.native:
        argv = [*n.commands[-1][:2], str(model), *n.commands[-1][3:]]
        for flags, value in ((ADDR_FLAGS, master_addr), (PORT_FLAGS, port)):
            for flag in flags:
                if flag in argv:
                    argv = set_flag(argv, flag, value)
        if dtype:
            argv = set_flag(argv, "--dtype", dtype)
        nodes.append(NodeSpec(rank=n.node_rank, role=n.role, argv=argv + list(extra_args or []), env=dict(n.env)))
    return MultiNodeConfig(model=model, name=name, nodes=nodes, args=plan_args(plan, dtype) + list(extra_args or []),
                           dtype=served_dtype(plan, dtype), python=python, startup_timeout_s=startup_timeout_s,
                           join_timeout_s=join_timeout_s)


def probe(addr: str, port: int, prefix: list[str] | None = None, timeout_s: float = 2.0) -> str | None:
    """None when a TCP connection to addr:port succeeds (from inside `prefix`'s namespace if given), else why not."""
    if prefix:
        code = ("import socket,sys\ntry:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()\n"
                "except Exception as e:\n print(type(e).__name__, e); sys.exit(1)")
        r = subprocess.run([*prefix, sys.executable, "-c", code, addr, str(port), str(timeout_s)], capture_output=True,
                           text=True, timeout=timeout_s + 10, env=child_env())
        return None if r.returncode == 0 else _why(r.stdout.strip() or r.stderr.strip(), addr, port, timeout_s)
    try:
        socket.create_connection((addr, port), timeout=timeout_s).close()
        return None
    except OSError as e:
        return _why(f"{type(e).__name__} {e}", addr, port, timeout_s)


def _why(err: str, addr: str, port: int, timeout_s: float) -> str:
    if "Refused" in err:
        return f"nothing listens at {addr}:{port} (connection refused)"
    if "timed out" in err.lower() or "Timeout" in err:
        return f"{addr}:{port} did not answer within {timeout_s:.0f} s (an address no host has, or a firewall)"
    return f"cannot reach {addr}:{port}: {err}"


class MultiNodeServer:
    """Same surface as VLLMServer (base_url, api_key, command, log_path, config, start/stop, raise_if_dead)."""
    def __init__(self, config: MultiNodeConfig, log_dir: Path):
        if [n.role for n in config.nodes].count("head") != 1 or config.nodes[0].role != "head":
            raise QuantgateError("a multi-node config needs exactly one head, listed first", fix="build it with multinode_config_from_plan")
        self.config = config
        self.log_dir = Path(log_dir)
        self.api_key = secrets.token_urlsafe(24)
        self.port = config.port or free_port(config.host)
        self.procs: dict[int, subprocess.Popen] = {}
        self.failure: QuantgateError | None = None
        self.startup_s: float | None = None
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._log_start: dict[int, int] = {}
        self._watchdog: Watchdog | None = None
        self.tag = tag_env()  # marks every node's processes: stop() finds any of them left

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.port}/v1"

    @property
    def endpoint(self) -> http.Endpoint:
        """The served model as its clients address it."""
        return http.Endpoint(self.base_url, self.config.name, self.api_key)

    @property
    def log_path(self) -> Path:
        return self.node_log(self.config.nodes[0])

    def node_log(self, node: NodeSpec) -> Path:
        return self.log_dir / f"node{node.rank}-{node.role}.log"

    def node_command(self, node: NodeSpec) -> list[str]:
        if node.role != "head":
            return list(node.argv)
        argv = node.argv
        for flag, value in (("--host", self.config.host), ("--port", str(self.port)), ("--served-model-name", self.config.name)):
            argv = set_flag(argv, flag, value)
        return argv

    @property
    def commands(self) -> list[list[str]]:
        return [self.node_command(n) for n in self.config.nodes]

    @property
    def command(self) -> list[str]:
        return self.node_command(self.config.nodes[0])

    # --- start -------------------------------------------------------------------------------------------------
    def _preflight(self) -> None:
        head = self.config.nodes[0]
        if not port_is_free(self.config.host, self.port):
            raise QuantgateError(f"{head.label}: API port {self.port} on {self.config.host} is in use{port_holder(self.port)}",
                                 fix="pick another port or leave it unset for a free one")
        addr, port = master_of(head.argv)
        if head.prefix or addr is None or port is None:
            return  # the head runs in another namespace: nothing to check from here
        try:
            with socket.socket() as s:
                s.bind((addr, 0))
        except OSError:
            raise SettingError(f"{head.label}: master address {addr} is not an address of this host, so the head cannot listen on it",
                                 setting="master_addr", fix="use the head's own address (127.0.0.1 when every node is local)") from None
        if not port_is_free(addr, port):
            raise SettingError(f"{head.label}: master port {port} on {addr} is in use{port_holder(port)}", setting="master_port",
                                 fix="free that port, or leave the master port unset so a free one is picked")

    def start(self) -> MultiNodeServer:
        self._preflight()
        python = serve_python(self.config.python)
        t0 = time.monotonic()
        try:
            for node in self.config.nodes:  # head first: it owns the store the workers connect to
                env = {**node.env, **self.tag, **({"VLLM_API_KEY": self.api_key} if node.role == "head" else {})}
                log = self.node_log(node)
                self._log_start[node.rank] = log.stat().st_size if log.exists() else 0
                self.procs[node.rank] = spawn(python, self.node_command(node), env, self.node_log(node), prefix=node.prefix)
            self._wait_ready(t0)
        except BaseException:
            self.stop(raising=False)  # the start-up error says more than anything left behind
            raise
        self.startup_s = time.monotonic() - t0
        self._watcher = threading.Thread(target=self._watch, name="multinode-watch", daemon=True)
        self._watcher.start()
        if self.config.stall_timeout_s:
            self._watchdog = Watchdog(self.base_url, self.log_path, self.procs[self.config.nodes[0].rank].pid, self._on_stall,
                                      stall_s=self.config.stall_timeout_s, what="multi-node server (head)").start()
        return self

    def _on_stall(self, error: QuantgateError) -> None:
        """The watchdog's verdict: stop every node (waiting clients fail now) and keep it for raise_if_dead."""
        self._stop.set()  # the node watcher must not report the nodes stopped here as died
        if self._watcher is not None:
            self._watcher.join(timeout=60)
        self._stop_nodes()
        self.failure = error

    def joined(self, node: NodeSpec) -> bool:
        try:
            with open(self.node_log(node), "rb") as f:
                f.seek(self._log_start.get(node.rank, 0))  # logs are appended to: only this start counts
                text = f.read().decode(errors="replace")
        except OSError:
            return False
        return JOINED.search(text) is not None

    def _died(self, node: NodeSpec, when: str) -> QuantgateError:
        code = self.procs[node.rank].returncode
        return QuantgateError(f"{node.label} exited with code {code} {when}; last lines of its log:\n{log_tail(self.node_log(node))}",
                              where=str(self.node_log(node)),
                              fix="read that node's log; a node killed or out of memory, or ranks that disagree on the layout")

    def _unreachable(self, nodes: list[NodeSpec]) -> list[tuple[NodeSpec, str]]:
        """(node, why) for each node whose master address does not answer from where that node runs."""
        out = []
        for node in nodes:
            addr, port = master_of(node.argv)
            why = probe(addr, port, node.prefix) if addr and port else "it has no master address"
            if why:
                out.append((node, why))
        return out

    def _cannot_join(self, missing: list[NodeSpec]) -> list[tuple[NodeSpec, str]]:
        """Workers that can never join: the head's store answers, but they point elsewhere and nothing is there."""
        head = self.config.nodes[0]
        elsewhere = [n for n in missing if master_of(n.argv) != master_of(head.argv)]
        if not elsewhere or self._unreachable([head]):
            return []  # every node points at the head, or the head's store is not up yet: too early to tell
        return self._unreachable(elsewhere)

    def _not_joined(self, missing: list[NodeSpec], culprits: list[tuple[NodeSpec, str]], *, early: bool) -> QuantgateError:
        head_addr, head_port = master_of(self.config.nodes[0].argv)
        lines = [f"{node.label} did not join: {why}, its --master-addr/--master-port; the head's store is at "
                 f"{head_addr}:{head_port}" for node, why in culprits]
        if not culprits:
            lines = [f"{n.label} did not join although its master address answers" for n in missing]
            culprits = [(n, "") for n in missing]
        tails = "\n".join(f"--- {n.label}, last lines of {self.node_log(n)}:\n{log_tail(self.node_log(n), 8)}" for n, _ in culprits)
        when = "cannot join the head" if early else f"had not joined within {self.config.join_timeout_s:.0f} s"
        return QuantgateError(f"not every node joined: {len(culprits)} node(s) {when}:\n" + "\n".join(lines) + "\n" + tails,
                              where=", ".join(n.label for n, _ in culprits),
                              fix="give every node the head's address and master port, check the port is open between the "
                                  "hosts, or raise serving.join_timeout_s on a slow machine")

    def _wait_ready(self, t0: float) -> None:
        nodes = self.config.nodes
        check_join = all("--nnodes" in n.argv for n in nodes)  # data-parallel launches log no such line
        last_check = 0.0
        while True:
            for node in nodes:
                if self.procs[node.rank].poll() is not None:
                    raise self._died(node, "while the nodes were starting")
            elapsed = time.monotonic() - t0
            missing = [n for n in nodes if check_join and not self.joined(n)]
            if not missing and is_ready(self.endpoint):
                return
            if missing and elapsed > self.config.join_timeout_s:
                raise self._not_joined(missing, self._unreachable(missing), early=False)
            if missing and elapsed - last_check >= 5:  # a worker sent to the wrong address fails now, not at the deadline
                last_check = elapsed
                if doomed := self._cannot_join(missing):
                    raise self._not_joined(missing, doomed, early=True)
            if elapsed > self.config.startup_timeout_s:
                raise QuantgateError(
                    f"the multi-node server did not become healthy within {self.config.startup_timeout_s:.0f} s (every node "
                    f"joined); last lines of the head's log:\n{log_tail(self.log_path)}", where=str(self.log_path),
                    fix="raise serving.startup_timeout_s if the machine is slow, else read the log")
            time.sleep(1.0)

    # --- watch and stop ----------------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            dead = next((n for n in self.config.nodes if self.procs[n.rank].poll() is not None), None)
            if dead is not None:
                failure = self._died(dead, "while serving; every other node was stopped")
                self._stop_nodes()
                self.failure = failure  # set once the others are gone, so a reader sees the final state
                return

    def _stop_nodes(self) -> None:
        threads = [threading.Thread(target=stop_group, args=(p,)) for p in self.procs.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def stop(self, raising: bool = True) -> None:
        """Stop every node, then prove it: no process of any node's group or of this server's tag is left, and
        neither the API port nor the master (torch TCPStore) port listens; what is, is SIGKILLed, and what
        survives that raises (or is logged when `raising` is False)."""
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=60)
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        procs = dict(self.procs)
        if not procs:
            return
        self._stop_nodes()
        wait_port_free(self.config.host, self.port)
        self.procs = {}
        head = self.config.nodes[0]
        ports = [self.port] + ([p] if not head.prefix and (p := master_of(head.argv)[1]) else [])
        for rank, proc in procs.items():
            report_leftovers(f"multi-node server {self.base_url}, node {rank}", proc.pid, None, [], raising)
        report_leftovers(f"multi-node server {self.base_url}", None, self.tag[TAG_VAR], ports, raising)

    def alive(self) -> bool:
        return bool(self.procs) and self.failure is None and all(p.poll() is None for p in self.procs.values())

    def raise_if_dead(self) -> None:
        if self.failure is not None:
            raise self.failure
        for node in self.config.nodes:
            if node.rank in self.procs and self.procs[node.rank].poll() is not None:
                raise self._died(node, "while serving")

    def __enter__(self) -> MultiNodeServer:
        return self.start()

    def __exit__(self, exc_type, *exc) -> None:
        self.stop(raising=exc_type is None)  # never hide the exception that ends the block
