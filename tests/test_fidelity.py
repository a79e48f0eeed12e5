"""Token-level fidelity: KL from top-k lists, per-sample sums, cluster-bootstrap summary (pure, table-driven), and
scoring through a real vLLM server of the demo model (slow): response shape, noise floor, resume, --max-logprobs."""

from __future__ import annotations

import json
from pathlib import Path
import math
import time

import httpx
import numpy as np
import pytest

from _fake_openai import FakeServer
from quantgate.base.errors import ConfigError, QuantgateError
from quantgate.base.paths import EVAL_SETS
from quantgate.fidelity import parts, run
from quantgate.fidelity.core import (FidelityInterval, FidelityStats, SampleFidelity, ScoredSample, compare_sample,
                                     kl_topk, merge_draws, needed_samples, score_position, summarize)
from quantgate.base.http import Endpoint

L = math.log
CORPUS = EVAL_SETS / "fidelity_corpus.txt"


# --- kl_topk -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("base,cand,expected", [
    # identical lists: exactly 0
    ({0: L(.6), 1: L(.3)}, {0: L(.6), 1: L(.3)}, 0.0),
    ({5: L(.999)}, {5: L(.999)}, 0.0),
    # same tokens, rest 0.1 on both sides: 0.6 ln(0.6/0.5) + 0.3 ln(0.3/0.4)
    ({0: L(.6), 1: L(.3)}, {0: L(.5), 1: L(.4)}, .6 * L(.6 / .5) + .3 * L(.3 / .4)),
    # token 1 missing on cand's side: min(cand's smallest 0.2, unlisted 0.1 / 1 missing) = 0.1; cand rest 0.2
    ({0: L(.6), 1: L(.3)}, {0: L(.7), 2: L(.2)}, .6 * L(.6 / .7) + .3 * L(.3 / .1) + .1 * L(.1 / .2)),
    # token 1 missing, cand's smallest listed (0.1) is below the unlisted mass (0.4): 0.1; cand rest 0.4
    ({0: L(.6), 1: L(.3)}, {0: L(.5), 2: L(.1)}, .6 * L(.6 / .5) + .3 * L(.3 / .1) + .1 * L(.1 / .4)),
    # two tokens missing share the unlisted mass 0.2 (0.1 each, below cand's smallest 0.3); cand rest 0.8 - 0.5 - 0.3
    ({0: L(.5), 1: L(.2), 2: L(.2)}, {0: L(.5), 3: L(.3)}, .5 * 0 + .2 * L(2) + .2 * L(2) + .1 * L(.1 / .3)),
])
def test_kl_topk_against_hand_computation(base, cand, expected):
    assert kl_topk(base, cand) == pytest.approx(expected, abs=1e-9)


def test_kl_is_exactly_zero_for_identical_inputs_and_nonnegative_otherwise():
    rng = np.random.default_rng(1)
    for _ in range(300):
        p = rng.dirichlet(np.ones(30))
        q = rng.dirichlet(np.ones(30))
        base = {int(t): float(np.log(p[t])) for t in np.argsort(-p)[:5]}
        cand = {int(t): float(np.log(q[t])) for t in np.argsort(-q)[:5]}
        assert kl_topk(base, dict(base)) == 0.0
        assert kl_topk(base, cand) >= 0.0


def test_kl_with_all_of_cands_mass_listed_is_large_but_finite():
    # cand puts all its mass on tokens base does not list: base's token gets ~0 probability, not a crash
    kl = kl_topk({0: L(.9)}, {1: L(.5), 2: L(.5)})
    assert math.isfinite(kl) and kl > 5


def test_kl_topk_refuses_empty_lists():
    with pytest.raises(QuantgateError):
        kl_topk({}, {0: 0.0})


def test_score_position_kl_is_the_log_ratio_and_topk_adds_the_actual_token():
    base, cand = {0: L(.6), 1: L(.3)}, {1: L(.6), 0: L(.3)}
    s = score_position(base, cand, token=7, base_lp=L(.05), cand_lp=L(.01))
    assert not s.top1_agree
    assert s.dnll == pytest.approx(-L(.01) + L(.05))  # candidate finds the token less likely: > 0
    # tokens 0 and 1 are in both lists: their part of the KL exactly; token 7 (outside them) by its log-ratio
    assert s.kl == pytest.approx(.6 * (L(.6) - L(.3)) + .3 * (L(.3) - L(.6)) + L(.05) - L(.01))
    apart = score_position({0: L(.6)}, {1: L(.6)}, token=7, base_lp=L(.05), cand_lp=L(.01))
    assert apart.kl == pytest.approx(L(.05) - L(.01))  # no token in both lists: the plain log-ratio
    shared = score_position({0: L(.6), 1: L(.3)}, {0: L(.5), 2: L(.3)}, token=0, base_lp=L(.6), cand_lp=L(.5))
    assert shared.kl == pytest.approx(.6 * (L(.6) - L(.5)))  # token 0 is in both lists: the exact head, no tail
    outside = score_position({0: L(.6), 1: L(.3)}, {0: L(.5), 2: L(.3)}, token=7, base_lp=L(.01), cand_lp=L(.02))
    assert outside.kl == pytest.approx(.6 * (L(.6) - L(.5)) + L(.01) - L(.02))
    assert s.kl_topk == pytest.approx(kl_topk({**base, 7: L(.05)}, {**cand, 7: L(.01)}, cand_ranked=cand))
    same = score_position(base, base, token=1, base_lp=L(.3), cand_lp=L(.3))
    assert same == (0.0, 0.0, True, 0.0)


def test_topk_guess_for_missing_tokens_ignores_a_far_down_actual_token():
    """The actual token (p 1e-7 on cand's side) joins cand's list, but the tokens cand does not list are guessed
    from cand's own top-k: before the fix every missing base token was guessed at 1e-7, reading the KL high."""
    base = {0: L(.5), 1: L(.3), 2: L(.1)}
    cand = {0: L(.5), 3: L(.3), 4: L(.1)}  # tokens 1 and 2 missing; cand's smallest listed is 0.1
    far = {**cand, 9: math.log(1e-7)}
    with_actual = kl_topk({**base, 9: math.log(1e-7)}, far, cand_ranked=cand)
    old_way = kl_topk({**base, 9: math.log(1e-7)}, far)  # guesses from the list with the far token in it
    assert with_actual < old_way / 3
    assert with_actual == pytest.approx(kl_topk({**base, 9: math.log(1e-7)}, far, cand_ranked=cand))


def test_sampled_estimate_is_unbiased_for_the_full_kl_and_less_noisy_than_the_log_ratio():
    """Tokens drawn from P_base: the gate's estimate converges on the exact full-vocabulary KL, with a smaller
    spread than the plain log-ratio; the top-k diagnostic on the same draws does not converge on it."""
    rng = np.random.default_rng(7)
    p = rng.dirichlet(np.full(200, 0.1))  # peaked, as a language model's next token mostly is
    q = p * np.exp(rng.normal(0, 0.4, 200))
    q /= q.sum()
    exact = float(np.sum(p * (np.log(p) - np.log(q))))
    top_b = {int(t): float(np.log(p[t])) for t in np.argsort(-p)[:10]}
    top_c = {int(t): float(np.log(q[t])) for t in np.argsort(-q)[:10]}
    scores = [score_position(top_b, top_c, int(x), float(np.log(p[x])), float(np.log(q[x])))
              for x in rng.choice(200, size=20000, p=p)]
    est, ratio = np.array([s.kl for s in scores]), np.array([s.dnll for s in scores])
    se = est.std() / math.sqrt(len(est))
    assert abs(est.mean() - exact) < 4 * se and abs(ratio.mean() - exact) < 4 * ratio.std() / math.sqrt(len(ratio))
    assert est.std() < 0.9 * ratio.std()
    assert abs(np.mean([s.kl_topk for s in scores]) - exact) > 4 * se


# --- compare_sample ----------------------------------------------------------------------------------------------

def _scored(id_: str, ids: list[int], tops: list[dict[int, float]], category: str = "c") -> ScoredSample:
    """A sample whose actual-token logprob is read from its own top list (or -5 when outside it)."""
    lp = [top.get(t, -5.0) for t, top in zip(ids[1:], tops)]
    return ScoredSample(id=id_, category=category, ids=ids, lp=lp, top=[(list(t), list(t.values())) for t in tops])


def test_compare_sample_sums_per_position():
    tops_a = [{3: L(.6), 4: L(.3)}, {5: L(.9)}]
    tops_b = [{4: L(.6), 3: L(.3)}, {5: L(.9)}]
    r = compare_sample(_scored("s1", [1, 3, 5], tops_a), _scored("s1", [1, 3, 5], tops_b))
    assert (r.n_tokens, r.top1_agree) == (2, 1)
    assert r.kl_topk_sum == pytest.approx(kl_topk(tops_a[0], tops_b[0])) and r.kl_max == pytest.approx(r.kl_topk_sum)
    assert r.dnll_sum == pytest.approx(-L(.3) + L(.6))
    first = score_position(tops_a[0], tops_b[0], 3, L(.6), L(.3))
    assert r.kl_sum == pytest.approx(first.kl)  # the second position agrees exactly: 0


def test_compare_sample_of_identical_dumps_is_zero():
    tops = [{3: L(.6), 4: L(.3)}, {5: L(.9), 6: L(.05)}]
    r = compare_sample(_scored("s", [1, 3, 5], tops), _scored("s", [1, 3, 5], tops))
    assert (r.kl_sum, r.top1_agree, r.dnll_sum, r.kl_max) == (0.0, 2, 0.0, 0.0)


@pytest.mark.parametrize("cand_ids", [[1, 3, 6], [2, 3, 5], [1, 3, 5, 6]])
def test_compare_sample_refuses_misaligned_ids(cand_ids):
    tops = [{3: L(.6)}] * (len(cand_ids) - 1)
    with pytest.raises(QuantgateError, match="sample 'q-7'"):
        compare_sample(_scored("q-7", [1, 3, 5], tops[:2]), _scored("q-7", cand_ids, tops))


def test_scored_sample_checks_its_lengths():
    with pytest.raises(ValueError):
        ScoredSample(id="x", category="c", ids=[1, 2, 3], lp=[0.0], top=[([2], [0.0])])


# --- summarize -----------------------------------------------------------------------------------------------------

def _sf(i: int, n: int, kl_mean: float, top1: float = 1.0, dnll_mean: float = 0.0, cat: str = "a") -> SampleFidelity:
    return SampleFidelity(id=f"s{i:03d}", category=cat, n_tokens=n, kl_sum=kl_mean * n, top1_agree=round(top1 * n),
                          dnll_sum=dnll_mean * n, kl_max=kl_mean)


def test_summary_pools_tokens_as_a_ratio_of_sums():
    s = summarize([_sf(0, 1, 1.0, top1=0.0, dnll_mean=2.0), _sf(1, 9, 0.0)], n_boot=200)
    assert s.kl.mean == pytest.approx(0.1)  # (1 + 0) / 10 tokens, not the mean of 1.0 and 0.0
    assert s.top1.mean == pytest.approx(0.9) and s.dnll.mean == pytest.approx(0.2)
    assert (s.n_samples, s.n_tokens) == (2, 10)


def test_summary_of_identical_samples_has_zero_width():
    s = summarize([_sf(i, 20, 0.0) for i in range(5)], n_boot=100)
    assert s.kl == FidelityInterval(mean=0.0, low=0.0, high=0.0, level=0.9)
    assert s.top1.mean == s.top1.low == s.top1.high == 1.0


def test_interval_contains_the_mean_and_narrows_with_more_samples():
    rng = np.random.default_rng(7)

    def width(n: int) -> float:
        samples = [_sf(i, int(rng.integers(20, 200)), float(rng.gamma(2.0, 0.01))) for i in range(n)]
        s = summarize(samples, n_boot=1000, seed=3)
        assert s.kl.low <= s.kl.mean <= s.kl.high and s.kl.level == 0.9
        return s.kl.high - s.kl.low

    assert width(400) < width(25) / 2


def test_summary_is_seeded_and_level_sets_the_width():
    samples = [_sf(i, 50, 0.01 * (i % 7)) for i in range(40)]
    a, b = summarize(samples, seed=1, n_boot=500), summarize(samples, seed=1, n_boot=500)
    assert a == b
    wide = summarize(samples, seed=1, n_boot=500, level=0.99)
    assert wide.kl.high - wide.kl.low > a.kl.high - a.kl.low and wide.kl.level == 0.99


def test_summary_per_category_and_worst_samples():
    samples = [_sf(i, 10, 0.001 * i, cat="qa" if i % 2 else "math") for i in range(30)]
    s = summarize(samples, n_boot=100)
    assert set(s.by_category) == {"math", "qa"}
    assert s.by_category["qa"].n_samples == 15 and isinstance(s.by_category["qa"], FidelityStats)
    assert [w.id for w in s.worst] == [f"s{i:03d}" for i in range(29, 19, -1)]
    assert s.worst[0].kl_mean == pytest.approx(0.029)


def test_summary_refuses_nothing_to_summarize():
    with pytest.raises(QuantgateError):
        summarize([])
    with pytest.raises(QuantgateError):
        summarize([_sf(0, 0, 0.0)])


def test_needed_samples():
    s = FidelityStats(n_samples=100, n_tokens=5000, kl=FidelityInterval(mean=0.01, low=0.006, high=0.014, level=0.9),
                      top1=FidelityInterval(mean=1, low=1, high=1, level=0.9),
                      dnll=FidelityInterval(mean=0, low=0, high=0, level=0.9))
    assert needed_samples(s, 0.012) == 400   # upper half-width 0.004 vs gap 0.002: (2)^2 x 100
    assert needed_samples(s, 0.018) == 25    # already under the limit: fewer than we have
    assert needed_samples(s, 0.01) is None and needed_samples(s, 0.005) is None


# --- adapter pieces without a server -------------------------------------------------------------------------------

# One element of `choices[0].prompt_logprobs` as vLLM 0.32 (CPU) returned it for prompt_logprobs=3: the actual token
# (" France", rank 2617) is listed first, outside the top 3.
ROW = {"4649": {"logprob": -10.316598892211914, "rank": 2617, "decoded_token": " France"},
       "260": {"logprob": -1.5831178426742554, "rank": 1, "decoded_token": " the"},
       "216": {"logprob": -4.26771879196167, "rank": 2, "decoded_token": " "},
       "253": {"logprob": -4.402818202972412, "rank": 3, "decoded_token": " a"}}


def test_parse_reads_the_actual_token_and_the_ranked_top_k():
    seq = run.Sequence(id="x", category="c", token_ids=[1, 4649, 260])
    row2 = {"260": {"logprob": -0.5, "rank": 1, "decoded_token": " the"},
            "11": {"logprob": -2.0, "rank": 2, "decoded_token": "b"}, "12": {"logprob": -3.0, "rank": 3, "decoded_token": "c"}}
    rec = run._parse({"choices": [{"prompt_logprobs": [None, ROW, row2]}]}, seq, top_k=3)
    assert rec["lp"] == [ROW["4649"]["logprob"], -0.5]
    assert rec["top"][0] == [[260, 216, 253], [ROW["260"]["logprob"], ROW["216"]["logprob"], ROW["253"]["logprob"]]]
    assert rec["top"][1][0] == [260, 11, 12]
    ScoredSample.model_validate(rec)
    with pytest.raises(ValueError):  # a row count that does not match the tokens
        run._parse({"choices": [{"prompt_logprobs": [None, ROW]}]}, seq, top_k=3)


def test_a_refused_top_k_names_the_server_flag():
    text = ('{"error":{"message":"Requested prompt logprobs of 10, which is greater than max allowed: 2 '
            '(parameter=prompt_logprobs, value=10)","type":"BadRequestError","param":"prompt_logprobs","code":400}}')
    err = run._fatal(400, text, 10, "demo")
    assert isinstance(err, ConfigError) and "--max-logprobs 10" in str(err)
    assert run._fatal(400, '{"error":{"message":"maximum context length is 2048"}}', 10, "demo") is None
    assert run._fatal(503, "busy", 10, "demo") is None


def test_stratified_limit_is_deterministic_and_covers_categories():
    items = [{"id": f"{c}-{i}", "category": c} for c in ("b", "a", "c") for i in range(5, 0, -1)]
    items += [{"id": "z-1", "category": "z"}]
    picked = run.stratified(items, 6)
    assert picked == run.stratified(list(reversed(items)), 6)  # the draw, not the file's order, decides
    assert [it["category"] for it in picked] == ["a", "b", "c", "z", "a", "b"]  # round-robin over sorted categories
    assert run.stratified(items, None) == items


def test_sequences_hash_ignores_order_and_sees_tokens():
    a = run.Sequence(id="a", category="c", token_ids=[1, 2, 3])
    b = run.Sequence(id="b", category="c", token_ids=[4, 5])
    b2 = run.Sequence(id="b", category="c", token_ids=[4, 6])
    assert run.sequences_hash([a, b]) == run.sequences_hash([b, a]) != run.sequences_hash([a, b2])


def test_corpus_passages():
    passages = run.corpus_passages(CORPUS)
    assert 6 <= len(passages) <= 20 and any(any(ord(ch) > 0x3000 for ch in p) for p in passages)


def test_a_torn_last_line_is_dropped_and_a_foreign_dump_refused(tmp_path):
    seq = run.Sequence(id="a", category="c", token_ids=[1, 2])
    line = {"id": "a", "category": "c", "ids": [1, 2], "score_from": 1, "lp": [-1.0], "top": [[[2], [-1.0]]]}
    path = tmp_path / run.DUMP
    path.write_text(json.dumps(line) + "\n" + '{"id": "b", "categ')
    assert run._kept(path, [seq], top_k=1) == {"a"}
    assert path.read_text().endswith("\n") and path.read_text().count("\n") == 1
    with pytest.raises(QuantgateError, match="other tokens or with another top-k"):
        run._kept(path, [seq], top_k=5)
    with pytest.raises(QuantgateError, match="other tokens"):
        run._kept(path, [run.Sequence(id="a", category="c", token_ids=[1, 3])], top_k=1)


def _dump(folder: Path, ids: list[str]) -> Path:
    folder.mkdir(parents=True)
    lines = [{"id": i, "category": i.split("-")[0], "ids": [1, 2, 3], "score_from": 1, "lp": [-1.0, -0.5],
              "top": [[[2, 4], [-1.0, -2.0]], [[3, 4], [-0.5, -2.0]]]} for i in ids]
    (folder / run.DUMP).write_text("".join(json.dumps(x) + "\n" for x in lines))
    (folder / run.MANIFEST).write_text(json.dumps({"status": "complete"}))
    return folder


def test_the_floor_scores_a_stratified_subset_and_is_compared_on_it(tmp_path):
    from quantgate.fidelity.stream import FLOOR_CONTEXT, floor_ids

    ids = [f"{c}-{k}" for c in ("qa", "math", "context:4096", "context:1024") for k in range(10)]
    seqs = [run.Sequence(id=i, category=i.split("-")[0], token_ids=[1, 2, 3], score_from=1) for i in ids]
    keep = floor_ids(seqs, 9)
    picked = [s for s in seqs if s.id in keep]
    assert floor_ids([{"id": s.id, "category": s.category} for s in seqs], 9) == keep  # lines as prompts
    by_cat = {c: sum(s.category == c for s in picked) for c in ("qa", "math", "context:4096", "context:1024")}
    # every category is there; a haystack (its prefill the cost) at most FLOOR_CONTEXT times per length
    assert len(picked) == 9 and by_cat["context:4096"] == by_cat["context:1024"] == FLOOR_CONTEXT
    assert by_cat["qa"] + by_cat["math"] == 9 - 2 * FLOOR_CONTEXT and min(by_cat.values()) > 0
    assert floor_ids(seqs, None) == set(ids)
    main, alt = _dump(tmp_path / "main", ids), _dump(tmp_path / "alt", [s.id for s in picked])
    floor = run.compare_dumps(main, alt, subset=True)
    assert sorted(f.id for f in floor) == sorted(s.id for s in picked) and all(f.kl_sum == 0 for f in floor)
    with pytest.raises(QuantgateError, match="different samples"):  # a candidate must hold every sequence
        run.compare_dumps(main, alt)
    with pytest.raises(QuantgateError, match="different samples"):  # and a subset only ids the baseline has
        run.compare_dumps(alt, main, subset=True)


def test_parts_cover_every_sequence_once_with_the_same_mix():
    ids = [f"context:2048-{k}" for k in range(12)] + [f"qa-{k:03d}" for k in range(101)]
    seqs = [run.Sequence(id=i, category=i.split("-")[0], token_ids=[1, 2, 3]) for i in ids]
    shares = [parts.part(seqs, i, 4) for i in range(4)]
    assert sorted(s.id for share in shares for s in share) == sorted(ids)
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert all(sum(s.category.startswith("context") for s in share) == 3 for share in shares)  # long ones spread
    assert parts.part(list(reversed(seqs)), 1, 4) == shares[1]  # by id, whatever the order given
    with pytest.raises(ValueError):
        parts.part(seqs, 4, 4)


def test_a_dump_manifest_is_written_and_read_through_its_model(tmp_path):
    seqs = [run.Sequence(id="a", category="c", token_ids=[1, 2, 3])]
    _dump(tmp_path / "d", ["a"])
    run.DumpManifest(schema=run.SCHEMA, status="complete", n=1, n_scored=1, top_k=2, model="m", endpoint="e",
                     sequences_hash=run.sequences_hash(seqs), elapsed_s=1.5, error=None, parts=4).write(tmp_path / "d")
    raw = json.loads((tmp_path / "d" / run.MANIFEST).read_text())
    assert list(raw) == ["schema", "status", "n", "n_scored", "top_k", "model", "endpoint", "sequences_hash",
                         "elapsed_s", "error", "parts"]  # what its writer set, in order; `source` left out
    assert run.is_complete(tmp_path / "d", run.sequences_hash(seqs), top_k=2)
    assert not run.is_complete(tmp_path / "d", run.sequences_hash(seqs), top_k=3)
    (tmp_path / "d" / run.MANIFEST).write_text('["not", "a", "manifest"]')
    assert run.DumpManifest.read(tmp_path / "d") is None and not run.is_complete(tmp_path / "d", None)
    with pytest.raises(QuantgateError, match="no readable manifest"):
        run.load_dump(tmp_path / "d")


def test_load_dump_refuses_a_partial_dump(tmp_path):
    with pytest.raises(QuantgateError, match="manifest"):
        run.load_dump(tmp_path)
    (tmp_path / run.MANIFEST).write_text(json.dumps({"status": "partial"}))
    with pytest.raises(QuantgateError, match="partial"):
        run.load_dump(tmp_path)


# --- scoring through a fake endpoint (fast): retries, a refused top-k -------------------------------------------

def test_scoring_through_a_fake_endpoint_retries_then_stops_on_a_refused_k(tmp_path):
    seqs = [run.Sequence(id=f"s{k}", category="c", token_ids=[1, 10 + k, 20 + k]) for k in range(4)]
    done: list[int] = []
    with FakeServer() as srv:
        srv.script = {"ids:1,10,20": ["500", "drop", "ok"]}  # transient failures: retried
        run.score_sequences(Endpoint(srv.url, "fake-model"), seqs, tmp_path / "a", top_k=3, concurrency=2,
                            progress=lambda d, t: done.append(d))
        assert srv.calls["ids:1,10,20"] == 3 and sorted(done) == [1, 2, 3, 4]
        dump = run.load_dump(tmp_path / "a")
        assert dump["s1"].lp == [-1.0, -1.0] and dump["s1"].top[0] == ([11, 12, 13], [-1.0, -2.0, -3.0])
        srv.max_logprobs = 2
        sent = len(srv.requests)
        with pytest.raises(ConfigError, match="--max-logprobs 3"):  # no retry can fix it: stops at once
            run.score_sequences(Endpoint(srv.url, "fake-model"), seqs, tmp_path / "b", top_k=3, concurrency=1)
        assert len(srv.requests) == sent + 1


# --- against the real demo server (slow) ---------------------------------------------------------------------------

RECORDS = [
    {"id": "qa-1", "category": "qa", "prompt": "What is the capital of France?", "output": "The capital of France is Paris."},
    {"id": "qa-2", "category": "qa", "messages": [{"role": "system", "content": "Answer briefly."},
                                                   {"role": "user", "content": "Who wrote Hamlet?"}],
     "output": "William Shakespeare wrote Hamlet around 1600."},
    {"id": "math-1", "category": "math", "prompt": "What is 12 times 7?", "output": "12 times 7 is 84."},
    {"id": "fr-1", "category": "translate", "prompt": "Translate to French: good morning",
     "output": "Bonjour ! En français, on dit « bonjour »."},
    {"id": "failed-1", "category": "qa", "prompt": "never answered", "output": None},
]


def _greedy(srv, prompt: str) -> str:
    r = httpx.post(f"{srv.base_url}/chat/completions", headers={"Authorization": f"Bearer {srv.api_key}"}, timeout=120,
                   json={"model": "demo", "messages": [{"role": "user", "content": prompt}], "max_tokens": 16,
                         "temperature": 0})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def greedy_records(demo_server) -> list[dict]:
    """Two answers the demo model wrote itself (greedy, 16 tokens at most)."""
    return [{"id": f"greedy-{i}", "category": "greedy", "prompt": p, "output": _greedy(demo_server, p)}
            for i, p in enumerate(["Name three colors.", "What is the largest ocean?"])]


@pytest.fixture(scope="module")
def sequences(demo_model, greedy_records):
    """12 sequences: the handwritten records, two greedy answers of the demo model, and corpus passages."""
    seqs = run.build_sequences(RECORDS + greedy_records, demo_model, corpus=CORPUS, limit=12)
    assert len(seqs) == 12 and "failed-1" not in {s.id for s in seqs}
    assert {s.category for s in seqs} == {"qa", "math", "translate", "greedy", "corpus"}
    return seqs


@pytest.mark.slow
def test_real_scoring_shape_floor_and_cache(demo_model, demo_server, greedy_records, sequences, tmp_path):
    srv, calls = demo_server, []
    t0 = time.monotonic()
    path = run.score_sequences(srv.endpoint, sequences, tmp_path / "a", concurrency=8,
                               progress=lambda done, total: calls.append((done, total)))
    elapsed = time.monotonic() - t0
    assert calls[-1] == (12, 12) and len(calls) == 12
    manifest = json.loads((tmp_path / "a" / run.MANIFEST).read_text())
    assert manifest["status"] == "complete" and manifest["n"] == 12 and manifest["top_k"] == 10
    assert run.is_complete(tmp_path / "a", run.sequences_hash(sequences), top_k=10)
    dump = run.load_dump(tmp_path / "a")
    for s in sequences:
        d = dump[s.id]
        assert d.ids == s.token_ids and len(d.lp) == len(s.token_ids) - 1
        for lp, (ids, lps), tok in zip(d.lp, d.top, s.token_ids[1:]):
            assert len(ids) == 10 and lps == sorted(lps, reverse=True) and lp <= lps[0] + 1e-6
            assert tok not in ids or lps[ids.index(tok)] == lp
    # teacher forcing lines up: the model's own greedy answer is its top-1 almost everywhere
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_model))
    hits = []
    for rec in greedy_records:
        s, n_out = dump[rec["id"]], len(tok(rec["output"], add_special_tokens=False)["input_ids"])
        hits += [t == ids[0] for t, (ids, _) in zip(s.ids[-n_out:], s.top[-n_out:])]
    assert len(hits) >= 8 and sum(hits) >= 0.8 * len(hits), hits
    # cached: a second call sends nothing
    run.score_sequences(srv.endpoint, sequences, tmp_path / "a",
                        progress=lambda *a: pytest.fail("a complete dump was scored again"))
    # noise floor: the same model scored one request at a time (other batches) agrees with itself
    run.score_sequences(srv.endpoint, sequences, tmp_path / "b", concurrency=1)
    floor = summarize(run.floor(tmp_path / "a", tmp_path / "b"), n_boot=200)
    print(f"\nscored {len(sequences)} sequences ({floor.n_tokens} tokens) in {elapsed:.1f} s;"
          f" floor KL {floor.kl.mean:.3g} (high {floor.kl.high:.3g}), top1 {floor.top1.mean:.4f}")
    assert floor.n_tokens == sum(len(s.token_ids) - 1 for s in sequences)
    assert floor.kl.mean < 1e-4 and floor.top1.mean >= 0.99 and abs(floor.dnll.mean) < 1e-3
    assert path == tmp_path / "a" / run.DUMP


@pytest.mark.slow
def test_real_scoring_in_parts_merges_into_the_whole_dump(demo_server, sequences, tmp_path):
    """Three parts on the real server, as a variant's replicas score them: one alone, then two at once in threads.
    The dump is complete only when the last part is in, and then holds what scoring it whole gives."""
    import threading

    srv, out, n = demo_server, tmp_path / "parted", 3
    run.score_sequences(srv.endpoint, sequences, tmp_path / "whole")

    def score(i: int) -> bool:
        run.score_sequences(srv.endpoint, parts.part(sequences, i, n), parts.part_dir(out, i, n))
        return parts.merge_parts(out, sequences, n, top_k=10)

    assert score(0) is False and not run.is_complete(out, run.sequences_hash(sequences), top_k=10)
    merged: list[bool] = []
    threads = [threading.Thread(target=lambda i=i: merged.append(score(i))) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert merged[-1] is True  # the part that finished last merged (the other: True too if it found it merged)
    assert run.is_complete(out, run.sequences_hash(sequences), top_k=10) and not (out / parts.PARTS).exists()
    manifest = json.loads((out / run.MANIFEST).read_text())
    assert manifest["parts"] == n and manifest["n"] == len(sequences)
    whole, parted = run.load_dump(tmp_path / "whole"), run.load_dump(out)
    assert parted.keys() == whole.keys()
    for i, s in parted.items():
        assert s.ids == whole[i].ids and s.lp == pytest.approx(whole[i].lp, abs=1e-4)
    assert parts.merge_parts(out, sequences, n, top_k=10)  # merged already: nothing to do


@pytest.mark.slow
def test_real_scoring_resumes_after_losing_lines(demo_server, sequences, tmp_path):
    srv, out = demo_server, tmp_path / "dump"
    run.score_sequences(srv.endpoint, sequences, out)
    lines = (out / run.DUMP).read_text(encoding="utf-8").splitlines(keepends=True)
    kept = lines[: len(lines) // 2]
    (out / run.DUMP).write_text("".join(kept) + lines[-1][:40], encoding="utf-8")  # half the lines + a torn one
    (out / run.MANIFEST).unlink()
    calls = []
    run.score_sequences(srv.endpoint, sequences, out, progress=lambda d, t: calls.append(d))
    after = (out / run.DUMP).read_text(encoding="utf-8").splitlines(keepends=True)
    assert after[: len(kept)] == kept and len(after) == len(sequences)
    assert calls == list(range(len(kept) + 1, len(sequences) + 1))
    first = {r["id"]: r for r in map(json.loads, lines)}
    for rec in map(json.loads, after):  # the refilled lines hold the same numbers as the first pass
        assert rec["ids"] == first[rec["id"]]["ids"] and rec["lp"] == pytest.approx(first[rec["id"]]["lp"], abs=1e-4)
    assert json.loads((out / run.MANIFEST).read_text())["status"] == "complete"


@pytest.mark.slow
def test_a_server_with_small_max_logprobs_is_named(odd_demo_server, sequences, tmp_path):
    srv = odd_demo_server  # --max-logprobs 2 (tests/conftest.py)
    with pytest.raises(ConfigError, match=r"--max-logprobs 10") as err:
        run.score_sequences(srv.endpoint, sequences[:3], tmp_path / "k10", top_k=10)
    assert "max allowed: 2" in str(err.value)
    assert not (tmp_path / "k10" / run.MANIFEST).exists()
    run.score_sequences(srv.endpoint, sequences[:3], tmp_path / "k2", top_k=2)
    assert run.is_complete(tmp_path / "k2", run.sequences_hash(sequences[:3]), top_k=2)


def test_draws_of_one_prompt_merge_into_one_sample():
    a = SampleFidelity(id="set/q1#0", category="c", n_tokens=3, kl_sum=0.3, top1_agree=2, dnll_sum=0.2, kl_max=0.5,
                       kl_topk_sum=0.1)
    b = a.model_copy(update={"id": "set/q1#1", "n_tokens": 5, "kl_sum": -0.1, "kl_max": 0.9})
    c = a.model_copy(update={"id": "set/q2#0"})
    merged = merge_draws([c, b, a])
    assert [m.id for m in merged] == ["set/q1", "set/q2"]
    assert (merged[0].n_tokens, merged[0].kl_sum, merged[0].top1_agree, merged[0].kl_max) == (8, pytest.approx(0.2), 4, 0.9)
    assert merged[1] == c.model_copy(update={"id": "set/q2"})


def test_a_comparison_of_the_same_complete_dumps_is_kept_and_one_of_a_rewritten_dump_redone(tmp_path, monkeypatch):
    # the candidate's early decision compares the dumps; the release's compare step finds that file and keeps it
    from quantgate.release import fidelity_step

    ids = [f"qa-{k}" for k in range(4)]
    base, cand = _dump(tmp_path / "base", ids), _dump(tmp_path / "cand", ids)
    calls: list[str] = []
    real = fidelity_step.compare_dumps
    monkeypatch.setattr(fidelity_step, "compare_dumps", lambda b, c, **kw: calls.append(Path(c).name) or real(b, c, **kw))
    out = tmp_path / "run" / "fidelity" / "cand.json"
    fidelity_step.compare(tmp_path / "run", {"main": base}, "cand", {"main": cand})
    first = out.read_bytes()
    fidelity_step.compare(tmp_path / "run", {"main": base}, "cand", {"main": cand})
    assert calls == ["cand"] and out.read_bytes() == first
    # the candidate's dump rewritten since (its manifest is written last): compared again, with the new scores
    lines = [json.loads(x) for x in (cand / run.DUMP).read_text().splitlines()]
    (cand / run.DUMP).write_text("".join(json.dumps({**x, "lp": [-2.0, -0.5], "top": [[[4, 2], [-0.2, -2.0]], x["top"][1]]}) + "\n" for x in lines))
    time.sleep(0.01)
    (cand / run.MANIFEST).write_text(json.dumps({"status": "complete"}))
    fidelity_step.compare(tmp_path / "run", {"main": base}, "cand", {"main": cand})
    assert calls == ["cand", "cand"] and json.loads(out.read_bytes())["summary"]["kl"]["mean"] > 0
    # a file of other dumps (another candidate's) is no comparison of these
    other = _dump(tmp_path / "other", ids)
    fidelity_step.compare(tmp_path / "run", {"main": base}, "cand", {"main": other})
    assert calls[-1] == "other" and json.loads(out.read_bytes())["dumps"]["candidate"] == str(other)
