"""The report and the dashboard in a real headless Chromium (Debian's `chromium`): no console errors or failed
loads, charts render (a screenshot that is not blank), every link resolves, from disk and served on 127.0.0.1."""

from __future__ import annotations

import io
import threading
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from _cdp import Browser, browser  # noqa: F401 (the module's headless Chromium fixture)
from _report_fixtures import CAND, inconclusive_run, release_run
from typer.testing import CliRunner

from quantgate.cli.main import app

RUNS = {"demo-20261101T100000Z": dict(lose={"proper_nouns": 6}, recall_lose=2),
        "demo-20261102T100000Z": {},
        "other-20261103T100000Z": dict(model="other", hardware="x86-avx512")}
BROKEN = "broken-20261104T100000Z"
UNDECIDED = "demo-20261105T100000Z"  # INCONCLUSIVE, with fidelity, gains and a model output full of HTML
pytestmark = pytest.mark.slow  # a real browser; building the five runs alone takes about 8 s


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("results")
    for run_id, kw in RUNS.items():
        release_run(root, run_id, **kw)
    inconclusive_run(root, UNDECIDED)
    broken = release_run(root, BROKEN)
    (broken / "decision.json").unlink()
    (broken / "compare" / f"{CAND}.json").write_text("{truncated")
    res = CliRunner().invoke(app, ["dashboard", "--results", str(root)])
    assert res.exit_code == 0, res.output
    return root


def spread(png: bytes) -> float:
    from PIL import Image, ImageStat

    return ImageStat.Stat(Image.open(io.BytesIO(png)).convert("L")).stddev[0]


LINKS = "Array.from(document.querySelectorAll('a[href]')).map(a => a.href)"
BROKEN_IMAGES = "Array.from(document.images).filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.alt)"


def check_page(browser: Browser, url: str) -> list[str]:
    """Open, assert it renders cleanly; return its links."""
    browser.open(url)
    assert browser.problems() == [], url
    assert browser.evaluate(BROKEN_IMAGES) == [], url
    assert browser.evaluate("document.querySelectorAll('img, figure.chart svg').length") > 0, url
    assert spread(browser.screenshot()) > 15, f"blank screenshot of {url}"
    return browser.evaluate(LINKS)


def test_harness_sees_errors_and_blank_pages(browser, tmp_path):
    """The checks below can fail: a broken page and a blank page are caught."""
    bad = tmp_path / "bad.html"
    bad.write_text('<html><body><img src="missing.png" alt="x"><script>console.error("boom"); undefinedName.x;</script></body></html>')
    browser.open(bad.as_uri())
    found = " ".join(browser.problems())
    assert "boom" in found and "undefinedName" in found and "ERR_FILE_NOT_FOUND" in found
    browser.open("about:blank")
    assert spread(browser.screenshot()) < 1


def _file_of(url: str) -> Path:
    u = urlparse(url)
    assert u.scheme == "file", url
    return Path(unquote(u.path))


def test_dashboard_and_reports_from_disk(browser, results):
    index = results / "dashboard" / "index.html"
    links = check_page(browser, index.as_uri())
    reports = {_file_of(u) for u in links}
    assert reports == {results / "runs" / r / "report.html" for r in [*RUNS, UNDECIDED, BROKEN]}
    for report in sorted(reports):
        for url in check_page(browser, report.as_uri()):
            path = _file_of(url)
            assert path.is_file(), url
            if urlparse(url).fragment:
                assert browser.evaluate(f"!!document.getElementById({urlparse(url).fragment!r})"), url
    browser.open((results / "runs" / BROKEN / "report.html").as_uri())
    text = browser.evaluate("document.getElementById('gaps').innerText")
    assert "decision" in text and "corrupt JSON" in text


def _select(browser: Browser, key: str, value: str) -> int:
    browser.evaluate(f"(() => {{ const s = document.getElementById('filter-{key}'); s.value = {value!r};"
                     " s.dispatchEvent(new Event('change')); })()")
    return browser.evaluate("document.querySelectorAll('#runs tr.f:not([hidden])').length")


def test_dashboard_filters(browser, results):
    browser.open((results / "dashboard" / "index.html").as_uri())
    assert _select(browser, "model", "") == 5
    assert _select(browser, "model", "other") == 1
    assert browser.evaluate("document.querySelectorAll('.trend:not([hidden])').length") == 1
    assert _select(browser, "model", "demo") == 4
    # demo-20261102 (no losses) and the broken run, whose summary.json still records its PROMOTE
    assert _select(browser, "decision", "PROMOTE") == 2
    assert _select(browser, "decision", "REJECT") == 1
    assert _select(browser, "decision", "INCONCLUSIVE") == 1
    assert browser.evaluate("document.querySelector('#runs tr.f:not([hidden]) td:nth-child(3)').innerText") \
        .startswith(UNDECIDED)
    assert _select(browser, "hardware", "x86-avx512") == 0
    assert browser.problems() == []


BADGE_COLOUR = "getComputedStyle(document.querySelector('.badge.{}')).backgroundColor"


def test_inconclusive_badge_colour_and_report(browser, results):
    browser.open((results / "dashboard" / "index.html").as_uri())
    colours = {d: browser.evaluate(BADGE_COLOUR.format(d)) for d in ("PROMOTE", "REJECT", "INCONCLUSIVE")}
    assert len(set(colours.values())) == 3, colours
    check_page(browser, (results / "runs" / UNDECIDED / "report.html").as_uri())  # the HTML output stays text
    assert browser.evaluate(BADGE_COLOUR.format("INCONCLUSIVE")) == colours["INCONCLUSIVE"]
    assert browser.evaluate("document.getElementById('decision').innerText") == "INCONCLUSIVE"
    assert browser.evaluate("document.querySelectorAll('table.flips tr.regression, table.flips tr.gain').length") == 4
    assert "onerror" in browser.evaluate("document.querySelector('table.flips tr.regression').innerText")
    assert browser.evaluate("document.querySelectorAll('table.fidelity tr').length") == 4


def test_served_on_loopback(browser, results):
    import httpx

    from quantgate.report.dashboard import serve

    server = serve(results, 0)
    host, port = server.server_address[:2]
    assert host == "127.0.0.1"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{port}"
        links = check_page(browser, f"{base}/dashboard/index.html")
        assert len(links) == len(RUNS) + 2
        with httpx.Client(timeout=10) as client:
            for report in links:
                assert report.startswith(base + "/runs/"), report
                for url in check_page(browser, report):
                    assert client.get(url).status_code == 200, url
    finally:
        server.shutdown()
        server.server_close()
