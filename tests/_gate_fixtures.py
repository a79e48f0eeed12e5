"""A release run folder made of real pipeline outputs over synthetic scores (no server, no model).

The comparison is computed by quantgate.evals.compare.compare_runs and the recall delta by quantgate.recall.score.compare,
so the files have exactly the shapes the release flow writes.
"""

from __future__ import annotations

import json
from pathlib import Path

from quantgate.evals.compare import compare_runs, summarize
from quantgate.evals.metrics import load_table
from quantgate.fidelity.core import SampleFidelity
from quantgate.fidelity.core import summarize as summarize_fidelity
from quantgate.recall import score as recall_score

# category -> metrics, as in eval_sets/default.jsonl
CATEGORY_METRICS = {
    "factual_qa": ["exact_match"],
    "arithmetic_numbers": ["numeric_match"],
    "proper_nouns": ["exact_match"],
    "multilingual": ["chrf"],
    "instruction_format": ["choice_accuracy"],
    "summarization": ["rouge_l"],
}


def _dump(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return path


def records(per_category: int = 50, lose: dict[str, int] | None = None) -> tuple[list[dict], list[dict]]:
    """Baseline and candidate per-sample records. The baseline gets 4 of 5 right; the candidate the same, except
    that it loses `lose[category]` samples the baseline had right."""
    base, cand = [], []
    for cat, metrics in CATEGORY_METRICS.items():
        lost = 0
        for i in range(per_category):
            sid = f"{cat}-{i:03d}"
            good = i % 5 != 0
            b = {m: (0.8 if m in ("chrf", "rouge_l") else 1.0) if good else 0.0 for m in metrics}
            c = dict(b)
            if good and lost < (lose or {}).get(cat, 0):
                c = {m: 0.0 for m in metrics}
                lost += 1
            base.append({"id": sid, "category": cat, "output": f"b{i}", "scores": b})
            cand.append({"id": sid, "category": cat, "output": f"b{i}" if c == b else f"c{i}", "scores": c})
    return base, cand


def eval_dir(path: Path, recs: list[dict], *, failed: int = 0) -> Path:
    n = len(recs) + failed
    metrics = sorted({m for r in recs for m in r["scores"]})
    _dump(path / "manifest.json", {"status": "complete", "n_samples": n})
    _dump(path / "summary.json", {"n_samples": n, "n_answered": len(recs), "n_failed": failed,
                                  "error_rate": failed / n, "metrics": summarize(recs, metrics)})
    return path


def recall_dirs(root: Path, cand_name: str, n: int = 40, lose: int = 0, errors: int = 0) -> Path:
    """Baseline and candidate recall folders (requests.jsonl) and the candidate's delta.json."""
    def rec(i: int, ok: bool, err: bool) -> dict:
        return {"id": f"r{i:03d}", "length": 1024, "depth": (i % 5) * 25, "kind": "single", "lang": "en",
                "error": "timeout" if err else None, "recall": None if err else float(ok),
                "exact": None if err else ok}
    base = [rec(i, True, False) for i in range(n)]
    cand = [rec(i, i >= lose, i >= n - errors) for i in range(n)]
    bdir, cdir = root / "baseline" / "recall", root / cand_name / "recall"
    for d, rs in ((bdir, base), (cdir, cand)):
        d.mkdir(parents=True, exist_ok=True)
        (d / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs), encoding="utf-8")
    delta = recall_score.compare(base, cand)
    delta["baseline"] = str(bdir)
    _dump(cdir / "delta.json", delta)
    return cdir


def judge_report(path: Path, *, reliable: bool = True, net: float = 0.0, lower: float = -0.03, n: int = 300,
                 not_stronger: str | None = None) -> Path:
    return _dump(path, {
        "schema": 1, "counts_as_evidence": reliable, "judge_not_stronger": not_stronger,
        "calibration": {"reliable": reliable, "accuracy": 0.9 if reliable else 0.4, "bar": 0.8,
                        "reason": None if reliable else "accuracy 40.0% is below the bar of 80%"},
        "comparison": {"overall": {"non_inferiority": {"n": n, "net": net, "lower_bound": lower, "margin": 0.05,
                                                       "p_value": 0.01, "alpha": 0.05, "non_inferior": lower > -0.05}}},
    })


def fidelity_file(path: Path, kl: float, top1: float = 0.97, n: int = 80, tokens: int = 60) -> Path:
    """Per-sample fidelity as the release's fidelity step writes it (a spread of KL over samples)."""
    samples = [SampleFidelity(id=f"s{i:03d}", category=list(CATEGORY_METRICS)[i % 6], n_tokens=tokens,
                              kl_sum=kl * tokens * (0.5 + (i % 5) / 4), top1_agree=round(top1 * tokens),
                              dnll_sum=kl * tokens, kl_max=kl * 3) for i in range(n)]
    return _dump(path, {"summary": summarize_fidelity(samples).model_dump(mode="json"),
                        "samples": [s.model_dump(mode="json") for s in samples]})


def pay_off_doc(speedup: float, workload: str = "latency", spread: float = 1.05) -> dict:
    """pay_off.json as quantgate.perf.compare writes it: the latency profile's figures, each `speedup` times as fast
    as the baseline, with a 90% interval of x/÷ `spread` over 3 + 3 runs."""
    def row(figure: str, lower: bool) -> dict:
        r = 1 / speedup if lower else speedup
        return {"figure": figure, "at": "lowest", "concurrency": 1, "lower_is_better": lower, "baseline": 10.0,
                "candidate": 10.0 * r, "ratio": {"value": r, "low": r / spread, "high": r * spread, "level": 0.9,
                                                 "method": "welch-log", "n_base": 3, "n_cand": 3, "df": 4.0}}
    return {"workload": workload, "throughput_ratio": speedup, "concurrency": 1, "repeats": 3,
            "decide": [row("tpot_p50_ms", True), row("ttft_p50_ms", True)], "source": "perf probe"}


def make_run(root: Path, cand_name: str = "w4a16-gptq", *, lose: dict[str, int] | None = None, parity: str = "pass",
             failed: int = 0, recall_lose: int = 0, judge: dict | None = None, throughput_ratio: float | None = 1.4,
             base_size: int = 1000, cand_size: int = 400, kl: float | None = 0.003) -> Path:
    """A complete run folder for one candidate; the defaults give a candidate the default policy promotes."""
    run = root / "run"
    base, cand = records(lose=lose)
    bdir, cdir = eval_dir(root / "cache" / "base" / "default", base), eval_dir(root / "cache" / "cand" / "default", cand,
                                                                                failed=failed)
    _dump(run / "run.json", {"spec": {"name": "t", "schemes": [cand_name]}})
    _dump(run / "baseline" / "evidence.json", {
        "variant": {"name": "baseline", "scheme": None, "size_bytes": base_size, "path": str(root / "ckpt-base")},
        "evals": {"default": str(bdir)}, "parity": {"verdict": parity, "reason": f"parity {parity}"}})
    _dump(run / cand_name / "evidence.json", {
        "variant": {"name": cand_name, "scheme": cand_name, "size_bytes": cand_size, "path": str(root / "ckpt")},
        "evals": {"default": str(cdir)}, "parity": None})
    table = load_table()
    cmp_ = compare_runs(base, cand, {m: table[m] for m in sorted({m for r in base for m in r["scores"]})}, n_boot=500)
    _dump(run / "compare" / f"{cand_name}.json", {"default": cmp_})
    recall_dirs(run, cand_name, lose=recall_lose)
    judge_report(run / cand_name / "judge" / "report.json", **(judge or {}))
    if throughput_ratio is not None:
        _dump(run / cand_name / "pay_off.json", pay_off_doc(throughput_ratio))
    if kl is not None:
        fidelity_file(run / "fidelity" / f"{cand_name}.json", kl)
        fidelity_file(run / "fidelity" / "floor.json", 0.0002, top1=0.998)
    return run


def checkpoint(path: Path, content: bytes = b"weights") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.safetensors").write_bytes(content)
    (path / "config.json").write_text("{}")
    return path
