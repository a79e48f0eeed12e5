"""Human review: stratified blinded export, the HTML form, import round trip, and errors naming CSV lines."""

from __future__ import annotations

import csv
import io
import json
import re

import pytest

from quantgate.base.errors import QuantgateError
from quantgate.judge.review import allocate, export_review, import_review, load_key, parse_filled
from quantgate.judge.reviewfile import ReviewKey

CATS = {"facts": 30, "numbers": 20, "names": 10, "tiny": 2}


@pytest.fixture
def judge_dir(tmp_path):
    """A judge output directory: 62 pairs (plus 3 identical ones) and the judge's combined verdicts."""
    d = tmp_path / "judge"
    d.mkdir()
    pairs, winners = [], {}
    for cat, n in CATS.items():
        for i in range(n):
            pid = f"{cat}-{i:02d}"
            pairs.append({"id": pid, "category": cat, "question": f"Q {pid}, with \"quotes\", commas\nand a newline",
                          "reference": "ref", "baseline": f"base {pid}", "candidate": f"cand {pid}"})
            winners[pid] = ["second", "first", "tie", None][i % 4]
    pairs += [{"id": f"same-{i}", "category": "facts", "question": "q", "reference": "r", "baseline": "x",
               "candidate": "x"} for i in range(3)]
    (d / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (d / "report.json").write_text(json.dumps({
        "calibration": {"reliable": True, "accuracy": 1.0, "correct": 4, "n": 4, "ci_low": .5, "ci_high": 1.0,
                        "bar": .8, "by_type": {}, "reason": None},
        "comparison": {"winners": winners, "n_pairs": 0, "n_identical": 0, "invalid_pairs": 0, "invalid_rate": 0.0,
                       "position_consistency": 1.0, "by_category": {}, "worst_losses": [],
                       "overall": {"n": 0, "invalid": 0, **{k: {"count": 0, "rate": 0.0, "ci_low": 0.0, "ci_high": 0.0}
                                                            for k in ("win", "tie", "loss")},
                                   "non_inferiority": {"margin": .05, "net": 0.0, "lower_bound": 0.0, "alpha": .05,
                                                       "p_value": 1.0, "non_inferior": False}}},
        "counts_as_evidence": True}))
    return d


def _rows(path):
    return list(csv.DictReader(io.StringIO(path.read_text(encoding="utf-8"), newline="")))


def _write(path, rows):
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    path.write_text(buf.getvalue(), encoding="utf-8")


@pytest.mark.parametrize("sizes, n, want", [
    ({"a": 30, "b": 20, "c": 10}, 30, {"a": 15, "b": 10, "c": 5}),
    ({"a": 30, "b": 20, "c": 10, "d": 2}, 50, {"a": 24, "b": 16, "c": 8, "d": 2}),  # 24.19, 16.13, 8.06, 1.61
    ({"a": 1, "b": 1}, 5, {"a": 1, "b": 1}),
])
def test_allocate(sizes, n, want):
    assert allocate(sizes, n) == want


def test_export_is_stratified_blinded_and_seeded(judge_dir, tmp_path):
    paths = export_review(judge_dir, tmp_path / "send", n=50, seed=4)
    rows, key = _rows(paths["csv"]), json.loads(paths["key"].read_text())
    assert paths["key"].parent == judge_dir  # the key is not beside what goes to reviewers
    assert len(rows) == 50 and len({r["review_id"] for r in rows}) == 50
    counts = {c: sum(r["category"] == c for r in rows) for c in CATS}
    assert counts == {"facts": 24, "numbers": 16, "names": 8, "tiny": 2}
    sides = [key["items"][r["review_id"]]["a"] for r in rows]
    assert 10 < sides.count("baseline") < 40  # A/B order is mixed
    for r in rows:  # nothing in what reviewers see says which side is which
        assert "base" not in r["review_id"] + r["category"]
        item = key["items"][r["review_id"]]
        assert r["answer_a"] == f"{item['a']} {item['pair_id']}".replace("baseline", "base").replace("candidate", "cand")
    assert not any(key["items"][r["review_id"]]["pair_id"].startswith("same") for r in rows)  # identical left out
    assert _rows(export_review(judge_dir, tmp_path / "again", n=50, seed=4)["csv"]) == rows
    html = paths["html"].read_text()
    assert "http://" not in html and "https://" not in html and "<script src" not in html
    data = json.loads(re.search(r'<script id="rows" type="application/json">(.*?)</script>', html, re.S).group(1))
    assert [d["review_id"] for d in data] == [r["review_id"] for r in rows] and "Download filled CSV" in html


def test_export_refuses_more_pairs_than_exist(judge_dir, tmp_path):
    with pytest.raises(QuantgateError, match="only 62 pairs"):
        export_review(judge_dir, tmp_path / "send", n=63)


def test_roundtrip_restores_baseline_candidate(judge_dir, tmp_path):
    paths = export_review(judge_dir, tmp_path / "send", n=50, seed=1)
    key = json.loads(paths["key"].read_text())
    rows = _rows(paths["csv"])
    # the reviewer always prefers the candidate, except for numbers (tie) and one row left blank
    for r in rows:
        a = key["items"][r["review_id"]]["a"]
        r["choice"] = "TIE" if r["category"] == "numbers" else ("a" if a == "candidate" else "B")
    rows[0]["choice"] = "" if rows[0]["category"] != "numbers" else rows[0]["choice"]
    _write(tmp_path / "filled.csv", rows)
    h = import_review(judge_dir, tmp_path / "filled.csv")
    blank = 1 if rows[0]["choice"] == "" else 0
    n_num = sum(r["category"] == "numbers" for r in rows)
    assert h["n_reviewed"] == 50 - blank and h["n_blank"] == blank
    assert h["rates"]["loss"]["count"] == 0 and h["rates"]["tie"]["count"] == n_num
    assert h["rates"]["win"]["count"] == 50 - blank - n_num
    # agreement: judge winners cycle second/first/tie/None by index; compare with the human's per pair
    winners = json.loads((judge_dir / "report.json").read_text())["comparison"]["winners"]
    human = {key["items"][r["review_id"]]["pair_id"]: ("tie" if r["choice"] == "TIE" else "second")
             for r in rows if r["choice"]}
    both = [(h_, winners[p]) for p, h_ in human.items() if winners[p] is not None]
    assert h["agreement"]["n"] == len(both) and h["agreement"]["agree"] == sum(a == b for a, b in both)
    assert "Human review" in (judge_dir / "report.md").read_text()
    assert json.loads((judge_dir / "human.json").read_text()) == h


def test_bad_rows_are_named_by_line(judge_dir, tmp_path):
    paths = export_review(judge_dir, tmp_path / "send", n=50, seed=2)
    key = load_key(paths["key"])
    text = paths["csv"].read_text()
    # rows span 2 lines each (the question holds a newline): row k starts at line 2 + 2k
    rows = _rows(paths["csv"])
    for r in rows:
        r["choice"] = "A"
    rows[2]["choice"] = "C"
    rows[4]["review_id"] = "R999"
    rows[6] = dict(rows[5])
    _write(tmp_path / "bad.csv", rows)
    with pytest.raises(QuantgateError) as exc:
        parse_filled((tmp_path / "bad.csv").read_text(), key, "bad.csv")
    msg = exc.value.render()
    assert exc.value.where == "bad.csv:6"
    assert "invalid choice 'C'" in msg
    assert "bad.csv:10: unknown review_id 'R999'" in msg
    assert "bad.csv:14: duplicate review_id" in msg and "(first at line 12)" in msg
    assert "3 bad row(s)" in msg and text


@pytest.mark.parametrize("content, match", [
    ("", "the CSV is empty"),
    ("id,answer\nR001,A\n", "missing column"),
    ("review_id,choice\nR001,\n", "no row has a choice"),
    ("review_id,choice\nR001,A,extra\n", r"2 fields|3 fields"),
])
def test_malformed_csv(content, match):
    key = ReviewKey.model_validate({"items": {"R001": {"pair_id": "p", "a": "baseline"}}})
    with pytest.raises(QuantgateError, match=match):
        parse_filled(content, key, "f.csv")
