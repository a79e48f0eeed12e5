"""Eval set loading: malformed sets are rejected with file and line; good ones load through `datasets`."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from quantgate.base.errors import ConfigError
from quantgate.base.paths import EVAL_SETS
from quantgate.evals.dataset import estimate_tokens_chars4, load_evalset
from quantgate.evals.metrics import load_table

META = """name: t
version: 1
default_max_tokens: 16
metrics:
  exact_match: {higher_is_better: true, aggregation: mean}
  chrf: {higher_is_better: true, aggregation: mean}
categories: {factual_qa: facts, multilingual: other languages}
"""
GOOD = {"id": "a", "category": "factual_qa", "prompt": "Capital of France?", "references": ["Paris"], "metrics": ["exact_match"]}


def write_set(tmp_path: Path, lines: list, meta: str = META) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines), encoding="utf-8")
    (tmp_path / "t.meta.yaml").write_text(meta, encoding="utf-8")
    return path


def line(**changes) -> dict:
    row = {**GOOD, **changes}
    return {k: v for k, v in row.items() if v is not ...}


# (lines, expected line number of the problem, words the message must contain)
BAD = [
    ([GOOD, line(id="b", references=...)], 2, "field 'references': Field required"),
    ([GOOD, line(id="b", references=[])], 2, "field 'references'"),
    ([GOOD, line()], 2, "duplicate id 'a' (first at line 1)"),
    ([line(prompt="   ")], 1, "empty prompt"),
    ([line(prompt=..., messages=[{"role": "user", "content": ""}])], 1, "empty prompt"),
    ([line(messages=[{"role": "user", "content": "hi"}])], 1, "exactly one of 'messages' or 'prompt'"),
    ([line(prompt=..., messages=[{"role": "assistant", "content": "hi"}])], 1, "last message must have role 'user'"),
    ([GOOD, line(id="b", metrics=["bleurt"])], 2, "unknown metric 'bleurt'"),
    ([GOOD, line(id="b", metrics=["bleu"])], 2, "unknown metric 'bleu'"),  # in the table, not declared by this set
    ([GOOD, GOOD | {"id": "b", "category": "poetry"}], 2, "category 'poetry' is not declared in the sidecar; it declares: factual_qa, multilingual"),
    ([GOOD, "{not json"], 2, "invalid JSON"),
    ([GOOD, "[1, 2]"], 2, "expected a JSON object"),
    ([line(surprise=1)], 1, "field 'surprise': Extra inputs are not permitted"),
    ([line(max_tokens=0)], 1, "field 'max_tokens'"),
]


@pytest.mark.parametrize("lines,lineno,words", BAD)
def test_malformed_sets_name_file_and_line(tmp_path, lines, lineno, words):
    path = write_set(tmp_path, lines)
    with pytest.raises(ConfigError) as err:
        load_evalset(path)
    assert err.value.where == f"{path}:{lineno}"
    assert words in err.value.message


def test_every_problem_is_reported_at_once(tmp_path):
    path = write_set(tmp_path, [GOOD, "", line(id="b", category="poetry"), "oops", line(id="a")])
    with pytest.raises(ConfigError) as err:
        load_evalset(path)
    text = err.value.render()
    assert "3 problem(s)" in text
    for no in (3, 4, 5):  # the blank line 2 still counts for numbering
        assert f"{path}:{no}" in text


@pytest.mark.parametrize("max_context,ok", [(21, True), (20, False)])
def test_prompt_longer_than_served_context(tmp_path, max_context, ok):
    path = write_set(tmp_path, [line(prompt="x" * 20)])  # 20 chars -> 5 estimated tokens, + max_tokens 16
    if ok:
        assert len(load_evalset(path, max_context=max_context).samples) == 1
    else:
        with pytest.raises(ConfigError, match=r"prompt of 5 tokens \(estimate: characters/4\) \+ max_tokens 16 exceeds"):
            load_evalset(path, max_context=max_context)


def test_context_check_uses_the_given_token_counter(tmp_path):
    path = write_set(tmp_path, [line(prompt="one two three", max_tokens=2)])

    def words(text: str) -> int:
        return len(text.split())

    with pytest.raises(ConfigError, match=r"prompt of 3 tokens \(words\) \+ max_tokens 2 exceeds the served context of 4"):
        load_evalset(path, max_context=4, count_tokens=words)
    assert estimate_tokens_chars4("abcde") == 2


@pytest.mark.parametrize("meta,words", [
    (META.replace("chrf", "bleurt"), "unknown metric 'bleurt'"),
    (META.replace("chrf: {higher_is_better: true", "chrf: {higher_is_better: false"), "the metric table says True"),
    (META.replace("version: 1", "version: one"), "field 'version'"),
])
def test_bad_sidecar_names_its_file(tmp_path, meta, words):
    path = write_set(tmp_path, [GOOD], meta)
    with pytest.raises(ConfigError) as err:
        load_evalset(path)
    assert str(tmp_path / "t.meta.yaml") in err.value.render() and words in err.value.render()


def test_missing_sidecar(tmp_path):
    path = write_set(tmp_path, [GOOD])
    (tmp_path / "t.meta.yaml").unlink()
    with pytest.raises(ConfigError, match="no sidecar"):
        load_evalset(path)


def test_good_set_loads_through_datasets_with_line_numbers(tmp_path):
    chat = line(id="c", prompt=..., messages=[{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Bonjour ?"}], metrics=["chrf"],
                references=["Bonjour", "Salut"], criteria="polite", max_tokens=8)
    path = write_set(tmp_path, [GOOD, "", chat])
    es = load_evalset(path)
    assert es.lines == {"a": 1, "c": 3}
    assert len(es.dataset) == 2 and es.dataset[1]["references"] == ["Bonjour", "Salut"]
    assert es.samples[0].chat() == [{"role": "user", "content": "Capital of France?"}]
    assert es.samples[1].chat()[0] == {"role": "system", "content": "Be brief."}
    assert [es.max_tokens(s) for s in es.samples] == [16, 8]
    before = es.sha256
    path.write_text(path.read_text() + json.dumps(line(id="d")) + "\n")
    assert load_evalset(path).sha256 != before


def test_default_set_is_valid_and_balanced():
    es = load_evalset(EVAL_SETS / "default.jsonl", max_context=2048)
    cats = Counter(s.category for s in es.samples)
    assert len(es.samples) == 300 and set(cats.values()) == {50} and len(cats) == 6
    assert {m for s in es.samples for m in s.metrics} == set(es.meta.metrics) <= set(load_table())
    assert len({s.prompt for s in es.samples}) == 300  # no repeated prompt
    assert max(len(s.prompt_text()) for s in es.samples) < 400  # short prompts for a small model


def test_stratified_subset_covers_every_category_in_file_order():
    from types import SimpleNamespace

    from quantgate.evals.dataset import stratified_subset

    rows = [SimpleNamespace(id=f"{c}{i}", category=c) for c in "abc" for i in range(5)]
    sub = stratified_subset(rows, 7)
    assert [r.category for r in sub] == ["a", "a", "a", "b", "b", "c", "c"]  # every category its share
    assert sub == sorted(sub, key=rows.index)  # in file order
    assert [r.id for r in sub] != ["a0", "a1", "a2", "b0", "b1", "c0", "c1"]  # a draw, not the first ids
    assert stratified_subset(rows, None) == rows and stratified_subset(rows, 99) == rows
