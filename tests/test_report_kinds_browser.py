"""A measurement kind added as a module (quantgate/kinds/) as a person sees it, in a real headless Chromium: the
promote fixture run with a perplexity comparison of its candidate (<run>/<candidate>/perplexity.json, the figures of
tests/test_kind_perplexity.py's real FP32-vs-BF16 run) has an "Other measurements" table in the candidate's section,
with the paired count, both sides, the delta with its interval and level, and each side's perplexity, inside the
page's width. The screenshot's path is printed: look at it."""

from __future__ import annotations

import pytest
from _cdp import Browser, browser  # noqa: F401 (the module's headless Chromium fixture)
from _report_fixtures import CAND, promote_run
from typer.testing import CliRunner

from quantgate.cli.main import app
from quantgate.gate.kinds import comparison_file
from quantgate.gate.models import KindComparison, PairedStat

RUN = "demo-20261203T100000Z"
pytestmark = pytest.mark.slow  # a real browser

ROWS = """Array.from(document.querySelectorAll('table.kinds tr')).map(r => Array.from(r.cells).map(c => c.innerText
  .replace(/\\s+/g, ' ').trim()))"""
BOX = "(() => { const r = document.querySelector('table.kinds').getBoundingClientRect(); " \
      "return [r.left, r.top, r.right, r.bottom, document.documentElement.clientWidth]; })()"


def test_a_kinds_comparison_is_a_row_of_the_candidates_measurements(browser: Browser, tmp_path):  # noqa: F811
    run = promote_run(tmp_path / "results", RUN)
    comp = KindComparison(kind="perplexity", unit="passage", quantity="mean NLL per token (nats), lower is better",
                          figures={"baseline_perplexity": 19.845, "candidate_perplexity": 19.853},
                          stat=PairedStat(n=10, base_mean=2.98793, cand_mean=2.98833, delta=0.0004, ci_low=-0.00521, ci_high=0.00598,
                                    higher_is_better=False))
    comparison_file(run, CAND, "perplexity").write_text(comp.model_dump_json())
    res = CliRunner().invoke(app, ["report", str(run)])
    assert res.exit_code == 0, res.output
    browser.open((run / "report.html").as_uri())
    browser.send("Emulation.setDeviceMetricsOverride", {"width": 1280, "height": 800, "deviceScaleFactor": 1,
                                                        "mobile": False})
    assert browser.problems() == []
    head, row = browser.evaluate(ROWS)
    assert head[:2] == ["kind", "paired"] and row[1] == "10 passages", row
    assert row[0] == "perplexity mean NLL per token (nats), lower is better", row  # what the two sides' figures are
    assert row[2] == "2.9879" and row[3] == "2.9883", row
    assert row[4] == "+0.00040 [-0.00521, +0.00598] (95%)", row
    assert row[5] == "baseline perplexity 19.845; candidate perplexity 19.853", row
    left, top, right, bottom, width = browser.evaluate(BOX)
    assert 0 <= left < right <= width and bottom > top, (left, right, width)
    browser.evaluate(f"window.scrollTo(0, {max(0, top - 200)})")
    shot = tmp_path / "kinds-table.png"
    shot.write_bytes(browser.screenshot())
    print(f"screenshot: {shot}")
