"""Child processes that never outlive quantgate, and proof afterwards that none is left (Linux /proc).

- `guarded(command)`: the argv that runs `command` under quantgate/base/procguard.py, which kills the child's
  whole process group when quantgate dies, even by SIGKILL (PR_SET_PDEATHSIG plus a parent-id poll). Start it in
  a new session (`start_new_session=True`) so that the group is the child's alone. The kernel's parent-death
  signal follows the THREAD that started the child: start a long-lived child from a thread that outlives it
  (the `with server:` block's thread, as every caller here does). Once `close_children()` was called (a stop
  signal is stopping this process's tree), `guarded` refuses: a child started after the stop's last look at the
  tree would outlive the process by its guard's grace period.
- `tag_env()`: a variable that marks a child and everything it starts; `tagged(tag)` finds them again, in any
  process group or session (a worker that called setsid included).
- `leftovers(pgid, tag)`, `listening(ports)`: what is still alive / still bound after a stop, from /proc and
  the socket tables /proc/net/tcp and /proc/net/tcp6.
- `verify_gone(...)`: the check a stop() ends with: SIGKILL what is left, wait, and raise naming pids and ports
  when something survives.
- `shm_held(pids)`, `remove_shm(paths)` (from procguard, which also runs them after its sweep): the /dev/shm files
  a server's processes have mapped or open, noted before its stop, and removed after it once nobody holds them.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from quantgate.base.errors import QuantgateError
from quantgate.base.procguard import group_members, remove_shm, set_parent_death_signal, shm_held

__all__ = ["GUARD", "TAG_VAR", "close_children", "guarded", "group_members", "holders", "leftovers", "listening",
           "remove_shm", "set_parent_death_signal", "shm_held", "tag_env", "tagged", "verify_gone"]

GUARD = Path(__file__).with_name("procguard.py")
TAG_VAR = "QUANTGATE_CHILD_TAG"
LISTEN = "0A"  # TCP state code of a listening socket in /proc/net/tcp*


_closed = threading.Event()  # close_children(): no child starts any more


def close_children() -> None:
    """From now on `guarded` refuses to start a child: this process is stopping its whole tree, for good."""
    _closed.set()


def guarded(command: list[str], python: Path | str | None = None, grace_s: float = 5.0) -> list[str]:
    """argv that runs `command` under the guard (procguard.py), interpreted by `python` (default: this one); a
    QuantgateError once close_children() was called."""
    if _closed.is_set():
        raise QuantgateError(f"not started: {Path(command[0]).name} {' '.join(command[1:3])}...: this process is "
                             "stopping every process it started", where="quantgate.base.procs.guarded",
                             fix="nothing to fix: a stop signal ends this process")
    return [str(python or sys.executable), "-I", "-S", str(GUARD), str(os.getpid()), f"{grace_s:g}", "--", *command]


def tag_env() -> dict[str, str]:
    """{TAG_VAR: a fresh random tag}: put it in a child's environment; its descendants inherit it."""
    return {TAG_VAR: secrets.token_hex(8)}


def tagged(tag: str) -> list[int]:
    """Live processes (of this user: others' environments are unreadable) whose environment carries `tag`."""
    needle = f"{TAG_VAR}={tag}".encode()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
        except (OSError, IndexError):
            continue
        out.append(int(name))
    return out


def leftovers(pgid: int | None, tag: str | None) -> list[int]:
    """Live processes of process group/session `pgid` or carrying `tag` (this process excluded)."""
    pids = set(group_members(pgid, exclude=os.getpid()) if pgid else ())
    pids |= set(tagged(tag) if tag else ())
    return sorted(pids)


def _socket_rows() -> Iterable[tuple[str, int, str, str]]:
    """(local address hex, port, state, inode) of every TCP socket in this network namespace."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            addr, _, port = f[1].rpartition(":")
            yield addr, int(port, 16), f[3], f[9]


def _address(hexaddr: str) -> str:
    """The kernel's hex address (32-bit words in host byte order) as text: '127.0.0.1', '::'."""
    words = [bytes.fromhex(hexaddr[i:i + 8]) for i in range(0, len(hexaddr), 8)]
    raw = b"".join(w[::-1] if sys.byteorder == "little" else w for w in words)
    return str(ipaddress.ip_address(raw))


def listening(ports: Iterable[int]) -> dict[int, list[str]]:
    """port -> the addresses it listens on (e.g. '127.0.0.1'; '::' or '0.0.0.0': every interface), for
    each of `ports` that something listens on, read from the kernel's socket tables."""
    out: dict[int, list[str]]
    wanted, out = set(ports), {}
    for addr, port, state, _ in _socket_rows():
        if port in wanted and state == LISTEN:
            out.setdefault(port, []).append(_address(addr))
    return out


def holders(port: int) -> list[int]:
    """Pids (of this user) holding a socket listening on `port`."""
    inodes = {inode for _, p, state, inode in _socket_rows() if p == port and state == LISTEN}
    out = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{name}/fd")
            if any(os.readlink(f"/proc/{name}/fd/{fd}")[8:-1] in inodes for fd in fds):
                out.append(int(name))
        except OSError:
            continue
    return out


def _describe(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = "?"
    return f"pid {pid} ({cmd[:100]})"


def _kill(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _ours(ports: list[int], pgid: int | None, tag: str | None) -> tuple[dict[int, list[str]], list[str]]:
    """The ports among `ports` still listening that are the server's (held by its processes, or by a holder this
    user cannot see), and a note for each one another program of ours took since (a free port is re-used)."""
    mine, foreign = {}, []
    for port, addrs in listening(ports).items():
        hs = holders(port)
        if hs and not set(hs) & set(leftovers(pgid, tag)):
            foreign.append(f"port {port} is now held by {', '.join(_describe(h) for h in hs)}, not by this server")
        else:
            mine[port] = addrs
    return mine, foreign


def verify_gone(what: str, pgid: int | None, tag: str | None, ports: Iterable[int] = (), wait_s: float = 10.0) -> str | None:
    """After a stop: no process of group/session `pgid` or carrying `tag`, nothing of it listening on `ports`.

    Whatever is left is SIGKILLed (processes of that group or tag only; a port another program took since is
    named, never killed) and waited for up to `wait_s`. Returns None when nothing was left, else a warning naming
    what had to be killed (or who holds a port now), and raises QuantgateError naming the pids and ports that
    survive even SIGKILL."""
    ports = [p for p in ports if p]
    pids, (bound, foreign) = leftovers(pgid, tag), _ours(ports, pgid, tag)
    if not pids and not bound:
        return f"{what}: " + "; ".join(foreign) if foreign else None
    found = "; ".join([*(_describe(p) for p in pids), *(f"port {p} listening on {', '.join(a)}" for p, a in bound.items())])
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        _kill(leftovers(pgid, tag))
        pids, (bound, foreign) = leftovers(pgid, tag), _ours(ports, pgid, tag)
        if not pids and not bound:
            return f"{what}: left after stop and killed with SIGKILL: {found}" + "".join(f"; {f}" for f in foreign)
        time.sleep(0.2)
    raise QuantgateError(f"{what}: still left {wait_s:g} s after SIGKILL: "
                         + "; ".join([*(_describe(p) for p in pids), *(f"port {p} listening on {', '.join(a)}"
                                                                        for p, a in bound.items())]),
                         where=f"process group {pgid}" if pgid else what,
                         fix="kill the processes named above (a process in uninterruptible sleep waits for its I/O; "
                             "a port whose holder is not shown belongs to another user)")
