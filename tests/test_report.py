"""Release report (quantgate.report.page): content from the evidence, self-contained HTML, gaps instead of crashes."""

from __future__ import annotations

import json
import re
import shutil
from html import unescape
from pathlib import Path

import pytest
from _report_fixtures import CAND, release_run
from typer.testing import CliRunner

from quantgate.cli.main import app
from quantgate.report.page import markdown_summary, write_report

RUN_ID = "demo-20261101T100000Z"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return release_run(tmp_path_factory.mktemp("results"), RUN_ID, lose={"proper_nouns": 6}, recall_lose=2)


@pytest.fixture
def run(pristine, tmp_path) -> Path:
    """A private copy (tests damage it); the cache folders it points at stay shared and untouched."""
    dst = tmp_path / "results" / "runs" / RUN_ID
    shutil.copytree(pristine, dst)
    return dst


def hrefs(html: str) -> list[str]:
    return [unescape(h) for h in re.findall(r'(?:href|src)="([^"]*)"', html)]


def test_report_shows_the_evidence(run):
    html_path, md_path = write_report(run)
    html = html_path.read_text()
    decision = json.loads((run / "decision.json").read_text())
    cmp_ = json.loads((run / "compare" / f"{CAND}.json").read_text())["default"]
    assert 'id="decision">REJECT<' in html
    for check in decision["candidates"][CAND]["checks"]:
        assert unescape(html).count(check["reason"]) >= 1, check["name"]
    pn = cmp_["metrics"]["exact_match"]["by_category"]["proper_nouns"]
    assert f"[{pn['ci_low']:+.3f}, {pn['ci_high']:+.3f}]" in html
    assert len(cmp_["regressions"]) == 6
    for r in cmp_["regressions"]:  # both outputs of every regression
        assert f"<pre>{r['base_output']}</pre>" in html and f"<pre>{r['cand_output']}</pre>" in html
    assert "Calibration accuracy 90.0%" in html and "number_swap" in html
    assert "48 of 50 exported pairs reviewed" in html
    assert html.count("data:image/png;base64,") >= 4  # trade-off, forest, two recall heatmaps
    assert 'id="gaps"' not in html and "85.2 s wall" in html  # complete evidence: no gap section
    md = md_path.read_text()
    assert md.startswith("# Release `demo`: **REJECT**") and "| default/exact_match | 100 |" in md
    assert "category:default/proper_nouns/exact_match" in md and "report.html" in md


def test_report_is_self_contained_and_links_resolve(run):
    html_path, _ = write_report(run)
    html = html_path.read_text()
    assert not re.search(r"(src|href)=\"(https?:)?//", html) and "<script src" not in html and "@import" not in html
    refs = hrefs(html)
    local = [h for h in refs if not h.startswith(("data:", "#"))]
    assert local, "the report links its evidence files"
    for h in local:
        assert (html_path.parent / h).is_file(), h
    for h in (h for h in refs if h.startswith("#")):
        assert f'id="{h[1:]}"' in html, h


DAMAGE = [
    ("decision.json", "missing", "decision", "missing file"),
    ("decision.json", "garbage", "decision", "corrupt JSON"),
    ("summary.json", "garbage", "summary", "corrupt JSON"),
    ("run.json", "list", "run record", "expected a JSON dict"),
    (f"compare/{CAND}.json", "missing", f"{CAND}: comparison", "missing file"),
    (f"compare/{CAND}.json", "wrong_shape", f"{CAND}: comparison", "unexpected content"),
    ("baseline/evidence.json", "garbage", "baseline: evidence", "corrupt JSON"),
    (f"{CAND}/recall/delta.json", "missing", f"{CAND}: recall delta", "missing file"),
    (f"{CAND}/recall/heatmap.png", "garbage", "heatmap: not a readable PNG", ""),
    (f"{CAND}/judge/report.json", "garbage", f"{CAND}: judge report", "corrupt JSON"),
    (f"{CAND}/judge/report.json", "wrong_shape", f"{CAND}: judge", "unexpected content"),
    (f"{CAND}/pay_off.json", "missing", f"{CAND}: perf ratios", "missing file"),
]


@pytest.mark.parametrize("rel, how, what, reason", DAMAGE)
def test_damaged_evidence_renders_with_the_gap(run, rel, how, what, reason):
    path = run / rel
    if how == "missing":
        path.unlink()
    elif how == "garbage":
        path.write_bytes(b"{\x00 not json")
    elif how == "list":
        path.write_text("[]")
    else:  # right JSON, wrong shape inside
        path.write_text(json.dumps({"default": {"metrics": {"exact_match": {"overall": 3}}, "regressions": 5}}
                                   if "compare" in rel else {"calibration": [], "comparison": "x"}))
    html_path, md_path = write_report(run)
    html = unescape(html_path.read_text())
    assert what in html and reason in html
    assert "</html>" in html and md_path.read_text().startswith("# Release")


def test_empty_run_folder_still_renders(tmp_path):
    run = tmp_path / "runs" / "empty"
    run.mkdir(parents=True)
    (run / "run.json").write_text("{}")
    html = write_report(run)[0].read_text()
    assert "no candidate found" in html and "UNKNOWN" in html


@pytest.mark.parametrize("files, status", [
    ({}, "human-none"),
    ({"report.json": "judge"}, "human-not_exported"),
    ({"report.json": "judge", "review_key.json": {"items": [{"review_id": "r1"}] * 50}}, "human-awaiting"),
    ({"report.json": "judge", "human.json": "human"}, "human-imported"),
])
def test_human_review_status(run, files, status, pristine):
    judge = run / CAND / "judge"
    shutil.rmtree(judge)
    for name, content in files.items():
        judge.mkdir(exist_ok=True)
        src = {"judge": pristine / CAND / "judge" / "report.json", "human": pristine / CAND / "judge" / "human.json"}
        data = json.loads(src[content].read_text()) if isinstance(content, str) else content
        (judge / name).write_text(json.dumps(data))
    html = write_report(run)[0].read_text()
    assert f'class="{status}"' in html
    if status == "human-awaiting":
        assert "50 pairs exported" in html


def test_summary_notes_are_shown(run):
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "notes": ["served with bfloat16 activations"]}))
    html_path, md_path = write_report(run)
    assert "note: served with bfloat16 activations" in html_path.read_text()
    assert "> note: served with bfloat16 activations" in md_path.read_text()


def test_markdown_summary_escapes_table_cells(run):
    dec = json.loads((run / "decision.json").read_text())
    dec["candidates"][CAND]["reasons"] = ["a | b\nc"]
    (run / "decision.json").write_text(json.dumps(dec))
    md = markdown_summary(run)
    assert "- a \\| b c" in md


def test_cli_report_and_bad_folder(run, tmp_path):
    out = tmp_path / "elsewhere" / "r.html"
    res = CliRunner().invoke(app, ["report", str(run), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert out.is_file() and out.with_suffix(".md").is_file()
    for h in hrefs(out.read_text()):  # links from another folder still point at the run's files
        if not h.startswith(("data:", "#")):
            assert (out.parent / h).is_file(), h
    res = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert res.exit_code != 0 and "no run.json" in str(res.exception)
