"""Faults a release must survive, with real processes: only complete work is cached (an eval with failed requests,
a failed parity check), the judge server killed half-way, the release flow SIGTERMed between steps, and two
releases of that spec then resumed at once.

The judge server here is the fake OpenAI-compatible server in a process of its own (a real process, killed for
real): a real judge model would cost minutes per start on this CPU, and what is tested is the judge client's
file, not the judge. The flow tests run `quantgate release` on the real demo model (llmcompressor, vLLM, Prefect)
with a tiny spec: one INT8 candidate (served by every x86 vLLM CPU build), 12 eval samples, no recall, perf or
fidelity. Each test prints what it measured (`pytest -s`)."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
from _fake_openai import FakeServer
from _judge_fakes import write_run
from _shared import LAYER0_ONLY

from quantgate.base import procs
from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import write_json
from quantgate.base.http import read_results
from quantgate.base.paths import EVAL_SETS, REPO
from quantgate.evals.dataset import load_evalset, stratified_subset
from quantgate.evals.run import is_complete, is_scored, load_run, run_eval
from quantgate.gate.evidence import _eval_error_rate
from quantgate.parity.core import ParityPolicy, check_parity
from quantgate.parity.engine import ParityRecord, passed
from quantgate.release import steps as rel
from quantgate.spec.resolve import load_spec
from quantgate.base.proctree import descendants
from quantgate.serving.server import free_port
from quantgate.base.http import Endpoint
from tests._procs import live

EVALSET = EVAL_SETS / "default.jsonl"


# --- only complete work is cached -----------------------------------------------------------------------------

def test_an_eval_with_failed_requests_is_not_cached_and_its_failures_are_asked_again(tmp_path):
    samples = stratified_subset(load_evalset(EVALSET, with_dataset=False).samples, 60)
    failing = [s.prompt for s in samples[::25]]  # 3 of 60 (5%), within the 10% limit given below
    out = tmp_path / "run"
    with FakeServer() as server:
        for prompt in failing:
            server.script[prompt] = ["400"]  # refused once (not retried): the sample fails in this run only
        first = run_eval(EVALSET, Endpoint(server.url, "fake-model"), out, limit=60, progress=False, max_error_rate=0.1)
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["status"] == "partial" and manifest["n_failed"] == len(failing)
        assert first["n_failed"] == len(failing) and first["n_answered"] == 60 - len(failing)
        assert not is_complete(out) and is_scored(out)  # not finished work, but its answers can be read
        # the gate reads this run's failures (and rejects it: 5% > the default policy's 2%)
        rate = _eval_error_rate("baseline", "default", out)
        assert rate.rate == pytest.approx(len(failing) / 60) and rate.n == 60
        _, records = load_run(out)
        assert len(records) == 60 - len(failing) and all(r["output"] is not None for r in records)  # answered only
        asked_before = len(server.requests)
        second = run_eval(EVALSET, Endpoint(server.url, "fake-model"), out, limit=60, progress=False,
                          max_error_rate=0.1)
        asked_again = [r["messages"][-1]["content"] for r in server.requests[asked_before:]]
    assert sorted(asked_again) == sorted(failing)  # only the failed ids, answered ones kept
    assert second["n_failed"] == 0 and is_complete(out)
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    answered = [r["id"] for r in lines if r["error"] is None]
    assert len(answered) == len(set(answered)) == 60  # every id answered exactly once
    print(f"\neval: 60 samples, {len(failing)} failed in run 1 (status partial, error rate {rate.rate:.1%}); "
          f"run 2 asked {len(asked_again)} requests, status complete")


def test_a_failed_parity_check_is_not_reused(tmp_path):
    assert not passed(tmp_path)  # nothing there
    write_json(tmp_path / "parity.json", {"verdict": "fail", "reason": "engine problem"})
    assert not passed(tmp_path)  # a fail is evidence for this run's gate, not a result to keep
    (tmp_path / "parity.json").write_text('{"verdict": "pa')  # torn
    assert not passed(tmp_path)
    write_json(tmp_path / "parity.json", {"verdict": "pass", "reason": "ok"})
    assert not passed(tmp_path)  # a pass that is no parity record (quantgate.parity.engine.ParityRecord)
    report = check_parity([[1, 2]], [[1, 2]], ParityPolicy(agree_prefix_tokens=1, min_agree_share=1.0))
    ParityRecord(**dict(report), dtype="float32", served_dtype="auto").write(tmp_path)
    assert passed(tmp_path)


# --- the judge server killed half-way, then resumed -----------------------------------------------------------

JUDGE_SERVER = textwrap.dedent("""
    import asyncio, hashlib, sys
    from aiohttp import web
    port, log = int(sys.argv[1]), sys.argv[2]

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "judge", "max_model_len": 8192}]})

    async def version(request):
        return web.json_response({"version": "fake-1.0"})

    async def chat(request):
        body = await request.json()
        prompt = body["messages"][-1]["content"]
        await asyncio.sleep(0.05)
        with open(log, "a") as fh:  # one line per answered request
            fh.write(hashlib.sha256(prompt.encode()).hexdigest() + "\\n")
        return web.json_response({"choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": "Fine.\\nVERDICT: A"}}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/version", version)
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=port, print=lambda *a: print("ready", flush=True), access_log=None)
""")


def _start_judge(port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", JUDGE_SERVER, str(port), str(log)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _judge_evidence(tmp_path: Path, n: int):
    es = load_evalset(EVALSET)
    picked = stratified_subset(es.samples, n)
    evs = {}
    for name, prefix in (("baseline", ""), ("int8-w8a8", "in other words: ")):
        folder = write_run(tmp_path / "cache" / name, es, {s.id: prefix + s.references[0] for s in picked}, name)
        variant = rel.Variant(name=name, path=tmp_path, scheme=None if name == "baseline" else name,
                              content_hash=name * 2, size_bytes=1)
        evs[name] = rel.Evidence(variant=variant, folder=tmp_path / "run" / name, cache=tmp_path / "cache" / name,
                                 serve_command=[], dtype=None, evals={"default": folder}, served=False)
    return evs


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_judge_server_killed_half_way_then_resumed_loses_nothing_judged(tmp_path):
    port, n = free_port(), 30
    evs = _judge_evidence(tmp_path, n)
    (tmp_path / "spec.yaml").write_text(textwrap.dedent(f"""\
        version: 1
        name: t
        model: demo
        hardware: x86-cpu
        schemes: [int8-w8a8]
        eval_sets: [{EVALSET}]
        judge: {{endpoint: 'http://127.0.0.1:{port}', model: judge, calibration_per_type: 1, concurrency: 4,
                 timeout_s: 10}}
        """))
    spec = load_spec(tmp_path / "spec.yaml")
    run, log = tmp_path / "run", tmp_path / "requests.log"
    path = run / "int8-w8a8" / "judge" / "judgements.jsonl"
    server = _start_judge(port, log)
    killed = threading.Event()

    def kill_half_way() -> None:  # SIGKILL the judge server once half the judgements are written
        while server.poll() is None:
            if path.is_file() and path.read_bytes().count(b"\n") >= n:
                server.send_signal(signal.SIGKILL)
                killed.set()
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=kill_half_way, daemon=True)
    watcher.start()
    with pytest.raises(QuantgateError, match="judge failed"):
        rel.judge(spec, run, evs["baseline"], [evs["int8-w8a8"]], log=lambda m: None)
    watcher.join(30)
    server.wait(10)
    assert killed.is_set(), "the kill must land while judging"
    assert (run / "int8-w8a8" / "judge" / "error.json").is_file()  # the gate shows why the evidence is missing
    before = [json.loads(x) for x in path.read_text().splitlines()]
    judged_before = {r["id"] for r in before if r["error"] is None}
    asked_first = log.read_text().split()
    server = _start_judge(port, log)  # the judge is back: the same release step again
    try:
        reports = rel.judge(spec, run, evs["baseline"], [evs["int8-w8a8"]], log=lambda m: None)
    finally:
        server.kill()
        server.wait(10)
    after = [json.loads(x) for x in path.read_text().splitlines()]
    ok = [r["id"] for r in after if r["error"] is None]
    jobs = set(read_results(path))
    assert len(ok) == len(set(ok)) == len(jobs), "a job was judged twice"  # each judged exactly once
    assert judged_before <= set(ok) and all(r["error"] is None for r in read_results(path).values())
    asked_after = log.read_text().split()[len(asked_first):]
    prompts = {r["id"]: r["messages"][-1]["content"] for r in after}
    rejudged = [i for i in judged_before if hashlib.sha256(prompts[i].encode()).hexdigest() in asked_after]
    assert rejudged == []  # nothing judged before the kill was asked again
    report = json.loads(reports["int8-w8a8"].read_text())
    assert report["parse"]["judgements"] == len(jobs) and not (run / "int8-w8a8" / "judge" / "error.json").exists()
    print(f"\njudge: {len(jobs)} judge requests (pairs x 2 orders, calibration included); server SIGKILLed after "
          f"{len(judged_before)} judged, {len(before) - len(judged_before)} failed records at the kill; resumed: "
          f"{len(asked_after)} asked, {len(rejudged)} judged pairs asked again, each job judged once")


# --- the release flow: SIGTERM between steps, then two releases resumed at once --------------------------------

SPEC = """\
version: 1
name: faults
model: demo
hardware: x86-cpu
context: 1024
concurrency: 4
schemes: [int8-w8a8]
eval_sets: [{evalset}]
quantization:  # a real llmcompressor run kept short: GPTQ on the first of the 30 decoder layers only
  calibration: {{samples: 8, max_seq_length: 64}}
  overrides: {{int8-w8a8: {{ignore: ['{ignore}']}}}}
eval: {{limit: {limit}}}
recall: null
perf: null
fidelity: null
"""
TAG_VAR = "QUANTGATE_FAULT_TEST_TAG"  # inherited by every process the release starts (child_env keeps QUANTGATE_*)


def _tagged(tag: str) -> list[int]:
    """Live (not zombie) processes whose environment carries the tag: the release and everything it started."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if needle not in Path(f"/proc/{name}/environ").read_bytes().split(b"\0"):
                continue
            if Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z":
                found.append(int(name))
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


def _describe(pids: list[int]) -> list[str]:
    return [f"{pid}: {_cmdline(pid)[:150]}" for pid in pids]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, demo_model):
    root = tmp_path_factory.mktemp("faults")
    env = {**os.environ, "QUANTGATE_RESULTS": str(root / "results"), "PREFECT_HOME": str(root / "prefect"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONUNBUFFERED": "1"}
    return root, env


def _spec(root: Path, name: str, limit: int) -> Path:
    path = root / f"{name}.yaml"
    path.write_text(SPEC.format(evalset=EVALSET, limit=limit, ignore=LAYER0_ONLY))
    return path


def _release(spec: Path, env: dict, *extra: str, tag: str | None = None) -> tuple[subprocess.Popen, Path]:
    """`quantgate release SPEC ...` in a process of its own, its output in a log file (readable while it runs)."""
    env = {**env, TAG_VAR: tag or secrets.token_hex(6)}
    log = spec.parent / f"release-{secrets.token_hex(4)}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "quantgate.cli.main", "release", str(spec), *extra], env=env,
                                cwd=REPO, stdout=fh, stderr=subprocess.STDOUT)
    return proc, log


def _tail(log: Path, n: int = 4000) -> str:
    return log.read_text(errors="replace")[-n:]


def _rows(run: Path) -> list[dict]:
    try:
        return json.loads((run / "timings.json").read_text())
    except (OSError, ValueError):
        return []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _bad_files(cache: Path) -> list[str]:
    """Cache files that do not parse, and temporary files left behind."""
    bad = []
    for f in cache.rglob("*"):
        if not f.is_file() or f.suffix == ".lock":
            continue
        if f.name.endswith(".tmp"):
            bad.append(f"{f}: temporary file left")
        elif f.suffix == ".json":
            try:
                json.loads(f.read_text(encoding="utf-8"))
            except ValueError as exc:
                bad.append(f"{f}: {exc}")
        elif f.suffix == ".jsonl":
            for no, line in enumerate(f.read_text(encoding="utf-8").splitlines(keepends=True), 1):
                try:
                    json.loads(line)
                    assert line.endswith("\n")
                except (ValueError, AssertionError):
                    bad.append(f"{f}:{no}: torn or corrupt line")
    return bad


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_the_flow_sigtermed_between_steps_leaves_nothing_running_and_two_resumed_at_once_share_the_cache(workspace,
                                                                                                        prefect_api):
    """SIGTERM once a variant is measured: the release's whole tree goes, exit 143. Then the same spec started twice
    at once: both finish with a decision, the quantization and the variant measured before the kill are reused by
    both, the variant left unmeasured is measured by one of them and reused by the other, and no cache file is torn."""
    root, env = workspace
    env = {**env, "PREFECT_API_URL": prefect_api}  # the session's server: this test is about the release's own tree
    spec, tag = _spec(root, "faults", 12), secrets.token_hex(6)
    run1 = root / "results" / "runs" / "sigterm-1"
    proc, log1 = _release(spec, env, "--run-id", run1.name, tag=tag)
    t0 = time.monotonic()

    def finished() -> set[str]:
        return {r["step"] for r in _rows(run1) if r["status"] == "ok"}

    # the kill: once the quantization and the first variant's measurement are done (the other variant's server is
    # then serving, beside it or next), right as that step's row is written
    while not ("quantize int8-w8a8" in finished() and any(s.startswith("serve and measure") for s in finished())):
        assert proc.poll() is None, _tail(log1)
        assert time.monotonic() - t0 < 1800, "no variant was ever measured"
        time.sleep(0.1)
    alive = _tagged(tag)
    servers = [p for p in alive if "vllm" in _cmdline(p).lower()]
    proc.send_signal(signal.SIGTERM)
    at_kill, steps_at_kill = time.monotonic() - t0, finished()
    code = proc.wait(timeout=120)
    steps1 = finished()  # a step busy at the kill may still finish (and record itself) while the release stops
    deadline, left = time.monotonic() + 60, _tagged(tag)
    while left and time.monotonic() < deadline:  # the release stops its tree; give slow exits a minute
        time.sleep(0.5)
        left = _tagged(tag)
    assert left == [], f"left running after SIGTERM: {_describe(left)}"
    assert code == 128 + signal.SIGTERM and "ConnectError" not in log1.read_text(errors="replace"), _tail(log1)
    status = json.loads((run1 / "status.json").read_text())  # the run says how it ended (report, dashboard, show)
    assert status["status"] == "interrupted" and status["signal"] == "SIGTERM", status
    # measured before the SIGTERM stopped the release (a step whose server the stop killed ends as a serving
    # failure of that dead run: it is measured again)
    measured = {v for v in ("baseline", "int8-w8a8")
                if f"serve and measure {v}" in steps1 and not (run1 / v / "error.json").exists()}

    t1 = time.monotonic()
    runs = [root / "results" / "runs" / f"sigterm-{i}" for i in (2, 3)]
    tags = [secrets.token_hex(6) for _ in runs]
    again = [_release(spec, env, "--run-id", run.name, tag=t) for run, t in zip(runs, tags)]
    for p, _ in again:
        p.wait(timeout=1800)
    wall2 = time.monotonic() - t1
    served: dict[str, list[bool]] = {"baseline": [], "int8-w8a8": []}
    for (p, log), run, t in zip(again, runs, tags):
        assert p.returncode in (0, 3, 4), _tail(log)  # a decision (PROMOTE, REJECT or INCONCLUSIVE)
        # a normal end: every process the release started stopped before it exited, without a traceback
        assert _tagged(t) == [] and "Traceback" not in log.read_text(errors="replace"), _tail(log)
        summary, decision = (json.loads((run / f).read_text()) for f in ("summary.json", "decision.json"))
        assert summary["candidates"]["int8-w8a8"]["decision"] == decision["candidates"]["int8-w8a8"]["decision"]
        quant = json.loads((run / "int8-w8a8" / "quantization.json").read_text())
        assert quant["reused"] is True  # quantized before the SIGTERM: not quantized again
        for v in served:
            ev = json.loads((run / v / "evidence.json").read_text())
            served[v].append(ev["served"])
            assert is_complete(ev["evals"]["default"])
    for v, flags in served.items():  # measured once: before the kill, else by exactly one of the two re-runs
        assert sorted(flags) == ([False, False] if v in measured else [False, True]), (v, measured, served)
    bad = _bad_files(root / "results" / "cache")
    assert bad == [], bad
    rows2 = {r["step"]: r["seconds"] for r in _rows(runs[0])}
    print(f"\nflow SIGTERM: killed {at_kill:.0f} s in (exit {code}), after {sorted(steps_at_kill)} (finished by the exit: "
          f"{sorted(steps1 - steps_at_kill) or 'nothing more'}); {len(alive)} processes of "
          f"the release alive at the kill ({len(servers)} vLLM), {len(left)} left after it (/proc, by an inherited tag)"
          f"\ntwo re-runs at once: {wall2:.0f} s wall; quantization reused ({rows2['quantize int8-w8a8']} s); "
          f"served (run 2, run 3): {served}; cache files intact")


# --- `quantgate release` told to stop: its whole process tree goes with it -------------------------------------

STOPPED_PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from quantgate.base import proctree
    from quantgate.release import stopping
    proctree.GRACE_S = 1.0
    with stopping.on_stop_signals(stopping.STOP_SIGNALS):  # what a release sets: SIGTERM, SIGHUP, SIGINT
        kids = [subprocess.Popen(["sleep", "300"]),                                  # a plain child
                subprocess.Popen(["sleep", "301"], start_new_session=True),          # its own session and group
                subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 302 & wait"]),  # ignores SIGTERM, has a child
                subprocess.Popen([sys.executable, "-c",                              # a grandchild in a new session
                                  "import subprocess; subprocess.Popen(['sleep', '303'], start_new_session=True)"
                                  "; import time; time.sleep(300)"])]
        print(" ".join(str(k.pid) for k in kids), flush=True)
        time.sleep(300)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_takes_the_whole_process_tree_down(tmp_path, sig):
    """SIGTERM (a service manager, `kill`) and SIGINT (Ctrl-C) alike: the whole tree down, exit 128 + the signal
    (143, 130), within 15 s."""
    parent = subprocess.Popen([sys.executable, "-c", STOPPED_PARENT], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    kids = [int(x) for x in parent.stdout.readline().split()]
    deadline = time.monotonic() + 30
    while len(tree := descendants(parent.pid)) < 6 and time.monotonic() < deadline:  # 4 children, 2 grandchildren
        time.sleep(0.05)
    assert set(kids) <= set(tree) and len(tree) >= 6, tree
    t0 = time.monotonic()
    parent.send_signal(sig)
    assert parent.wait(timeout=30) == 128 + sig and time.monotonic() - t0 < 15
    time.sleep(0.2)
    alive = [p for p in tree if Path(f"/proc/{p}").exists()
             and Path(f"/proc/{p}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z"]
    assert alive == [], _describe(alive)
    print(f"\nstop signal: {len(tree)} processes below the release (2 in sessions of their own, one ignoring "
          f"SIGTERM), {len(alive)} left")


# --- Prefect's temporary API server: owned, guarded, stopped last ----------------------------------------------

PREFECT_APP = "prefect.server.api.server:create_app"


def _listening(pids: list[int]) -> dict[int, set[int]]:
    """pid -> the TCP ports it listens on (psutil), for the pids still alive."""
    out = {}
    for pid in pids:
        try:
            ports = {c.laddr.port for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            continue
        out[pid] = ports
    return out


def _wait_for_prefect_server(proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> tuple[psutil.Process, int]:
    """Prefect's temporary API server below `proc` (uvicorn running Prefect's app), once it listens: (it, its port)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, _tail(log)
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:
                if "uvicorn" in p.cmdline() and PREFECT_APP in p.cmdline():
                    ports = [c.laddr.port for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
                    if ports:
                        return p, ports[0]
            except psutil.Error:
                continue
        time.sleep(0.2)
    raise AssertionError(f"Prefect's API server never listened below pid {proc.pid}: {_tail(log)}")


def _fresh_env(workspace, tmp_path: Path) -> dict:
    """The module's environment (its Prefect home: the server's database is migrated once), a fresh results folder."""
    _, env = workspace
    return {**env, "QUANTGATE_RESULTS": str(tmp_path / "results")}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_sigkilled_release_leaves_no_process_and_no_port_prefects_api_server_included(workspace, tmp_path):
    env, tag = _fresh_env(workspace, tmp_path), secrets.token_hex(6)
    proc, log = _release(_spec(tmp_path, "sigkill", 12), env, tag=tag)
    t0 = time.monotonic()
    try:
        server, port = _wait_for_prefect_server(proc, log)
        up = time.monotonic() - t0
        assert server.parent() is not None and "procguard" in " ".join(server.parent().cmdline())  # under the guard
        assert os.getsid(server.pid) != os.getsid(proc.pid)  # a session of its own: a terminal's Ctrl-C misses it
        tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        ports = set().union(*_listening(tree).values()) | {port}
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 15  # every process gone and every port free within 15 s (polled: done early)
        while True:
            left = live(tree) + [p for p in _tagged(tag) if p not in tree]
            bound = procs.listening(ports)
            if (not left and not bound) or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        gone_s = time.monotonic() - (deadline - 15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert left == [], f"alive 15 s after the release was SIGKILLed: {_describe(left)}"
    assert bound == {}, f"still listening 15 s after the release was SIGKILLed: {bound}"
    print(f"\nrelease SIGKILLed {up:.0f} s in, as soon as Prefect's API server listened (port {port}): {len(tree)} "
          f"processes below it then, listening on {sorted(ports)}; all gone and free {gone_s:.1f} s after the SIGKILL")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_sigtermed_flow_script_stops_its_tree_prefects_api_server_last_within_15_s(workspace, tmp_path):
    """`python flows/release.py SPEC` told to stop while a task runs a child: exit 143 within 15 s, nothing left,
    Prefect's API server the last to go, no connection error. (Before: Prefect's engine took SIGTERM from the flow's
    handler and waited for the running tasks, minutes.)"""
    tag = secrets.token_hex(6)
    env = {**_fresh_env(workspace, tmp_path), TAG_VAR: tag}
    log = tmp_path / "flow.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, str(REPO / "flows" / "release.py"), str(_spec(tmp_path, "term", 12))],
                                env=env, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT)
    try:
        server, port = _wait_for_prefect_server(proc, log)
        deadline = time.monotonic() + 600
        while True:  # a task is running: a guarded child (the quantization or a vLLM server) besides Prefect's
            tree = psutil.Process(proc.pid).children(recursive=True)
            prefect = {p.pid for p in tree if _sid(p.pid) == os.getsid(server.pid)}  # uvicorn, its guard, the watcher
            guards = [p for p in tree if p.pid not in prefect and "procguard" in " ".join(_cmdline(p.pid).split()[:4])]
            if guards:
                break
            assert proc.poll() is None and time.monotonic() < deadline, _tail(log)
            time.sleep(0.2)
        pids = [p.pid for p in tree]
        proc.send_signal(signal.SIGTERM)
        t0, gone = time.monotonic(), {}
        while proc.poll() is None and time.monotonic() - t0 < 30:  # when each process of the tree went
            gone |= {p: time.monotonic() - t0 for p in pids if p not in gone and not live([p])}
            time.sleep(0.02)
        took = time.monotonic() - t0
        code = proc.wait(timeout=30)
        left = live(pids) + [p for p in _tagged(tag) if p not in pids]
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text(errors="replace")
    assert code == 128 + signal.SIGTERM and took < 15, (code, took, out[-3000:])
    assert left == [], f"left after SIGTERM: {_describe(left)}"
    assert procs.listening([port]) == {}
    others = [t for p, t in gone.items() if p not in prefect]
    assert server.pid in gone and others and gone[server.pid] >= max(others), gone  # Prefect's server went last
    assert "ConnectError" not in out and "Traceback" not in out[out.index("quantgate: SIGTERM"):], out[-3000:]
    print(f"\nflows/release.py SIGTERMed while {len(guards)} guarded child(ren) ran ({len(pids)} processes): exit {code} "
          f"after {took:.1f} s; the others gone by {max(others):.1f} s, Prefect's API server at {gone[server.pid]:.1f} s; "
          f"{len(left)} left, port {port} free")


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except ProcessLookupError:
        return None


TINY_FLOW = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from prefect import flow, get_run_logger, task
    from quantgate.release.stopping import run_flow

    @task
    def wait_for(go: str) -> str:
        while not Path(go).exists():
            time.sleep(0.1)
        get_run_logger().info("task done")  # logs and events sent right before the end: drained, then the server stops
        return "done"

    @flow
    def tiny(go: str) -> str:
        return wait_for.submit(go).result()

    print("result", run_flow(tiny, go=sys.argv[1]), flush=True)
""")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_flow_run_by_run_flow_stops_its_prefect_api_server_at_the_end_without_errors(workspace, tmp_path):
    _, env = workspace
    go, log = tmp_path / "go", tmp_path / "tiny.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-c", TINY_FLOW, str(go)], env={**env, "PYTHONPATH": str(REPO)},
                                cwd=tmp_path, stdout=fh, stderr=subprocess.STDOUT)
    try:
        server, port = _wait_for_prefect_server(proc, log)
        pids = [server.pid, server.ppid()]
        go.write_text("go")
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text(errors="replace")
    assert code == 0 and "result done" in out, out[-3000:]
    assert live(pids) == [] and procs.listening([port]) == {}, "Prefect's API server outlived the flow's process"
    assert "Traceback" not in out and "ConnectError" not in out and "Stopping temporary server" in out, out[-3000:]
    print(f"\nrun_flow: the flow ended, Prefect's API server (port {port}) stopped before the process exited, no error")
