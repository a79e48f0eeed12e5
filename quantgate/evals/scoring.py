"""Score an eval run: per-sample metric values from quantgate's `evaluate` modules, each loaded once.

`import evaluate` imports transformers' pipelines (and torch) for its model-pipeline Evaluator classes, which
quantgate never uses; `import_evaluate` keeps those pipelines out of that import (see there).
The lock makes `load_metric` safe to call from a background thread while the client runs.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from quantgate.evals.metrics import TABLE, load_table

_LOADED: dict[tuple[str, str], Any] = {}
_LOCK = threading.Lock()


def import_evaluate():
    """Import `evaluate` with the `datasets` progress bars off, without importing `transformers.pipelines`.

    evaluate's Evaluator classes (unused here) import transformers' pipelines and with them torch: 6-8 s of CPU
    here, taken from a CPU-bound local server while the client runs (bench/eval_overhead.py). While evaluate
    imports, a None entry in sys.modules makes `transformers.pipelines` unimportable, so those classes see
    transformers as missing (evaluate's own ImportError fallback); the entry goes right after. Nothing is stubbed:
    transformers, AutoTokenizer and the pipelines import as usual afterwards (tests/test_metrics.py checks that).
    """
    if "evaluate" not in sys.modules and "transformers.pipelines" not in sys.modules:
        sys.modules["transformers.pipelines"] = None
        try:
            import evaluate
        finally:
            if "transformers.pipelines" in sys.modules and sys.modules["transformers.pipelines"] is None:
                del sys.modules["transformers.pipelines"]
    import evaluate
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    return evaluate


def load_metric(name: str, table: Path | str = TABLE):
    """The loaded `evaluate` module for a metric of the table (cached for the process)."""
    key = (str(table), name)
    with _LOCK:
        if key not in _LOADED:
            spec = load_table(table)[name]
            evaluate = import_evaluate()
            _LOADED[key] = evaluate.load(str(spec.path(Path(table))), keep_in_memory=True)
        return _LOADED[key]


def score_samples(samples: Iterable[Any], outputs: Mapping[str, str], table: Path | str = TABLE) -> list[dict]:
    """Per-sample scores: [{id, category, scores: {metric: value}, references}] for every sample that has an output.

    `samples` carry id, category, references and metrics (quantgate.evals.dataset.Sample); `outputs` maps id -> text.
    Each metric is computed in ONE call over all samples that name it.
    """
    samples = [s for s in samples if s.id in outputs]
    by_metric: dict[str, list[Any]] = {}
    for s in samples:
        for m in s.metrics:
            by_metric.setdefault(m, []).append(s)
    values: dict[str, dict[str, float]] = {s.id: {} for s in samples}
    for metric, group in by_metric.items():
        result = load_metric(metric, table).compute(
            predictions=[outputs[s.id] for s in group], references=[list(s.references) for s in group]
        )
        for s, v in zip(group, result["scores"]):
            values[s.id][metric] = v
    return [{"id": s.id, "category": s.category, "scores": values[s.id], "references": list(s.references)}
            for s in samples]
