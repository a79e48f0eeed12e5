"""What a person sees first, in a real headless Chromium: the demo's early REJECT, a PROMOTE and the dashboard
(written with --out) at 1280x800. The decision and its deciding checks fit the first viewport; every chart has
marks; no two text labels of a chart overlap; the fidelity-by-slice chart has one mark per slice with its limit;
no absolute path is on the page. Screenshots go under pytest's tmp folder (their paths are printed: look at them)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _cdp import Browser, browser  # noqa: F401 (the module's headless Chromium fixture)
from _report_fixtures import CAND, CONTEXT_SLICES, FIDELITY_CATEGORIES, early_reject_run, promote_run
from typer.testing import CliRunner

from quantgate.cli.main import app

REJECT, PROMOTE = "demo-20261201T100000Z", "demo-20261202T100000Z"
VIEWPORT = {"width": 1280, "height": 800, "deviceScaleFactor": 1, "mobile": False}
SLICES = 1 + len(FIDELITY_CATEGORIES) + len(CONTEXT_SLICES)  # pooled, each category, each context length
pytestmark = pytest.mark.slow  # a real browser


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("results")
    early_reject_run(root, REJECT)
    promote_run(root, PROMOTE)
    out = tmp_path_factory.mktemp("dashboard-out")
    res = CliRunner().invoke(app, ["dashboard", "--results", str(root), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert not (root / "dashboard").exists() and not (root / "runs" / REJECT / "report.html").exists()
    return {"results": root, "reject": out / "runs" / REJECT / "report.html",
            "promote": out / "runs" / PROMOTE / "report.html", "dashboard": out / "index.html"}


def look(browser: Browser, page: Path, shots: Path) -> None:
    """Open the page at 1280x800 and save what a person sees first, and the whole page."""
    browser.open(page.as_uri())
    browser.send("Emulation.setDeviceMetricsOverride", VIEWPORT)
    assert browser.problems() == [], page
    first = shots / f"{page.parent.name}-{page.stem}-first.png"
    first.write_bytes(browser.screenshot())
    height = browser.evaluate("document.documentElement.scrollHeight")
    browser.send("Emulation.setDeviceMetricsOverride", {**VIEWPORT, "height": min(height, 8000)})
    full = shots / f"{page.parent.name}-{page.stem}-full.png"
    full.write_bytes(browser.screenshot())
    browser.send("Emulation.setDeviceMetricsOverride", VIEWPORT)
    print(f"screenshots: {first} {full}")


# every chart: its marks and its text labels' boxes, in page coordinates
CHARTS = """Array.from(document.querySelectorAll('figure.chart')).map(f => ({
  id: f.id, svg: f.querySelectorAll('svg').length,
  marks: f.querySelectorAll('svg path, svg use, svg line, svg polyline').length,
  labels: Array.from(f.querySelectorAll('svg text')).filter(t => t.textContent.trim()).map(t => {
    const r = t.getBoundingClientRect(); return [t.textContent.trim(), r.left, r.top, r.right, r.bottom]; })}))"""


def overlaps(labels: list) -> list[tuple[str, str]]:
    """Pairs of labels whose boxes share more than a pixel each way."""
    out = []
    for i, (a, *ra) in enumerate(labels):
        for b, *rb in labels[i + 1:]:
            if min(ra[2], rb[2]) - max(ra[0], rb[0]) > 1 and min(ra[3], rb[3]) - max(ra[1], rb[1]) > 1:
                out.append((a, b))
    return out


def charts_are_drawn_and_readable(browser: Browser) -> list[dict]:
    charts = browser.evaluate(CHARTS)
    assert charts, "no chart on the page"
    for c in charts:
        assert c["svg"] == 1 and c["marks"] > 10 and c["labels"], f"empty chart {c['id']}"
        assert overlaps(c["labels"]) == [], f"overlapping labels in {c['id']}"
    return charts


ABSOLUTE = re.compile(r"(?<![\w.:/])/(?:[\w.+-]+/)+[\w.+-]+")


def no_absolute_path(browser: Browser, site: dict[str, Path]) -> None:
    html = browser.evaluate("document.documentElement.outerHTML")
    assert str(site["results"]) not in html and "/tmp/" not in html
    assert ABSOLUTE.findall(re.sub(r'(xmlns(:\w+)?|href|src)="[^"]*"', "", html)) == []


def first_screen(browser: Browser) -> dict:
    return browser.evaluate("""(() => {
      const rows = Array.from(document.querySelectorAll('#lead ul.deciding li:not(.muted)'));
      return {decision: document.getElementById('decision').innerText,
              bottom: Math.max(...rows.map(r => r.getBoundingClientRect().bottom),
                               document.getElementById('decision').getBoundingClientRect().bottom),
              rows: rows.map(r => r.innerText), height: window.innerHeight,
              lead: document.getElementById('lead').innerText,
              gapsFirst: !!document.querySelector('#gaps') &&
                document.querySelector('#gaps').getBoundingClientRect().top < document.getElementById('lead').getBoundingClientRect().top};
    })()""")


def slice_marks(browser: Browser, measure: str) -> tuple[list[str], list[str]]:
    fig = f"document.getElementById('fidelity-{CAND}')"
    ids = lambda kind: browser.evaluate(  # noqa: E731
        f"Array.from({fig}.querySelectorAll('[id*=\"-{kind}-{measure}-\"]')).map(e => e.id.split('-').pop())")
    return ids("slice"), ids("limit")


def test_the_early_reject_leads_with_its_decision(browser, site, tmp_path):
    look(browser, site["reject"], tmp_path)
    seen = first_screen(browser)
    assert seen["decision"] == "REJECT" and not seen["gapsFirst"]
    assert seen["rows"] and seen["bottom"] <= seen["height"], seen
    assert seen["rows"][0].startswith("fidelity:kl FAIL") and "95% upper bound" in seen["rows"][0] and "limit" in seen["rows"][0]
    assert "What would change it" in seen["lead"] and "recall grid, perf probe: skipped: decided early by fidelity" in seen["lead"]
    text = browser.evaluate("document.body.innerText")
    assert "missing evidence" not in text and "Gaps in the evidence" not in text and "intervals at" not in text
    assert text.count("decided early: REJECT by fidelity") == 0  # the early decision's text is not repeated
    early = browser.evaluate("Array.from(document.querySelectorAll('tr.early')).map(r => [r.cells[0].innerText, "
                             "getComputedStyle(r.cells[8]).color])")
    assert {n for n, _ in early} >= {"recall:recall", "pay_off:speed"} and {c for _, c in early} == {"rgb(123, 133, 145)"}
    charts = charts_are_drawn_and_readable(browser)
    assert "speed vs size" not in str(charts)  # no perf probe: no speed panel
    for measure in ("kl", "top1"):
        marks, limits = slice_marks(browser, measure)
        assert len(marks) == SLICES and sorted(limits) == sorted(marks), (measure, marks, limits)
    failing = browser.evaluate(f"Array.from(document.querySelectorAll('#fidelity-{CAND} svg text'))"
                               ".filter(t => (t.getAttribute('style') || '').includes('#b22222')).length")
    assert failing > 0  # the failing slices' labels are marked
    no_absolute_path(browser, site)


def test_the_promote_leads_with_its_decision(browser, site, tmp_path):
    look(browser, site["promote"], tmp_path)
    seen = first_screen(browser)
    assert seen["decision"] == "PROMOTE" and seen["rows"] and seen["bottom"] <= seen["height"], seen
    assert "Every required check passed" in seen["lead"] and all("pass" in r for r in seen["rows"])
    assert "Gaps in the evidence" not in browser.evaluate("document.body.innerText")
    charts = charts_are_drawn_and_readable(browser)
    assert {"trade-off", f"fidelity-{CAND}"} <= {c["id"] for c in charts}
    assert {"quality vs size", "speed vs size"} <= {t for c in charts for t, *_ in c["labels"]}
    text = browser.evaluate("document.body.innerText")  # speed: its interval, the A/A floor, where it was measured
    assert "1.85x [1.67, 2.06]" in text and "0.93x-1.05x" in text, text[-3000:]
    assert "Side by side in one window: 3 rounds of baseline, candidates, baseline again" in text
    for measure in ("kl", "top1"):
        marks, limits = slice_marks(browser, measure)
        assert len(marks) == SLICES and sorted(limits) == sorted(marks)
    no_absolute_path(browser, site)


def test_the_dashboard_trends_fidelity(browser, site, tmp_path):
    look(browser, site["dashboard"], tmp_path)
    charts = charts_are_drawn_and_readable(browser)
    labels = [t for c in charts for t, *_ in c["labels"]]
    assert "12-01 10:00" in labels and "12-02 10:00" in labels  # runs by when they started, not cut ids
    assert browser.evaluate("document.querySelectorAll('figure.fidelity-trend svg').length") == 1
    assert browser.evaluate("Array.from(document.querySelectorAll('#runs a')).map(a => a.getAttribute('href'))") == \
        [f"runs/{PROMOTE}/report.html", f"runs/{REJECT}/report.html"]
    no_absolute_path(browser, site)
