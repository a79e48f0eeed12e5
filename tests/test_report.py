"""Release report (quantgate.report.page): content from the evidence, self-contained HTML, gaps instead of crashes."""

from __future__ import annotations

import json
import re
import shutil
from html import unescape
from pathlib import Path

import pytest
from _report_fixtures import CAND, HOSTILE, POLICY, as_schema1, early_reject_run, inconclusive_run, release_run
from typer.testing import CliRunner

from quantgate.cli.main import app
from quantgate.gate.checks import DECIDED_EARLY
from quantgate.gate.evidence import decide_run, gate_run
from quantgate.report.page import BADGES, TEMPLATES, markdown_summary, write_report

RUN_ID = "demo-20261101T100000Z"
RUN2_ID = "demo-20261105T100000Z"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return release_run(tmp_path_factory.mktemp("results"), RUN_ID, lose={"proper_nouns": 6}, recall_lose=2)


@pytest.fixture(scope="module")
def pristine2(tmp_path_factory) -> Path:
    """Schema 2 at full stretch: an INCONCLUSIVE candidate, fidelity with its floor, gains and an HTML output."""
    return inconclusive_run(tmp_path_factory.mktemp("results"), RUN2_ID)


@pytest.fixture
def run(pristine, tmp_path) -> Path:
    """A private copy (tests damage it); the cache folders it points at stay shared and untouched."""
    dst = tmp_path / "results" / "runs" / RUN_ID
    shutil.copytree(pristine, dst)
    return dst


@pytest.fixture
def run2(pristine2, tmp_path) -> Path:
    dst = tmp_path / "results" / "runs" / RUN2_ID
    shutil.copytree(pristine2, dst)
    return dst


def decision_of(run: Path) -> dict:
    return json.loads((run / "decision.json").read_text())["candidates"][CAND]


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
    failed = [c["name"] for c in decision["candidates"][CAND]["checks"] if c["outcome"] == "fail"]
    assert failed and html.count('<span class="badge FAIL">FAIL</span>') == len(failed)
    pn = cmp_["metrics"]["exact_match"]["by_category"]["proper_nouns"]
    assert f"[{pn['ci_low']:+.3f}, {pn['ci_high']:+.3f}]" in html
    assert len(cmp_["regressions"]) == 6
    for r in cmp_["regressions"]:  # both outputs of every regression
        assert f"<pre>{r['base_output']}</pre>" in html and f"<pre>{r['cand_output']}</pre>" in html
    assert "Calibration accuracy 90.0%" in html and "number_swap" in html
    assert "48 of 50 exported pairs reviewed" in html
    assert html.count("data:image/png;base64,") == 2  # the two recall heatmaps
    assert {"trade-off", f"forest-{CAND}"} <= set(re.findall(r'<figure class="chart" id="([^"]+)"><svg', html))
    assert 'id="gaps"' not in html and "85.2 s wall" in html  # complete evidence: no gap section
    md = md_path.read_text()
    assert md.startswith("# Release `demo`: **REJECT**") and "| default/exact_match | 100 |" in md
    assert "| category:default/proper_nouns/exact_match | FAIL |" in md and "Flips: 6 lost" in md
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


# --- schema 2: three outcomes, power, flips, fidelity -------------------------------------------------------------

def test_inconclusive_decision_shows_outcomes_power_and_needs(run2):
    html_path, md_path = write_report(run2)
    html, text = html_path.read_text(), unescape(html_path.read_text())
    dec = decision_of(run2)
    (check,) = [c for c in dec["checks"] if c["outcome"] == "inconclusive"]
    p = check["power"]
    assert p["limit_below_mdd"] and dec["decision"] == "INCONCLUSIVE" and dec["needs"]
    assert 'id="decision">INCONCLUSIVE<' in html and '<span class="badge INCONCLUSIVE">INCONCLUSIVE</span>' in html
    assert html.count('<span class="badge INCONCLUSIVE">INCONCLUSIVE</span>') == 4  # first screen, overview, candidate, check
    row = text[text.index(f"<td>{check['name']}</td>"):].split("</tr>")[0]
    assert ">INCONCLUSIVE<" in row and f"{p['mdd']:.4f}" in row and f">{p['n']}</td>" in row
    assert "limit below MDD" in row and f"needs about {p['needs_samples']} samples" in row
    assert f"To decide:</b> {dec['needs']}" in text and dec["operating"]["note"] in text
    assert "12 passed, 0 failed, 1 inconclusive, 0 skipped." in text
    md = md_path.read_text()
    assert md.startswith("# Release `demo`: **INCONCLUSIVE**") and "## w4a16-gptq: INCONCLUSIVE" in md
    assert f"| {check['name']} | INCONCLUSIVE | {check['measured']:.4f} | {check['limit']:.4f} | {p['mdd']:.4f} (limit below MDD) | {p['n']} |" in md
    assert f"- **To decide:** {dec['needs']}" in md and dec["operating"]["note"] in md
    assert "| w4a16-gptq | INCONCLUSIVE | 0.400 | 1.400 | 1 / 3 | 0 / 1 |" in md


def test_inconclusive_has_its_own_colour():
    css = (TEMPLATES / "style.css").read_text()
    rule = lambda cls: re.search(r"\." + cls + r"\b[^{]*\{([^}]*)\}", css).group(1)  # noqa: E731
    assert rule("INCONCLUSIVE") not in (rule("REJECT"), rule("PROMOTE"))
    assert "INCONCLUSIVE" not in re.search(r"[^}]*\.REJECT[^{]*", css).group(0)


def test_flips_ledger_regressions_first_with_counts(run2):
    html_path, md_path = write_report(run2)
    html = html_path.read_text()
    rep = json.loads((run2 / "compare" / f"{CAND}.json").read_text())["default"]
    assert len(rep["regressions"]) == 1 and len(rep["gains"]) == 3
    assert "<b class=\"bad\">1 regressions</b>" in html and "<b class=\"good\">3 gains</b>" in html
    ledger = html[html.index('<table class="flips">'):].split("</table>")[0]
    kinds = re.findall(r'<tr class="(regression|gain)">', ledger)
    assert kinds == ["regression", "gain", "gain", "gain"]
    for r in rep["regressions"] + rep["gains"]:
        assert unescape(ledger).count(f"<pre>{r['base_output']}</pre>") >= 1
        assert r["cand_output"] in unescape(ledger) and r["id"] in ledger
    # the category that lost, net, comes first; its gain before the other category's gains
    assert ledger.index("arithmetic_numbers-000") < ledger.index("factual_qa-000")
    assert "default / arithmetic_numbers" in html and ">+2</td>" in html
    md = md_path.read_text()
    assert "Flips: 1 lost (right -> wrong), 3 gained (wrong -> right)." in md
    assert "| lost | arithmetic_numbers-001 | arithmetic_numbers |" in md and "| gained | factual_qa-005 |" in md


def test_flips_are_capped(run2, monkeypatch):
    from quantgate.report import sections

    monkeypatch.setattr(sections, "MAX_GAINS", 2)
    html = write_report(run2)[0].read_text()
    assert "First 2 of 3 gains shown." in html and html.count('<tr class="gain">') == 2


def test_old_comparison_without_gains(run2):
    path = run2 / "compare" / f"{CAND}.json"
    cmp_ = json.loads(path.read_text())
    del cmp_["default"]["gains"]
    path.write_text(json.dumps(cmp_))
    html = write_report(run2)[0].read_text()
    assert "gains not recorded by this comparison" in html and 'id="gaps"' not in html


def test_fidelity_section_with_floor_categories_and_worst(run2):
    html_path, md_path = write_report(run2)
    html = unescape(html_path.read_text())
    cand = json.loads((run2 / "fidelity" / f"{CAND}.json").read_text())["summary"]
    floor = json.loads((run2 / "fidelity" / "floor.json").read_text())["summary"]
    kl, fkl, top1 = cand["kl"], floor["kl"], cand["top1"]
    iv = lambda x: f"{x['mean']:.3g} (95% upper bound {x['high']:.3g})"  # noqa: E731  the gate's one-sided bound
    assert kl["level"] == 0.9 and f'<td class="n">{iv(kl)}</td><td class="n">{iv(fkl)}</td>' in html
    assert f"{top1['mean']:.1%} (95% lower bound {top1['low']:.1%})" in html
    assert f"{cand['n_samples']} samples, {cand['n_tokens']} tokens; each figure with the 95% bound the gate judges" in html
    assert "intervals at" not in html
    for cat, v in cand["by_category"].items():
        assert f"<tr><td>{cat}</td>" in html and iv(v["kl"]) in html and iv(floor["by_category"][cat]["kl"]) in html
    for w in cand["worst"]:
        assert f"<tr><td>{w['id']}</td><td>{w['category']}</td><td class=\"n\">{w['kl_mean']:.3g}</td>" in html
    md = md_path.read_text()
    assert f"Fidelity ({cand['n_samples']} samples): KL {iv(kl)} (noise floor {iv(fkl)}); top-1" in md


def test_a_bound_judged_at_a_looks_level_is_the_one_shown(run2):
    """A look judges each slice at its share of the policy's alpha: the gate's reason states a 99% bound, wider
    than the fidelity file's own 95% one. The section's table, its sentence and the chart show the gate's bound at
    the gate's level for the slices it judged, and the file's 95% bound for a slice it did not judge."""
    html_path = run2 / "report.html"
    cand = json.loads((run2 / "fidelity" / f"{CAND}.json").read_text())["summary"]
    cats = sorted(cand["by_category"])
    judged_cat, other_cat = cats[0], cats[1]
    ckl = cand["by_category"][judged_cat]["kl"]
    wide = round(ckl["high"] * 1.5 + 0.001, 5)  # the 99% bound: wider than the file's 95% one
    doc = json.loads((run2 / "decision.json").read_text())
    doc["candidates"][CAND]["checks"].append(
        {"name": f"fidelity:kl:{judged_cat}", "measured": ckl["mean"], "limit": 0.02, "bound": "ci", "required": True,
         "outcome": "inconclusive", "evidence_file": None, "passed": False,
         "reason": f"mean KL {ckl['mean']:.4g} nats (99% upper bound {wide}) over 300 tokens in 5 samples; limit 0.02: "
                   "the interval crosses the limit"})
    (run2 / "decision.json").write_text(json.dumps(doc))
    html = unescape(write_report(run2, html_path)[0].read_text())
    row = html.split(f"<tr><td>{judged_cat}</td>")[1].split("</tr>")[0]
    assert f"{ckl['mean']:.3g} (99% upper bound {wide:.3g})" in row and f"{ckl['high']:.3g})" not in row
    okl = cand["by_category"][other_cat]["kl"]
    other = html.split(f"<tr><td>{other_cat}</td>")[1].split("</tr>")[0]
    assert f"{okl['mean']:.3g} (95% upper bound {okl['high']:.3g})" in other  # not judged: the file's own bound
    assert ("each figure with the 95% bound the gate judges (KL's upper, top-1's lower), and where the gate judged a "
            "figure at its look's share of the policy's error rate, with that bound (99%)") in html
    chart = html.split(f'id="fidelity-{CAND}"')[1].split("</figure>")[0]
    assert f"{judged_cat} (99%)" in chart and f"{other_cat} (95%)" in chart and "upper bound judged" in chart


def test_fidelity_with_shifted_field_names_still_reads(run2):
    """The summary at the top level, intervals named value / ci_low / ci_high, a bare number, no worst list."""
    path = run2 / "fidelity" / f"{CAND}.json"
    s = json.loads(path.read_text())["summary"]
    path.write_text(json.dumps({"n_samples": 40, "kl": {"value": 0.02, "ci_low": 0.01, "ci_high": 0.03},
                                "top1": 0.97, "by_category": s["by_category"]}))
    html = unescape(write_report(run2)[0].read_text())
    assert "0.02 [0.01, 0.03]" in html and "97.0%" in html and "worst samples" not in html
    assert "fidelity" not in " ".join(re.findall(r'<div class="gap">(.*?)</div>', html))


@pytest.mark.parametrize("rel, content, what, reason", [
    (f"fidelity/{CAND}.json", "{broken", f"{CAND}: fidelity", "corrupt JSON"),
    (f"fidelity/{CAND}.json", {"summary": {"kl": 1, "by_category": [1, 2]}}, f"{CAND}: fidelity", "unexpected content"),
    (f"fidelity/{CAND}.json", {"samples": []}, f"{CAND}: fidelity", "no \"summary\" object"),
    ("fidelity/floor.json", None, "fidelity noise floor", "missing file"),
    ("fidelity/floor.json", [1], "fidelity noise floor", "expected a JSON dict"),
    ("decision.json", "checks", f"{CAND}: checks", "unexpected content"),
    (f"compare/{CAND}.json", "gains", f"{CAND}: flips", "unexpected content"),
])
def test_damaged_schema2_evidence_renders_with_the_gap(run2, rel, content, what, reason):
    path = run2 / rel
    if content is None:
        path.unlink()
    elif content == "checks":
        doc = json.loads(path.read_text())
        doc["candidates"][CAND]["checks"] = {"not": "a list"}
        path.write_text(json.dumps(doc))
    elif content == "gains":
        doc = json.loads(path.read_text())
        doc["default"]["gains"] = 5
        path.write_text(json.dumps(doc))
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    html_path, md_path = write_report(run2)
    html = unescape(html_path.read_text())
    assert what in html and reason in html
    assert "</html>" in html and md_path.read_text().startswith("# Release")
    if "floor" in rel:
        kl = json.loads((run2 / "fidelity" / f"{CAND}.json").read_text())["summary"]["kl"]
        assert "no noise floor (fidelity/floor.json)" in html
        assert f"<td class=\"n\">{kl['mean']:.3g} (95% upper bound {kl['high']:.3g})</td><td class=\"n\">—</td>" in html


def test_schema1_decision_still_renders(run2):
    as_schema1(run2)
    html_path, md_path = write_report(run2)
    html = html_path.read_text()
    assert 'id="decision">REJECT<' in html and 'id="gaps"' not in html
    assert "badge INCONCLUSIVE" not in html and '<span class="badge pass">pass</span>' in html
    assert '<span class="badge FAIL">FAIL</span>' in html  # the inconclusive check was `passed: false` in schema 1
    assert "To decide" not in html and "Operating characteristics" not in html
    md = md_path.read_text()
    assert "| primary:default/numeric_match | FAIL |" in md and "INCONCLUSIVE" not in md


def test_untrusted_text_cannot_inject_html_into_the_markdown(run2):
    dec = json.loads((run2 / "decision.json").read_text())
    dec["candidates"][CAND]["reasons"] = ["<script>alert(1)</script> & <b>bold</b> | x"]
    dec["candidates"][CAND]["needs"] = "<img src=y>"
    (run2 / "decision.json").write_text(json.dumps(dec))
    html_path, md_path = write_report(run2)
    md = md_path.read_text()
    assert HOSTILE not in md and "<img" not in md and "<script" not in md and "<b>" not in md
    assert "&lt;img src=x onerror=\"alert(1)\"&gt; \\| \\[click\\](http://evil.example) &amp; \\`code\\`" in md
    assert "- &lt;script&gt;alert(1)&lt;/script&gt; &amp; &lt;b&gt;bold&lt;/b&gt; \\| x" in md
    assert "- **To decide:** &lt;img src=y&gt;" in md
    assert markdown_summary(run2).count("&lt;img") == md.count("&lt;img")
    html = html_path.read_text()  # the HTML page escapes it too (autoescape)
    assert "<img src=x" not in html and "<script>alert" not in html and "&lt;img src=x onerror=" in html


def test_report_of_the_real_gate_decision(run2):
    """The gate itself (default policy) over the schema-2 run: whatever it decides, every check's outcome, reason
    and minimum detectable drop is on the page, and its outcome in the summary."""
    (d,), _ = gate_run(run2, POLICY)
    html_path, md_path = write_report(run2)
    html, md = html_path.read_text(), md_path.read_text()
    text = unescape(html)
    assert f'id="decision">{d.decision}<' in html and f"**{d.decision}**" in md
    for c in d.checks:
        row = text[text.index(f"<tr><td>{c.name}</td>"):].split("</tr>")[0]
        assert c.reason in row and f">{BADGES[c.outcome]}</span>" in row, c.name
        if c.power and c.power.mdd is not None:
            assert f"{c.power.mdd:.4f}" in row, c.name
        assert f"| {c.name} | {BADGES[c.outcome]} |" in md, c.name
    if d.needs:
        assert d.needs in text and d.needs in md
    assert 'id="gaps"' not in html


def test_early_reject_summary_and_show_lead_with_the_decision(tmp_path):
    """The demo's early REJECT: the deciding checks first, the skipped steps as skipped (not missing, no gap), the
    early decision's text not repeated, no absolute path in the summary or in `show`."""
    run = early_reject_run(tmp_path / "results", "demo-20261201T100000Z")
    md = write_report(run)[1].read_text()
    lead = md[:md.index("| candidate |")]
    assert "**w4a16-gptq: REJECT**" in lead and "- `fidelity:kl` FAIL: " in lead and "95% upper bound" in lead
    assert "_w4a16-gptq: recall grid, perf probe: skipped: decided early by fidelity_" in lead
    assert "missing evidence" not in md and "Gaps in the evidence" not in md and "decided early: REJECT" not in md
    assert "| recall:recall | skip |" in md and str(tmp_path) not in md
    res = CliRunner().invoke(app, ["show", str(run)])
    assert res.exit_code == 0 and res.output.startswith("REJECT: run demo-20261201T100000Z")
    assert "    fidelity:kl  FAIL  " in res.output and "missing" not in res.output
    assert "  baseline: recall grid, perf probe: skipped: decided early by fidelity" in res.output
    assert str(tmp_path) not in res.output.replace(f"files in {run}", "")


def test_an_early_reject_before_the_eval_sets_says_they_were_skipped_not_missing(tmp_path):
    """A REJECT decided at a streaming look, before either side ran its eval sets: the task checks (primary, pooled,
    categories, error rate) are skipped as decided early, never missing evidence, and the lead names the eval sets."""
    run = early_reject_run(tmp_path / "results", "demo-20261201T110000Z", evals=False)
    (d,) = decide_run(run, POLICY)
    task = [c for c in d.checks if c.name.split(":")[0] in ("primary", "pooled", "category", "error_rate")]
    assert d.decision == "REJECT" and task, [c.name for c in d.checks]
    assert all(c.outcome == "skipped" and c.reason.startswith(DECIDED_EARLY) for c in task), \
        [(c.name, c.outcome, c.reason) for c in task]
    html_path, md_path = write_report(run)
    md, html = md_path.read_text(), html_path.read_text()
    lead = md[:md.index("| candidate |")]
    assert "_w4a16-gptq: eval sets, recall grid, perf probe: skipped: decided early by fidelity_" in lead, lead
    assert "missing evidence" not in md and "Gaps in the evidence" not in md
    # nothing was compared, so no flips are counted: not "0 regressions", not "no sample changed"
    assert "No sample changed" not in html and "0 regressions" not in html and "Flips:" not in md
    assert html.count("no comparison with the baseline (its eval sets were skipped: decided early by fidelity)") == 2
    assert f"| {CAND} | REJECT | " in md and md.split(f"| {CAND} | REJECT | ")[1].split("|")[2].strip() == "—"


def test_a_kl_interval_is_never_below_zero():
    from quantgate.report import fidelitysection

    assert fidelitysection.interval({"mean": -1e-8, "low": -0.002, "high": 0.003}, "kl") == \
        {"mean": 0.0, "low": 0.0, "high": 0.003, "level": None}
    assert fidelitysection.interval({"mean": -0.001, "low": -0.002, "high": 0.003}, "dnll")["low"] == -0.002


def test_a_repaired_candidate_shows_what_it_keeps_in_the_report_and_its_card(run):
    from quantgate.gate.models import KeptLayer
    from quantgate.gate.repairfile import LayerRanking, RepairRecord
    from quantgate.report.modelcard import card_inputs, render_card

    kept = [KeptLayer(layer=i, modules=rf"re:model\.layers\.{i}\.", removes={"pooled": g, "multilingual": 2 * g},
                      added_bytes=3_500_000) for i, g in ((0, 0.004), (29, 0.0025))]
    rec = RepairRecord(candidate=CAND, repairs="int8-w8a8", scheme="int8-w8a8",
                       failing={"pooled": 0.02, "multilingual": 0.02}, kept=kept, min_top1={"multilingual": 0.93},
                       measured={"pooled": 0.011, "multilingual": 0.013}, measured_top1={"multilingual": 0.951},
                       passes=True, margin=0.7, added_size=0.043, alpha=0.025,
                       ranking=LayerRanking(prompts=["a", "b", "c"], per_slice=3, sequences=6, scored_tokens=300,
                                            before={"pooled": 0.025, "multilingual": 0.045},
                                            before_top1={"multilingual": 0.86},
                                            gains={"pooled": [0.004] + [0.0] * 28 + [0.0025],
                                                   "multilingual": [0.008] + [0.0] * 28 + [0.005]},
                                            order=[0, 29] + list(range(1, 29)),
                                            tried={1: {"pooled": 0.015, "multilingual": 0.03},
                                                   2: {"pooled": 0.011, "multilingual": 0.013}},
                                            tried_top1={1: {"multilingual": 0.9}, 2: {"multilingual": 0.951}},
                                            truth_s=80.0, sets_s=30.0))
    rec.write(run / CAND)
    doc = json.loads((run / "decision.json").read_text())
    doc["candidates"][CAND]["repair"] = rec.note(run / CAND / "repair.json").model_dump(mode="json")
    (run / "decision.json").write_text(json.dumps(doc))
    html_path, md_path = write_report(run)
    text = re.sub(r"<[^>]+>", " ", html_path.read_text())
    text = re.sub(r"\s+", " ", unescape(text))
    assert "Repair of int8-w8a8: layers kept at 16 bits" in text
    assert "A repair of int8-w8a8: decoder layers 0, 29 kept at 16 bits (+4.3% bytes" in text
    assert r"re:model\.layers\.29\." in text and "top 2 (chosen)" in text and "95.1%" in text
    assert "3 prompts (3 per slice, 6 sequences, 300 scored tokens" in text and "alpha 0.025" in text
    assert "A repair of int8-w8a8: decoder layers 0, 29 kept at 16 bits" in md_path.read_text()
    card = render_card(card_inputs(run, CAND, model="demo", version="v1", decision=doc["candidates"][CAND]))
    assert "kept at 16 bits: decoder layers 0, 29 (+4.3% bytes), a repair of `int8-w8a8`" in card
    assert r"`re:model\.layers\.0\.`" in card
