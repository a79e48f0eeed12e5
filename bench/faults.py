"""Start/kill cycles of the serving manager: orphan processes and bound ports left afterwards, counted.

    .venv/bin/python bench/faults.py [--cycles 20] [--kinds single,multi] [--ends kill-parent,stop,kill-both]

Each cycle starts a parent process (like the release flow) that serves the demo model with quantgate's serving
manager: one vLLM server (`single`), or 2 local nodes with PP=2 (`multi`). Once the server answers, the cycle
ends it one of three ways, in turn: `kill-parent` SIGKILLs the parent (nothing of quantgate runs any cleanup: the
process guard must take the server down), `stop` asks the parent to call stop() (which verifies its own work),
`kill-both` SIGKILLs the parent and every process guard it started at the same instant (nothing of quantgate
survives to clean up: what is left must end by itself, through the parent-death signals the guard set up).
Then, for up to --settle-s seconds, it counts
- orphans: live processes carrying the server's tag (quantgate.base.procs.tagged: the server, its engine cores,
  every node and worker, in whatever process group or session they ended up) or in the session of one of its
  process guards (noted once the server answered; a process that changed its environment still counts),
- ports: the API port and (multi) the torch master port still listening (quantgate.base.procs.listening: the
  kernel's socket tables /proc/net/tcp and /proc/net/tcp6), and
- shm: files in /dev/shm that appeared during the cycle and are still there with no live process holding them
  (vLLM's `psm_*` message queues and multiprocessing semaphores: a file some live process maps or holds open belongs
  to that process, an orphan or work running beside the bench, and is not a leftover).
All three must be 0. Prints one line per cycle, the totals, seconds per cycle and the CPU model. tests/test_faults_serving.py
runs a few cycles of this same code; this script runs the issue's full count (20).
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quantgate.base.procguard import shm_held  # noqa: E402
from quantgate.base.procs import leftovers, listening  # noqa: E402
from quantgate.target.catalogue import ensure_demo_model  # noqa: E402

# The parent: serves, prints one JSON line once the server answers, then waits for "stop" on stdin (or a SIGKILL).
PARENT = r"""
import json, sys
from pathlib import Path
from quantgate.base.procs import TAG_VAR, listening
kind, model, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
if kind == "single":
    from quantgate.serving.server import ServerConfig, VLLMServer
    srv = VLLMServer(ServerConfig(model=model, name="demo", args=["--enforce-eager", "--dtype", "float32",
                     "--max-model-len", "2048"], env={"VLLM_CPU_KVCACHE_SPACE": "1"}), log_path=out / "server.log")
    ports = [srv.port]
else:
    from quantgate.plan.build import build_plan
    from quantgate.serving.multinode import MultiNodeServer, master_of, multinode_config_from_plan
    plan = build_plan(model, "x86-cpu", context=1024, concurrency=2, gpus=1, nodes=2, replicas=1,
                      nodes_share_host=True, master_addr="127.0.0.1")
    srv = MultiNodeServer(multinode_config_from_plan(plan, model, "demo"), log_dir=out)
    ports = [srv.port, master_of(srv.config.nodes[0].argv)[1]]
srv.start()
print(json.dumps({"tag": srv.tag[TAG_VAR], "ports": ports, "listen": listening(ports)}), flush=True)
if sys.stdin.readline().strip() == "stop":
    srv.stop()
    print("stopped", flush=True)
"""


SHM = Path("/dev/shm")


def shm_files() -> set[str]:
    return {p.name for p in SHM.iterdir()} if SHM.is_dir() else set()


def unheld(names: set[str]) -> list[str]:
    """The files of `names` (in /dev/shm) that no live process maps or holds open."""
    held = shm_held([int(n) for n in os.listdir("/proc") if n.isdigit()])
    return sorted(n for n in names if str(SHM / n) not in held and (SHM / n).exists())


def guards_of(pid: int) -> list[int]:
    """The process guards `pid` started: its children running quantgate's procguard.py."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_bytes()
            ppid = int(stat.rsplit(b")", 1)[1].split()[1])
            if ppid == pid and b"procguard.py" in Path(f"/proc/{name}/cmdline").read_bytes():
                out.append(int(name))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _end(parent: subprocess.Popen, end: str) -> None:
    if end == "kill-parent":
        parent.send_signal(signal.SIGKILL)
    elif end == "kill-both":  # the parent and its guards in one sweep, before any of them can react
        for pid in [parent.pid, *guards_of(parent.pid)]:
            os.kill(pid, signal.SIGKILL)
    else:
        assert parent.stdin is not None
        parent.stdin.write("stop\n")
        parent.stdin.flush()


def cycle(kind: str, end: str, model: Path, out: Path, *, start_timeout_s: float = 900, settle_s: float = 60) -> dict:
    """One start -> ready -> end cycle; returns its figures (orphans, ports and shm files counted after it settled)."""
    out.mkdir(parents=True, exist_ok=True)
    before = shm_files()
    t0 = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(out / "parent.log", "wb") as err:
        parent = subprocess.Popen([sys.executable, "-c", PARENT, kind, str(model), str(out)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    try:
        ready = json.loads(_read_line(parent, start_timeout_s))
        ready_s = time.monotonic() - t0
        sessions = guards_of(parent.pid)  # each guard leads the session its server runs in
        t1 = time.monotonic()
        _end(parent, end)
        parent.wait(timeout=300)
    finally:  # interrupted (Ctrl-C) or failed: the parent goes, and its guards take its servers down
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    deadline = time.monotonic() + settle_s
    def orphans() -> set[int]:
        return {p for pgid in [None, *sessions] for p in leftovers(pgid, ready["tag"])}

    while (orphans() or listening(ready["ports"]) or unheld(shm_files() - before)) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = unheld(shm_files() - before)
    return {"kind": kind, "end": end, "ready_s": round(ready_s, 1), "cleanup_s": round(time.monotonic() - t1, 1),
            "orphans": len(orphans()), "sessions": sessions, "ports": len(listening(ready["ports"])), "shm": len(left),
            "shm_left": left,
            "tag": ready["tag"], "parent_exit": parent.returncode, "listen_while_up": ready["listen"], "ports_checked": ready["ports"]}


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The parent's ready line; its log tail in the error when it exits or times out first."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sel.select(timeout=1.0):
            line = proc.stdout.readline()
            if line.strip():
                return line
        if proc.poll() is not None:
            break
    raise RuntimeError(f"the serving parent did not report ready (exit {proc.poll()}); see its parent.log")


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "unknown")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--kinds", default="single,multi", help="comma list, used in turn: single, multi")
    ap.add_argument("--ends", default="kill-parent,stop,kill-both",
                    help="comma list, used in turn: kill-parent, stop, kill-both")
    ap.add_argument("--settle-s", type=float, default=60, help="how long a cycle waits for the leftovers to go")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench" / f"faults-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args()
    kinds, ends = args.kinds.split(","), args.ends.split(",")
    model = ensure_demo_model()
    rows, t0 = [], time.monotonic()
    for i in range(args.cycles):
        kind, end = kinds[i % len(kinds)], ends[(i // len(kinds)) % len(ends)]
        try:
            row = cycle(kind, end, model, args.out / f"cycle{i:02d}-{kind}", settle_s=args.settle_s)
        except KeyboardInterrupt:  # the totals of the cycles that finished are still printed
            print(f"interrupted in cycle {i + 1}", flush=True)
            break
        rows.append(row)
        print(f"cycle {i + 1:2d}/{args.cycles} {kind:6s} {end:11s} ready {row['ready_s']:6.1f} s  cleanup "
              f"{row['cleanup_s']:5.1f} s  orphans {row['orphans']}  ports {row['ports']}  shm {row['shm']}  listening while up: "
              f"{row['listen_while_up']}", flush=True)
    total = time.monotonic() - t0
    orphans, ports = sum(r["orphans"] for r in rows), sum(r["ports"] for r in rows)
    shm = sum(r["shm"] for r in rows)
    print(f"\ncycles {len(rows)}  orphans {orphans}  ports {ports}  shm {shm}  seconds per cycle {total / max(len(rows), 1):.1f}  "
          f"(total {total:.0f} s)  CPU: {cpu_model()}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "faults.json").write_text(json.dumps({"rows": rows, "orphans": orphans, "ports": ports, "shm": shm,
                                                      "seconds": round(total, 1), "cpu": cpu_model()}, indent=1))
    return 0 if orphans == ports == shm == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
