"""Eval data as teams keep it: Parquet, CSV, a folder saved by `datasets`, a chat log in OpenAI's messages format,
each with a column mapping and its own categories in the sidecar; every bad row named by file and row; the checks a
policy cannot feed from a team's set said before any work."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import datasets
import pytest

from quantgate.base.errors import ConfigError
from quantgate.base.paths import REPO
from quantgate.evals.dataset import load_evalset
from quantgate.evals.setsource import meta_path_for, samples_beside
from quantgate.evals.metrics import load_table
from quantgate.gate.feeding import Feed, SetShape, unfed
from quantgate.gate.sizing import slice_samples_needed
from quantgate.gate.policy import DEFAULT_POLICY, load_policy

META = """name: tickets
version: 1
default_max_tokens: 24
metrics:
  token_f1: {higher_is_better: true, aggregation: mean}
  exact_match: {higher_is_better: true, aggregation: mean}
categories:
  billing: Invoices and refunds.
  shipping: Where a parcel is.
source:
  columns: {id: ticket, prompt: question, references: answer, category: topic}
  defaults: {metrics: [token_f1, exact_match]}
"""
ROWS = [{"ticket": f"T{k}", "question": f"Where is parcel {k}?", "answer": f"In depot {k}.",
         "topic": "shipping" if k % 2 else "billing", "agent": "x"} for k in range(1, 7)]


def parquet_set(tmp_path: Path, rows: list[dict] = ROWS, meta: str = META) -> Path:
    path = tmp_path / "tickets.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    meta_path_for(path).write_text(meta, encoding="utf-8")
    return path


def refused(path: Path) -> str:
    """Every problem the load names, one 'where: what' per line (the first one's place heads the message)."""
    with pytest.raises(ConfigError) as err:
        load_evalset(path)
    first, *rest = err.value.render().splitlines()
    where, head = first.split(": ", 1)
    return "\n".join([f"{where}: {head.split(' in the eval set: ', 1)[-1]}", head, *(x.strip() for x in rest)])


def test_a_parquet_set_with_its_own_columns_and_categories_loads(tmp_path):
    es = load_evalset(parquet_set(tmp_path))
    assert [s.id for s in es.samples] == [f"T{k}" for k in range(1, 7)]
    first = es.samples[0]
    assert first.chat() == [{"role": "user", "content": "Where is parcel 1?"}]
    assert first.references == ["In depot 1."] and first.metrics == ["token_f1", "exact_match"]
    assert Counter(s.category for s in es.samples) == {"billing": 3, "shipping": 3}
    assert es.lines["T3"] == 3 and es.dataset is not None and len(es.dataset) == 6  # rows, 1-based
    before = es.sha256
    parquet_set(tmp_path, ROWS[:5])
    assert load_evalset(tmp_path / "tickets.parquet").sha256 != before


def test_bad_parquet_rows_are_named_by_row_and_field(tmp_path):
    rows = [dict(r) for r in ROWS]
    rows[1]["answer"] = None                     # row 2: no reference
    rows[3]["topic"] = "shiping"                 # row 4: a category the sidecar does not declare
    rows[4]["ticket"] = "T1"                     # row 5: a duplicate id
    text = refused(parquet_set(tmp_path, rows))
    where = tmp_path / "tickets.parquet"
    assert f"{where}:row 2: field 'references'" in text
    assert f"{where}:row 4: field 'category': category 'shiping' (did you mean 'shipping'?) is not declared" in text
    assert f"{where}:row 5: duplicate id 'T1' (first at row 1)" in text
    assert "3 problem(s)" in text and "correct the rows named above" in text


def test_a_set_without_a_category_column_or_default_says_how_to_give_one(tmp_path):
    rows = [{k: v for k, v in r.items() if k != "topic"} for r in ROWS]
    text = refused(parquet_set(tmp_path, rows, META.replace(", category: topic", "")))
    assert "row 1: no category: map a column to it (source.columns.category) or give source.defaults.category" in text
    with pytest.raises(ConfigError) as err:  # mapped to a column the file does not have: said once, at the mapping
        load_evalset(parquet_set(tmp_path, rows))
    assert err.value.where == f"{tmp_path / 'tickets.meta.yaml'}:11 field 'source.columns.category'"
    assert "maps column 'topic', which the file does not have; its columns: ticket, question, answer, agent" \
        in err.value.message and "source.defaults" in err.value.fix, err.value.render()


def test_a_csv_set_takes_text_cells_for_its_lists(tmp_path):
    path = tmp_path / "qa.csv"
    path.write_text('ticket,question,answer,topic\nT1,Two plus two?,"[""4"", ""four""]",billing\nT2,Capital of Peru?,'
                    'Lima,shipping\n', encoding="utf-8")
    meta_path_for(path).write_text(META, encoding="utf-8")
    es = load_evalset(path)
    assert [s.references for s in es.samples] == [["4", "four"], ["Lima"]]


def test_a_datasets_folder_with_splits_needs_one_named(tmp_path):
    folder = tmp_path / "tickets"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:2]),
                          "test": datasets.Dataset.from_list(ROWS[2:])}).save_to_disk(str(folder))
    meta_path_for(folder).write_text(META, encoding="utf-8")
    assert meta_path_for(folder) == tmp_path / "tickets.meta.yaml" and samples_beside(meta_path_for(folder)) == folder
    text = refused(folder)
    assert "the folder holds splits train, test" in text and "source.split" in text
    meta_path_for(folder).write_text(META.replace("source:\n", "source:\n  split: test\n"), encoding="utf-8")
    assert [s.id for s in load_evalset(folder).samples] == ["T3", "T4", "T5", "T6"]
    r = subprocess.run([sys.executable, "-m", "quantgate.cli", "check", str(folder), str(meta_path_for(folder))],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.splitlines() == [f"ok evalset {folder}"], r.stdout + r.stderr


CHAT_META = """name: traffic
version: 1
metrics: {token_f1: {higher_is_better: true, aggregation: mean}}
source: {format: chat, defaults: {category: production, metrics: [token_f1]}}
"""


def test_a_chat_log_replays_each_conversation_with_its_last_reply_as_reference(tmp_path):
    convo = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Hi, "}, {"type": "text", "text": "my order?"}]},
             {"role": "assistant", "content": "It ships today."}]
    path = tmp_path / "traffic.jsonl"
    lines = [{"messages": convo, "model": "prod-v3", "ts": 1}, {"messages": convo[:2]},
             {"messages": [*convo[:2], {"role": "tool", "content": "{}"}, convo[2]]}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    meta_path_for(path).write_text(CHAT_META, encoding="utf-8")
    text = refused(path)
    assert f"{path}:2: column 'messages': the last message is not an assistant reply" in text
    assert f"{path}:3: column 'messages': message 2: role 'tool'" in text
    path.write_text(json.dumps(lines[0]) + "\n", encoding="utf-8")
    (s,) = load_evalset(path).samples
    assert s.id == "row-1" and s.category == "production" and s.references == ["It ships today."]
    assert s.chat() == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, my order?"}]


def test_a_parquet_file_named_as_a_jsonl_set_says_it_is_not_text(tmp_path):
    """Before sets declared a source, a Parquet file got 'not UTF-8: byte ...'; under a .parquet name it loads."""
    path = parquet_set(tmp_path)
    assert load_evalset(path).samples
    renamed = path.rename(tmp_path / "tickets.jsonl")
    assert "not UTF-8" in refused(renamed)


def test_the_default_policy_says_which_checks_a_teams_own_set_cannot_feed():
    policy = load_policy(DEFAULT_POLICY)
    binary = {n for n, m in load_table().items() if m.binary}
    own = SetShape("tickets", {"billing": Counter({"token_f1": 30}), "proper_noun": Counter({"token_f1": 4})})
    found = unfed(policy, Feed([own], binary, fidelity={"billing": 30, "proper_noun": 4}))
    text = "\n".join(map(str, found))
    assert "primary: no sample of any eval set is scored with exact_match or numeric_match or choice_accuracy" in text
    assert "pooled: no sample is scored with a binary metric" in text
    assert "category:proper_nouns: does not apply: no eval set has category 'proper_nouns' (did you mean " \
           "'proper_noun'?)" in text
    assert "fidelity per category: proper_noun 4 fidelity samples, fewer than fidelity.min_category_samples=10" in text
    assert "INCONCLUSIVE on every run: this release cannot PROMOTE" in text
    # its own categories are checked (own_categories): proper_noun's 4 samples are too few to judge
    assert "category:tickets/proper_noun: 4 samples of category 'proper_noun' scored with token_f1, fewer than " \
           "min_samples=10 (own_categories)" in text and "category:tickets/billing" not in text
    assert {str(u).split(":")[0] for u in found if u.blocks} == {"primary", "pooled", "fidelity per category",
                                                                  "category"}
    fed = SetShape("default", {c: Counter({"exact_match": 50, "numeric_match": 50, "chrf": 50})
                               for c in ("arithmetic_numbers", "proper_nouns", "multilingual")})
    assert unfed(policy, Feed([fed], binary, fidelity={c: 50 for c in fed.scored})) == []


def test_a_spec_that_measures_no_recall_under_a_policy_requiring_it_is_told_so():
    policy = load_policy(DEFAULT_POLICY)
    binary = {n for n, m in load_table().items() if m.binary}
    lines = [str(u) for u in unfed(policy, Feed([], binary, measured={"fidelity", "perf"}))]
    assert any(x.startswith("recall: the spec measures no recall (its `recall` section is off), so the check is "
                            "INCONCLUSIVE on every run") for x in lines), lines
    assert not any(x.startswith(("fidelity:", "pay_off:", "judge:")) for x in lines)  # measured, or optional


def test_a_recall_grid_too_small_to_judge_each_length_is_told_so():
    policy = load_policy(DEFAULT_POLICY)
    binary = {n for n, m in load_table().items() if m.binary}
    (line,) = [str(x) for x in unfed(policy, Feed([], binary, needles={512: 2})) if str(x).startswith("recall")]
    assert "2 recall needles in all, fewer than min_samples=10" in line and "INCONCLUSIVE on every run" in line
    (line,) = [str(x) for x in unfed(policy, Feed([], binary, needles={512: 20, 1024: 6})) if str(x).startswith("recall")]
    assert line.startswith("recall: 6 needles at 1024 tokens, fewer than min_samples=10")
    assert not [str(x) for x in unfed(policy, Feed([], binary, needles={512: 10, 1024: 10})) if str(x).startswith("recall")]


def test_a_speed_probe_of_one_repeat_under_a_ci_bound_is_told_so():
    policy = load_policy(DEFAULT_POLICY)
    binary = {n for n, m in load_table().items() if m.binary}
    (line,) = [str(x) for x in unfed(policy, Feed([], binary, perf_repeats=1)) if str(x).startswith("pay_off")]
    assert "the probe runs 1 repeat a side" in line and "set perf.repeats to 2 or more" in line
    assert not [str(x) for x in unfed(policy, Feed([], binary, perf_repeats=3)) if str(x).startswith("pay_off")]


def test_a_context_length_with_too_few_haystacks_names_context_prompts_not_the_eval_limit():
    """A context:<length> slice holds the haystacks sampled at that length: only fidelity.context_prompts grows it
    (the fix used to name fidelity.limit, which does not reach it)."""
    policy = load_policy(DEFAULT_POLICY)
    binary = {n for n, m in load_table().items() if m.binary}
    found = unfed(policy, Feed([], binary, fidelity={"billing": 40, "context:512": 6, "context:1024": 6}))
    (u,) = [u for u in found if str(u).startswith("fidelity")]
    assert u.blocks and str(u).startswith("fidelity per context length: context:1024 6, context:512 6 haystack "
                                          "prompts, fewer than fidelity.min_category_samples=10"), u
    need = slice_samples_needed(policy.fidelity.alpha, haystack=True)  # what bounds a good candidate, not only 10
    assert need >= 10 and str(u).endswith(f"fix: set fidelity.context_prompts to {need} or more in the spec")
    assert "fidelity.limit" not in str(u)
    few = unfed(policy, Feed([], binary, fidelity={"billing": 4, "context:512": 12}))
    (u,) = [u for u in few if str(u).startswith("fidelity")]
    assert str(u).startswith("fidelity per category: billing 4") and "a larger fidelity.limit" in str(u)
    assert "context_prompts" not in str(u)


def test_slices_with_enough_samples_to_judge_but_too_few_to_bound_are_foreseen():
    """An own-data release of 16 prompts per category came out INCONCLUSIVE in every slice; `check` counted only
    min_category_samples (10) and said nothing. The prediction (quantgate.gate.sizing, checked against the gate's
    own bounds by bench/fidelity_sizing.py) names each such slice, its predicted bound and the field's value."""
    from quantgate.gate.sizing import fidelity_bound_share, SPREAD
    policy = load_policy(DEFAULT_POLICY)
    binary = {n for n, m in load_table().items() if m.binary}
    (u,) = [u for u in unfed(policy, Feed([], binary, fidelity={"billing": 16, "refunds": 40, "context:512": 12}))
            if str(u).startswith("fidelity")]
    share = max(fidelity_bound_share(16, 0.05, *SPREAD["prompt"][m]) for m in ("kl", "top1"))
    assert u.blocks and str(u).startswith(f"fidelity per category: billing 16 (bound {share:.2f}x the limit) fidelity "
                                          "samples, too few to bound"), u
    assert "refunds" not in str(u) and "a larger fidelity.limit in the spec (about " \
        f"{slice_samples_needed(0.05, haystack=False)} prompts per category)" in str(u)
    # the demo's sizes (50 per category, 12 haystacks per length) are boundable: nothing said
    assert not [u for u in unfed(policy, Feed([], binary, fidelity={"billing": 50, "context:512": 12}))
                if str(u).startswith("fidelity")]
    # a smaller bound's level needs more: 18 prompts are enough at alpha 0.05, not at 0.01
    strict = policy.model_copy(update={"fidelity": policy.fidelity.model_copy(update={"alpha": 0.01})})
    for pol, short in ((policy, False), (strict, True)):
        said = [u for u in unfed(pol, Feed([], binary, fidelity={"billing": 18})) if str(u).startswith("fidelity")]
        assert bool(said) == short and (not short or "one-sided 99% bound" in str(said[0])), said
