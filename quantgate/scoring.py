"""Score an eval run: per-sample metric values from quantgate's `evaluate` modules, each loaded once.

`import evaluate` imports transformers for its model-pipeline Evaluator classes (1-4 s here), which quantgate
never uses; `import_evaluate` keeps that subpackage out (see there).
The lock makes `load_metric` safe to call from a background thread while the client runs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from quantgate.metrics import TABLE, load_table

_LOADED: dict[tuple[str, str], Any] = {}
_LOCK = threading.Lock()


def import_evaluate():
    """Import `evaluate` (slow: it pulls in transformers, 1-4 s here; callers do it in a background thread)
    with the `datasets` progress bars off. Not stubbed: the same process loads tokenizers through transformers."""
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

    `samples` carry id, category, references and metrics (quantgate.evalset.Sample); `outputs` maps id -> text.
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
