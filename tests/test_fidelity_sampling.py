"""The baseline's sampled continuations (quantgate.fidelity.sampling): prompts, resume (fast), and sampling
then scoring through the real vLLM server of the demo model (slow): the continuation is what the gate scores."""

from __future__ import annotations

import json

import pytest

from quantgate.base.errors import ConfigError, QuantgateError
from quantgate.base.paths import EVAL_SETS
from quantgate.fidelity import run, sampling
from quantgate.fidelity.core import compare_sample, summarize

RECORDS = [
    {"id": "qa-1", "category": "qa", "prompt": "What is the capital of France?"},
    {"id": "qa-2", "category": "qa", "messages": [{"role": "system", "content": "Answer briefly."},
                                                   {"role": "user", "content": "Who wrote Hamlet?"}]},
    {"id": "math-1", "category": "math", "prompt": "What is 12 times 7?"},
    {"id": "fr-1", "category": "translate", "prompt": "Translate to French: good morning"},
]


def test_a_samples_file_from_other_prompts_is_refused_and_a_partial_one_cannot_be_scored(tmp_path):
    p = sampling.Prompt(id="a", category="c", token_ids=[1, 2])
    (tmp_path / sampling.SAMPLES).write_text(json.dumps({"id": "a", "category": "c", "prompt_ids": [1, 3],
                                                         "ids": [4]}) + "\n")
    with pytest.raises(QuantgateError, match="another prompt"):
        sampling._kept(tmp_path / sampling.SAMPLES, [p], None)
    with pytest.raises(QuantgateError, match="missing or incomplete"):
        sampling.load_sequences(tmp_path)


def _answer(ids: list[int], rows: list[dict[int, float]]) -> dict:
    return {"choices": [{"token_ids": ids, "logprobs": {
        "tokens": [f"token_id:{t}" for t in ids],
        "top_logprobs": [{f"token_id:{t}": lp for t, lp in row.items()} for row in rows]}}]}


def test_a_sampling_answer_gives_the_dump_line_a_teacher_forced_scoring_would():
    p = sampling.Prompt(id="a", category="c", token_ids=[1, 2])
    # the second token was sampled from outside the top-2: the answer lists it beside them (k + 1 entries)
    line = sampling._parse(_answer([7, 9], [{7: -0.1, 8: -2.5}, {9: -6.0, 3: -0.2, 4: -1.9}]), p, top_k=2)
    assert line["lp"] == [-0.1, -6.0]
    assert line["top"] == [[[7, 8], [-0.1, -2.5]], [[3, 4], [-0.2, -1.9]]]  # ranked, the outsider left out
    assert "lp" not in sampling._parse(_answer([7], [{7: -0.1}]), p)  # no top_k: the tokens only
    with pytest.raises(ValueError, match="lacks the sampled token"):
        sampling._parse(_answer([7], [{8: -0.1}]), p, top_k=2)
    with pytest.raises(ValueError, match="1 logprob rows for 2"):
        sampling._parse(_answer([7, 9], [{7: -0.1}]), p, top_k=2)
    bad = _answer([7], [{7: -0.1}])
    bad["choices"][0]["logprobs"]["tokens"] = ["hello"]
    with pytest.raises(ValueError, match="return_tokens_as_token_ids"):
        sampling._parse(bad, p, top_k=2)


def test_samples_without_logprobs_are_not_kept_for_a_top_k_and_give_no_dump(tmp_path):
    p = sampling.Prompt(id="a", category="c", token_ids=[1, 2])
    line = {"id": "a", "category": "c", "prompt_ids": [1, 2], "ids": [4, 5]}
    (tmp_path / sampling.SAMPLES).write_text(json.dumps(line) + "\n")
    assert sampling._kept(tmp_path / sampling.SAMPLES, [p], None) == {"a"}
    with pytest.raises(QuantgateError, match="without its top-5 logprobs"):
        sampling._kept(tmp_path / sampling.SAMPLES, [p], 5)
    (tmp_path / run.MANIFEST).write_text(json.dumps({"status": "complete", "top_k": None}))
    with pytest.raises(QuantgateError, match="no logprobs of their own"):
        sampling.write_dump(tmp_path, tmp_path / "dump")


def test_duplicate_ids_are_refused():
    with pytest.raises(ConfigError, match="duplicate sample id 'qa-1'"):
        run.items_of(RECORDS + RECORDS[:1], None, answers=False)


@pytest.mark.slow
def test_real_sampling_is_cached_resumable_and_scored_over_the_continuation_only(demo_model, demo_server, tmp_path):
    srv = demo_server
    prompts = sampling.build_prompts(RECORDS, demo_model, corpus=EVAL_SETS / "fidelity_corpus.txt", limit=6)
    assert len(prompts) == 6 and {p.category for p in prompts} == {"qa", "math", "translate", "corpus"}
    short = next(p.id for p in prompts if p.category == "corpus")  # its own length, as a haystack's
    prompts = [p.model_copy(update={"max_tokens": 3}) if p.id == short else p for p in prompts]
    done: list[int] = []
    sampling.sample_continuations(srv.endpoint, prompts, tmp_path / "a", max_tokens=24,
                                  top_k=5, concurrency=6, progress=lambda d, t: done.append(d))
    assert sorted(done) == list(range(1, 7)) and sampling.is_complete(tmp_path / "a")
    lines = {r["id"]: r for r in run.read_lines(tmp_path / "a" / sampling.SAMPLES)}
    assert all(0 < len(r["ids"]) <= 24 for r in lines.values())
    assert len(lines[short]["ids"]) <= 3 < max(len(r["ids"]) for r in lines.values())
    # complete: a second call asks nothing (the samples are what every variant scores)
    sampling.sample_continuations(srv.endpoint, prompts, tmp_path / "a", max_tokens=24,
                                  top_k=5, progress=lambda *a: pytest.fail("complete samples were drawn again"))
    # resume: a lost line is drawn again, the rest is kept and not asked
    kept = (tmp_path / "a" / sampling.SAMPLES).read_text().splitlines(keepends=True)
    (tmp_path / "a" / sampling.SAMPLES).write_text("".join(kept[:-1]))
    (tmp_path / "a" / run.MANIFEST).unlink()
    calls: list[int] = []
    sampling.sample_continuations(srv.endpoint, prompts, tmp_path / "a", max_tokens=24,
                                  top_k=5, progress=lambda d, t: calls.append(d))
    after = (tmp_path / "a" / sampling.SAMPLES).read_text().splitlines(keepends=True)
    assert calls == [6] and after[:-1] == kept[:-1] and len(after) == 6
    lines = {r["id"]: r for r in run.read_lines(tmp_path / "a" / sampling.SAMPLES)}
    # scored over the continuation only; the baseline against itself on another path: the estimate is ~0
    seqs = sampling.load_sequences(tmp_path / "a")
    assert all(s.score_from == len(lines[s.id]["prompt_ids"]) for s in seqs)
    # the baseline's dump is the sampling answers' own logprobs; a teacher-forced prefill of the same sequences
    # (a candidate's path, here the same model) agrees with it up to engine numerics: the noise floor
    sampling.write_dump(tmp_path / "a", tmp_path / "main")
    assert run.is_complete(tmp_path / "main", run.sequences_hash(seqs), top_k=5)
    run.score_sequences(srv.endpoint, seqs, tmp_path / "alt", top_k=5, concurrency=6)
    base, alt = run.load_dump(tmp_path / "main"), run.load_dump(tmp_path / "alt")
    assert {i: len(d.lp) for i, d in base.items()} == {i: len(r["ids"]) for i, r in lines.items()}
    assert max(abs(a - b) for i in base for a, b in zip(base[i].lp, alt[i].lp)) < 1e-3  # same logprobs
    floor = summarize([compare_sample(base[i], d) for i, d in alt.items()], n_boot=200)
    assert floor.n_tokens == sum(len(r["ids"]) for r in lines.values()) and abs(floor.kl.mean) < 1e-3
    assert floor.top1.mean == 1.0  # decoding and prefill rank the same token first everywhere
    # a sampled token is one the model finds likely enough: no actual-token logprob is absurdly low on average
    mean_lp = sum(sum(d.lp) for d in base.values()) / floor.n_tokens
    assert -6.0 < mean_lp < 0.0
