"""Serving performance probe (adapter): vLLM's own benchmark client against a running OpenAI-compatible server.

    result = run_probe(Endpoint("http://127.0.0.1:8000", "demo"), out_dir, settings, tokenizer=ckpt, checkpoint=ckpt,
                       server_log=log, plan=plan_json)      # settings: quantgate.perf.workloads.settings(...)
    result = probe(server.endpoint, out_dir, concurrency=[1, 8, 32], ...)   # fixed levels, no profile

One warm-up run first (not counted), then for every repeat and concurrency level `vllm bench serve` (random
dataset, fixed lengths, fixed seed, temperature 0, ignore-eos: the same prompts and work for every variant), all in
one child process of the serving environment (quantgate/serving/bench_driver.py). While it runs, the probe reads
the finished runs, samples the engine's /metrics about once a second, and marks the runs that should not start:
levels above where a sweep saturated or broke the SLO, and everything once the time budget is spent
(quantgate.perf.sweep). It adds what the variant costs: safetensors bytes on disk, the memory the engine logged for
weights and KV cache, and the planner's KV capacity. It writes <out>/perf.json (quantgate.perf.models.PerfResult)
and the raw vLLM results under <out>/raw/.
Failed requests are never averaged away: any failure makes the probe an error that names the level and error rate.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import shlex
import time
from pathlib import Path

from pydantic import ValidationError

from quantgate.base.runfiles import PERF
from quantgate.base.errors import ConfigError, QuantgateError, SettingError
from quantgate.base.fileio import write_json
from quantgate.base.http import Endpoint, EndpointError, get, model_entry
from quantgate.perf.client import BenchClient
from quantgate.perf.compare import first_error, level_medians
from quantgate.perf.metrics import parse as parse_metrics
from quantgate.perf.metrics import summarize as summarize_metrics
from quantgate.perf.models import (PerfResult, PlannerKV, ProbeSettings, RunResult, Skipped, SweepRecord, Workload,
                                   failed_run, parse_engine_log, run_from_bench)
from quantgate.perf.sweep import Key, to_skip
from quantgate.perf.sweep import plan as run_order
from quantgate.plan.models import Plan

TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model")
METRICS_S = 1.0  # how often the engine's /metrics is sampled


def endpoint_root(endpoint: str) -> str:
    """'http://h:p', 'http://h:p/' or 'http://h:p/v1' -> 'http://h:p'."""
    root = endpoint.strip().rstrip("/")
    if not root.startswith(("http://", "https://")):
        raise SettingError(f"endpoint {endpoint!r} is not an http(s) URL", setting="endpoint", fix="e.g. http://127.0.0.1:8000/v1")
    return root.removesuffix("/v1")


def check_endpoint(endpoint: Endpoint, timeout_s: float = 10.0) -> dict:
    """The server's /v1/models entry for its model; a clear error when unreachable, unauthorised or not serving it."""
    root, model = endpoint_root(endpoint.url), endpoint.model
    url = f"{root}/v1/models"
    try:
        return model_entry(endpoint, timeout_s, where="endpoint")
    except EndpointError as exc:  # in this command's words: a probe that sent nothing failed every request
        if exc.reason == "unreachable":
            raise SettingError(f"cannot reach the endpoint {url}: {exc.detail} (error rate 100%: no request could be sent)",
                                 setting="endpoint", fix="start the server (or check host/port) and probe again") from None
        if exc.reason == "not_served":
            raise SettingError(f"the endpoint {url} does not serve {model!r}; it serves {exc.served}", setting="model",
                                 fix="pass one of the served model names") from None
        raise


def resolve_tokenizer(tokenizer: Path | None, model_entry: dict) -> Path:
    """The tokenizer folder: the given one, else the folder the server loaded (`root` in /v1/models) if it is here."""
    if tokenizer is not None:
        if not Path(tokenizer).is_dir():
            raise SettingError(f"tokenizer folder not found: {tokenizer}", setting="tokenizer", fix="pass a checkpoint folder with tokenizer files")
        return Path(tokenizer)
    root = model_entry.get("root")
    if root and Path(root).is_dir():
        return Path(root)
    raise SettingError(f"no tokenizer: the server's model folder {root!r} is not on this machine", setting="tokenizer",
                      fix="give a tokenizer folder (the baseline checkpoint folder, for every variant)")


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
        raise SettingError(f"no *.safetensors in {checkpoint}", setting="checkpoint", fix="pass the folder the server loaded")
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


def bench_argv(root: str, model: str, w: Workload, concurrency: int, num_prompts: int, result_dir: Path,
               filename: str, requests: str | None = None) -> list[str]:
    """Arguments of `vllm bench serve` for one measured run (with the SLO, vLLM's own goodput is saved too)."""
    slo = w.slo
    goodput = [f"{k}:{v:g}" for k, v in (("ttft", slo.ttft_ms), ("tpot", slo.tpot_ms)) if v is not None] if slo else []
    data = (["--dataset-path", str(requests), "--sharegpt-output-len", str(w.output_len)] if requests else
            ["--random-input-len", str(w.input_len), "--random-output-len", str(w.output_len), "--random-range-ratio",
             str(w.range_ratio)])
    return ["--backend", w.backend, "--base-url", root, "--endpoint", w.endpoint_path, "--model", model,
            "--tokenizer", w.tokenizer, "--dataset-name", w.dataset, *data, "--num-prompts", str(num_prompts),
            "--seed", str(w.seed), "--temperature", str(w.temperature), "--max-concurrency", str(concurrency), "--request-rate", "inf", "--num-warmups", str(w.warmups),
            *(["--ignore-eos"] if w.ignore_eos else []), *(["--goodput", *goodput] if goodput else []),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", filename]


class _Watch:
    """Called every client.POLL_S while the benchmark client runs: reads the runs finished so far, samples the engine's
    /metrics every METRICS_S, and releases the next run (GATE.go) or skips it (GATE.skip, quantgate.perf.sweep.to_skip):
    the driver waits for one of the two before each run, so no run starts before the decision about it."""

    def __init__(self, settings: ProbeSettings, root: str, api_key: str | None, files: dict[Key, Path],
                 warmup: Path | None):
        self.settings, self.root, self.api_key, self.files, self.warmup = settings, root, api_key, files, warmup
        self.t0 = time.monotonic()
        self.done: dict[Key, RunResult] = {}
        self.skipped: dict[Key, str] = {}
        self.released: set[Key] = set()
        self.stopped: str | None = None
        self.samples: list[tuple[int | None, dict[str, float]]] = []
        self.metrics_error: str | None = None
        self.warmup_s: float | None = None
        self.last_sample = -METRICS_S

    def __call__(self) -> None:
        for key, path in self.files.items():
            if key not in self.done and path.is_file():
                try:
                    self.done[key] = _read_run(path, key, self.settings)
                except ValueError:  # still being written: next time
                    pass
        if self.warmup is not None and self.warmup_s is None and (self.warmup.is_file() or self.done):
            self.warmup_s = round(time.monotonic() - self.t0, 2)
        if (self.warmup is None or self.warmup_s is not None) and time.monotonic() - self.last_sample >= METRICS_S:
            self.last_sample = time.monotonic()
            self._sample(next((k[1] for k in self.files if k in self.released and k not in self.done), None))
        self._release()

    def _release(self) -> None:
        s = self.settings
        skip, why = to_skip(list(self.files), self.done, sweep=s.sweep, slo=s.slo, gain=s.saturation_gain,
                            elapsed_s=time.monotonic() - self.t0, budget_s=s.budget_s)
        self.stopped = self.stopped or why
        for key, path in self.files.items():
            if key in self.done or key in self.skipped or path.with_name(path.name + ".error").is_file():
                continue
            if key in self.released:
                return  # running now
            if key in skip:
                _marker(path, "skip").write_text(skip[key])
                self.skipped[key] = skip[key]
                continue
            _marker(path, "go").write_text("")
            self.released.add(key)
            return

    def _sample(self, level: int | None) -> None:
        if self.metrics_error is not None:
            return
        try:
            resp = get(f"{self.root}/metrics", self.api_key, timeout_s=2.0, where="/metrics")
        except QuantgateError as exc:
            self.metrics_error = f"/metrics unreachable: {exc.message}"
            return
        if resp.status_code != 200:
            self.metrics_error = f"/metrics answered HTTP {resp.status_code}"
            return
        self.samples.append((level, parse_metrics(resp.text)))


def _requests_sha256(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as exc:
        raise SettingError(f"cannot read the requests file {path}: {exc}", setting="requests",
                          fix="write it with quantgate.perf.workloads.write_requests (an eval set's lengths: "
                              "`perf.lengths: eval_sets` in a release spec)") from None


def _marker(result: Path, kind: str) -> Path:
    """GATE.go / GATE.skip of a run, the gate being its result file's path (quantgate/serving/bench_driver.py)."""
    return result.with_name(f"{result.name}.{kind}")


def _read_run(path: Path, key: Key, s: ProbeSettings) -> RunResult:
    bench = json.loads(path.read_text())
    return run_from_bench(bench, repeat=key[0], concurrency=key[1], num_prompts=int(bench.get("num_prompts") or 0)
                          or s.num_prompts, slo=s.slo)


def probe(endpoint: Endpoint, out: Path, *, concurrency: list[int], num_prompts: int = 64, input_len: int = 128,
          output_len: int = 32, repeats: int = 3, seed: int = 0, warmups: int = 2, **io) -> PerfResult:
    """A probe at fixed levels without a workload profile (see run_probe for `io`: tokenizer, checkpoint, ...)."""
    if not concurrency or any(c < 1 for c in concurrency):
        raise SettingError(f"concurrency levels must be positive integers, got {concurrency}", setting="perf.concurrency", fix="e.g. 1,8,32")
    if min(num_prompts, input_len, output_len, repeats) < 1:
        raise SettingError("num_prompts, input_len, output_len and repeats must be >= 1",
                           setting="num_prompts / input_len / output_len / repeats", fix="give positive numbers")
    settings = ProbeSettings(levels=concurrency, num_prompts=num_prompts, input_len=input_len, output_len=output_len,
                             repeats=repeats, seed=seed, warmups=warmups)
    return run_probe(endpoint, out, settings, **io)


def _prepare(out: Path, root: str, model: str, w: Workload, s: ProbeSettings) -> tuple[list[dict], dict[Key, Path], Path | None]:
    """The driver's run list (warm-up first, then plan order, each run skippable) and the result file per run."""
    raw = Path(out) / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for stale in raw.glob("*.json*"):
        stale.unlink()
    runs, files, warmup = [], {}, None
    if s.warmup_prompts:
        warmup = raw / "warmup.json"
        runs.append({"argv": bench_argv(root, model, w, min(max(s.levels), s.warmup_prompts), s.warmup_prompts, raw,
                                        warmup.name, s.requests), "error_file": str(raw / "warmup.json.error")})
    for r, c in run_order(s.levels, s.repeats):
        files[(r, c)] = raw / f"c{c}-r{r}.json"
        runs.append({"argv": bench_argv(root, model, w, c, w.prompts_at(c), raw, files[(r, c)].name, s.requests),
                     "error_file": str(raw / f"c{c}-r{r}.json.error"), "gate": str(files[(r, c)])})
    return runs, files, warmup


def _collect(files: dict[Key, Path], w: Workload, watch: _Watch, crash: str) -> tuple[list[RunResult], list[Skipped]]:
    runs, skipped = [], []
    for (r, c), path in files.items():
        err_file = path.with_name(path.name + ".error")
        if path.is_file():
            runs.append(_read_run(path, (r, c), watch.settings))
        elif _marker(path, "skip").is_file() and not err_file.is_file():
            skipped.append(Skipped(repeat=r, concurrency=c, reason=watch.skipped.get((r, c)) or _marker(path, "skip").read_text()))
        else:
            why = json.loads(err_file.read_text())["exception"] if err_file.is_file() else (crash or "no result written")
            runs.append(failed_run(repeat=r, concurrency=c, num_prompts=w.prompts_at(c), error=why))
    return runs, skipped


def run_probe(endpoint: Endpoint, out: Path, settings: ProbeSettings, *, tokenizer: Path | None = None,
              checkpoint: Path | None = None, server_log: Path | None = None,
              plan: Path | None = None, python: Path | None = None, timeout_s: float = 3600.0,
              check: bool = True, client: BenchClient | None = None) -> PerfResult:
    """Probe one served variant under `settings`; writes <out>/perf.json. With `check`, any failed request raises
    after writing. `client`: a benchmark client kept across probes (a speed window's); without one, a client of its
    own."""
    s = settings
    size = weights_bytes(checkpoint) if checkpoint else None  # bad inputs fail before any load is sent
    kv_plan = planner_kv(plan) if plan else None
    if server_log is not None and not Path(server_log).is_file():
        raise SettingError(f"server log not found: {server_log}", setting="server_log", fix="pass the log the vLLM server writes")
    entry = check_endpoint(endpoint)
    tok = resolve_tokenizer(tokenizer, entry)
    root, model, api_key = endpoint_root(endpoint.url), endpoint.model, endpoint.api_key
    w = Workload(num_prompts=s.num_prompts, input_len=s.input_len, output_len=s.output_len, seed=s.seed, warmups=s.warmups,
                 tokenizer=str(tok), tokenizer_sha256=tokenizer_sha256(tok), profile=s.profile, waves=s.waves,
                 range_ratio=s.range_ratio, slo=s.slo, warmup_prompts=s.warmup_prompts, decide=s.decide,
                 dataset="sharegpt" if s.requests else "random", requests_sha256=_requests_sha256(s.requests))
    specs, files, warmup = _prepare(Path(out), root, model, w, s)
    started, t0 = dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), time.perf_counter()
    watch = _Watch(s, root, api_key, files, warmup)
    if client is None:
        with BenchClient() as own:
            crash = own.run(specs, Path(out), api_key, python, timeout_s, watch)
    else:
        crash = client.run(specs, Path(out), api_key, python, timeout_s, watch)
    runs, skipped = _collect(files, w, watch, crash)
    seconds = round(time.perf_counter() - t0, 2)
    error = first_error(runs)
    sweep = SweepRecord(levels=s.levels, measured=sorted({r.concurrency for r in runs if r.completed}),
                        stopped=watch.stopped, skipped=skipped, budget_s=s.budget_s, warmup_s=watch.warmup_s,
                        over_budget=s.budget_s is not None and seconds > s.budget_s)
    result = PerfResult(
        client="vllm bench serve (vLLM's benchmark client, run from the serving environment)", endpoint=root, model=model,
        workload=w, concurrency=s.levels, repeats=s.repeats, runs=runs, medians=level_medians(runs),
        checkpoint=str(checkpoint) if checkpoint else None, weights_bytes=size,
        engine=parse_engine_log(Path(server_log).read_text(errors="replace"), log=str(server_log)) if server_log else None,
        planner=kv_plan, commands=["vllm bench serve " + shlex.join(x["argv"]) for x in specs if "gate" in x][: len(s.levels)],
        sweep=sweep, engine_metrics=summarize_metrics(watch.samples, watch.metrics_error),
        status="error" if error else "ok", error=f"{root} ({model}): {error}" if error else None,
        started=started, seconds=seconds,
    )
    write_json(Path(out) / PERF, result.model_dump(mode="json"))
    if check and result.error:
        raise QuantgateError(result.error, where=str(Path(out) / PERF),
                             fix="read the errors in perf.json and the server log; lower the probe's concurrency if the server fails under load")
    return result


def load_result(folder: Path) -> PerfResult:
    """A probe's perf.json (from a folder or the file itself), validated."""
    path = Path(folder)
    path = path / PERF if path.is_dir() else path
    try:
        return PerfResult.model_validate_json(path.read_text(encoding="utf-8"))
    except OSError:
        raise ConfigError(f"no probe result at {path}", where=str(path), fix="run `quantgate perf ... --out DIR` first") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(f"not a perf.json: {'.'.join(map(str, first['loc']))}: {first['msg']}", where=str(path),
                          fix="re-run `quantgate perf` to write it again") from None
