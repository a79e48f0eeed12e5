"""The performance probe's record (pure): schema of perf.json, vLLM bench results -> runs, server log -> memory.

perf.json (one per served variant, written by `quantgate perf`):
    workload     what was sent: same for every variant, else perf-compare refuses
    runs         one row per (repeat, concurrency): throughput, TTFT/ITL percentiles, failures
    medians      per concurrency, medians over the repeats (quantgate.perf.compare.level_medians)
    weights_bytes, engine (server log), planner (plan JSON): what the variant costs in memory
    status       "ok", or "error" with `error` saying which level failed and its error rate
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

VERSION = 1


class Workload(BaseModel):
    """Prompts and decoding; vLLM's random dataset with fixed lengths and seed gives the same prompts per tokenizer."""
    model_config = ConfigDict(extra="forbid")

    dataset: Literal["random"] = "random"
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

    def identity(self) -> dict:
        """Fields that must match for two probes to be comparable (the tokenizer is checked by hash, separately)."""
        return self.model_dump(exclude={"tokenizer", "tokenizer_sha256", "warmups"})


class Figures(BaseModel):
    """Throughput and latency of one run or of the median over runs (None: not measured, never 0)."""
    model_config = ConfigDict(extra="forbid")

    output_tok_s: float | None = None
    requests_s: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p95_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p95_ms: float | None = None
    tpot_p50_ms: float | None = None
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
    status: Literal["ok", "error"]
    error: str | None = None
    started: str
    seconds: float


def run_from_bench(bench: dict, *, repeat: int, concurrency: int, num_prompts: int, max_errors: int = 5) -> RunResult:
    """One `vllm bench serve` result JSON (saved with --save-detailed) -> a run row.

    Failed requests count against the run: its error rate is failed / sent, and the distinct error texts are kept.
    Latency percentiles come from --metric-percentiles 50,95 (keys p50_ttft_ms, p95_itl_ms, ...).
    """
    completed = int(bench.get("completed") or 0)
    failed = int(bench.get("failed") if bench.get("failed") is not None else max(num_prompts - completed, 0))
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

    return RunResult(
        repeat=repeat, concurrency=concurrency, num_prompts=num_prompts, completed=completed, failed=failed,
        error_rate=failed / sent, duration_s=bench.get("duration"),
        output_tok_s=num("output_throughput"), requests_s=num("request_throughput"),
        ttft_p50_ms=num("p50_ttft_ms"), ttft_p95_ms=num("p95_ttft_ms"), itl_p50_ms=num("p50_itl_ms"),
        itl_p95_ms=num("p95_itl_ms"), tpot_p50_ms=num("p50_tpot_ms"), e2el_p50_ms=num("p50_e2el_ms"),
        output_tokens=bench.get("total_output_tokens") if ok else None, errors=errors,
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
