"""Deciding while the evidence streams in: the stream order (quantgate.base.subsets.interleave,
quantgate.fidelity.stream), the planned streaming looks and their alpha (quantgate.gate.stream), a sampling that stops
when told and resumes (quantgate.fidelity.sampling against a fake server), and a streaming look's record judged by
the gate as its own checks judged it (quantgate.gate.early.stream_checks against quantgate.gate.evidence)."""

from __future__ import annotations

import asyncio
import json
import math
import time

import numpy as np
import pytest

from _fake_openai import FakeServer
from quantgate.base.errors import QuantgateError
from quantgate.base.http import Stopped, for_each
from quantgate.base.subsets import interleave
from quantgate.fidelity import sampling
from quantgate.fidelity.core import SampleFidelity, summarize
from quantgate.fidelity.record import FidelityRecord
from quantgate.fidelity.stream import floor_ids, stream_ids, stream_order
from quantgate.gate import stream
from quantgate.gate.checks import evaluate
from quantgate.gate.early import stream_checks
from quantgate.gate.evidence import collect
from quantgate.gate.looks import shares
from quantgate.gate.policy import load_policy
from quantgate.base.paths import REPO
from quantgate.base.http import Endpoint

POLICY = REPO / "releases" / "policies" / "default.yaml"


def test_every_prefix_of_the_stream_holds_each_slice_in_proportion():
    sizes = {"a": 50, "b": 50, "context:512": 12, "context:2048": 12, "tiny": 3}
    items = [(f"{c}-{k}", c) for c, n in sizes.items() for k in range(n)]
    order = interleave(items, lambda x: x[0], lambda x: x[1])
    assert sorted(order) == sorted(items)
    total = len(items)
    for n in range(1, total + 1):
        for c, size in sizes.items():
            got = sum(1 for x in order[:n] if x[1] == c)
            assert abs(got - n * size / total) <= 1.5, (n, c, got)
    # fixed by the ids alone: another input order, the same stream; within a slice, not the file's order
    assert interleave(list(reversed(items)), lambda x: x[0], lambda x: x[1]) == order
    assert [x[0] for x in order if x[1] == "a"] != [f"a-{k}" for k in range(50)]


def test_a_prompts_draws_stay_together_and_the_floor_is_chosen_from_the_prompts():
    prompts = [sampling.Prompt(id=f"set/{c}-{k}#{d}", category=c, token_ids=[1, k + 2]) for c in ("qa", "math")
               for k in range(10) for d in range(2)]
    prompts += [sampling.Prompt(id=f"context/h{k}", category="context:512", token_ids=[3, k]) for k in range(4)]
    ordered = stream_order(prompts)
    assert sorted(p.id for p in ordered) == sorted(p.id for p in prompts)
    heads = [p.id.split("#")[0] for p in ordered]
    assert heads == [h for h in stream_ids(prompts) for _ in range(1 if h.startswith("context/") else 2)]
    keep = floor_ids(prompts, 6)
    assert len(keep) == 6 and sum(i.startswith("context/") for i in keep) == 1  # one haystack per length


def test_streaming_looks_are_planned_before_the_full_sample_and_spend_its_share():
    assert stream.planned(336) == [34, 68, 101, 135, 168, 202, 236, 269, 303]
    assert stream.planned(100) == [30, 40, 50, 60, 70, 80, 90]  # none below MIN_PROMPTS
    assert stream.planned(20) == []  # too small a sample to look before its end
    sizes = stream.planned(336)
    looks = [stream.look(0.05, 336, n) for n in sizes]
    assert math.isclose(looks[-1].spent + shares(0.05, [*sizes, 336])[-1], 0.05)  # the full sample keeps the rest
    assert all(a.alpha > 0 and b.spent > a.spent for a, b in zip(looks, looks[1:]))
    with pytest.raises(QuantgateError, match="no planned streaming look"):
        stream.look(0.05, 336, 50)


def test_a_look_is_reached_only_when_its_whole_prefix_is_in():
    order = [f"p{i}" for i in range(100)]
    assert stream.reached(order, set(order[:45]), 100) == 40
    assert stream.reached(order, set(order[:45]) - {"p3"}, 100) is None  # a gap holds every look behind it
    assert stream.reached(order, set(order), 100) == 90  # the full sample is the gate's own look


def test_for_each_stops_when_told_and_cancels_what_is_in_flight():
    done: list[int] = []

    async def handle(_client, item: int) -> None:
        await asyncio.sleep(0.05)
        done.append(item)

    t0 = time.monotonic()
    with pytest.raises(Stopped):
        asyncio.run(for_each(list(range(200)), handle, concurrency=4, stop=lambda: len(done) >= 8))
    assert 8 <= len(done) < 40 and time.monotonic() - t0 < 5
    done.clear()
    asyncio.run(for_each(list(range(20)), handle, concurrency=4, stop=lambda: False))
    assert sorted(done) == list(range(20))


def test_a_stopped_sampling_keeps_its_lines_and_the_next_one_resumes_in_order(tmp_path):
    prompts = [sampling.Prompt(id=f"p{k:02d}", category="c", token_ids=[1, 10 * k + 5]) for k in range(30)]
    prompts = list(reversed(prompts))  # the caller's order, not the ids'
    path = tmp_path / sampling.SAMPLES
    with FakeServer(delay_s=0.2) as srv:  # 6 s in all: the stop (asked every 0.5 s) comes well before
        lines = lambda: path.read_text().count("\n") if path.exists() else 0  # noqa: E731
        sampling.sample_continuations(Endpoint(srv.url, "fake-model"), prompts, tmp_path, max_tokens=2, top_k=2,
                                      concurrency=1, stop=lambda: lines() >= 5)
        m = sampling.SamplesManifest.read(tmp_path)
        assert m is not None and m.status == "partial" and m.stopped and m.error is None
        assert sampling.is_stopped(tmp_path) and sampling.is_final(tmp_path) and not sampling.is_complete(tmp_path)
        first = [json.loads(x)["id"] for x in path.read_text().splitlines()]
        assert 5 <= len(first) < 30 and first == [p.id for p in prompts[: len(first)]]  # sent in the given order
        sampling.sample_continuations(Endpoint(srv.url, "fake-model"), prompts, tmp_path, max_tokens=2, top_k=2,
                                      concurrency=4)
    assert sampling.is_complete(tmp_path) and not sampling.is_stopped(tmp_path)
    ids = [json.loads(x)["id"] for x in path.read_text().splitlines()]
    assert sorted(ids) == sorted(p.id for p in prompts) and ids[: len(first)] == first


def _samples(rng: np.random.Generator, kl: dict[str, float], n: int) -> list[SampleFidelity]:
    out = []
    for c, mean in kl.items():
        for k in range(n):
            tokens = 40
            out.append(SampleFidelity(id=f"{c}-{k}", category=c, n_tokens=tokens,
                                      kl_sum=float(rng.gamma(8.0, mean / 8.0) * tokens), top1_agree=38,
                                      dnll_sum=0.0, kl_max=0.1))
    return out


def test_a_streaming_look_is_judged_by_the_gate_as_it_was_at_the_look(tmp_path):
    rng = np.random.default_rng(3)
    cats = {"factual_qa": 0.004, "multilingual": 0.1, "summarization": 0.005}
    cand, floor = _samples(rng, cats, 12), _samples(rng, {c: 0.0004 for c in cats}, 4)
    total = 336
    look = stream.look(0.05, total, 68, by_category={c: 12 for c in cats}, elapsed_s=120.0)
    record = FidelityRecord(summary=summarize(cand), estimator="sampled-logratio", samples=cand, stream=look)
    floor_rec = FidelityRecord(summary=summarize(floor), estimator="sampled-logratio", samples=floor)
    files = tmp_path / "fidelity" / "int8-w8a8.json", tmp_path / "fidelity" / "floor.json"
    checks = stream_checks(load_policy(POLICY), "int8-w8a8", "int8-w8a8", record, floor_rec,
                           (str(files[0]), str(files[1])))
    failed = {c.name for c in checks if c.outcome == "fail"}
    assert "fidelity:kl:multilingual" in failed and "fidelity:kl:factual_qa" not in failed
    files[0].parent.mkdir()
    record.write(files[0])
    floor_rec.write(files[1])
    ev = collect(tmp_path, "int8-w8a8")  # the gate reads the look's record at the look's level
    assert ev.stream == look and math.isclose(ev.fidelity.kl.level, 1 - 2 * look.alpha)
    decision = evaluate(load_policy(POLICY), ev.model_copy(update={"scheme": "int8-w8a8"}))
    gate = {c.name: c for c in decision.checks if c.name.startswith("fidelity")}
    assert {c.name: (c.outcome, c.bound) for c in checks} == {n: (gate[n].outcome, gate[n].bound) for n in gate}
    assert decision.decision == "REJECT" and decision.stream == look
    assert f"streaming look {look.index} of {look.of}" in decision.operating.note
    plain = FidelityRecord(summary=summarize(cand), estimator="sampled-logratio", samples=cand)
    plain.write(files[0])
    assert "stream" not in json.loads(files[0].read_text())  # a full sample's record is as it was


def test_a_slice_decided_at_its_own_look_leaves_the_pooled_checks_to_the_full_sample(tmp_path):
    rng = np.random.default_rng(5)
    slice_only = _samples(rng, {"multilingual": 0.1}, 15)
    floor = _samples(rng, {"multilingual": 0.0004, "factual_qa": 0.0004}, 4)
    look = stream.look(0.05, 50, 15, scope="multilingual", minimum=10, by_category={"multilingual": 15})
    assert look.of == len(stream.planned(50, minimum=10)) == 8  # 10, 15, ..., 45 of the slice's 50
    record = FidelityRecord(summary=summarize(slice_only), estimator="sampled-logratio", samples=slice_only, stream=look)
    floor_rec = FidelityRecord(summary=summarize(floor), estimator="sampled-logratio", samples=floor)
    checks = {c.name: c for c in stream_checks(load_policy(POLICY), "int8-w8a8", "int8-w8a8", record, floor_rec,
                                               ("a", "b"))}
    assert checks["fidelity:kl:multilingual"].outcome == "fail" and checks["fidelity:floor"].outcome == "pass"
    # its pooled figures are the slice's own: not judged as the pooled checks
    assert checks["fidelity:kl"].outcome == checks["fidelity:top1"].outcome == "skipped"
    assert "slice multilingual's streaming look" in checks["fidelity:kl"].reason
    assert not [n for n in checks if n.endswith(":factual_qa")]


def test_a_looks_bound_is_worded_at_its_own_level_not_rounded_to_100_percent():
    """A streaming look judges at a small share of alpha (0.005: a two-sided 99% interval, each end a one-sided 99.5%
    bound): the reason says 99.5%, as the report does, never "100% upper bound"."""
    from quantgate.gate.models import FidelityEvidence, Interval
    from quantgate.gate.statistical import _bounded
    from quantgate.report.page import _fmt_bounded
    from quantgate.report.sections import bound_of

    ev = FidelityEvidence(n_samples=15, n_tokens=1424, kl=Interval(mean=0.0454, low=0.03, high=0.108, level=0.99),
                          top1=Interval(mean=0.86, low=0.80, high=0.9, level=0.99), estimator="sampled-logratio")
    kl, top1 = _bounded("fidelity:kl", ev, "kl", 0.02, True), _bounded("fidelity:top1", ev, "top1", 0.93, True)
    assert "(99.5% upper bound 0.108)" in kl.reason and "(99.5% lower bound 80.00%)" in top1.reason, (kl, top1)
    assert bound_of(kl.reason) == 0.108 and bound_of(top1.reason) == 0.8
    assert "(99.5% upper bound" in _fmt_bounded({"mean": 0.0454, "low": 0.03, "high": 0.108}, "sig", "upper", 0.995)
    assert "(95% upper bound" in _fmt_bounded({"mean": 0.0454, "low": 0.03, "high": 0.108}, "sig", "upper", 0.95)
