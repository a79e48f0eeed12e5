"""Needle prompts, packed haystacks, pacing and recall scoring: determinism, placement measured with the demo
tokenizer, answer caps, grid cost, refusal, scores, clustering, and the pacer's admission and deadlines (pure)."""

from __future__ import annotations

import re
from pathlib import Path
from statistics import NormalDist

import jinja2
import pytest
from tokenizers import Tokenizer

from quantgate.base.errors import QuantgateError
from quantgate.recall import haystack as hs, needle as nd, score as rs
from quantgate.gate.policy import load_policy
from quantgate.gate.sizing import recall_sizing
from quantgate.recall.pace import SAFETY, Pacer
from quantgate.recall.run import load_filler, load_needle_data

REPO = Path(__file__).resolve().parents[1]


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


def grid(kit, lengths=(512,), depths=(0, 50, 100), kinds=nd.KINDS, samples=1, seed=0, ask="single", max_answer_tokens=32):
    return hs.build_grid(lengths, depths, kinds, samples, seed=seed, ask=ask, max_answer_tokens=max_answer_tokens, **kit)


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
@pytest.mark.parametrize("ask", ["single", "turns", "together"])
def test_prompts_that_do_not_fit_are_refused_with_the_numbers(kit, answer, spare, ask):
    prompts = grid(kit, lengths=(512,), depths=(0, 100), kinds=("number", "multi"), max_answer_tokens=answer, ask=ask)
    worst = max(prompts, key=lambda p: p.prompt_tokens + p.max_tokens)
    max_model_len = worst.prompt_tokens + worst.max_tokens + spare  # spare 0: the longest request fills the context
    if spare >= 0:
        nd.check_fits(prompts, max_model_len)
        return
    with pytest.raises(QuantgateError) as err:
        nd.check_fits(prompts, max_model_len)
    assert (f"{worst.prompt_tokens} prompt tokens + {worst.max_tokens} answer tokens > max_model_len {max_model_len}"
            in err.value.message)
    n_over = sum(p.prompt_tokens + p.max_tokens > max_model_len for p in prompts)
    assert err.value.message.startswith(f"{n_over} of {len(prompts)} prompts")


@pytest.mark.parametrize("cap", [4, 32, 100])
def test_answer_caps_cover_the_asked_facts_and_never_pass_the_cap(kit, cap):
    count = kit["counter"].text
    for ask in ("single", "turns"):
        for p in grid(kit, ask=ask, max_answer_tokens=cap):
            doc = document(p)
            facts = [s for s in re.split(r"(?<=[.。]) ", doc) if any(v in s for v in p.expected)]
            need = count(" ".join(facts)) + nd.ANSWER_SLACK
            assert p.max_tokens == min(cap, need), (p.id, p.max_tokens, need)
    together = grid(kit, ask="together", depths=(0, 50, 100), max_answer_tokens=cap)
    by_request = {}
    for p in together:
        by_request.setdefault(p.request, []).append(p)
    for ps in by_request.values():  # one request asks the haystack's three needles: their caps and a line number each
        single = [min(cap, count(" ".join(s for s in re.split(r"(?<=[.。]) ", document(p)) if any(v in s for v in p.expected)))
                      + nd.ANSWER_SLACK) for p in ps]
        assert len(ps) == 3 and ps[0].max_tokens == sum(single) + 2 * 3


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


# --- packed haystacks (layouts turns and together) ------------------------------------------------------------------

def _needle_start(kit, doc: str, value: str) -> int:
    """Tokens before the sentence holding `value`, measured in the document as in the single-layout test."""
    first = doc.index(value)
    prev_stop = max(doc.rfind(". ", 0, first), doc.rfind("。", 0, first))
    start_char = 0 if prev_stop < 0 else prev_stop + (2 if doc[prev_stop] == "." else 1)
    return kit["counter"].text(doc[:start_char].rstrip()) if start_char else 0


@pytest.mark.parametrize("length", [512, 1024, 2048])
def test_a_turns_haystack_holds_one_needle_per_depth_each_asked_over_the_same_document(kit, length):
    depths = (0, 25, 50, 75, 100)
    prompts = grid(kit, lengths=(length,), depths=depths, ask="turns")
    tol = kit["data"].depth_tolerance_tokens
    for kind in nd.KINDS:
        ps = [p for p in prompts if p.kind == kind]
        assert [p.depth for p in ps] == list(depths) and len({p.haystack for p in ps}) == 1
        assert len({p.id for p in ps}) == len({p.request for p in ps}) == len(depths)  # one question per needle
        doc = document(ps[0])
        assert all(document(p) == doc for p in ps)  # the haystack is the shared prefix of every question
        prefix = ps[0].messages[-1]["content"].split("</document>")[0]
        assert all(p.messages[-1]["content"].startswith(prefix) for p in ps)
        values = [v for p in ps for v in p.expected]
        assert len(set(values)) == len(values) and all(doc.count(v) == 1 for v in values)
        for p in ps:
            assert set(p.other_values) >= set(values) - set(p.expected) and not set(p.other_values) & set(p.expected)
            assert p.prompt_tokens == count_chat(kit, p) <= length
            measured = _needle_start(kit, doc, p.expected[0])
            assert abs(measured - p.target_token_start) <= tol and p.needle_token_start == measured, (p.id, measured)
        assert ps[0].shared_tokens < min(p.prompt_tokens for p in ps) and ps[0].shared_tokens > 0.9 * length - 100


def test_haystacks_of_every_kind_share_their_filler_at_one_length(kit):
    prompts = grid(kit, lengths=(1024,), depths=(50, 100), ask="turns")
    heads = {p.kind: document(p)[:200] for p in prompts}
    assert len(set(heads.values())) == 1  # same filler text up to the first needle, whatever the kind
    other = grid(kit, lengths=(1024,), depths=(50, 100), ask="turns", seed=1)
    assert document(other[0])[:200] != heads["number"]


def test_together_asks_every_needle_of_a_haystack_in_one_request(kit):
    prompts = grid(kit, lengths=(1024,), depths=(0, 50, 100), ask="together", samples=2)
    requests = {}
    for p in prompts:
        requests.setdefault(p.request, []).append(p)
    assert len(requests) == len(nd.KINDS) * 2 and all(len(ps) == 3 for ps in requests.values())
    for ps in requests.values():
        question = ps[0].messages[-1]["content"].rsplit("Question:", 1)[1]
        assert all(p.messages == ps[0].messages for p in ps)
        assert [line[:3] for line in question.strip().splitlines()[1:]] == ["1. ", "2. ", "3. "]
        assert len({p.id for p in ps}) == 3  # three observations, one request


def test_grid_cost_counts_each_haystack_once_when_questions_share_it(kit):
    kw = dict(lengths=(512, 1024), depths=(0, 25, 50, 75, 100), kinds=nd.KINDS)
    single, turns, together = (hs.cost(grid(kit, ask=a, samples=s, **kw)) for a, s in
                               (("single", 1), ("turns", 2), ("together", 2)))
    assert single["needles"] == single["requests"] == single["haystacks"] == 2 * 5 * 4
    assert single["prompt_tokens_computed"] == single["prompt_tokens"]
    assert turns["needles"] == turns["requests"] == 2 * single["needles"] and turns["haystacks"] == 2 * 4 * 2
    assert turns["cells"] == single["cells"] == 40
    assert turns["prompt_tokens_computed"] < 0.5 * single["prompt_tokens"]  # twice the needles, under half the work
    assert turns["prompt_tokens"] > 4 * turns["prompt_tokens_computed"]  # what the prefix cache saves
    assert together["requests"] == together["haystacks"] and together["needles"] == turns["needles"]


@pytest.mark.parametrize("kind,depths,words", [
    ("name", range(0, 100, 11), ["10 distinct name subjects", "the needle data has 8"]),  # 10 depths, 8 subjects
    ("multi", range(0, 100, 13), ["18 distinct multi subjects", "has 16"]),  # 8 depths x k=2 + (n - k)=2 = 18
])
def test_more_depths_than_distinct_keys_are_refused(kit, kind, depths, words):
    with pytest.raises(QuantgateError) as err:
        grid(kit, lengths=(2048,), depths=list(depths), kinds=(kind,), ask="turns")
    assert all(w in err.value.message for w in words), err.value.message


def test_repeated_depths_and_unknown_layouts_are_refused(kit):
    with pytest.raises(QuantgateError, match="repeated depths"):
        grid(kit, depths=(0, 50, 50), ask="turns")
    with pytest.raises(QuantgateError, match="unknown layout"):
        grid(kit, ask="pairs")


# --- clustering ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("groups,icc,deff", [
    ([[1, 1, 1], [0, 0, 0], [1, 1, 1], [0, 0, 0]], 1.0, 3.0),  # needles of a haystack move together
    ([[1, 0, 1, 0], [1, 0, 1, 0], [0, 1, 0, 1]], 0.0, 1.0),  # no haystack effect at all
    ([[1, 1], [1, 1], [1, 1]], None, None),  # nothing varies: nothing to estimate
    ([[1, 0, 0]], None, None),  # one cluster
])
def test_cluster_effect(groups, icc, deff):
    out = rs.cluster_effect(groups)
    assert (out["icc"], out["design_effect"]) == (icc, deff)
    assert out["n"] == sum(map(len, groups)) and out["clusters"] == len(groups)
    if deff:
        assert out["n_effective"] == pytest.approx(out["n"] / deff, abs=0.05)


def test_a_kind_that_is_hard_everywhere_is_not_counted_as_haystack_dependence():
    # two kinds, two haystacks each: every number needle found, no name needle found, nothing else differs
    recs = [{**_rec(f"{k}{h}{d}", 512, d, k, 1.0 if k == "number" else 0.0), "haystack": f"{k}{h}"}
            for k in ("number", "name") for h in "ab" for d in (0, 50, 100)]
    assert rs.cluster_effect([[r["recall"] for r in recs if r["haystack"] == h] for h in
                              ("numbera", "numberb", "namea", "nameb")])["icc"] == 1.0  # raw: all between haystacks
    within = rs.cells(recs)["observations"]["recall_within_haystack"]
    assert within["icc"] is None and within["n"] == 12 and within["clusters"] == 4  # centred on the kind: no effect


def test_compare_reports_requests_haystacks_and_the_clustering_of_paired_differences():
    def rec(i, hay, recall):
        return {**_rec(i, 512, int(i[-1]) * 50, "number", recall), "haystack": hay, "request": i}
    base = [rec(f"{h}-{d}", h, 1.0) for h in "abcd" for d in "012"]
    cand = [rec(f"{h}-{d}", h, 0.0 if h in "ab" else 1.0) for h in "abcd" for d in "012"]
    d = rs.compare(base, cand)
    assert (d["n_paired"], d["n_requests"], d["n_haystacks"]) == (12, 12, 4)
    assert d["paired_within_haystack"]["icc"] == 1.0 and d["paired_within_haystack"]["n_effective"] == 4.0
    cells = rs.cells(cand)
    assert cells["observations"]["needles"] == 12 and cells["observations"]["haystacks"] == 4


# --- pacing -------------------------------------------------------------------------------------------------------

def test_the_pacer_sends_one_request_until_it_has_measured_a_rate():
    p = Pacer(budget_s=300, max_requests=8)
    assert p.admit(4000) and p.deadline(4000) == 300 and p.rate is None
    p.start("a", 4000, now=0.0)
    assert not p.admit(10)  # no rate yet: one at a time
    p.finish("a", now=20.0, ok=True)
    assert p.rate == pytest.approx(200.0)  # 4000 tokens in 20 busy seconds


@pytest.mark.parametrize("inflight,new,admitted", [
    ([4000] * 7, 2000, True),  # 28,000 + 2,000 = 30,000 = 200 tok/s x 300 s / SAFETY
    ([4000] * 7, 2001, False),
    ([100] * 8, 10, False),  # max_requests
    ([], 10 ** 6, True),  # alone: always, whatever its size
])
def test_work_in_flight_stays_within_what_the_rate_finishes_before_the_deadline(inflight, new, admitted):
    p = Pacer(budget_s=300, max_requests=8, done_tokens=2000, busy_s=10.0)  # 200 tok/s
    for i, t in enumerate(inflight):
        p.start(str(i), t, now=100.0)
    assert p.admit(new) is admitted
    expected = max(300.0, SAFETY * (sum(inflight) + new) / 200.0)  # twice the time the work ahead needs, or more
    assert p.deadline(new) == pytest.approx(expected)
    if admitted and inflight:
        assert p.deadline(new) == 300.0  # admitted behind others: the work ahead fits half of the budget


def test_busy_time_counts_overlapping_requests_once_and_a_timeout_halves_the_rate():
    p = Pacer()
    p.start("a", 1000, now=0.0)
    p.start("b", 1000, now=1.0)
    p.finish("a", now=5.0, ok=True)
    p.finish("b", now=10.0, ok=True)
    assert p.busy_s == pytest.approx(10.0) and p.rate == pytest.approx(200.0)
    p.start("c", 500, now=50.0)  # idle time between 10 and 50 is not busy time
    p.finish("c", now=55.0, ok=False, timed_out=True)
    assert p.busy_s == pytest.approx(15.0) and p.rate == pytest.approx(0.5 * 2000 / 15.0)


# --- the recall check's power at a grid's size ---------------------------------------------------------------------

def test_recall_sizing_at_the_old_and_the_packed_grid():
    policy = load_policy(REPO / "releases" / "policies" / "default.yaml")
    st = policy.statistics
    alpha = st.false_reject * st.recall_share  # the recall family's own share (one recall check here)
    assert st.recall_share > 0
    k = NormalDist().inv_cdf(1 - alpha) + NormalDist().inv_cdf(st.power)
    for n, deff in ((60, 1.0), (120, 1.0), (120, 2.0), (180, 1.5)):
        s = recall_sizing(policy, n, other_checks=7, discordance=0.10, design_effect=deff)
        n_eff = int(n / deff)
        assert s.mdd == pytest.approx(max(k * (0.10 / n_eff) ** 0.5, k * k / n_eff))
        assert (s.check, s.n, s.limit) == ("recall", n, policy.recall.value)
    old, new = (recall_sizing(policy, n, other_checks=7).mdd for n in (60, 120))
    assert new < old and recall_sizing(policy, 120, other_checks=7, design_effect=2.0).mdd == pytest.approx(old)
