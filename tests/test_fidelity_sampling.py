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
        sampling._kept(tmp_path / sampling.SAMPLES, [p])
    with pytest.raises(QuantgateError, match="missing or incomplete"):
        sampling.load_sequences(tmp_path)


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
    sampling.sample_continuations(srv.base_url, "demo", srv.api_key, prompts, tmp_path / "a", max_tokens=24,
                                  concurrency=6, progress=lambda d, t: done.append(d))
    assert sorted(done) == list(range(1, 7)) and sampling.is_complete(tmp_path / "a")
    lines = {r["id"]: r for r in run.read_lines(tmp_path / "a" / sampling.SAMPLES)}
    assert all(0 < len(r["ids"]) <= 24 for r in lines.values())
    assert len(lines[short]["ids"]) <= 3 < max(len(r["ids"]) for r in lines.values())
    # complete: a second call asks nothing (the samples are what every variant scores)
    sampling.sample_continuations(srv.base_url, "demo", srv.api_key, prompts, tmp_path / "a", max_tokens=24,
                                  progress=lambda *a: pytest.fail("complete samples were drawn again"))
    # resume: a lost line is drawn again, the rest is kept and not asked
    kept = (tmp_path / "a" / sampling.SAMPLES).read_text().splitlines(keepends=True)
    (tmp_path / "a" / sampling.SAMPLES).write_text("".join(kept[:-1]))
    (tmp_path / "a" / run.MANIFEST).unlink()
    calls: list[int] = []
    sampling.sample_continuations(srv.base_url, "demo", srv.api_key, prompts, tmp_path / "a", max_tokens=24,
                                  progress=lambda d, t: calls.append(d))
    after = (tmp_path / "a" / sampling.SAMPLES).read_text().splitlines(keepends=True)
    assert calls == [6] and after[:-1] == kept[:-1] and len(after) == 6
    lines = {r["id"]: r for r in run.read_lines(tmp_path / "a" / sampling.SAMPLES)}
    # scored over the continuation only; the baseline against itself on another path: the estimate is ~0
    seqs = sampling.load_sequences(tmp_path / "a")
    assert all(s.score_from == len(lines[s.id]["prompt_ids"]) for s in seqs)
    run.score_sequences(srv.base_url, "demo", srv.api_key, seqs, tmp_path / "main", concurrency=6)
    run.score_sequences(srv.base_url, "demo", srv.api_key, seqs, tmp_path / "alt", concurrency=1)
    base = run.load_dump(tmp_path / "main")
    assert {i: len(d.lp) for i, d in base.items()} == {i: len(r["ids"]) for i, r in lines.items()}
    floor = summarize([compare_sample(base[i], d) for i, d in run.load_dump(tmp_path / "alt").items()], n_boot=200)
    assert floor.n_tokens == sum(len(r["ids"]) for r in lines.values()) and abs(floor.kl.mean) < 1e-3
    # a sampled token is one the model finds likely enough: no actual-token logprob is absurdly low on average
    mean_lp = sum(sum(d.lp) for d in base.values()) / floor.n_tokens
    assert -6.0 < mean_lp < 0.0
