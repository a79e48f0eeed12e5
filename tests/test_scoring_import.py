"""quantgate.evals.scoring.import_evaluate: evaluate loads without transformers' pipelines (and torch), and leaves
transformers fully importable afterwards (the release flow scores and tokenizes in one process)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_loading_a_metric_imports_neither_pipelines_nor_torch_and_leaves_no_block():
    out = _run("import sys; from quantgate.evals.scoring import load_metric; load_metric('exact_match');"
               "print('transformers.pipelines' in sys.modules, 'torch' in sys.modules)")
    assert out == "False False"


@pytest.mark.slow
def test_transformers_pipelines_import_after_a_metric_was_loaded():
    out = _run("from quantgate.evals.scoring import load_metric; load_metric('token_f1');"
               "import transformers.pipelines as p; from transformers import AutoTokenizer; print(callable(p.pipeline))")
    assert out == "True"
