"""Steps of the release flow (flows/release.py), as plain functions over files.

Run folder (results/runs/<run-id>/):
    run.json                   the spec as loaded, git state, package versions
    <variant>/plan.json        the parallel layout the variant was served with
    <variant>/server.log       vLLM's log (absent when every result came from the cache)
    <variant>/evidence.json    what was measured and where it lives (cache folders)
    compare/<candidate>.json   paired statistics against the baseline
    summary.json               one page of figures per candidate

Variant evidence is cached under results/cache/variants/<key>/, keyed by the checkpoint's content hash, the exact
serving arguments and the engine version: the baseline is served and evaluated once and reused by every release
that shares it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel

from quantgate.models import checkpoint_hash, resolve_model
from quantgate.runrecord import git_state, new_run_id, package_versions, run_dir, write_json
from quantgate.paths import results_dir
from quantgate.spec import ReleaseSpec

__all__ = ["resolve_model"]
Log = Callable[[str], None]


class Variant(BaseModel):
    name: str                      # "baseline" or the scheme id
    path: Path
    scheme: str | None = None
    content_hash: str
    size_bytes: int
    quantization: dict[str, Any] | None = None  # the quantization manifest


class Evidence(BaseModel):
    variant: Variant
    folder: Path                   # <run>/<variant>
    cache: Path                    # results/cache/variants/<key>
    serve_command: list[str]
    parity: dict[str, Any] | None = None
    evals: dict[str, Path] = {}    # eval set name -> run directory of quantgate.evalrun
    served: bool                   # False when every result came from the cache


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and p.suffix == ".safetensors")


def start_run(spec: ReleaseSpec, spec_path: str | Path, run_id: str | None) -> Path:
    run = run_dir(run_id or new_run_id(spec.name))
    write_json(run / "run.json", {"spec_file": str(spec_path), "spec": spec.model_dump(mode="json"), "git": git_state(),
                                  "packages": package_versions()})
    return run


def baseline_variant(model_dir: Path) -> Variant:
    return Variant(name="baseline", path=model_dir, content_hash=checkpoint_hash(model_dir), size_bytes=_size(model_dir))


def quantize_variant(spec: ReleaseSpec, model_dir: Path, scheme: str, run: Path, log: Log = print) -> Variant:
    from quantgate.quantize import QuantizeRequest, quantize

    base_hash = checkpoint_hash(model_dir)[:12]
    out = results_dir() / "checkpoints" / f"{base_hash}-{scheme}"
    req = QuantizeRequest(model=model_dir, scheme=scheme, out=out, hardware=spec.hardware, overwrite=True,
                          overrides=spec.quantization.overrides.get(scheme, {}), calibration=spec.quantization.calibration)
    result = quantize(req, log=log)
    write_json(run / scheme / "quantization.json", {"reused": result.reused, **result.manifest})
    return Variant(name=scheme, path=result.out, scheme=scheme, content_hash=checkpoint_hash(result.out),
                   size_bytes=_size(result.out), quantization=result.manifest)


def _server_config(spec: ReleaseSpec, variant: Variant, folder: Path):
    from quantgate.cli_plan import build_plan
    from quantgate.serving.server import config_from_plan

    plan = build_plan(variant.path, spec.hardware, context=spec.context, concurrency=spec.concurrency,
                      gpus=spec.gpus, nodes=spec.nodes, replicas=spec.serving.replicas)
    write_json(folder / "plan.json", plan.model_dump(mode="json"))
    return config_from_plan(plan, variant.path, variant.name, dtype=spec.serving.dtype, extra_args=spec.serving.extra_args,
                            python=spec.serving.python, startup_timeout_s=spec.serving.startup_timeout_s)


def _cache_key(variant: Variant, config, engine: str) -> str:
    blob = {"model": variant.content_hash, "args": config.args, "env": config.env, "engine": engine}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:20]


def _eval_dir(cache: Path, evalset: Path, limit: int | None) -> Path:
    digest = hashlib.sha256(evalset.read_bytes()).hexdigest()[:12]
    return cache / "evals" / f"{evalset.stem}-{digest}-{limit or 'all'}"


def _complete(eval_dir: Path) -> bool:
    try:
        return json.loads((eval_dir / "manifest.json").read_text()).get("status") == "complete"
    except (OSError, ValueError):
        return False


def serve_and_evaluate(spec: ReleaseSpec, variant: Variant, run: Path, *, parity: bool, log: Log = print) -> Evidence:
    from quantgate.serving.env import serve_python, vllm_version
    from quantgate.serving.server import VLLMServer

    folder = run / variant.name
    config = _server_config(spec, variant, folder)
    engine = vllm_version(serve_python(config.python))
    cache = results_dir() / "cache" / "variants" / _cache_key(variant, config, engine)
    evals = {p.stem: _eval_dir(cache, p, spec.eval.limit) for p in spec.eval_sets}
    parity_file = cache / "parity.json"
    todo = [name for name, d in evals.items() if not _complete(d)]
    need_parity = parity and not parity_file.is_file()
    server = VLLMServer(config, log_path=folder / "server.log")
    if todo or need_parity:
        log(f"{variant.name}: serving with `{' '.join(server.command)}` {config.env}")
        with server as srv:
            if need_parity:
                from quantgate.engine_parity import run_parity

                dtype = _arg(config.args, "--dtype", "float32")
                report = run_parity(variant.path, srv.base_url, srv.api_key, variant.name, cache, dtype=dtype)
                log(f"{variant.name}: engine parity {report.verdict}: {report.reason}")
            for name in todo:
                from quantgate.evalrun import run_eval

                log(f"{variant.name}: eval set {name} ({spec.eval.limit or 'all'} samples)")
                run_eval(next(p for p in spec.eval_sets if p.stem == name), srv.base_url, variant.name, evals[name],
                         concurrency=spec.eval.concurrency, limit=spec.eval.limit, api_key=srv.api_key,
                         model_hash=variant.content_hash, max_error_rate=spec.eval.max_error_rate, progress=False)
    else:
        log(f"{variant.name}: every result is cached in {cache}; not serving")
    parity_report = json.loads(parity_file.read_text()) if parity else None
    if parity_report is not None and parity_report["verdict"] != "pass":
        from quantgate.errors import QuantgateError

        raise QuantgateError(f"engine parity failed for the baseline: {parity_report['reason']}", where=str(parity_file),
                             fix="the serving engine, not quantization, is wrong: change serving.dtype or the engine version")
    ev = Evidence(variant=variant, folder=folder, cache=cache, serve_command=server.command, parity=parity_report,
                  evals=evals, served=bool(todo or need_parity))
    write_json(folder / "evidence.json", ev.model_dump(mode="json"))
    return ev


def _arg(args: list[str], flag: str, default: str) -> str:
    return args[args.index(flag) + 1] if flag in args else default


def compare_variants(baseline: Evidence, candidate: Evidence, run: Path) -> dict[str, Any]:
    from quantgate.evalrun import compare_dirs

    out = {name: compare_dirs(baseline.evals[name], candidate.evals[name]) for name in baseline.evals}
    write_json(run / "compare" / f"{candidate.variant.name}.json", out)
    return out


def _summary_row(base: Evidence, cand: Evidence, comparison: dict[str, Any]) -> dict[str, Any]:
    metrics = {}
    for set_name, report in comparison.items():
        for metric, m in report["metrics"].items():
            o = m["overall"]
            metrics[f"{set_name}/{metric}"] = {k: o.get(k) for k in ("n", "base_mean", "cand_mean", "delta", "ci_low", "ci_high", "mcnemar_p")}
    return {
        "scheme": cand.variant.scheme,
        "size_bytes": cand.variant.size_bytes,
        "size_ratio": round(cand.variant.size_bytes / base.variant.size_bytes, 4),
        "metrics": metrics,
        "regressions": sum(len(r["regressions"]) for r in comparison.values()),
        "agreement": {s: r["agreement"]["overall"] for s, r in comparison.items()},
    }


def finish_run(spec: ReleaseSpec, run: Path, base: Evidence, cands: list[Evidence], comparisons: dict[str, dict]) -> dict[str, Any]:
    summary = {
        "release": spec.name, "run": run.name, "model": spec.model, "hardware": spec.hardware,
        "baseline": {"size_bytes": base.variant.size_bytes, "parity": base.parity and {k: base.parity[k] for k in ("verdict", "reason")}},
        "candidates": {c.variant.name: _summary_row(base, c, comparisons[c.variant.name]) for c in cands},
        "decision": None,
        "decision_note": "no promotion gate yet: this run records evidence only",
    }
    write_json(run / "summary.json", summary)
    return summary


def summary_markdown(summary: dict[str, Any]) -> str:
    lines = [f"# Release `{summary['release']}` — run `{summary['run']}`", "",
             f"Model `{summary['model']}` on `{summary['hardware']}`. Baseline engine parity: "
             f"**{(summary['baseline']['parity'] or {}).get('verdict', 'n/a')}**.", "",
             "| candidate | size vs baseline | metric | baseline | candidate | delta [95% CI] | regressions |",
             "|---|---|---|---|---|---|---|"]
    for name, row in summary["candidates"].items():
        for i, (metric, m) in enumerate(row["metrics"].items()):
            first = i == 0
            size = f"{row['size_ratio']:.2f}x" if first else ""
            lines.append(f"| {name if first else ''} | {size} | {metric} | "
                         f"{m['base_mean']:.3f} | {m['cand_mean']:.3f} | {m['delta']:+.3f} [{m['ci_low']:+.3f}, {m['ci_high']:+.3f}] | "
                         f"{row['regressions'] if first else ''} |")
    lines += ["", f"_{summary['decision_note']}_"]
    return "\n".join(lines) + "\n"
