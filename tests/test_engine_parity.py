"""Engine parity against real servers: FP32 vLLM matches transformers; BF16 vLLM on this CPU does not."""

from __future__ import annotations

import json

import pytest

from quantgate.parity.engine import reference_run, run_parity


@pytest.mark.slow
def test_parity_passes_on_a_correct_server(demo_model, demo_server, tmp_path):
    srv = demo_server
    report = run_parity(demo_model, srv.base_url, srv.api_key, "demo", tmp_path, dtype="float32")
    assert report.verdict == "pass", report.reason
    saved = json.loads((tmp_path / "parity.json").read_text())
    assert saved["template_mismatch"] == [] and "Paris" in saved["texts"]["capital"]["served"]


@pytest.mark.slow
def test_a_reference_computed_before_the_server_is_checked_against_the_served_prompt(demo_model, demo_server, tmp_path):
    # what a release on a CPU does: the transformers side computed while the server starts, from the chat template
    ref = reference_run(demo_model, "float32")
    srv = demo_server
    assert run_parity(demo_model, srv.base_url, srv.api_key, "demo", tmp_path, dtype="float32", reference=ref).verdict == "pass"
    # a reference decoded from other prompt tokens than the server's is no reference for them: the check fails
    shifted = ref._replace(prompt_ids=[ref.prompt_ids[0][1:], *ref.prompt_ids[1:]])
    report = run_parity(demo_model, srv.base_url, srv.api_key, "demo", tmp_path, dtype="float32", reference=shifted)
    assert report.verdict == "fail" and "template for ['capital']" in report.reason
    assert json.loads((tmp_path / "parity.json").read_text())["template_mismatch"] == ["capital"]


@pytest.mark.slow
def test_parity_fails_on_a_server_whose_outputs_differ(demo_model, odd_demo_server, tmp_path):
    # vLLM 0.32 CPU with BF16 activations gives different text for this model (seen here, eager and compiled);
    # the reference runs in FP32, so the check must call it an engine problem.
    srv = odd_demo_server  # BF16 activations (tests/conftest.py)
    report = run_parity(demo_model, srv.base_url, srv.api_key, "demo", tmp_path, dtype="float32")
    assert report.verdict == "fail"
    assert report.reason.startswith("engine problem") and report.agree_share < 0.9
