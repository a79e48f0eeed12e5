"""One size-ratio precedence for the gate and the report (quantgate.gate.sizeratio): they cannot show different
figures for one candidate, whichever files a run folder holds."""

from __future__ import annotations

import json

import pytest

from _gate_fixtures import make_run
from quantgate.base.stats import num
from quantgate.gate.evidence import collect
from quantgate.gate.sizeratio import size_ratio
from quantgate.report.runview import load_run
from quantgate.report.runview import size_ratio as report_size_ratio


@pytest.mark.parametrize("x, want", [(3, 3.0), (0.5, 0.5), (True, None), ("0.5", None), (None, None),
                                     (float("nan"), None), ([1], None)])
def test_num_takes_only_real_numbers(x, want):
    assert num(x) == want


def test_measured_sizes_come_first_then_a_stated_ratio_then_the_compression_ratio():
    assert size_ratio(400, 1000, 0.9, 4.0) == (0.4, "sizes")
    assert size_ratio(None, 1000, 0.9, 4.0) == (0.9, "stated")
    assert size_ratio(0, 1000, "0.9", 4.0) == (0.25, "compression")  # a string is no figure
    assert size_ratio(None, None, None, 0) is None


def _summary(run, ratio):
    (run / "summary.json").write_text(json.dumps({"candidates": {"w4a16-gptq": {"size_ratio": ratio}}}))


@pytest.mark.parametrize("sizes, stated, want", [((1000, 400), 0.7, 0.4),      # both sizes beat summary.json
                                                  ((1000, None), 0.7, 0.7),    # no candidate size: summary.json
                                                  ((None, None), None, None)])  # nothing usable: a gap, both sides
def test_the_gate_and_the_report_show_the_same_size_ratio(tmp_path, sizes, stated, want):
    run = make_run(tmp_path, base_size=sizes[0], cand_size=sizes[1])
    if stated is not None:
        _summary(run, stated)
    gate = collect(run, "w4a16-gptq").size_ratio
    report = report_size_ratio(load_run(run), "w4a16-gptq")
    assert (gate.value if gate else None) == pytest.approx(want) if want else gate is None
    assert report == (pytest.approx(want) if want else None)
