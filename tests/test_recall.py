"""The recall adapter: files written from a fake server's answers, baseline deltas, and a real vLLM run (slow)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import typer
from _fake_openai import FakeServer
from test_needle import demo_counter
from typer.testing import CliRunner

from quantgate.cli.recall import recall
from quantgate.recall import needle as nd
from quantgate.recall.run import load_filler, load_needle_data, read_jsonl, run_recall


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
    prompts = nd.build_grid([256, 384], [0, 100], ["number", "multi"], 1, seed=3, data=data, filler=filler, counter=counter)
    with FakeServer() as server:  # answers "echo: <user message>": the document, so every value is in the answer
        kw = dict(endpoint=server.url, model="fake-model", api_key=None, grid={}, max_answer_tokens=8, progress=False)
        base = run_recall(prompts, tmp_path / "base", **kw)
        assert len(server.requests) == len(prompts)
        assert all(r["max_tokens"] == 8 and r["temperature"] == 0.0 for r in server.requests)
        assert base["overall"]["recall"] == 1.0 and check_run_dir(tmp_path / "base")["overall"]["n"] == len(prompts)
        # a baseline that missed the first prompt: the candidate improves exactly there
        recs = read_jsonl(tmp_path / "base" / "requests.jsonl")
        recs[0].update(recall=0.0, exact=False)
        (tmp_path / "base" / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        cand = run_recall(prompts, tmp_path / "cand", baseline=tmp_path / "base", **kw)
    check_run_dir(tmp_path / "cand", delta=True)
    d = cand["delta"]
    assert d["improvements"] == [prompts[0].id] and d["regressions"] == []
    assert d["overall"]["delta"] == pytest.approx(1 / len(prompts))
    first = next(c for c in d["cells"] if (c["length"], c["depth"], c["kind"]) == (256, 0, "number"))
    assert (first["base"], first["cand"], first["delta"]) == (0.0, 1.0, 1.0)


@pytest.mark.slow
def test_real_grid_on_the_demo_model_served_by_vllm(demo_model, demo_server, tmp_path, monkeypatch):
    """Small grid (2 lengths x 3 depths x 4 kinds) on the demo model, then a 4-prompt subset against it as baseline."""
    app = typer.Typer()
    app.command()(recall)
    srv = demo_server  # --max-model-len 2048, asked from /v1/models below
    monkeypatch.setenv("QG_RECALL_TEST_KEY", srv.api_key)
    common = ["--endpoint", srv.base_url, "--model", "demo", "--tokenizer", str(demo_model), "--samples", "1",
              "--api-key-env", "QG_RECALL_TEST_KEY", "--no-progress", "--concurrency", "4"]
    first = CliRunner().invoke(app, [*common, "--out", str(tmp_path / "a"), "--lengths", "256,512",
                                     "--depths", "0,50,100", "--kinds", "number,name,multilingual,multi"])
    assert first.exit_code == 0, (first.output, first.exception)
    second = CliRunner().invoke(app, [*common, "--out", str(tmp_path / "b"), "--baseline", str(tmp_path / "a"),
                                      "--lengths", "256", "--depths", "0,100", "--kinds", "number,multi"])
    assert second.exit_code == 0, (second.output, second.exception)
    print(first.output, second.output, sep="\n")
    cells = check_run_dir(tmp_path / "a")
    check_run_dir(tmp_path / "b", delta=True)
    delta = json.loads((tmp_path / "b" / "delta.json").read_text())
    assert (delta["n_paired"], delta["n_base_only"], delta["n_cand_only"]) == (4, 20, 0)  # same seed: same prompts
    assert cells["grid"]["max_model_len"] == 2048 and cells["overall"]["n"] == 24 and cells["overall"]["n_error"] == 0
    for r in read_jsonl(tmp_path / "a" / "requests.jsonl"):
        assert r["served_prompt_tokens"] == r["prompt_tokens"] <= r["length"]  # our count is the server's count
    if os.environ.get("QG_RECALL_REPORT"):
        Path(os.environ["QG_RECALL_REPORT"]).write_text(json.dumps({"a": cells, "delta": json.loads((tmp_path / "b" / "delta.json").read_text())}, indent=1))
