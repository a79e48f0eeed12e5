"""Start/kill cycles of the serving manager: orphan processes and bound ports left afterwards, counted.

    .venv/bin/python bench/faults.py [--cycles 20] [--kinds single,multi] [--ends kill-parent,stop]

Each cycle starts a parent process (like the release flow) that serves the demo model with quantgate's serving
manager: one vLLM server (`single`), or 2 local nodes with PP=2 (`multi`). Once the server answers, the cycle
ends it one of two ways, in turn: `kill-parent` SIGKILLs the parent (nothing of quantgate runs any cleanup: the
process guard must take the server down), `stop` asks the parent to call stop() (which verifies its own work).
Then, for up to --settle-s seconds, it counts
- orphans: live processes carrying the server's tag (quantgate.base.procs.tagged: the server, its engine cores,
  every node and worker, in whatever process group or session they ended up), and
- ports: the API port and (multi) the torch master port still listening (quantgate.base.procs.listening: the
  kernel's socket tables /proc/net/tcp and /proc/net/tcp6).
Both must be 0. Prints one line per cycle, the totals, seconds per cycle and the CPU model. tests/test_faults_serving.py
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

from quantgate.base.procs import listening, tagged  # noqa: E402
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


def cycle(kind: str, end: str, model: Path, out: Path, *, start_timeout_s: float = 900, settle_s: float = 60) -> dict:
    """One start -> ready -> end cycle; returns its figures (orphans and ports counted after it settled)."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(out / "parent.log", "wb") as err:
        parent = subprocess.Popen([sys.executable, "-c", PARENT, kind, str(model), str(out)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    try:
        ready = json.loads(_read_line(parent, start_timeout_s))
        ready_s = time.monotonic() - t0
        t1 = time.monotonic()
        if end == "kill-parent":
            parent.send_signal(signal.SIGKILL)
        else:
            parent.stdin.write("stop\n")
            parent.stdin.flush()
        parent.wait(timeout=300)
    finally:  # interrupted (Ctrl-C) or failed: the parent goes, and its guards take its servers down
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    deadline = time.monotonic() + settle_s
    while (tagged(ready["tag"]) or listening(ready["ports"])) and time.monotonic() < deadline:
        time.sleep(0.5)
    return {"kind": kind, "end": end, "ready_s": round(ready_s, 1), "cleanup_s": round(time.monotonic() - t1, 1),
            "orphans": len(tagged(ready["tag"])), "ports": len(listening(ready["ports"])),
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
    ap.add_argument("--ends", default="kill-parent,stop", help="comma list, used in turn: kill-parent, stop")
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
              f"{row['cleanup_s']:5.1f} s  orphans {row['orphans']}  ports {row['ports']}  listening while up: "
              f"{row['listen_while_up']}", flush=True)
    total = time.monotonic() - t0
    orphans, ports = sum(r["orphans"] for r in rows), sum(r["ports"] for r in rows)
    print(f"\ncycles {len(rows)}  orphans {orphans}  ports {ports}  seconds per cycle {total / max(len(rows), 1):.1f}  "
          f"(total {total:.0f} s)  CPU: {cpu_model()}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "faults.json").write_text(json.dumps({"rows": rows, "orphans": orphans, "ports": ports,
                                                      "seconds": round(total, 1), "cpu": cpu_model()}, indent=1))
    return 0 if orphans == ports == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
