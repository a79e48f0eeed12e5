"""Process faults with real processes and signals: children die with their parent (the process guard), stop()
proves nothing is left, the stall watchdog decides right, and (slow, real vLLM / llmcompressor) start/kill cycles
leave 0 orphans and 0 ports, an eval survives its server's SIGKILL, and a quantization child dies with its parent.

Figures are printed (run with -s to see them)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from quantgate.base import http
from quantgate.base.errors import QuantgateError
from quantgate.base.procguard import SHM_EVERY_S
from quantgate.base.procs import TAG_VAR, guarded, leftovers, listening, shm_held, tag_env, tagged, verify_gone
from quantgate.evals.client import ClientConfig, Request, read_results, run
from quantgate.plan.commands import ONE_PROCESS
from quantgate.spec.resolve import load_spec
from quantgate.release.variants import Variant, make_server, server_config
from quantgate.serving import server as server_mod
from quantgate.serving.server import VLLMServer
from quantgate.serving.watchdog import IN_FLIGHT, PROGRESS, STALL_S, ServerSample, advance, parse_metrics
from tests._procs import cmdline, live

REPO = Path(__file__).resolve().parents[1]
SECRETS = {"OPENAI_API_KEY": "sk-parent-secret", "AWS_SECRET_ACCESS_KEY": "aws-parent-secret", "HF_TOKEN": "hf-secret"}


def wait_until(cond, timeout_s: float, step_s: float = 0.1) -> float:
    """Seconds until cond() held; raises AssertionError after timeout_s."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, f"not within {timeout_s} s"
        time.sleep(step_s)
    return time.monotonic() - t0


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


# --- the process guard with plain processes (fast) ---------------------------------------------------------------

PARENT = """
import os, subprocess, sys, time
from quantgate.base.procs import guarded
p = subprocess.Popen(guarded(["bash", "-c", sys.argv[1]], grace_s=2), start_new_session=True)
print(p.pid, flush=True)
time.sleep(300)
"""


def _guarded_parent(tag: dict[str, str], script: str = "sleep 300 & sleep 300 & wait", count: int = 6
                    ) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, **tag, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, script], stdout=subprocess.PIPE, text=True, env=env)
    guard = int(parent.stdout.readline())
    wait_until(lambda: len(tagged(tag[TAG_VAR])) >= count, 10)  # parent, guard, its watcher, bash, 2 x sleep
    return parent, guard


def test_a_sigkilled_parent_takes_the_guarded_group_with_it():
    tag = tag_env()
    parent, guard = _guarded_parent(tag)
    group = leftovers(guard, None)
    assert len(group) == 5 and guard in group
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    took = wait_until(lambda: not tagged(tag[TAG_VAR]), 10)
    print(f"guarded group (guard, watcher, bash, 2 sleeps) gone {took:.2f} s after the parent's SIGKILL")
    assert not live(group)


def test_processes_deaf_to_sigterm_are_sigkilled_even_if_the_parent_death_signal_comes_twice():
    """Python's multiprocessing resource tracker ignores SIGTERM, so only the sweep's SIGKILL wave ends it; and
    the kernel sends an orphaned guard its parent-death signal again when its new parent (a subreaper) exits.
    Found by bench/faults.py: a second signal during the sweep killed the guard before its SIGKILL wave."""
    tag = tag_env()
    parent, guard = _guarded_parent(tag, "trap '' TERM; sleep 300 & sleep 300 & wait")
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    time.sleep(0.5)  # the guard is in its SIGTERM wave now (grace 2 s): a second notice arrives
    os.kill(guard, signal.SIGUSR2)
    took = wait_until(lambda: not tagged(tag[TAG_VAR]), 15)
    print(f"SIGTERM-deaf group gone {took + 0.5:.2f} s after the parent's SIGKILL (grace 2 s)")


def test_a_sigkilled_guard_takes_its_child_and_its_watcher_sweeps_the_rest():
    """The guard SIGKILLed while its parent lives: COMMAND dies of its parent-death signal, and the orphans it
    leaves (the sleeps, as vLLM's engine cores would be) are swept by the guard's watcher, not left for stop()."""
    tag = tag_env()
    parent, guard = _guarded_parent(tag)
    try:
        kids = psutil.Process(guard).children()
        bash = [p for p in kids if p.name() == "bash"][0].pid
        sleeps = [p.pid for p in psutil.Process(bash).children()]
        watcher = [p.pid for p in kids if p.pid != bash]
        assert len(sleeps) == 2 and len(watcher) == 1
        os.kill(guard, signal.SIGKILL)
        wait_until(lambda: not live([bash]), 5)  # PR_SET_PDEATHSIG(SIGKILL) set between fork and exec
        took = wait_until(lambda: not leftovers(guard, None), 10)
        print(f"a SIGKILLed guard's group (bash, 2 sleeps, watcher) gone {took:.2f} s later")
        assert verify_gone("test group", guard, None) is None and not live(sleeps + watcher)
    finally:
        parent.kill()
        parent.wait()


def test_a_sigkilled_parent_and_guard_together_leave_nothing():
    """quantgate and its guard SIGKILLed at the same instant: nothing of quantgate is left to clean up, and the
    guard's watcher still takes the group down (bench/faults.py `kill-both` with vLLM)."""
    tag = tag_env()
    parent, guard = _guarded_parent(tag)
    group = leftovers(guard, None)
    for pid in (parent.pid, guard):
        os.kill(pid, signal.SIGKILL)
    parent.wait()
    took = wait_until(lambda: not tagged(tag[TAG_VAR]), 10)
    print(f"parent and guard SIGKILLed together: the group gone {took:.2f} s later")
    assert not live(group)


def test_a_guard_sigkilled_in_the_middle_of_its_sweep_leaves_the_sigkill_waves_to_its_watcher():
    """The double kill as it lands: the parent's SIGKILL starts the guard's sweep (its SIGTERM wave), and the guard's
    own SIGKILL comes a moment later, before its SIGKILL wave. A member deaf to SIGTERM (vLLM's PP worker, the
    resource tracker) is then ended by the watcher, which the guard's SIGTERM wave no longer takes down with the
    rest (bench/faults.py: a PP=2 kill-both cycle left Worker_PP1 alive)."""
    tag = tag_env()
    parent, guard = _guarded_parent(tag, "trap '' TERM; sleep 300 & sleep 300 & wait")
    group = leftovers(guard, None)
    watcher = [p.pid for p in psutil.Process(guard).children() if "procguard" in cmdline(p)]
    assert len(watcher) == 1
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    time.sleep(1.0)  # the guard is in its SIGTERM wave (grace 2 s), which the bash and its sleeps are deaf to
    assert live(watcher), "the guard's SIGTERM wave took its watcher down"
    os.kill(guard, signal.SIGKILL)
    took = wait_until(lambda: not tagged(tag[TAG_VAR]), 15)
    print(f"guard SIGKILLed mid-sweep: its SIGTERM-deaf group gone {took:.2f} s later (grace 2 s)")
    assert not live(group)


@pytest.mark.parametrize("script,code", [("exit 0", 0), ("exit 3", 3), ("kill -9 $$", -9), ("kill -15 $$", -15)])
def test_the_guard_returns_the_childs_status(script, code):
    proc = subprocess.run(guarded(["bash", "-c", script]), start_new_session=True, timeout=30)
    assert proc.returncode == code


def test_the_guard_forwards_sigterm_and_sweeps_leftovers():
    tag = tag_env()
    proc = subprocess.Popen(guarded(["bash", "-c", "sleep 300 & wait"], grace_s=2), start_new_session=True,
                            env={**os.environ, **tag})
    wait_until(lambda: len(tagged(tag[TAG_VAR])) == 4, 10)  # guard, watcher, bash, sleep
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == -signal.SIGTERM  # bash died of the forwarded SIGTERM; its sleep was swept
    assert tagged(tag[TAG_VAR]) == []


# --- shared memory the group leaves in /dev/shm ------------------------------------------------------------------

SHM_CHILD = """
import mmap, os, sys, time
maps = []
for path in sys.argv[1:]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # as shm_open does; the fd stays open, the file mapped
    os.ftruncate(fd, 4096)
    maps.append(mmap.mmap(fd, 4096))
print("mapped", flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("killed", ["parent", "child"])
def test_the_guard_removes_the_shared_memory_its_group_held_and_nothing_else(tmp_path, killed):
    """A vLLM engine that is killed leaves its psm_* files in /dev/shm. The guard removes those its group held once
    nobody holds them: not a file another process still maps, nor one the group never touched."""
    token = tag_env()[TAG_VAR]
    own, shared, foreign = (Path(f"/dev/shm/psm_qgtest_{token}_{n}") for n in ("own", "shared", "foreign"))
    foreign.write_bytes(b"\0" * 16)  # nobody of the group opens it
    tag = tag_env()
    env = {**os.environ, **tag, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, f"exec {sys.executable} -c '{SHM_CHILD}' {own} {shared}"],
                              stdout=subprocess.PIPE, text=True, env=env)
    guard, outsider = int(parent.stdout.readline()), None
    try:
        wait_until(lambda: own.exists() and shared.exists(), 30)
        outsider = subprocess.Popen([sys.executable, "-c", SHM_CHILD, str(shared)], stdout=subprocess.PIPE, text=True)
        assert outsider.stdout.readline().strip() == "mapped"  # another program maps `shared` too
        wait_until(lambda: {str(own), str(shared)} <= shm_held(leftovers(guard, None)), 10)
        if killed == "parent":  # the guard notes the files before its sweep
            parent.send_signal(signal.SIGKILL)
        else:  # the child dies first (as a SIGKILLed engine): the guard noted its files while it ran
            time.sleep(SHM_EVERY_S + 1)
            (child,) = [c for c in psutil.Process(guard).children() if "procguard" not in cmdline(c)]
            child.send_signal(signal.SIGKILL)  # the command, not the guard's watcher (a fork of the guard)
        took = wait_until(lambda: not own.exists(), 15)
        wait_until(lambda: not live([guard]), 15)
        assert shared.exists() and foreign.exists()  # held by another process / never the group's
    finally:
        for proc in (parent, outsider):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        for path in (own, shared, foreign):
            path.unlink(missing_ok=True)
    print(f"\nshared memory: {killed} SIGKILLed, the group's own file removed {took:.2f} s later; the file another "
          "process maps and the one the group never held kept")


def test_a_psm_file_made_and_abandoned_between_two_looks_is_removed_and_one_still_held_is_kept(tmp_path):
    """A PP=2 head that fails at once on a wrong worker port makes a psm_* file and dies before the guard's next
    look at its group's files (every SHM_EVERY_S). The sweep removes the psm_* files that appeared while the guard
    ran and that no live process holds; one that appeared meanwhile but another program maps is kept."""
    token = tag_env()[TAG_VAR]
    abandoned, held = Path(f"/dev/shm/psm_qgtest_{token}_abandoned"), Path(f"/dev/shm/psm_qgtest_{token}_held")
    env = {**os.environ, **tag_env(), "PYTHONPATH": str(REPO)}
    outsider = None
    # the command makes its file, closes it and lingers a second: gone well within SHM_EVERY_S, never looked at
    parent = subprocess.Popen([sys.executable, "-c", PARENT, f"sleep 1; : > {abandoned}; sleep 1"],
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        guard = int(parent.stdout.readline())
        outsider = subprocess.Popen([sys.executable, "-c", SHM_CHILD, str(held)], stdout=subprocess.PIPE, text=True)
        assert outsider.stdout.readline().strip() == "mapped"  # another program's file, made while the guard runs
        wait_until(lambda: abandoned.exists(), 15)
        wait_until(lambda: not live([guard]), 30)  # the command exited: the guard swept and left
        assert not abandoned.exists() and held.exists()
    finally:
        for proc in (parent, outsider):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        for path in (abandoned, held):
            path.unlink(missing_ok=True)


SEM_CHILD = """
import multiprocessing as mp, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # like a vLLM engine busy past the grace period: only SIGKILL ends it
lock = mp.get_context("spawn").Lock()  # a named semaphore in /dev/shm, registered with the resource tracker
print(lock._semlock.name, flush=True)
time.sleep(300)
"""


def test_the_sweep_lets_the_resource_tracker_unlink_the_semaphores_of_a_sigkilled_group(tmp_path):
    """Python's multiprocessing semaphores (sem.mp-*) are unlinked by the group's resource tracker once the
    processes it serves are gone. It ignores SIGTERM; SIGKILLed in the same wave as a process that outlived the
    grace period, it left the file behind (bench/faults.py, a PP=2 server). The sweep now spares it at first."""
    tag = tag_env()
    script = tmp_path / "sem_child.py"
    script.write_text(SEM_CHILD)
    parent, guard = _guarded_parent(tag, f"exec {sys.executable} {script} > {tmp_path / 'name'}", count=5)
    try:
        wait_until(lambda: (tmp_path / "name").read_text().strip() != "" if (tmp_path / "name").exists() else False, 30)
        sem = Path("/dev/shm/sem." + (tmp_path / "name").read_text().strip().lstrip("/"))
        wait_until(sem.exists, 10)
        tracker = [p for p in leftovers(guard, None) if b"resource_tracker" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert tracker, "the spawn context starts a resource tracker in the group"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        took = wait_until(lambda: not live([guard]), 20)
        assert not sem.exists(), f"{sem} left behind"
        assert not live(tracker)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    print(f"a SIGTERM-deaf group with a semaphore swept in {took:.2f} s; the resource tracker unlinked {sem.name}")


# --- /proc and socket tables -------------------------------------------------------------------------------------

def test_listening_reads_the_kernels_socket_tables():
    v4, v6 = socket.socket(), socket.socket(socket.AF_INET6)
    try:
        v4.bind(("127.0.0.1", 0))
        v6.bind(("::", 0))
        ports = [v4.getsockname()[1], v6.getsockname()[1]]
        assert listening(ports) == {}  # bound, not listening
        v4.listen()
        v6.listen()
        assert listening(ports) == {ports[0]: ["127.0.0.1"], ports[1]: ["::"]}
    finally:
        v4.close()
        v6.close()
    assert listening(ports) == {}


def test_verify_gone_names_a_port_another_program_took_and_leaves_it_alone():
    """A free port is re-used: after a stop, another program of ours may hold the server's old port. Named, never
    killed, and no error (it is not the server's)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    try:
        warning = verify_gone("test server", None, None, [port], wait_s=0.5)
        assert warning and f"port {port} is now held by pid {os.getpid()}" in warning and "not by this server" in warning
        assert listening([port])
    finally:
        sock.close()
    assert verify_gone("test server", None, None, [port]) is None


def test_verify_gone_kills_what_is_left_and_raises_on_what_survives():
    """A real leftover (a tagged process in a session of its own): with no time to kill it (wait_s=0) the error
    names it; given the time, it is SIGKILLed and the warning names it."""
    tag = tag_env()
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True, env={**os.environ, **tag})
    try:
        wait_until(lambda: tagged(tag[TAG_VAR]) == [proc.pid], 10)
        with pytest.raises(QuantgateError) as err:
            verify_gone("test server", None, tag[TAG_VAR], wait_s=0)
        assert f"test server: still left 0 s after SIGKILL: pid {proc.pid} (sleep 300)" in err.value.render()
        warning = verify_gone("test server", None, tag[TAG_VAR])
        assert warning == f"test server: left after stop and killed with SIGKILL: pid {proc.pid} (sleep 300)"
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()


def test_a_real_spawned_server_child_gets_no_parent_secrets(tmp_path, monkeypatch):
    """server.spawn with a stand-in launcher (a script that sleeps): the child's /proc/<pid>/environ has the
    server's own key and what it needs, not the parent's credentials."""
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    stand_in = tmp_path / "launcher.py"
    stand_in.write_text("import time\ntime.sleep(300)\n")
    monkeypatch.setattr(server_mod, "LAUNCHER", stand_in)
    tag = tag_env()
    proc = server_mod.spawn(Path(sys.executable), ["vllm", "serve", "m"], {"VLLM_API_KEY": "own-key", **tag},
                            tmp_path / "server.log")
    try:
        wait_until(lambda: len(tagged(tag[TAG_VAR])) == 3, 10)  # the guard, its watcher, the launcher
        child = [p for p in tagged(tag[TAG_VAR]) if psutil.Process(p).ppid() == proc.pid
                 and "procguard" not in cmdline(psutil.Process(p))][0]
        for pid in (proc.pid, child):
            env = environ_of(pid)
            assert not set(SECRETS) & set(env), env.keys()
            assert env["VLLM_API_KEY"] == "own-key" and env["PATH"] == os.environ["PATH"]
            assert env["PYTHONUNBUFFERED"] == "1"
    finally:
        server_mod.stop_group(proc)
    assert tagged(tag[TAG_VAR]) == []


# --- the stall decision (pure) -----------------------------------------------------------------------------------

def metrics(in_flight: float, tokens: float) -> dict[str, float]:
    return {IN_FLIGHT[0]: in_flight, PROGRESS[1]: tokens}


# (samples as (t, metrics or None, log size), stall_s, expected verdict at the last sample: None or a substring)
STALL_CASES = [
    ([(0, metrics(2, 10), 100), (50, metrics(2, 10), 100)], 60, None),              # quiet, not long enough
    ([(0, metrics(2, 10), 100), (61, metrics(2, 10), 100)], 60, "2 request(s) in flight"),
    ([(0, metrics(2, 10), 100), (61, metrics(2, 11), 100)], 60, None),              # a token: progress
    ([(0, metrics(2, 10), 100), (61, metrics(2, 10), 120)], 60, "in flight"),       # log lines: no tokens
    ([(0, None, 100), (61, None, 120)], 60, None),                                   # no metrics: the log counts
    ([(0, metrics(0, 10), 100), (500, metrics(0, 10), 100)], 60, None),             # idle: nobody waits
    ([(0, metrics(2, 10), 100), (30, metrics(2, 11), 100), (85, metrics(2, 11), 100)], 60, None),  # clock reset at 30
    ([(0, metrics(2, 10), 100), (30, metrics(2, 11), 100), (91, metrics(2, 11), 100)], 60, "for 61 s"),
    ([(0, metrics(2, 10), 100), (61, None, 100)], 60, "/metrics did not answer"),  # hung API server too
    ([(0, None, 100), (30, None, 100), (61, None, 100)], 60, "did not answer and its log did not grow for 61 s"),
    ([(0, metrics(1, 10), 100), (50, metrics(0, 10), 100), (105, metrics(1, 10), 100)], 60, None),  # idle at 50
]


@pytest.mark.parametrize("samples,stall_s,verdict", STALL_CASES)
def test_stall_decision(samples, stall_s, verdict):
    state, why = None, None
    for t, m, size in samples:
        state, why = advance(state, ServerSample(t, m, size), stall_s)
    if verdict is None:
        assert why is None
    else:
        assert why is not None and verdict in why, why


def _spec(tmp_path: Path, extra: str = ""):
    path = tmp_path / "spec.yaml"
    path.write_text("version: 1\nname: stall\nmodel: demo\nhardware: x86-cpu\ncontext: 1024\nconcurrency: 2\n"
                    f"schemes: [int8-w8a8]\nrecall: null\n{extra}")
    return load_spec(path)


@pytest.mark.parametrize("stall,expected", [(None, STALL_S), ("42", 42.0), ("null", None)])
def test_the_specs_stall_timeout_reaches_every_server_it_makes(tmp_path, demo_model, stall, expected):
    """serving.stall_timeout_s is the server's watchdog limit (test_a_hung_engine_is_named_by_the_watchdog serves
    one made this way); null: no watchdog. A multi-node server's too."""
    variant = Variant(name="demo", path=demo_model, content_hash="x", size_bytes=1)
    field = "" if stall is None else f"stall_timeout_s: {stall}, "
    cfg = server_config(_spec(tmp_path, f"serving: {{{field}replicas: 1}}\n"), variant, tmp_path / "demo")
    assert cfg.stall_timeout_s == expected and make_server(cfg, tmp_path / "demo").config.stall_timeout_s == expected
    multi = _spec(tmp_path, f"gpus: 1\nnodes: 2\nserving: {{{field}local_nodes: true, replicas: 1}}\n")
    assert server_config(multi, variant, tmp_path / "multi").stall_timeout_s == expected


def test_prometheus_text_is_summed_over_labels():
    text = textwrap.dedent("""\
        # HELP vllm:num_requests_running Number of requests
        # TYPE vllm:num_requests_running gauge
        vllm:num_requests_running{engine="0",model_name="demo"} 2.0
        vllm:num_requests_running{engine="1",model_name="demo"} 1.0
        vllm:generation_tokens_total{engine="0",model_name="demo"} 1234.0
        process_open_fds 17
        broken_line{a="b"} not-a-number
        """)
    m = parse_metrics(text)
    assert m["vllm:num_requests_running"] == 3.0 and m["vllm:generation_tokens_total"] == 1234.0
    assert m["process_open_fds"] == 17.0 and "broken_line" not in m


# --- real vLLM and llmcompressor (slow) --------------------------------------------------------------------------

def _faults_bench():
    spec = importlib.util.spec_from_file_location("faults_bench", REPO / "bench" / "faults.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
# one cycle per way a server is killed (stop() ends every other test's server, the multi-node stop() path is
# test_multinode's): bench/faults.py runs the count, stop() among them. PP=2 runs the double kill (parent and guards
# SIGKILLed at once), the hardest end: its guard's sweep starts on the parent's death and the guard dies under it, so
# its watcher finishes the sweep (it once left Worker_PP1 alive).
@pytest.mark.parametrize("kind,ends", [("single", ["kill-parent", "kill-both"]), ("multi", ["kill-both"])])
def test_start_kill_cycles_leave_no_orphan_and_no_port(demo_model, tmp_path, kind, ends):
    """The CI share of `bench/faults.py --cycles 20`: start to ready, then SIGKILL of the parent (and its guards)
    or stop()."""
    bench = _faults_bench()
    rows = [bench.cycle(kind, end, demo_model, tmp_path / f"cycle{i}") for i, end in enumerate(ends)]
    for r in rows:
        print(f"{kind} cycle, {r['end']}: ready {r['ready_s']} s, clean {r['cleanup_s']} s later, orphans "
              f"{r['orphans']}, ports {r['ports']} of {r['ports_checked']}, shm {r['shm_left']}; listening while "
              f"up: {r['listen_while_up']}")
    assert [(r["orphans"], r["ports"], r["shm"]) for r in rows] == [(0, 0, 0)] * len(rows)
    assert [r["parent_exit"] for r in rows] == [0 if e == "stop" else -9 for e in ends]
    assert all(r["sessions"] for r in rows)  # the guards were found (kill-both killed them)
    if kind == "multi":
        # docs/design.md, "Security": torch 2.13's TCPStore master listens on every interface even when given
        # 127.0.0.1, and vLLM creates it inside its worker processes. When this changes, update that section.
        master = str(rows[0]["ports_checked"][1])
        assert rows[0]["listen_while_up"][master] in (["::"], ["0.0.0.0"]), rows[0]["listen_while_up"]


EVAL_CHILD = """
import sys
from quantgate.evals.client import ClientConfig, Request, run
url, key, path, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
reqs = [Request(f"id{k:03d}", [{"role": "user", "content": f"Count from {k} to {k + 20}."}], 32) for k in range(n)]
run(reqs, path, ClientConfig(endpoint=url, model="demo", api_key=key, concurrency=4, progress=False, max_attempts=3,
                            backoff_s=0.2, backoff_max_s=1.0))
"""


def _eval_requests(n: int, max_tokens: int = 32) -> list[Request]:
    return [Request(f"id{k:03d}", [{"role": "user", "content": f"Count from {k} to {k + 20}."}], max_tokens)
            for k in range(n)]


@pytest.mark.slow
def test_vllm_sigkilled_mid_eval_then_the_eval_rerun_answers_every_id_once(demo_model, vllm_server, tmp_path):
    n, path = 24, tmp_path / "scores.jsonl"
    with vllm_server(demo_model, name="demo") as srv:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        child = subprocess.Popen([sys.executable, "-c", EVAL_CHILD, srv.base_url, srv.api_key, str(path), str(n)], env=env)
        wait_until(lambda: len(read_results(path)) >= n // 4, 600, 0.05)
        api = [p for p in psutil.Process(srv.proc.pid).children() if "vllm_launcher" in cmdline(p)][0]
        api.send_signal(signal.SIGKILL)  # the vLLM API server dies mid-eval
        child.wait(timeout=300)
        wait_until(lambda: not srv.alive(), 30)
        with pytest.raises(QuantgateError, match="died"):
            srv.raise_if_dead()
    before = read_results(path)
    answered = {i: r for i, r in before.items() if r["error"] is None}
    lines_before = path.read_text().splitlines()
    with vllm_server(demo_model, name="demo") as srv:
        stats = run(_eval_requests(n), path, ClientConfig(endpoint=srv.base_url, model="demo", api_key=srv.api_key,
                                                          concurrency=4, progress=False))
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    ok = Counter(r["id"] for r in records if r["error"] is None)
    duplicates = sum(c - 1 for c in ok.values())
    print(f"ids answered before the kill: {len(answered)}, failed at the kill: {len(before) - len(answered)}, "
          f"answered by the re-run: {stats.answered}, skipped by it: {stats.skipped}, answered in all: {len(ok)} of {n}, "
          f"duplicates: {duplicates}")
    assert 0 < len(answered) < n, "the kill must land mid-eval"
    assert ok == {f"id{k:03d}": 1 for k in range(n)}  # every id answered, exactly once
    assert stats.skipped == len(answered) and stats.answered == n - len(answered)
    assert lines[:len(lines_before)] == lines_before  # what was answered before is kept as it was
    assert read_results(path).keys() == ok.keys() and all(r["error"] is None for r in read_results(path).values())


QUANT_PARENT = """
import sys
from pathlib import Path
from quantgate.quantize.run import QuantizeRequest, quantize
quantize(QuantizeRequest(model=Path(sys.argv[1]), scheme="int8-w8a8", out=Path(sys.argv[2]), overwrite=True),
         log=lambda s: print(s, flush=True))
"""


@pytest.mark.slow
def test_a_quantization_child_dies_with_its_sigkilled_parent(demo_model, tmp_path):
    """The reported bug: SIGKILL of the orchestrator left the llmcompressor child running, re-parented to pid 1."""
    env = {**os.environ, **SECRETS, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, "-c", QUANT_PARENT, str(demo_model), str(tmp_path / "out")], env=env,
                              stdout=subprocess.PIPE, text=True)

    def runner() -> list[psutil.Process]:
        """The guard, its watcher (a fork of the guard) and the runner: every process naming the runner."""
        try:
            kids = psutil.Process(parent.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return [p for p in kids if "quantgate.quantize.runner" in cmdline(p)]

    def proper() -> list[int]:
        """The runner itself: exec'd, so its command line no longer names the guard."""
        return [p.pid for p in runner() if "procguard" not in cmdline(p)]

    wait_until(lambda: bool(proper()), 120)
    time.sleep(3)  # let the runner get into llmcompressor's imports (int8-w8a8 calibrates: it runs far longer)
    pids, child = [p.pid for p in runner()], proper()
    assert len(child) == 1 and len(pids) >= 2, f"the runner ended before the kill: {parent.poll()=}, {pids=}"
    child_env = environ_of(child[0])
    assert not set(SECRETS) & set(child_env) and child_env["TOKENIZERS_PARALLELISM"] == "false"
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    took = wait_until(lambda: not live(pids), 10)
    print(f"quantization child (pids {pids}) gone {took:.2f} s after its parent's SIGKILL")


@pytest.mark.slow
def test_a_hung_engine_is_named_by_the_watchdog(demo_model, tmp_path):
    """SIGSTOP the engine core under load: no token for stall_timeout_s while requests are in flight, so the
    watchdog stops the server, the waiting client fails at once, and raise_if_dead names the server. The server is
    the release's (release.variants.server_config), its limit the spec's serving.stall_timeout_s. Its engine,
    killed, cannot unlink its shared memory: the stop removes it from /dev/shm. A one-worker server runs its worker
    in the engine's process and holds no /dev/shm file (quantgate.plan.commands.ONE_PROCESS): this one is served with
    a worker process of its own, as every multi-worker plan is, so that it does."""
    variant = Variant(name="demo", path=demo_model, content_hash="x", size_bytes=1)
    cfg = server_config(_spec(tmp_path, "serving: {stall_timeout_s: 10}\n"), variant, tmp_path / "demo")
    cfg = cfg.model_copy(update={"env": {**cfg.env, ONE_PROCESS: "1"}})
    errors: list[BaseException] = []
    with VLLMServer(cfg, log_path=tmp_path / "server.log") as srv:
        tag, pid = srv.tag[TAG_VAR], srv.proc.pid
        assert srv._watchdog is not None and srv._watchdog.stall_s == 10  # the spec's limit is the watchdog's
        shm = shm_held(leftovers(pid, tag))
        assert shm, "vLLM holds no /dev/shm file: the assertion below proves nothing"
        job = ClientConfig(endpoint=srv.base_url, model="demo", api_key=srv.api_key, concurrency=4, progress=False,
                           timeout_s=900, max_attempts=2, backoff_s=0.2)

        def client() -> None:
            try:
                run(_eval_requests(8, max_tokens=400), tmp_path / "r.jsonl", job)
            except BaseException as exc:  # noqa: BLE001 - inspected below
                errors.append(exc)

        thread = threading.Thread(target=client)
        thread.start()
        root = srv.base_url.removesuffix("/v1")
        wait_until(lambda: parse_metrics(http.get(f"{root}/metrics").text).get(PROGRESS[1], 0) > 0, 300, 0.5)
        engine = [p for p in psutil.Process(pid).children(recursive=True) if "EngineCore" in cmdline(p)]
        assert engine, "no engine core process found"
        for p in engine + [c for e in engine for c in e.children(recursive=True)]:
            p.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        wait_until(lambda: srv.stalled is not None, 180, 0.5)
        named_s = time.monotonic() - t0
        thread.join(timeout=120)
        assert not thread.is_alive(), "the waiting client was not released"
        with pytest.raises(QuantgateError) as err:
            srv.raise_if_dead()
        text = err.value.render()
        print(f"hung engine named {named_s:.1f} s after its SIGSTOP (stall limit 10 s, polled every 5 s); the client "
              f"ended with: {type(errors[0]).__name__ if errors else 'no error'}")
        assert f"at {root} (pid {pid}) is stalled" in text and "in flight" in text and "last log lines" in text.lower()
    assert tagged(tag) == [] and listening([srv.port]) == {}
    left = sorted(p for p in shm if os.path.exists(p))
    assert left == [], f"shared memory of the stopped server left in /dev/shm: {left}"
    print(f"the stopped server's {len(shm)} /dev/shm files ({', '.join(sorted(os.path.basename(p) for p in shm))}) "
          "removed")
