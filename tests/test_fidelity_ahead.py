"""Scoring ahead of the samples (fast, through the fake OpenAI server): a candidate's server scores the baseline's
continuations as their lines are written, and its parts then score only the rest; the merged dump is the same."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from _fake_openai import FakeServer
from quantgate.fidelity import parts, run, sampling
from quantgate.release import fidelity_step
from quantgate.base.http import Endpoint

TOP_K = 3


def _line(k: int) -> dict:
    """A samples line: prompt [1, k] and a continuation of two tokens (scored from position 2)."""
    return {"id": f"s{k}", "category": "c", "prompt_ids": [1, 100 + k], "ids": [200 + k, 300 + k],
            "lp": [-1.0, -1.0], "top": [[[5, 6, 7], [-1.0, -2.0, -3.0]]] * 2}


def _append(path: Path, text: str) -> None:
    with path.open("a", encoding="utf-8") as fh:
        fh.write(text)


def _wait(what, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_a_samples_tail_reads_only_finished_lines_and_starts_over_when_the_file_is_cut(tmp_path):
    path = tmp_path / sampling.SAMPLES
    tail = sampling.SamplesTail(tmp_path)
    assert tail.sequences() == []  # no file yet
    whole = json.dumps(_line(1)) + "\n" + json.dumps(_line(2)) + "\n"
    torn = json.dumps(_line(3))
    _append(path, whole + torn[:20])
    assert [s.id for s in tail.sequences()] == ["s1", "s2"]
    assert tail.sequences() == []  # the torn line waits for its end
    _append(path, torn[20:] + "\n" + "{not json\n" + json.dumps({**_line(4), "ids": []}) + "\n")
    got = tail.sequences()
    assert [s.id for s in got] == ["s3"] and got[0].score_from == 2 and got[0].token_ids == [1, 103, 203, 303]
    path.write_text(json.dumps(_line(5)) + "\n")  # cut shorter (a resumed sampling): read again from the start
    assert [s.id for s in tail.sequences()] == ["s5"]


def test_parts_score_only_what_was_scored_ahead_and_merge_the_same_dump(tmp_path, monkeypatch):
    monkeypatch.setattr(fidelity_step, "AHEAD_POLL_S", 0.02)
    samples, out, count = tmp_path / "samples", tmp_path / "main", 2
    samples.mkdir()
    spec = SimpleNamespace(fidelity=SimpleNamespace(top_k=TOP_K, concurrency=2))
    stream = parts.stream_dir(out) / run.DUMP
    stream.parent.mkdir(parents=True)
    # a line the stream holds from other tokens (samples drawn again since): neither scored again ahead of the
    # samples nor copied into a part, whose own scoring does it
    _append(stream, json.dumps({"id": "s0", "category": "c", "ids": [9, 9, 9], "score_from": 2, "lp": [-1.0],
                                "top": [[[1, 2, 3], [-1.0, -2.0, -3.0]]]}) + "\n")
    done = threading.Event()
    logs: list[str] = []
    with FakeServer() as fake:
        srv = SimpleNamespace(base_url=fake.url, config=SimpleNamespace(name="fake-model"), api_key=None,
                              endpoint=Endpoint(fake.url, "fake-model"))  # a served variant as the release sees one
        ahead: list[int] = []
        worker = threading.Thread(target=lambda: ahead.append(fidelity_step.score_ahead(
            spec, srv, out, samples, done.is_set, logs.append)))
        _append(samples / sampling.SAMPLES, "".join(json.dumps(_line(k)) + "\n" for k in range(3)))
        worker.start()
        _wait(lambda: len(parts.finished_lines(stream)) == 3)  # the foreign line, s1 and s2, scored as written
        _append(samples / sampling.SAMPLES, json.dumps(_line(3)) + "\n")
        _wait(lambda: len(parts.finished_lines(stream)) == 4)
        done.set()  # the samples are complete: what comes now is the parts' to score
        worker.join(10)
        assert ahead == [3]
        _append(samples / sampling.SAMPLES, "".join(json.dumps(_line(k)) + "\n" for k in (4, 5)))
        sampling.SamplesManifest(schema=sampling.SCHEMA, status="complete", n=6, n_sampled=6,
                                 top_k=TOP_K).write(samples)
        merged = [fidelity_step.measure_part(spec, srv, out, samples, logs.append, (i, count)) for i in range(count)]
        calls = {key: n for key, n in fake.calls.items() if key.startswith("ids:")}
    assert merged == [False, True] and not (out / parts.PARTS).exists()
    seqs = sampling.load_sequences(samples)
    assert run.is_complete(out, run.sequences_hash(seqs), top_k=TOP_K)
    dump = run.load_dump(out)
    assert sorted(dump) == [f"s{k}" for k in range(6)]
    assert all(dump[s.id].ids == s.token_ids and len(dump[s.id].lp) == 2 for s in seqs)
    # every sequence went to the server once: s1-s3 ahead of the samples, s0, s4 and s5 by their parts
    assert sorted(calls.values()) == [1] * 6 and len(calls) == 6
    assert any("1 of its 3 sequences were scored ahead" in m for m in logs)
    assert any("2 of its 3 sequences were scored ahead" in m for m in logs)
    assert any("3 sequences" in m and "while the baseline sampled" in m for m in logs)
