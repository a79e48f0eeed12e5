"""A run that ends without a decision explains itself (<run>/status.json): failed with the step and the root cause
(the first error in the failing child's or server's log, not vLLM's "see root cause above"), or interrupted; the
report, the dashboard and `quantgate show` say so instead of UNKNOWN. Real releases that fail or are stopped write
it too: tests/test_faults_release.py checks the SIGTERMed one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _gate_fixtures import make_run
from typer.testing import CliRunner

from quantgate.base.errors import QuantgateError
from quantgate.base.runstatus import load_status, root_cause_in_log, root_cause_in_text
from quantgate.cli.main import app
from quantgate.report.dashboard import build
from quantgate.release.runrecord import recording_status, timed

VLLM_LOG = """\
(APIServer pid=11) INFO 12-03 09:51:22 [api_server.py:1] vLLM API server version 0.32.0
(EngineCore pid=12) ERROR 12-03 09:51:30 [core.py:700] EngineCore failed to start.
(EngineCore pid=12) ERROR 12-03 09:51:30 [core.py:700] Traceback (most recent call last):
(EngineCore pid=12) ERROR 12-03 09:51:30 [core.py:700]   File "/x/safetensors/torch.py", line 1, in load_file
safetensors_rust.SafetensorError: Error while deserializing header: incomplete metadata, file not fully covered
Traceback (most recent call last):
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_the_root_cause_is_the_first_error_not_the_pointer_to_it(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(VLLM_LOG)
    assert root_cause_in_log(log) == ("SafetensorError: Error while deserializing header: incomplete metadata, file "
                                      "not fully covered")
    assert root_cause_in_text("all fine\nINFO done") is None and root_cause_in_log(tmp_path / "none.log") is None


class _ServerDied(QuantgateError):
    def __init__(self, log: Path) -> None:
        super().__init__("the vLLM server of the baseline could not start")
        self.log_path = log


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "results" / "runs" / "r-failed"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"spec": {"name": "demo", "model": "demo", "schemes": ["int8-w8a8"]}}))
    return run


def test_a_failed_release_records_the_step_the_cause_and_the_log(tmp_path):
    run = _run(tmp_path)
    log = run / "baseline" / "server.log"
    log.parent.mkdir()
    log.write_text(VLLM_LOG)
    with pytest.raises(_ServerDied), recording_status(run):
        with timed(run, "model"):
            pass
        with timed(run, "serve and measure baseline"):
            raise _ServerDied(log)
    st = load_status(run)
    assert st is not None and st.status == "failed" and st.step == "serve and measure baseline"
    assert st.root_cause.startswith("SafetensorError: Error while deserializing header") and st.log == str(log)
    assert "could not start" in st.error


def test_a_cause_inside_the_error_text_and_interrupts_and_completion(tmp_path):
    run = _run(tmp_path)
    with pytest.raises(QuantgateError), recording_status(run):
        raise QuantgateError("quantization child failed: exit code 1\n--- last lines of the log ---\n"
                             "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert load_status(run).root_cause == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    with pytest.raises(KeyboardInterrupt), recording_status(run):
        with timed(run, "quantize int8-w8a8"):  # the step it cut short is named, the bare interrupt without ": "
            raise KeyboardInterrupt
    st = load_status(run)
    assert (st.status, st.step, st.error) == ("interrupted", "quantize int8-w8a8", "KeyboardInterrupt")
    with recording_status(run) as done:
        done["decision"] = "REJECT"
    assert (load_status(run).status, load_status(run).decision) == ("completed", "REJECT")


def test_the_report_dashboard_and_show_say_failed_with_the_cause(tmp_path):
    results = tmp_path / "results"
    failed = _run(tmp_path)
    log = failed / "server.log"
    log.write_text(VLLM_LOG)
    with pytest.raises(_ServerDied), recording_status(failed):
        with timed(failed, "serve and measure baseline"):
            raise _ServerDied(log)
    gated = make_run(tmp_path / "ok", "int8-w8a8")  # a run with a decision beside it: unaffected
    shutil.copytree(gated, results / "runs" / "r-ok")
    index = build(results, log=lambda _: None)
    html = (failed / "report.html").read_text()
    assert 'id="decision">FAILED<' in html and "SafetensorError" in html and "serve and measure baseline" in html
    assert "summary.json" not in html and "decision.json" not in html  # not expected of a failed run
    assert "no candidate found" not in html and "int8-w8a8" in html  # the spec's candidate, though never measured
    md = (failed / "report.md").read_text()
    assert "**FAILED**" in md and "SafetensorError" in md
    dash = index.read_text()
    assert 'data-decision="FAILED"' in dash
    # the dashboard says how it ended, beside the badge; the run that measured nothing has no trend block
    assert "failed in step serve and measure baseline: SafetensorError: Error while deserializing header" in dash
    assert "on ? (" not in dash and dash.count("Trends across releases") == 1
    assert "<summary>Not written before the run ended (" in html and "Gaps in the evidence" not in html
    res = CliRunner().invoke(app, ["show", "r-failed", "--results", str(results)])
    assert res.exit_code == 0 and "FAILED" in res.output and "failed in step serve and measure baseline" in res.output
    assert "SafetensorError" in res.output
