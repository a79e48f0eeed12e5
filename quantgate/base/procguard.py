"""Guard a child process so that it never outlives the process that started it (stdlib only, run by file path).

    PYTHON -I -S procguard.py PARENT_PID GRACE_S -- COMMAND ARG...

quantgate starts every long-lived child (vLLM servers and their ranks, the quantization child, the benchmark
driver) through this guard, in a session of its own (quantgate.base.procs.guarded). The guard

- asks the kernel to signal it when its parent dies (PR_SET_PDEATHSIG), and also polls its parent id, so even a
  SIGKILLed parent is noticed within a second;
- forks COMMAND, with PR_SET_PDEATHSIG(SIGKILL) set between fork and exec: if the guard itself is SIGKILLed,
  COMMAND dies at once;
- forks a watcher, a copy of itself in the same process group, whose only job is the guard's own death: when the
  guard is SIGKILLed (alone, or together with the parent, so that nothing of quantgate is left to clean up), the
  watcher sweeps the group as the guard would have, so COMMAND's own children (vLLM's engine cores and workers,
  which no parent-death signal reaches) die too. The watcher is deaf to SIGTERM; the guard's own sweeps spare it
  and SIGKILL it when they are done, so a guard SIGKILLed halfway through its sweep still leaves the SIGKILL waves
  to its watcher (the parent and the guard killed together: the parent's death starts the guard's sweep a moment
  before the guard's own SIGKILL lands; bench/faults.py found a PP=2 worker deaf to SIGTERM left that way);
- when the parent dies: SIGTERM to the whole process group, SIGKILL to what is left after GRACE_S, and exit;
- when COMMAND exits: the same sweep of its leftovers (engine cores, workers), then exit with COMMAND's status
  (a signal death is re-raised, so the parent sees the same return code as without the guard);
- on SIGTERM/SIGINT: forwards SIGTERM to COMMAND and waits for it, as above;
- after each sweep: removes the shared-memory files (/dev/shm) the group had open or mapped while it ran (vLLM's
  `psm_*` message queues, multiprocessing semaphores), once no live process holds them: a SIGKILLed engine never
  unlinks its own. Only the group's files (seen in /proc/<pid>/maps and /proc/<pid>/fd of its members, looked at
  every SHM_EVERY_S and before the sweep) are removed, never another program's; and the `psm_*` files that appeared
  in /dev/shm while the guard ran and that no live process holds after the sweep (one made and abandoned between
  two looks: a PP=2 head that fails at once on a wrong worker port left one). Python's `SharedMemory` keeps its
  file open or mapped as long as its owner lives, so an unheld one is an orphan whoever made it. Python's multiprocessing
  semaphores (`sem.mp-*`) are mapped only for a moment, so the guard rarely sees them: their owner is the group's
  multiprocessing resource tracker, which unlinks them once every process it serves is gone. It ignores SIGTERM, so
  the sweep's SIGKILL wave spares it at first and gives it TRACKER_WAIT_S to clean up and exit by itself. (Removing
  unheld semaphores by name instead was tried and is wrong: a server starting beside the group hands its
  semaphores to its spawned workers by name, unmapped for a moment, and lost them.)

No quantgate imports: the serving environment runs it too. `set_parent_death_signal` is also used in-process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
PARENT_DIED = signal.SIGUSR2  # the guard's own parent-death signal: catchable, so it can sweep the group first
SHM = "/dev/shm/"
SHM_EVERY_S = 5.0  # how often the guard notes the group's shared-memory files (vLLM creates them at start-up)
SHM_ORPHAN = "psm_"  # Python SharedMemory's names (vLLM's message queues): unheld means abandoned
_shm_before: set[str] = set()  # the psm_* files there when the guard started (set in main, inherited by the watcher)
TRACKER = b"multiprocessing.resource_tracker"  # in the command line of Python's resource tracker process
TRACKER_WAIT_S = 3.0  # how long the sweep lets the group's resource trackers unlink what they track and exit


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send `sig` to this process when the thread that forked it exits (Linux prctl).
    False where prctl is unavailable (then only the parent-id poll protects)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def group_members(pgid: int, exclude: int = 0) -> list[int]:
    """Live (not zombie) processes whose process group or session is `pgid`, read from /proc."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == exclude:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != b"Z" and pgid in (int(fields[2]), int(fields[3])):
            out.append(int(name))
    return out


def is_tracker(pid: int) -> bool:
    """Whether `pid` is a multiprocessing resource tracker (it ignores SIGTERM and SIGINT)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return TRACKER in f.read()
    except OSError:
        return False


def sweep(grace_s: float, spare: int | None = None) -> None:
    """SIGTERM every other member of this process group, SIGKILL those left after `grace_s`: first all but the
    multiprocessing resource trackers, which get TRACKER_WAIT_S to unlink their semaphores and exit by themselves
    once the processes they serve are gone, then whatever is left. `spare` (the guard's watcher) is neither
    signalled nor waited for: the caller ends it after the sweep."""
    me, pgid = os.getpid(), os.getpgid(0)

    def others() -> list[int]:
        return [p for p in group_members(pgid, exclude=me) if p != spare]

    waves = ((signal.SIGTERM, grace_s, True), (signal.SIGKILL, TRACKER_WAIT_S, False), (signal.SIGKILL, 5.0, True))
    for sig, wait_s, trackers_too in waves:
        members = others()
        if not members:
            return
        for pid in members if trackers_too else [p for p in members if not is_tracker(p)]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while others() and time.monotonic() < deadline:
            time.sleep(0.1)


def shm_held(pids: list[int]) -> set[str]:
    """Paths of the files under /dev/shm that `pids` have mapped or open (/proc/<pid>/maps and /proc/<pid>/fd);
    files already unlinked are left out."""
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                for line in f:
                    at = line.find(b" " + SHM.encode())
                    if at >= 0:
                        out.add(line[at + 1:].rstrip(b"\n").decode(errors="replace"))
        except OSError:
            pass
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(SHM):
                out.add(target)
    return {p for p in out if not p.endswith(" (deleted)") and "/" not in p[len(SHM):]}


def psm_files() -> set[str]:
    """The SharedMemory files (psm_*) now in /dev/shm, as paths."""
    try:
        return {SHM + n for n in os.listdir(SHM) if n.startswith(SHM_ORPHAN)}
    except OSError:
        return set()


def _live_pids(exclude: int) -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit() and int(n) != exclude]


def remove_shm(paths: set[str]) -> list[str]:
    """Unlink each of `paths` (files directly under /dev/shm) that still exists and that no live process has mapped
    or open any more; returns the paths removed. A file another process still holds is kept."""
    there = [p for p in sorted(paths) if p.startswith(SHM) and os.path.isfile(p)]
    if not there:
        return []
    held = shm_held(_live_pids(exclude=os.getpid()))
    removed = []
    for path in there:
        if path in held:
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


class _ParentDied(Exception):
    pass


def _start(command: list[str], parent: int) -> int:
    pid = os.fork()
    if pid == 0:  # the child: dies with the guard, then becomes COMMAND
        try:
            set_parent_death_signal(signal.SIGKILL)
            if os.getppid() != parent:
                os._exit(1)
            os.execvp(command[0], command)
        except BaseException:  # noqa: BLE001 - exec failed: say why, never fall back into the guard's code
            print(f"procguard: cannot run {command[0]}: {sys.exc_info()[1]}", file=sys.stderr, flush=True)
        os._exit(127)
    return pid


def _exit_like(status: int) -> None:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        time.sleep(1)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def main(argv: list[str]) -> None:
    if len(argv) < 5 or argv[3] != "--" or not argv[1].isdigit():
        print("usage: procguard.py PARENT_PID GRACE_S -- COMMAND ARG...", file=sys.stderr)
        os._exit(2)
    parent, grace_s, command = int(argv[1]), float(argv[2]), argv[4:]
    _shm_before.update(psm_files())

    def parent_died(*_: object) -> None:
        signal.signal(PARENT_DIED, signal.SIG_IGN)  # once is enough (see _sweep_uninterrupted)
        raise _ParentDied

    signal.signal(PARENT_DIED, parent_died)
    try:
        set_parent_death_signal(PARENT_DIED)
        if os.getppid() != parent:  # the parent died before the kernel watch was set
            os._exit(1)
        child = _start(command, os.getpid())

        def forward(*_: object) -> None:
            try:
                os.kill(child, signal.SIGTERM)
            except ProcessLookupError:
                pass

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        watcher = _start_watcher(grace_s)
    except _ParentDied:  # the parent died while the guard started: quietly, as a child already forked dies with the
        os._exit(1)  # guard (its own parent-death SIGKILL), and a watcher already forked sweeps the group
    shm: set[str] = set()  # the group's shared-memory files, removed after the sweep
    try:
        noted = 0.0
        while True:
            done, status = os.waitpid(child, os.WNOHANG)
            if done:
                break
            if os.getppid() != parent:
                raise _ParentDied
            if time.monotonic() - noted >= SHM_EVERY_S:
                shm |= shm_held(group_members(os.getpgid(0), exclude=os.getpid()))
                noted = time.monotonic()
            time.sleep(0.5)
    except _ParentDied:
        _sweep_uninterrupted(grace_s, shm, watcher)
        os._exit(1)
    _sweep_uninterrupted(grace_s, shm, watcher)  # COMMAND is reaped: nothing to forward to any more
    _exit_like(status)


def _start_watcher(grace_s: float) -> int:
    """Fork the watcher (see the module docstring); returns its pid in the guard."""
    guard = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    try:  # the watcher: never returns into the guard's code
        # Deaf to SIGTERM: the guard's sweep spares it and SIGKILLs it when done, so a guard SIGKILLed in the middle
        # of its sweep (quantgate and the guard killed together: the guard's parent-death signal starts the sweep
        # a moment before its own SIGKILL lands) still has a watcher to send the SIGKILL waves it never sent.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)

        def guard_died(*_: object) -> None:
            signal.signal(PARENT_DIED, signal.SIG_IGN)
            raise _ParentDied

        signal.signal(PARENT_DIED, guard_died)
        set_parent_death_signal(PARENT_DIED)
        shm: set[str] = set()
        try:
            noted = 0.0
            while os.getppid() == guard:  # polled too: the kernel's signal may be missed while it was being set
                if time.monotonic() - noted >= SHM_EVERY_S:
                    shm |= shm_held(group_members(os.getpgid(0), exclude=os.getpid()))
                    noted = time.monotonic()
                time.sleep(0.5)
        except _ParentDied:
            pass
        _sweep_uninterrupted(grace_s, shm)
    finally:
        os._exit(0)


def _sweep_uninterrupted(grace_s: float, shm: set[str], watcher: int | None = None) -> None:
    """The final sweep, deaf to SIGTERM (it SIGTERMs the group, the guard included) and to further parent-death
    signals: the kernel sends one again each time an orphan's new parent (a subreaper) exits. The guard's
    `watcher` is spared until the sweep is done, then SIGKILLed and reaped. Then the group's shared-memory files
    that nobody holds any more are removed, with the psm_* files that appeared since the guard started and that
    nobody holds (remove_shm checks every live process)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(PARENT_DIED, signal.SIG_IGN)
    shm |= shm_held(group_members(os.getpgid(0), exclude=os.getpid()))
    sweep(grace_s, spare=watcher)
    if watcher is not None:
        try:
            os.kill(watcher, signal.SIGKILL)
            os.waitpid(watcher, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    remove_shm(shm | (psm_files() - _shm_before))


if __name__ == "__main__":
    main(sys.argv)
