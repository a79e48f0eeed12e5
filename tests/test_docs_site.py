"""The documentation: the site under docs/ builds with MkDocs in strict mode (mkdocs.yml), and a broken link fails
that build; README.md stays a front door (at most 200 lines, no dates, every docs/ link and image there, its minimal
spec valid); CHANGELOG.md exists; every figure section of docs/measurements.md says when, on what, and which command
of this repository measures it again.

The site is built from `.venv-docs` (requirements/docs.lock, `scripts/setup.sh docs`; `make test` builds it). When it
is missing, the module builds it the way `make test` does, and skips only when that build cannot run."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MKDOCS = REPO / ".venv-docs" / "bin" / "mkdocs"
README = REPO / "README.md"
MEASUREMENTS = REPO / "docs" / "measurements.md"
DATE = re.compile(r"20\d\d-\d\d-\d\d")


@pytest.fixture(scope="module")
def mkdocs() -> Path:
    if not MKDOCS.exists():
        res = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh"), "docs"], cwd=REPO, capture_output=True,
                             text=True, timeout=600)
        if res.returncode != 0 or not MKDOCS.exists():
            pytest.skip(".venv-docs is missing and `scripts/setup.sh docs` could not build it (is the package index "
                        f"reachable?): {res.stderr.strip()[-600:]}")
    return MKDOCS


def build(mkdocs: Path, root: Path, site: Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of the mkdocs.yml in `root` into `site`."""
    return subprocess.run([str(mkdocs), "build", "--strict", "--config-file", str(root / "mkdocs.yml"),
                           "--site-dir", str(site)], cwd=root, capture_output=True, text=True, timeout=300)


def copy_of_the_docs(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(REPO / "mkdocs.yml", root / "mkdocs.yml")
    shutil.copytree(REPO / "docs", root / "docs")
    return root


def test_the_site_builds_strict(mkdocs, tmp_path):
    res = build(mkdocs, REPO, tmp_path / "site")
    assert res.returncode == 0, res.stdout + res.stderr
    site = tmp_path / "site"
    assert (site / "index.html").is_file() and (site / "measurements" / "index.html").is_file()
    assert "WARNING" not in res.stderr, res.stderr


@pytest.mark.parametrize("planted, named", [
    ("See [the limits](no-such-page.md).", "no-such-page.md"),
    ("See [the limits](gate.md#no-such-heading).", "#no-such-heading"),
    ("See [the flow](../quantgate/release/flow.py).", "../quantgate/release/flow.py"),
])
def test_a_broken_link_fails_the_build_naming_it(mkdocs, tmp_path, planted, named):
    root = copy_of_the_docs(tmp_path)
    page = root / "docs" / "release.md"
    page.write_text(page.read_text(encoding="utf-8") + f"\n{planted}\n", encoding="utf-8")
    res = build(mkdocs, root, tmp_path / "site")
    assert res.returncode != 0, res.stdout + res.stderr
    assert named in res.stderr and "release.md" in res.stderr, res.stderr


def test_a_page_left_out_of_the_nav_fails_the_build(mkdocs, tmp_path):
    root = copy_of_the_docs(tmp_path)
    (root / "docs" / "orphan.md").write_text("# Orphan\n\nNo nav entry names this page.\n", encoding="utf-8")
    res = build(mkdocs, root, tmp_path / "site")
    assert res.returncode != 0 and "orphan.md" in res.stderr, res.stdout + res.stderr


def test_the_readme_is_a_front_door():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200, "README.md is a front door: at most 200 lines (the rest belongs in docs/)"
    dates = DATE.findall(text)
    assert not dates, f"README.md holds no dates (a measured figure goes to docs/measurements.md): {dates}"
    linked = re.findall(r"\]\(((?:docs/|CHANGELOG)[^)#\s]*)(?:#[^)]*)?\)", text)
    assert {"docs/measurements.md", "docs/own-model.md", "docs/outcomes.md", "CHANGELOG.md"} <= set(linked)
    assert [p for p in linked if not (REPO / p).is_file()] == []
    pages = {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")} - {"docs/index.md"}
    assert sorted(pages - set(linked)) == [], "README.md's map of the docs leaves these pages out"
    image = REPO / "docs" / "img" / "report.png"
    assert "(docs/img/report.png)" in text and image.stat().st_size < 150_000


def test_the_readme_spec_is_valid(tmp_path):
    """The minimal spec under "Your own model" passes `quantgate check` where the README says to save it."""
    text = README.read_text(encoding="utf-8")
    own = text[text.index("## Your own model"):]
    (spec,) = re.findall(r"```yaml\n(.*?)```", own[:own.index("\n## ", 3)], re.S)
    (tmp_path / "releases").mkdir()
    (tmp_path / "eval_sets").symlink_to(REPO / "eval_sets")
    (tmp_path / "releases" / "my-model.yaml").write_text(spec, encoding="utf-8")
    res = subprocess.run([sys.executable, "-m", "quantgate.cli", "check", str(tmp_path / "releases" / "my-model.yaml")],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ok spec" in res.stdout and "ok evalset" in res.stdout


def test_the_changelog_exists_and_is_grouped_by_date():
    text = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    days = re.findall(r"^## (20\d\d-\d\d-\d\d)$", text, re.M)
    assert text.startswith("# Changelog") and days and days == sorted(days, reverse=True)


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _commands(body: str) -> list[str]:
    """The commands a section names as its way to re-measure: code spans on its `Re-measure:` line, or the table's
    last column."""
    bullet = re.search(r"^- Re-measure:.*(?:\n  .*)*", body, re.M)
    lines = [bullet.group(0)] if bullet else []
    lines += [ln.rstrip("|").rsplit("|", 1)[-1] for ln in body.splitlines() if ln.startswith("| [")]
    return [c for ln in lines for c in re.findall(r"`([^`]+)`", ln)]


def _exists(command: str) -> bool:
    """Whether a command names only things this repository has: each repository path it gives, and a make target."""
    words = command.split()
    paths = [w for w in words if re.fullmatch(r"(bench|scripts|tests|\.venv/bin)/[\w./-]+", w)]
    make = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "make"]
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    return all((REPO / p).exists() or p.startswith(".venv/") for p in paths) and set(make) <= targets


def test_every_measured_figure_says_when_on_what_and_how_to_measure_it_again():
    sections = _sections(MEASUREMENTS.read_text(encoding="utf-8"))
    assert len(sections) >= 10
    for title, body in sections.items():
        assert DATE.search(body), f"docs/measurements.md, {title}: no date"
        commands = _commands(body)
        assert commands, f"docs/measurements.md, {title}: no command that measures it again"
        assert all(_exists(c) for c in commands), f"docs/measurements.md, {title}: {commands}"
        if title != "Figures on other pages":
            assert re.search(r"^- Machine: .+", body, re.M), f"docs/measurements.md, {title}: no machine"
