"""Run records: per-step wall times are appended in order, failed steps included."""

from __future__ import annotations

import time

import pytest

from quantgate.release.runrecord import timed, timings


def test_timed_appends_each_step_in_order_and_records_failures(tmp_path):
    with timed(tmp_path, "model"):
        time.sleep(0.2)
    with pytest.raises(ValueError):
        with timed(tmp_path, "quantize w4a16-gptq"):
            raise ValueError("boom")
    rows = timings(tmp_path)
    assert [(r["step"], r["status"]) for r in rows] == [("model", "ok"), ("quantize w4a16-gptq", "failed")]
    assert rows[0]["seconds"] >= 0.2


def test_no_or_broken_timings_file_reads_as_empty(tmp_path):
    assert timings(tmp_path) == []
    (tmp_path / "timings.json").write_text("{not json")
    assert timings(tmp_path) == []
