"""Serving performance probe (adapter): vLLM's own benchmark client against a running OpenAI-compatible server.

    result = probe("http://127.0.0.1:8000", "demo", out_dir, concurrency=[1, 8, 32], tokenizer=ckpt,
                   checkpoint=ckpt, server_log=log, plan=plan_json)

For every repeat and concurrency level it runs `vllm bench serve` (random dataset, fixed input/output lengths,
fixed seed, temperature 0, ignore-eos: the same prompts and work for every variant) from the serving environment,
in one child process (quantgate/serving/bench_driver.py). It adds what the variant costs: safetensors bytes on
disk, the memory the engine logged for weights and KV cache, and the planner's KV capacity. It writes
<out>/perf.json (quantgate.perf.models.PerfResult) and the raw vLLM results under <out>/raw/.
Failed requests are never averaged away: any failure makes the probe an error that names the level and error rate.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import shlex
import subprocess
import time
from pathlib import Path

from pydantic import ValidationError

from quantgate.base.errors import ConfigError, QuantgateError
from quantgate.base.fileio import write_json
from quantgate.base.http import EndpointError, model_entry
from quantgate.perf.compare import first_error, level_medians
from quantgate.perf.models import (PerfResult, PlannerKV, RunResult, Workload, failed_run, parse_engine_log,
                                   run_from_bench)
from quantgate.plan.models import Plan
from quantgate.serving.env import serve_python

DRIVER = Path(__file__).parents[1] / "serving" / "bench_driver.py"
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model")


def endpoint_root(endpoint: str) -> str:
    """'http://h:p', 'http://h:p/' or 'http://h:p/v1' -> 'http://h:p'."""
    root = endpoint.strip().rstrip("/")
    if not root.startswith(("http://", "https://")):
        raise QuantgateError(f"endpoint {endpoint!r} is not an http(s) URL", where="--endpoint", fix="e.g. http://127.0.0.1:8000/v1")
    return root.removesuffix("/v1")


def check_endpoint(endpoint: str, model: str, api_key: str | None, timeout_s: float = 10.0) -> dict:
    """The server's /v1/models entry for `model`; a clear error when unreachable, unauthorised or not serving it."""
    url = f"{endpoint_root(endpoint)}/v1/models"
    try:
        return model_entry(endpoint_root(endpoint), model, api_key, timeout_s, where="--endpoint")
    except EndpointError as exc:  # in this command's words: a probe that sent nothing failed every request
        if exc.reason == "unreachable":
            raise QuantgateError(f"cannot reach the endpoint {url}: {exc.detail} (error rate 100%: no request could be sent)",
                                 where="--endpoint", fix="start the server (or check host/port) and probe again") from None
        if exc.reason == "not_served":
            raise QuantgateError(f"the endpoint {url} does not serve {model!r}; it serves {exc.served}", where="--model",
                                 fix="pass one of the served model names") from None
        raise


def resolve_tokenizer(tokenizer: Path | None, model_entry: dict) -> Path:
    """The tokenizer folder: the given one, else the folder the server loaded (`root` in /v1/models) if it is here."""
    if tokenizer is not None:
        if not Path(tokenizer).is_dir():
            raise ConfigError(f"tokenizer folder not found: {tokenizer}", where="--tokenizer", fix="pass a checkpoint folder with tokenizer files")
        return Path(tokenizer)
    root = model_entry.get("root")
    if root and Path(root).is_dir():
        return Path(root)
    raise ConfigError(f"no tokenizer: the server's model folder {root!r} is not on this machine", where="--tokenizer",
                      fix="pass --tokenizer DIR (the baseline checkpoint folder, for every variant)")


def tokenizer_sha256(folder: Path) -> str | None:
    h = hashlib.sha256()
    found = False
    for name in TOKENIZER_FILES:
        p = Path(folder) / name
        if p.is_file():
            h.update(name.encode() + b"\0" + p.read_bytes())
            found = True
    return h.hexdigest() if found else None


def weights_bytes(checkpoint: Path) -> int:
    """Bytes of *.safetensors in the checkpoint folder (weights as shipped)."""
    files = sorted(Path(checkpoint).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors in {checkpoint}", where="--checkpoint", fix="pass the folder the server loaded")
    return sum(f.stat().st_size for f in files)


def planner_kv(plan_path: Path) -> PlannerKV:
    """The planner's KV capacity from a plan JSON (`quantgate plan --out`)."""
    try:
        plan = Plan.model_validate_json(Path(plan_path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read plan: {exc}", where=str(plan_path), fix="write one with `quantgate plan ... --out FILE`") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(f"not a plan JSON: {'.'.join(map(str, first['loc']))}: {first['msg']}", where=str(plan_path),
                          fix="write one with `quantgate plan ... --out FILE`") from None
    c = plan.capacity
    return PlannerKV(plan=str(plan_path), kv_tokens_per_replica=c.kv_tokens_per_replica, kv_pool_gib_per_replica=c.kv_pool_gib_per_replica,
                     concurrency_per_replica=c.concurrency_per_replica, context=c.context, weight_gib_per_device=c.weight_gib_per_device)


def bench_argv(root: str, model: str, w: Workload, concurrency: int, result_dir: Path, filename: str) -> list[str]:
    """Arguments of `vllm bench serve` for one measured run."""
    return ["--backend", w.backend, "--base-url", root, "--endpoint", w.endpoint_path, "--model", model,
            "--tokenizer", w.tokenizer, "--dataset-name", w.dataset, "--random-input-len", str(w.input_len),
            "--random-output-len", str(w.output_len), "--random-range-ratio", "0.0", "--num-prompts", str(w.num_prompts),
            "--seed", str(w.seed), "--temperature", str(w.temperature), "--max-concurrency", str(concurrency),
            "--request-rate", "inf", "--num-warmups", str(w.warmups), *(["--ignore-eos"] if w.ignore_eos else []),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", filename]


def _run_driver(runs: list[dict], out: Path, api_key: str | None, python: Path | None, timeout_s: float) -> str:
    """Run the benchmark runs in one serving-env process; returns the tail of its output (for errors)."""
    spec = out / "raw" / "bench_spec.json"
    spec.write_text(json.dumps({"runs": runs}, indent=1))
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    if api_key:
        env["OPENAI_API_KEY"] = api_key  # read by vLLM's client; never on the command line
    log = out / "bench.log"
    try:
        with open(log, "wb") as fh:
            proc = subprocess.run([str(serve_python(python)), str(DRIVER), str(spec)], stdout=fh, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"benchmark client timed out after {timeout_s:.0f} s (see {log})"
    tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-4:])
    return "" if proc.returncode == 0 else f"benchmark client exited with code {proc.returncode}: {tail}"


def probe(endpoint: str, model: str, out: Path, *, concurrency: list[int], num_prompts: int = 64, input_len: int = 128,
          output_len: int = 32, repeats: int = 3, seed: int = 0, warmups: int = 2, tokenizer: Path | None = None,
          api_key: str | None = None, checkpoint: Path | None = None, server_log: Path | None = None,
          plan: Path | None = None, python: Path | None = None, timeout_s: float = 3600.0, check: bool = True) -> PerfResult:
    """Probe one served variant; writes <out>/perf.json. With `check`, any failed request raises after writing."""
    if not concurrency or any(c < 1 for c in concurrency):
        raise ConfigError(f"concurrency levels must be positive integers, got {concurrency}", where="--concurrency", fix="e.g. 1,8,32")
    if min(num_prompts, input_len, output_len, repeats) < 1:
        raise ConfigError("--num-prompts, --input-len, --output-len and --repeats must be >= 1", fix="pass positive numbers")
    size = weights_bytes(checkpoint) if checkpoint else None  # bad inputs fail before any load is sent
    kv_plan = planner_kv(plan) if plan else None
    if server_log is not None and not Path(server_log).is_file():
        raise ConfigError(f"server log not found: {server_log}", where="--server-log", fix="pass the log the vLLM server writes")
    entry = check_endpoint(endpoint, model, api_key)
    tok = resolve_tokenizer(tokenizer, entry)
    root = endpoint_root(endpoint)
    w = Workload(num_prompts=num_prompts, input_len=input_len, output_len=output_len, seed=seed, warmups=warmups,
                 tokenizer=str(tok), tokenizer_sha256=tokenizer_sha256(tok))
    out = Path(out)
    (out / "raw").mkdir(parents=True, exist_ok=True)
    levels = sorted(set(concurrency))
    plan_runs, todo = [], []
    for r in range(repeats):  # interleaved: drift on a noisy machine spreads over every level
        for c in levels:
            name = f"c{c}-r{r}.json"
            for stale in (out / "raw" / name, out / "raw" / f"{name}.error"):
                stale.unlink(missing_ok=True)
            plan_runs.append({"argv": bench_argv(root, model, w, c, out / "raw", name), "error_file": str(out / "raw" / f"{name}.error")})
            todo.append((r, c, out / "raw" / name))
    started, t0 = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), time.perf_counter()
    crash = _run_driver(plan_runs, out, api_key, python, timeout_s)
    runs: list[RunResult] = []
    for (r, c, path), spec in zip(todo, plan_runs):
        err_file = Path(spec["error_file"])
        if path.is_file():
            runs.append(run_from_bench(json.loads(path.read_text()), repeat=r, concurrency=c, num_prompts=num_prompts))
        else:
            why = json.loads(err_file.read_text())["exception"] if err_file.is_file() else (crash or "no result written")
            runs.append(failed_run(repeat=r, concurrency=c, num_prompts=num_prompts, error=why))
    error = first_error(runs)
    result = PerfResult(
        client="vllm bench serve (vLLM's benchmark client, run from the serving environment)", endpoint=root, model=model,
        workload=w, concurrency=levels, repeats=repeats, runs=runs, medians=level_medians(runs),
        checkpoint=str(checkpoint) if checkpoint else None, weights_bytes=size,
        engine=parse_engine_log(Path(server_log).read_text(errors="replace"), log=str(server_log)) if server_log else None,
        planner=kv_plan, commands=["vllm bench serve " + shlex.join(s["argv"]) for s in plan_runs[: len(levels)]],
        status="error" if error else "ok", error=f"{root} ({model}): {error}" if error else None,
        started=started, seconds=round(time.perf_counter() - t0, 2),
    )
    write_json(out / "perf.json", result.model_dump(mode="json"))
    if check and result.error:
        raise QuantgateError(result.error, where=str(out / "perf.json"),
                             fix="read the errors in perf.json and the server log; lower --concurrency if the server fails under load")
    return result


def load_result(folder: Path) -> PerfResult:
    """A probe's perf.json (from a folder or the file itself), validated."""
    path = Path(folder)
    path = path / "perf.json" if path.is_dir() else path
    try:
        return PerfResult.model_validate_json(path.read_text(encoding="utf-8"))
    except OSError:
        raise ConfigError(f"no probe result at {path}", where=str(path), fix="run `quantgate perf ... --out DIR` first") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(f"not a perf.json: {'.'.join(map(str, first['loc']))}: {first['msg']}", where=str(path),
                          fix="re-run `quantgate perf` to write it again") from None
