"""The performance probe's record (pure): schema of perf.json, vLLM bench results -> runs, server log -> memory.

perf.json (one per served variant, written by `quantgate perf`):
    workload     what was sent (profile, lengths, SLO): same for every variant, else perf-compare refuses
    runs         one row per (repeat, concurrency): throughput, goodput, TTFT/ITL/TPOT percentiles, failures
    medians      per concurrency, medians over the repeats (quantgate.perf.compare.level_medians)
    sweep        levels planned, runs skipped and why (saturation, SLO broken, time budget), the probe's cost
    engine_metrics  vLLM's /metrics during the probe: KV cache usage, preemptions, prefix-cache hits
    weights_bytes, engine (server log), planner (plan JSON): what the variant costs in memory
    status       "ok", or "error" with `error` saying which level failed and its error rate
"""

from __future__ import annotations

import re
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator

from quantgate.perf.intervals import RatioCI

VERSION = 2


class SLO(BaseModel):
    """Per-request service level: a request is good when it completed, its time to first token is at most `ttft_ms`
    and its time per output token after the first (TPOT) at most `tpot_ms` (vLLM's --goodput); a concurrency level
    meets the SLO when at least `attainment` of its requests are good."""
    model_config = ConfigDict(extra="forbid")

    ttft_ms: float | None = Field(None, gt=0)
    tpot_ms: float | None = Field(None, gt=0)
    attainment: float = Field(0.95, gt=0, le=1)


FigureName = Literal["output_tok_s", "requests_s", "goodput_rps", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms",
                     "itl_p95_ms", "tpot_p50_ms", "tpot_p95_ms", "e2el_p50_ms"]
LOWER_IS_BETTER = {"ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms", "tpot_p50_ms", "tpot_p95_ms", "e2el_p50_ms"}


class Decide(BaseModel):
    """A figure whose candidate/baseline ratio decides pay-off, and where it is read: the `lowest` or `highest`
    concurrency both variants were probed at, or per repeat the `best` value over all levels."""
    model_config = ConfigDict(extra="forbid")

    figure: FigureName
    at: Literal["lowest", "highest", "best"]


class Workload(BaseModel):
    """Prompts and decoding; vLLM's random dataset with fixed lengths and seed gives the same prompts per tokenizer."""
    model_config = ConfigDict(extra="forbid")

    dataset: Literal["random", "sharegpt"] = Field("random", description="sharegpt: the prompts of an eval set, each "
                                                     "generating output_len tokens (quantgate.perf.workloads.write_requests)")
    requests_sha256: str | None = Field(None, description="hash of the prompts file")
    backend: str = "openai-chat"
    endpoint_path: str = "/v1/chat/completions"
    num_prompts: int = Field(ge=1)
    input_len: int = Field(ge=1)
    output_len: int = Field(ge=1)
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = Field(True, description="every request generates exactly output_len tokens")
    warmups: int = Field(0, ge=0, description="requests sent before each measured run, not counted")
    tokenizer: str
    tokenizer_sha256: str | None = Field(None, description="hash of the tokenizer's vocabulary files")
    profile: str | None = Field(None, description="workload profile (quant_recipes/workloads.yaml)")
    waves: int = Field(1, ge=1, description="a run at concurrency c sends max(num_prompts, waves x c) requests")
    range_ratio: float = Field(0.0, ge=0, lt=1, description="request lengths uniform within +-ratio of the means")
    slo: SLO | None = None
    warmup_prompts: int = Field(0, ge=0, description="requests of one unmeasured run before the first measured one")
    decide: list[Decide] = Field(default_factory=list, description="the profile's pay-off figures")

    def identity(self) -> dict:
        """Fields that must match for two probes to be comparable (the tokenizer is checked by hash, separately)."""
        return self.model_dump(exclude={"tokenizer", "tokenizer_sha256", "warmups", "warmup_prompts"})

    def prompts_at(self, concurrency: int) -> int:
        return max(self.num_prompts, self.waves * concurrency)


class ProbeSettings(BaseModel):
    """Everything a probe does, resolved from a workload profile, the hardware's budget and the spec's overrides
    (quantgate.perf.workloads.settings), or given directly (`quantgate perf` without --workload)."""
    model_config = ConfigDict(extra="forbid")

    profile: str | None = None
    levels: list[int] = Field(min_length=1)
    sweep: bool = False
    saturation_gain: float = Field(1.1, ge=1)
    slo: SLO | None = None
    decide: list[Decide] = Field(default_factory=list)
    repeats: int = Field(3, ge=1)
    num_prompts: int = Field(64, ge=1)
    waves: int = Field(1, ge=1)
    input_len: int = Field(128, ge=1)
    output_len: int = Field(32, ge=1)
    range_ratio: float = Field(0.0, ge=0, lt=1)
    seed: int = 0
    warmups: int = Field(0, ge=0, description="unmeasured requests before each run (vLLM's --num-warmups)")
    warmup_prompts: int = Field(0, ge=0, description="one unmeasured run of this many requests first")
    budget_s: float | None = Field(None, gt=0, description="no run starts after this many seconds")
    requests: str | None = Field(None, description="prompts file (ShareGPT JSON) to send instead of random prompts")

    @field_validator("levels")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(c < 1 for c in v):
            raise ValueError(f"concurrency levels must be positive integers, got {v}")
        return sorted(set(v))


class Figures(BaseModel):
    """Throughput and latency of one run or of the median over runs (None: not measured, never 0)."""
    model_config = ConfigDict(extra="forbid")

    output_tok_s: float | None = None
    requests_s: float | None = None
    goodput_rps: float | None = Field(None, description="completed requests/s that met the SLO")
    slo_attainment: float | None = Field(None, description="share of the requests sent that met the SLO")
    ttft_p50_ms: float | None = None
    ttft_p95_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p95_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p95_ms: float | None = None
    e2el_p50_ms: float | None = None


class RunResult(Figures):
    repeat: int
    concurrency: int
    num_prompts: int
    completed: int
    failed: int
    error_rate: float
    duration_s: float | None = None
    output_tokens: int | None = None
    errors: list[str] = Field(default_factory=list, description="distinct error messages, first few")


class LevelMedian(Figures):
    concurrency: int
    repeats: int
    error_rate: float


class EngineMemory(BaseModel):
    """What the engine said about memory in its log. None where this engine/device does not log it."""
    model_config = ConfigDict(extra="forbid")

    device: str | None = None
    weights_gib: float | None = Field(None, description="'Model loading took X GiB memory' (GPU runners), summed over workers")
    checkpoint_gib: float | None = Field(None, description="'Checkpoint size: X GiB' as the loader read it")
    kv_cache_gib: float | None = Field(None, description="KV cache memory, summed over workers")
    kv_cache_tokens: int | None = Field(None, description="'<DEV> KV cache size: N tokens', summed over engines")
    kv_max_concurrency: float | None = Field(None, description="requests of max_model_len tokens the KV cache holds")
    max_model_len: int | None = None
    log: str | None = None
    lines: list[str] = Field(default_factory=list, description="the log lines these numbers came from")


class PlannerKV(BaseModel):
    model_config = ConfigDict(extra="forbid")

    plan: str
    kv_tokens_per_replica: int
    kv_pool_gib_per_replica: float
    concurrency_per_replica: float
    context: int
    weight_gib_per_device: float


class Skipped(BaseModel):
    model_config = ConfigDict(extra="forbid")

    repeat: int
    concurrency: int
    reason: str


class SweepRecord(BaseModel):
    """How the probe spent its budget: the levels planned and measured, the runs left out and why, its cost."""
    model_config = ConfigDict(extra="forbid")

    levels: list[int] = Field(description="concurrency levels planned")
    measured: list[int] = Field(default_factory=list, description="levels with at least one measured run")
    stopped: str | None = Field(None, description="why the sweep stopped below its last planned level")
    skipped: list[Skipped] = Field(default_factory=list)
    budget_s: float | None = Field(None, description="time budget of the probe (per hardware, workloads.yaml)")
    warmup_s: float | None = None
    over_budget: bool = False


class LevelEngine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kv_usage_max: float | None = None
    running_max: float | None = None
    waiting_max: float | None = None


class EngineMetrics(BaseModel):
    """vLLM's Prometheus /metrics sampled during the probe (quantgate.perf.metrics); None: not exported."""
    model_config = ConfigDict(extra="forbid")

    samples: int = 0
    kv_usage_max: float | None = Field(None, description="highest KV cache usage seen, 0..1")
    kv_usage_mean: float | None = None
    preemptions: float | None = Field(None, description="requests preempted during the probe")
    prefix_cache_queries: float | None = Field(None, description="tokens looked up in the prefix cache")
    prefix_cache_hits: float | None = None
    prefix_hit_rate: float | None = None
    by_level: dict[int, LevelEngine] = Field(default_factory=dict)
    error: str | None = Field(None, description="why /metrics could not be read")


class PerfResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = VERSION
    client: str
    endpoint: str
    model: str
    workload: Workload
    concurrency: list[int]
    repeats: int
    runs: list[RunResult]
    medians: list[LevelMedian]
    checkpoint: str | None = None
    weights_bytes: int | None = Field(None, description="*.safetensors bytes in the checkpoint folder")
    engine: EngineMemory | None = None
    planner: PlannerKV | None = None
    commands: list[str] = Field(default_factory=list, description="equivalent `vllm bench serve` command lines")
    sweep: SweepRecord | None = None
    engine_metrics: EngineMetrics | None = None
    status: Literal["ok", "error"]
    error: str | None = None
    started: str
    seconds: float


def good_requests(bench: dict, slo: SLO) -> int | None:
    """Requests of a detailed result (--save-detailed) that completed within the SLO: TTFT <= ttft_ms and TPOT =
    (latency - TTFT) / (output tokens - 1) <= tpot_ms (0 for a single output token), as vLLM's --goodput counts them.
    None when the per-request lists are missing."""
    ttfts, lat, outs = bench.get("ttfts"), bench.get("latencies"), bench.get("output_lens")
    if not (isinstance(ttfts, list) and isinstance(lat, list) and isinstance(outs, list)):
        return None
    errors = bench.get("errors") or [""] * len(ttfts)
    good = 0
    for ttft, latency, out, err in zip(ttfts, lat, outs, errors):
        if err or not out or ttft is None or latency is None:
            continue
        tpot = (latency - ttft) / (out - 1) if out > 1 else 0.0
        if (slo.ttft_ms is None or ttft * 1000 <= slo.ttft_ms) and (slo.tpot_ms is None or tpot * 1000 <= slo.tpot_ms):
            good += 1
    return good


def run_from_bench(bench: dict, *, repeat: int, concurrency: int, num_prompts: int, slo: SLO | None = None,
                   max_errors: int = 5) -> RunResult:
    """One `vllm bench serve` result JSON (saved with --save-detailed) -> a run row.

    Failed requests count against the run: its error rate is failed / sent, and the distinct error texts are kept.
    Latency percentiles come from --metric-percentiles 50,95 (keys p50_ttft_ms, p95_itl_ms, ...). With an SLO,
    goodput is the completed requests within it per second of the run, and attainment their share of those sent.
    """
    completed = int(bench.get("completed") or 0)
    failed = int(cast(Any, bench.get("failed")) if bench.get("failed") is not None else max(num_prompts - completed, 0))
    sent = completed + failed or num_prompts
    errors: list[str] = []
    for e in bench.get("errors") or []:
        text = " ".join(str(e).split())[:300]
        if text and text not in errors:
            errors.append(text)
        if len(errors) >= max_errors:
            break
    ok = completed > 0

    def num(key: str) -> float | None:
        v = bench.get(key)
        return float(v) if ok and isinstance(v, (int, float)) else None

    good = good_requests(bench, slo) if slo is not None and ok else None
    duration = num("duration")
    return RunResult(
        repeat=repeat, concurrency=concurrency, num_prompts=num_prompts, completed=completed, failed=failed,
        error_rate=failed / sent, duration_s=bench.get("duration"),
        output_tok_s=num("output_throughput"), requests_s=num("request_throughput"),
        goodput_rps=good / duration if good is not None and duration else None,
        slo_attainment=good / sent if good is not None else None,
        ttft_p50_ms=num("p50_ttft_ms"), ttft_p95_ms=num("p95_ttft_ms"), itl_p50_ms=num("p50_itl_ms"),
        itl_p95_ms=num("p95_itl_ms"), tpot_p50_ms=num("p50_tpot_ms"), tpot_p95_ms=num("p95_tpot_ms"),
        e2el_p50_ms=num("p50_e2el_ms"), output_tokens=bench.get("total_output_tokens") if ok else None, errors=errors,
    )


def failed_run(*, repeat: int, concurrency: int, num_prompts: int, error: str) -> RunResult:
    """A run whose client gave no result at all: every request counts as failed."""
    return RunResult(repeat=repeat, concurrency=concurrency, num_prompts=num_prompts, completed=0, failed=num_prompts,
                     error_rate=1.0, errors=[" ".join(error.split())[:500]])


# --- vLLM server log (wording of vLLM 0.32: v1/worker/*, v1/core/kv_cache_utils.py, model_loader/weight_utils.py)
_PROC = re.compile(r"^\((?P<proc>[^)]*?)\s*pid=(?P<pid>\d+)\)")
_WEIGHTS = re.compile(r"Model loading took (?P<gib>[\d.]+) GiB memory")
_CKPT = re.compile(r"Checkpoint size: (?P<gib>[\d.]+) GiB")
_KV_GPU = re.compile(r"Available KV cache memory: (?P<gib>[\d.]+) GiB")
_KV_CPU = re.compile(r"(?:Explicitly|Auto) set \((?P<gib>[\d.]+)/[\d.]+\) GiB for KV cache")
_KV_TOKENS = re.compile(r"(?P<dev>[A-Z]+(?: \+ host)?) KV cache size: (?P<tokens>[\d,]+) tokens, Maximum concurrency for "
                        r"(?P<len>[\d,]+) tokens per request: (?P<conc>[\d.]+)x")
START_MARK = "$ vllm serve"


def parse_engine_log(text: str, log: str | None = None) -> EngineMemory:
    """Memory figures from a vLLM server log. Only the last start in the file counts (logs are appended to).

    Per-process figures (workers, engine cores) are summed over distinct pids: each TP/PP rank and each DP
    engine holds its own share. A figure the engine did not log stays None.
    """
    lines = text.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith(START_MARK)]
    lines = lines[starts[-1]:] if starts else lines
    per: dict[str, dict[tuple[str, str], float]] = {"weights": {}, "kv": {}, "tokens": {}, "conc": {}}
    mem = EngineMemory(log=log)
    for ln in lines:
        m = _PROC.match(ln)
        who = (m["proc"], m["pid"]) if m else ("", "")
        if w := _WEIGHTS.search(ln):
            per["weights"][who] = float(w["gib"])
        elif c := _CKPT.search(ln):
            mem.checkpoint_gib = mem.checkpoint_gib or float(c["gib"])
        elif k := (_KV_GPU.search(ln) or _KV_CPU.search(ln)):
            per["kv"][who] = float(k["gib"])
        elif t := _KV_TOKENS.search(ln):
            per["tokens"][who] = int(t["tokens"].replace(",", ""))
            per["conc"][who] = float(t["conc"])
            mem.max_model_len = int(t["len"].replace(",", ""))
            mem.device = t["dev"]
        else:
            continue
        mem.lines.append(ln.strip()[:300])
    if per["weights"]:
        mem.weights_gib = round(sum(per["weights"].values()), 4)
    if per["kv"]:
        mem.kv_cache_gib = round(sum(per["kv"].values()), 4)
    if per["tokens"]:
        mem.kv_cache_tokens = sum(int(v) for v in per["tokens"].values())
        mem.kv_max_concurrency = round(sum(per["conc"].values()), 4)
    return mem


class SpeedFigure(BaseModel):
    """One of a workload profile's pay-off figures in a comparison (quantgate.perf.compare.decide_rows)."""
    model_config = ConfigDict(extra="ignore")

    figure: FigureName
    at: Literal["lowest", "highest", "best"]
    concurrency: int | None = None
    lower_is_better: bool
    baseline: float | None = None
    candidate: float | None = None
    ratio: RatioCI


class PerfWindowSummary(BaseModel):
    """pay_off.json `window`: the side-by-side window the ratios come from (quantgate.release.perf_window)."""
    model_config = ConfigDict(extra="ignore")

    rounds: int
    started: str = ""
    ended: str = ""
    seconds: float | None = None
    cores: list[int] = Field(default_factory=list)
    load: dict[str, float | None] = Field(default_factory=dict)
    file: str | None = None


class PayOffFigures(BaseModel):
    """What the gate's pay-off checks read from <run>/<candidate>/pay_off.json (quantgate.perf.compare output)."""
    model_config = ConfigDict(extra="ignore")

    workload: str | None = None
    decide: list[SpeedFigure] = Field(default_factory=list)
    size_ratio: float | None = None
    kv_tokens_ratio: float | None = None
    throughput_ratio: float | None = None
    concurrency: int | None = None
    slo_concurrency: dict[str, int | None] = Field(default_factory=dict)
    repeats: int | None = None
    floor: list[SpeedFigure] = Field(default_factory=list)  # the A/A floor: the baseline against itself, same figures
    window: PerfWindowSummary | None = None  # the side-by-side rounds (None: probes taken apart, unpaired)
    file: str | None = None

    def floor_of(self, figure: SpeedFigure) -> RatioCI | None:
        """The A/A floor's interval for one pay-off figure (read at the same place), None without a window."""
        return next((f.ratio for f in self.floor if f.figure == figure.figure and f.at == figure.at), None)
