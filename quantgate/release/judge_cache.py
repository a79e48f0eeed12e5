"""The judge's verdicts, cached by what they were made from (adapter): an unchanged re-run asks the judge nothing.

A candidate's judge run is fully determined by the judge (spec.judge, its template and sidecar), the gate's margin,
and the two eval folders it compares (themselves keyed by checkpoint, serving arguments, engine and eval set).
A finished run (report.json, no error.json) is copied to results/cache/judge/<key>/; a later release with the
same key copies it into its own run folder instead of serving and asking the judge again.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from quantgate.base.runfiles import JUDGE_REPORT
from quantgate.base.paths import results_dir
from quantgate.release.cachelayout import eval_sets_by_name
from quantgate.release.judge_step import ERROR, margin
from quantgate.spec.schema import ReleaseSpec

Log = Callable[[str], None]


def key(spec: ReleaseSpec, baseline_evals: Path, candidate_evals: Path) -> str:
    j = spec.judge
    assert j is not None
    template = Path(j.template)
    files = [template, template.with_suffix(".yaml")]
    blob = {"judge": j.model_dump(mode="json"), "margin": margin(spec), "baseline": str(baseline_evals),
            "candidate": str(candidate_evals),
            "files": {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files if f.is_file()}}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:20]


def folder(spec: ReleaseSpec, baseline_evals: Path, candidate_evals: Path) -> Path:
    return results_dir() / "cache" / "judge" / key(spec, baseline_evals, candidate_evals)


def finished(path: Path) -> bool:
    return (path / JUDGE_REPORT).is_file() and not (path / ERROR).exists()


def restore(cached: Path, out: Path) -> bool:
    """Copy a finished cached judge run into `out`; False when there is none."""
    if not finished(cached):
        return False
    shutil.copytree(cached, out, dirs_exist_ok=True)
    return True


def store(out: Path, cached: Path) -> None:
    """Keep a finished judge run for later releases (written beside, then renamed: never half a cache entry)."""
    if not finished(out) or finished(cached):
        return
    tmp = cached.with_name(cached.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(out, tmp)
    shutil.rmtree(cached, ignore_errors=True)
    tmp.rename(cached)


def judge(spec: ReleaseSpec, run: Path, baseline: Any, candidates: list, run_judge: Callable[..., dict[str, Path]],
          log: Log = print) -> dict[str, Path]:
    """`run_judge(spec, run, baseline, candidates, log=)` (quantgate.release.steps.judge) on the candidates whose
    verdicts are not cached; the others are copied from the cache. Returns candidate -> report.json."""
    first = next(iter(eval_sets_by_name(spec)))  # the judge's eval set (judge_step)
    caches = {c.variant.name: folder(spec, baseline.evals[first], c.evals[first]) for c in candidates
              if first in c.evals}
    reports = {n: run / n / "judge" / JUDGE_REPORT for n, d in caches.items() if restore(d, run / n / "judge")}
    for name in reports:
        log(f"{name}: judge verdicts from the cache ({caches[name]}): no judge asked")
    todo = [c for c in candidates if c.variant.name not in reports]
    try:
        return reports | (run_judge(spec, run, baseline, todo, log=log) if todo else {})
    finally:
        for c in todo:
            if c.variant.name in caches:
                store(run / c.variant.name / "judge", caches[c.variant.name])
