"""Needle prompts and recall scoring: determinism, placement measured with the demo tokenizer, refusal, scores."""

from __future__ import annotations

import re

import jinja2
import pytest
from tokenizers import Tokenizer

from quantgate.base.errors import QuantgateError
from quantgate.recall import needle as nd, score as rs
from quantgate.recall.run import load_filler, load_needle_data


def demo_counter(model_dir) -> nd.TokenCounter:
    """The demo model's own tokenizer and chat template without importing transformers (fast)."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    template = jinja2.Template((model_dir / "chat_template.jinja").read_text(encoding="utf-8"))

    def text(s: str) -> int:
        return len(tok.encode(s, add_special_tokens=False).ids)

    return nd.TokenCounter(text=text, chat=lambda m: text(template.render(messages=m, add_generation_prompt=True)))


@pytest.fixture(scope="module")
def kit(demo_model):
    return {"data": load_needle_data(), "filler": load_filler(), "counter": demo_counter(demo_model)}


def grid(kit, lengths=(512,), depths=(0, 50, 100), kinds=nd.KINDS, samples=1, seed=0):
    return nd.build_grid(lengths, depths, kinds, samples, seed=seed, **kit)


def document(p: nd.RecallPrompt) -> str:
    return re.search(r"<document>\n(.*)\n</document>", p.messages[-1]["content"], re.S).group(1)


def test_same_seed_same_prompts_other_seed_other_prompts(kit):
    a, b = grid(kit, seed=7), grid(kit, seed=7)
    assert [p.messages for p in a] == [p.messages for p in b] and [p.id for p in a] == [p.id for p in b]
    c = grid(kit, seed=8)
    assert all(x.messages != y.messages for x, y in zip(a, c))
    assert len({p.id for p in a}) == len(a)


@pytest.mark.parametrize("length", [256, 1024, 2048])
def test_needle_starts_at_the_requested_depth_within_tolerance(kit, length):
    tol, count = kit["data"].depth_tolerance_tokens, kit["counter"].text
    longest = max(count(" " + s) for s in kit["filler"])
    for p in grid(kit, lengths=(length,), depths=(0, 10, 25, 50, 75, 90, 100)):
        doc = document(p)
        first = doc.index(p.expected[0])
        prev_stop = doc.rfind(". ", 0, first)  # the needle sentence starts after the previous sentence's full stop
        start_char = prev_stop + 2 if prev_stop >= 0 else 0
        before = count(doc[:start_char].rstrip())
        block_end = doc.index(p.expected[-1]) + len(p.expected[-1]) + 1  # through the block's final full stop
        needle = count(doc[:block_end]) - before
        target = p.depth / 100 * (count(doc) - needle)
        assert abs(before - target) <= tol, (p.id, before, target)
        assert p.needle_token_start == before  # the recorded placement is the measured one
        # the whole prompt never exceeds the target, and misses it by less than two filler sentences
        assert length - 2 * longest - 4 < count_chat(kit, p) <= length == p.length
        assert count_chat(kit, p) == p.prompt_tokens


def count_chat(kit, p):
    return kit["counter"].chat(p.messages)


def test_each_value_occurs_once_and_multi_holds_n_facts_asking_k(kit):
    spec = kit["data"].multi
    for p in grid(kit, samples=2):
        doc = document(p)
        for v in (*p.expected, *p.other_values):
            assert doc.count(v) == 1, (p.id, v)
        if p.kind == "multi":
            assert (len(p.expected), len(p.expected) + len(p.other_values)) == (spec.k, spec.n)
            question = p.messages[-1]["content"].rsplit("Question:", 1)[1]
            assert not any(v in question for v in p.expected)


def test_multilingual_needles_use_the_other_languages(kit):
    prompts = grid(kit, lengths=(256,), depths=(0, 25, 50, 75, 100), kinds=("multilingual",), samples=4)
    assert {p.lang for p in prompts} == set(kit["data"].multilingual)
    zh = next(p for p in prompts if p.lang == "zh")
    assert re.fullmatch(r"[\u4e00-\u9fff]{3}", zh.expected[0]) and "？" in zh.messages[-1]["content"]


@pytest.mark.parametrize("answer", [1, 32, 100])
@pytest.mark.parametrize("spare", [0, -1, -40])
def test_prompts_that_do_not_fit_are_refused_with_the_numbers(kit, answer, spare):
    prompts = grid(kit, lengths=(512,), depths=(0, 100), kinds=("number", "multi"))
    worst = max(p.prompt_tokens for p in prompts)
    max_model_len = worst + answer + spare  # spare 0: the longest prompt plus its answer fills the context exactly
    if spare >= 0:
        nd.check_fits(prompts, max_model_len, answer)
        return
    with pytest.raises(QuantgateError) as err:
        nd.check_fits(prompts, max_model_len, answer)
    assert f"{worst} prompt tokens + {answer} answer tokens > max_model_len {max_model_len}" in err.value.message
    n_over = sum(p.prompt_tokens > max_model_len - answer for p in prompts)
    assert err.value.message.startswith(f"{n_over} of {len(prompts)} prompts")


@pytest.mark.parametrize("lengths,ctx,answer,bad", [([1024, 2048], 2048, 32, "2048"), ([1024], 2048, 32, None),
                                                     ([2016], 2048, 32, None), ([2017, 4096], 2048, 32, "2017, 4096")])
def test_lengths_beyond_the_context_are_refused(lengths, ctx, answer, bad):
    if bad is None:
        nd.check_lengths(lengths, ctx, answer, "test")
        return
    with pytest.raises(QuantgateError) as err:
        nd.check_lengths(lengths, ctx, answer, "test")
    assert f"length(s) {bad} + {answer} answer tokens exceed the context of {ctx}" in err.value.message


def test_a_length_too_short_for_the_needle_is_an_error(kit):
    with pytest.raises(QuantgateError, match="too short"):
        grid(kit, lengths=(60,), depths=(0,), kinds=("multi",))


@pytest.mark.parametrize("text,option,error", [("number,nam", "kinds", "nam"), ("", "kinds", "none given"),
                                               ("0,150", "depths", "150"), ("a,b", "depths", "integers")])
def test_bad_grid_options(text, option, error):
    with pytest.raises(QuantgateError, match=error):
        nd.parse_kinds(text) if option == "kinds" else nd.parse_ints(text, "--depths", 0, 100)


@pytest.mark.parametrize("value,output,hit", [
    ("4821337", "The code is 4821337.", True),
    ("4821337", "4 821 337", True),
    ("4821337", "4,821,337", True),
    ("4821337", "14821337", False),
    ("4821337", "482133", False),
    ("4821337", "４８２１３３７", True),  # full-width digits (NFKC)
    ("Velquin Zeltho", "velquin  ZELTHO.", True),
    ("Velquin Zeltho", "Velquin-Zeltho", True),
    ("Velquin Zeltho", "Velquin Zelthor", False),
    ("Bélor Çomirê", "Il s'appelle Bélor Çomirê.", True),
    ("Bélor Çomirê", "Belor Comire", False),  # diacritics are part of the name
    ("蔺瑛玥", "管理员名叫蔺瑛玥。", True),
    ("蔺瑛玥", "管理员名叫蔺瑛。", False),
])
def test_found_after_normalization(value, output, hit):
    assert rs.found(value, output) is hit


def test_score_counts_each_asked_value_and_reports_others():
    s = rs.score("1111111 and 3333333", ["1111111", "2222222"], ["3333333", "4444444"])
    assert (s["found"], s["recall"], s["exact"], s["others_found"]) == ([True, False], 0.5, False, 1)


def _rec(i, length, depth, kind, recall, error=None, lang="en"):
    return {"id": i, "length": length, "depth": depth, "kind": kind, "lang": lang, "error": error,
            "recall": None if error else recall, "exact": None if error else recall == 1.0}


def test_cells_average_answered_requests_and_count_errors():
    recs = [_rec("a", 256, 0, "number", 1.0), _rec("b", 256, 0, "number", 0.0), _rec("c", 256, 0, "number", 0, "HTTP 500"),
            _rec("d", 512, 50, "multi", 0.5), _rec("e", 512, 50, "multi", 1.0, lang="en")]
    out = rs.cells(recs)
    cell = {(c["length"], c["depth"], c["kind"]): c for c in out["cells"]}
    assert cell[(256, 0, "number")] == {"length": 256, "depth": 0, "kind": "number", "n": 2, "n_error": 1, "recall": 0.5, "exact": 0.5}
    assert cell[(512, 50, "multi")]["recall"] == 0.75 and cell[(512, 50, "multi")]["exact"] == 0.5
    assert out["overall"]["n"] == 4 and out["overall"]["recall"] == pytest.approx(2.5 / 4)


def test_compare_pairs_by_id_and_gives_cell_and_overall_deltas():
    base = [_rec("a", 256, 0, "number", 1.0), _rec("b", 256, 50, "number", 1.0), _rec("c", 256, 50, "name", 0.0),
            _rec("x", 256, 0, "name", 1.0)]
    cand = [_rec("a", 256, 0, "number", 0.0), _rec("b", 256, 50, "number", 1.0), _rec("c", 256, 50, "name", 1.0),
            _rec("y", 256, 0, "name", 1.0)]
    d = rs.compare(base, cand)
    assert (d["n_paired"], d["n_base_only"], d["n_cand_only"]) == (3, 1, 1)
    by = {(c["depth"], c["kind"]): c["delta"] for c in d["cells"]}
    assert by == {(0, "number"): -1.0, (50, "name"): 1.0, (50, "number"): 0.0}
    assert d["overall"]["delta"] == pytest.approx(0.0) and d["regressions"] == ["a"] and d["improvements"] == ["c"]
    with pytest.raises(QuantgateError, match="share no prompt"):
        rs.compare(base[:1], [_rec("z", 256, 0, "number", 1.0)])


def test_shipped_filler_has_no_digits_and_short_sentences(kit):
    assert not [s for s in kit["filler"] if re.search(r"\d", s)]
    longest = max(kit["counter"].text(" " + s) for s in kit["filler"])
    assert longest < 2 * kit["data"].depth_tolerance_tokens - 4  # half a sentence + joins stays within tolerance
