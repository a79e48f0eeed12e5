"""The recall adapter: files written from a fake server's answers, baseline deltas, the paced client's order and
resumption, what counts as a finished (cached) run, and a real vLLM run with prefix caching (slow)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import typer
from quantgate.base.errors import QuantgateError
from _fake_openai import FakeServer
from test_needle import demo_counter
from typer.testing import CliRunner

from quantgate.cli.recall import recall
from quantgate.recall import haystack as hs, needle as nd
from quantgate.recall.client import cost, queues
from quantgate.recall import score as recall_score
from quantgate.recall.resultfile import RecallCells, RecallDelta, load_recall_cells, load_recall_delta
from quantgate.recall.run import is_complete, jobs_of, load_filler, load_needle_data, read_jsonl, run_recall
from quantgate.base.http import Endpoint


def check_run_dir(out: Path, *, delta: bool = False) -> dict:
    """Files exist, numbers are shares in [0, 1], and cells.json agrees with requests.jsonl."""
    for name in ("prompts.jsonl", "answers.jsonl", "requests.jsonl", "cells.json", "heatmap.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cells = json.loads((out / "cells.json").read_text())
    recs = read_jsonl(out / "requests.jsonl")
    for c in cells["cells"]:
        mine = [r for r in recs if (r["length"], r["depth"], r["kind"]) == (c["length"], c["depth"], c["kind"])]
        ok = [r for r in mine if r["error"] is None]
        assert (c["n"], c["n_error"]) == (len(ok), len(mine) - len(ok))
        assert 0.0 <= c["recall"] <= 1.0 and 0.0 <= c["exact"] <= 1.0
        assert c["recall"] == pytest.approx(sum(r["recall"] for r in ok) / len(ok))
        assert c["exact"] == pytest.approx(sum(r["exact"] for r in ok) / len(ok))
    assert cells["overall"]["n"] == sum(c["n"] for c in cells["cells"]) == len([r for r in recs if r["error"] is None])
    if delta:
        assert (out / "delta_heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        d = json.loads((out / "delta.json").read_text())
        assert all(-1.0 <= c["delta"] <= 1.0 for c in d["cells"])
    return cells


def test_run_writes_requests_cells_and_heatmaps_and_deltas(demo_model, tmp_path):
    data, filler, counter = load_needle_data(), load_filler(), demo_counter(demo_model)
    prompts = nd.build_grid([256, 384], [0, 100], ["number", "multi"], 1, seed=3, data=data, filler=filler, counter=counter,
                            max_answer_tokens=20)
    with FakeServer() as server:  # answers "echo: <user message>": the document, so every value is in the answer
        kw = dict(endpoint=Endpoint(server.url, "fake-model"), grid={})
        base = run_recall(prompts, tmp_path / "base", **kw)
        assert len(server.requests) == len(prompts)
        caps = {p.messages[-1]["content"]: p.max_tokens for p in prompts}
        assert all(r["max_tokens"] == caps[r["messages"][-1]["content"]] <= 20 and r["temperature"] == 0.0
                   for r in server.requests)
        assert base.status == "complete" and is_complete(tmp_path / "base")
        assert base.overall.recall == 1.0 and check_run_dir(tmp_path / "base")["overall"]["n"] == len(prompts)
        # a baseline that missed the first prompt: the candidate improves exactly there
        recs = read_jsonl(tmp_path / "base" / "requests.jsonl")
        recs[0].update(recall=0.0, exact=False)
        (tmp_path / "base" / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        run_recall(prompts, tmp_path / "cand", baseline=tmp_path / "base", **kw)
    check_run_dir(tmp_path / "cand", delta=True)
    d = load_recall_delta(tmp_path / "cand" / "delta.json")
    assert d.improvements == [prompts[0].id] and d.regressions == []
    assert d.overall.delta == pytest.approx(1 / len(prompts)) and d.baseline == str(tmp_path / "base")
    first = next(c for c in d.cells if (c.length, c.depth, c.kind) == (256, 0, "number"))
    assert (first.base, first.cand, first.delta) == (0.0, 1.0, 1.0)


@pytest.fixture(scope="module")
def kit(demo_model):
    return dict(data=load_needle_data(), filler=load_filler(), counter=demo_counter(demo_model))


def turns(kit, lengths=(256, 384), depths=(0, 50, 100), kinds=("number", "multi")):
    return hs.build_grid(lengths, depths, kinds, 1, seed=5, ask="turns", **kit)


class Events(list):
    """server.requests that also logs each arrival, in order with the answers (FakeServer.answer)."""
    def __init__(self, log):
        super().__init__()
        self.log = log

    def append(self, body):
        self.log.append(("arrive", body["messages"][-1]["content"]))
        super().append(body)


def test_each_haystacks_other_questions_wait_until_its_first_is_answered(kit, tmp_path):
    prompts = turns(kit)
    haystack_of = {p.messages[-1]["content"]: p.haystack for p in prompts}
    log: list[tuple[str, str]] = []
    with FakeServer(delay_s=0.05) as server:
        server.requests = Events(log)
        server.answer = lambda prompt: log.append(("answer", prompt)) or f"echo: {prompt}"
        out = run_recall(prompts, tmp_path / "r", endpoint=Endpoint(server.url, "fake-model"), grid={},
                         concurrency=8)
    assert out.status == "complete" and out.overall.recall == 1.0
    for hay in {p.haystack for p in prompts}:
        events = [(e, m) for e, m in log if haystack_of[m] == hay]
        first = events[0][1]
        answered = events.index(("answer", first))
        assert [e for e, _ in events[:answered]] == ["arrive"]  # nothing else of this haystack was sent before
        assert sum(e == "arrive" for e, _ in events) == 3
    assert len({haystack_of[m] for e, m in log[:8] if e == "arrive"}) > 1  # haystacks still overlap one another
    cost = out.cost
    assert (cost["haystacks"], cost["requests"], cost["needles"], cost["cells"]) == (4, 12, 12, 12)
    assert cost["run"]["answered"] == 12 and cost["run"]["prefix_cache_hit_rate"] is None  # the fake has no /metrics


def test_progress_counts_a_haystacks_prompt_once_in_tokens_so_the_first_eta_is_not_a_count_of_requests(kit, tmp_path):
    """The grid's progress line is in prompt+sampled tokens: a haystack's first request carries its whole prompt,
    the others their own tail (with the prefix cached), each its sampled tokens; the total is that work, not the
    request count, whose first ETA waited for the long first requests ("ETA 46.5 min" at 2 of 120 needles, "4.9 min"
    30 s later, in a demo ladder's log)."""
    from quantgate.base import progress

    prompts = turns(kit)
    jobs = jobs_of(prompts)
    ready, waiting = queues(jobs, done=set())
    work = sum(cost(j) for j in ready) + sum(cost(j) for js in waiting.values() for j in js)
    assert work < sum(j.prompt_tokens for j in jobs)  # each haystack's prompt once, not once per question
    lines: list[str] = []
    with FakeServer(delay_s=0.01) as server, progress.reporting("baseline: recall", log=lines.append, every_s=0.0):
        out = run_recall(prompts, tmp_path / "r", endpoint=Endpoint(server.url, "fake-model"), grid={},
                         concurrency=8)
    assert out.status == "complete"
    assert lines and all(" prompt+sampled tokens" in x for x in lines), lines
    assert lines[-1].startswith(f"baseline: recall: {work}/{work} prompt+sampled tokens (100%)"), lines[-1]


def test_together_scores_every_needle_of_one_answer_on_its_own(kit, tmp_path):
    prompts = hs.build_grid((512, 768), (0, 50, 100), ("number", "multi"), 1, seed=5, ask="together", **kit)
    asked: dict[str, nd.RecallPrompt] = {}
    for p in prompts:
        asked.setdefault(p.messages[-1]["content"], p)
    with FakeServer() as server:  # answers only the first needle's value of each request
        server.answer = lambda prompt: " ".join(asked[prompt].expected)
        out = run_recall(prompts, tmp_path / "r", endpoint=Endpoint(server.url, "fake-model"), grid={})
        assert len(server.requests) == 4
    recs = read_jsonl(tmp_path / "r" / "requests.jsonl")
    assert len(recs) == 12 and out.cost["needles"] == 12 and out.cost["requests"] == 4
    first = {p.request: p.id for p in reversed(prompts)}  # the needle whose values the fake gives
    assert all(r["recall"] == (1.0 if first[r["request"]] == r["id"] else 0.0) for r in recs)
    # the other needles of the request see that answer as values of another needle: reported, not scored
    assert all(r["others_found"] >= 1 for r in recs if first[r["request"]] != r["id"])


def test_failed_requests_leave_the_run_partial_and_only_they_are_asked_again(kit, tmp_path):
    prompts = turns(kit)
    broken = prompts[4]
    with FakeServer() as server:
        server.script[broken.messages[-1]["content"]] = ["400"]  # not retried: an error at once, then answers
        kw = dict(endpoint=Endpoint(server.url, "fake-model"), grid={}, max_error_rate=0.5)
        first = run_recall(prompts, tmp_path / "r", **kw)
        assert first.status == "partial" and not is_complete(tmp_path / "r")
        assert (first.overall.n, first.overall.n_error) == (11, 1)
        sent = len(server.requests)
        second = run_recall(prompts, tmp_path / "r", **kw)
        assert [r["messages"][-1]["content"] for r in server.requests[sent:]] == [broken.messages[-1]["content"]]
    assert second.status == "complete" and is_complete(tmp_path / "r")
    assert second.cost["run"]["skipped"] == 11 and second.overall.n == 12


def test_too_many_failures_stop_the_run_and_leave_it_partial(kit, tmp_path):
    prompts = turns(kit)
    with FakeServer() as server:
        for p in prompts[:3]:
            server.script[p.messages[-1]["content"]] = ["400"]
        with pytest.raises(QuantgateError, match="requests failed"):
            run_recall(prompts, tmp_path / "r", endpoint=Endpoint(server.url, "fake-model"), grid={})
    cells = json.loads((tmp_path / "r" / "cells.json").read_text())
    assert cells["status"] == "partial" and not is_complete(tmp_path / "r")


def test_the_first_pending_request_of_a_haystack_carries_the_whole_prompt_even_when_resumed(kit):
    jobs = jobs_of(turns(kit, lengths=(256,), kinds=("number",)))  # one haystack, three questions
    assert len({j.group for j in jobs}) == 1 and all(j.tokens < j.prompt_tokens for j in jobs)
    ready, waiting = queues(jobs, done=set())
    assert [j.id for j in ready] == [jobs[0].id] and ready[0].tokens == jobs[0].prompt_tokens
    assert [j.id for j in waiting[jobs[0].group]] == [jobs[1].id, jobs[2].id]
    ready, waiting = queues(jobs, done={jobs[0].id})  # resumed on a new server: its cache holds nothing
    assert [j.id for j in ready] == [jobs[1].id] and ready[0].tokens == jobs[1].prompt_tokens
    assert [j.id for j in waiting[jobs[0].group]] == [jobs[2].id]


@pytest.mark.parametrize("damage", ["truncated cells", "partial status", "missing needle", "failed needle", "no cost"])
def test_only_a_whole_finished_run_counts_as_done(kit, tmp_path, damage):
    prompts = turns(kit, lengths=(256,), kinds=("number",))
    with FakeServer() as server:
        run_recall(prompts, tmp_path / "r", endpoint=Endpoint(server.url, "fake-model"), grid={})
    assert is_complete(tmp_path / "r")
    cells_path, req_path = tmp_path / "r" / "cells.json", tmp_path / "r" / "requests.jsonl"
    cells, lines = json.loads(cells_path.read_text()), req_path.read_text().splitlines(keepends=True)
    if damage == "truncated cells":
        cells_path.write_text(cells_path.read_text()[:-40])
    elif damage == "partial status":
        cells_path.write_text(json.dumps({**cells, "status": "partial"}))
    elif damage == "missing needle":
        req_path.write_text("".join(lines[:-1]))
    elif damage == "failed needle":
        req_path.write_text("".join(lines[:-1]) + json.dumps({**json.loads(lines[-1]), "error": "HTTP 500"}) + "\n")
    else:
        cells_path.write_text(json.dumps({k: v for k, v in cells.items() if k != "cost"}))
    assert not is_complete(tmp_path / "r")


@pytest.mark.parametrize("deadline_s,most", [(3.0, 1), (300.0, 5)])
def test_long_prompts_are_held_back_when_the_server_cannot_finish_them_within_the_deadline(kit, tmp_path, deadline_s, most):
    """A server taking 1 s per request: at most about 250 prompt tokens/s measured. With a 3 s budget the work in
    flight may be at most 375 tokens, so the 250-token prompts go one at a time; with 300 s, the first alone (it
    measures the rate), then the other five at once. Every deadline is at least the budget: nothing times out."""
    prompts = hs.build_grid([256], [0, 100], ["number", "name", "multi"], 1, seed=2, ask="single", **kit)
    with FakeServer(delay_s=1.0) as server:
        out = run_recall(prompts, tmp_path / "r", endpoint=Endpoint(server.url, "fake-model"), grid={},
                         concurrency=8, deadline_s=deadline_s)
    run = out.cost["run"]
    assert run["most_in_flight"] == most and run["timeouts"] == 0 and out.status == "complete"
    answers = read_jsonl(tmp_path / "r" / "answers.jsonl")
    assert all(a["attempts"] == 1 and a["deadline_s"] >= deadline_s for a in answers)


@pytest.mark.slow
def test_real_grid_on_the_demo_model_served_by_vllm(demo_model, demo_server, tmp_path, monkeypatch):
    """A turns grid (2 lengths x 3 depths x 4 kinds) on the demo model, then a subset against it as baseline: every
    request answered on its first attempt within its deadline, our token counts are the server's, and the questions
    over one haystack hit vLLM's prefix cache."""
    app = typer.Typer()
    app.command()(recall)
    srv = demo_server  # --max-model-len 2048, asked from /v1/models below
    monkeypatch.setenv("QG_RECALL_TEST_KEY", srv.api_key)
    common = ["--endpoint", srv.base_url, "--model", "demo", "--tokenizer", str(demo_model), "--samples", "1",
              "--api-key-env", "QG_RECALL_TEST_KEY", "--no-progress", "--concurrency", "4", "--ask", "turns"]
    first = CliRunner().invoke(app, [*common, "--out", str(tmp_path / "a"), "--lengths", "512,1024",
                                     "--depths", "0,50,100", "--kinds", "number,name,multilingual,multi"])
    assert first.exit_code == 0, (first.output, first.exception)
    second = CliRunner().invoke(app, [*common, "--out", str(tmp_path / "b"), "--baseline", str(tmp_path / "a"),
                                      "--lengths", "512", "--depths", "0,50,100", "--kinds", "number,multi"])
    assert second.exit_code == 0, (second.output, second.exception)
    print(first.output, second.output, sep="\n")
    cells = check_run_dir(tmp_path / "a")
    check_run_dir(tmp_path / "b", delta=True)
    delta = json.loads((tmp_path / "b" / "delta.json").read_text())
    assert (delta["n_paired"], delta["n_base_only"], delta["n_cand_only"]) == (6, 18, 0)  # same seed: same needles
    assert delta["n_haystacks"] == 2 and delta["n_requests"] == 6
    assert cells["grid"]["max_model_len"] == 2048 and cells["overall"]["n"] == 24 and cells["overall"]["n_error"] == 0
    assert cells["status"] == "complete" and is_complete(tmp_path / "a")
    cost = cells["cost"]
    assert (cost["haystacks"], cost["requests"], cost["needles"]) == (8, 24, 24)
    # the server's cache served most of what the layout shares (it caches whole blocks, so a little less than all)
    shared = cost["prompt_tokens"] - cost["prompt_tokens_computed"]
    assert cost["run"]["timeouts"] == 0 and cost["run"]["prefix_cache_hits"] >= 0.7 * shared > 0, cost
    assert all(a["attempts"] == 1 for a in read_jsonl(tmp_path / "a" / "answers.jsonl"))
    for r in read_jsonl(tmp_path / "a" / "requests.jsonl"):
        assert r["served_prompt_tokens"] == r["prompt_tokens"] <= r["length"]  # our count is the server's count
    if os.environ.get("QG_RECALL_REPORT"):
        Path(os.environ["QG_RECALL_REPORT"]).write_text(json.dumps({"a": cells, "delta": delta}, indent=1))


def test_cells_and_delta_are_written_through_their_models_in_the_scorers_order(tmp_path):
    """cells.json and delta.json byte for byte the scorer's dicts (key order, None means of a kind nothing answered,
    a fractional depth), written by RecallCells and RecallDelta and read back through them."""
    recs = [{"id": f"n{i}", "request": f"q{i // 2}", "haystack": f"h{i // 4}", "length": length, "depth": depth,
             "kind": kind, "lang": "en", "error": "HTTP 500" if kind == "name" else None,
             "recall": None if kind == "name" else (i % 3) / 2, "exact": None if kind == "name" else i % 3 == 2}
            for i, (length, depth, kind) in enumerate([(256, 0, "number"), (256, 12.5, "multi"), (384, 0, "name")] * 3)]
    base = [{**r, "recall": 1.0, "exact": True} if r["error"] is None else r for r in recs]
    cells = {"status": "partial", "model": "m", "endpoint": "http://x", "grid": {"lengths": [256, 384]},
             "cost": {"needles": 9, "run": {"wall_s": 1.5, "prefix_cache_hit_rate": None}}, **recall_score.cells(recs)}
    delta = {**recall_score.compare(base, recs), "baseline": str(tmp_path / "base")}
    RecallCells.model_validate(cells).write(tmp_path / "cells.json")
    RecallDelta.model_validate(delta).write(tmp_path / "delta.json")
    for name, doc in (("cells.json", cells), ("delta.json", delta)):
        assert (tmp_path / name).read_text() == json.dumps(doc, indent=2, ensure_ascii=False) + "\n", name
    read = load_recall_cells(tmp_path / "cells.json")
    assert read.by_kind["name"].recall is None and [c.depth for c in read.cells][:2] == [0, 12.5]
    assert [c.n for c in load_recall_delta(tmp_path / "delta.json").cells] == [3, 3]  # the failed kind is not paired
