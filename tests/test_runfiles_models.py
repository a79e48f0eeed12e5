"""The run folder's JSON files read back through their models (issue 17, item 3).

Each file is written by its real writer on small real inputs: the release's compare step
(quantgate.release.steps.compare_variants: compare/<candidate>.json, the recall delta.json, pay_off.json) over eval
run folders as `quantgate eval` leaves them, recall request records and two perf probe results; the judge's
report.json by quantgate.judge.run.run_judge against a scripted fake judge (the one mock: a judge is a remote
model that cannot run here); summary.json by quantgate.release.steps.finish_run after the real gate. Then each file
is read through its loader and its fields checked against what the writer returned, and a file with one wrongly
typed field is refused with an error naming the file and the field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from pydantic import ValidationError
from _gate_fixtures import make_run, recall_dirs

from quantgate.gate.summaryfile import Summary, write_summary
from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import write_json
from quantgate.base.paths import EVAL_SETS
from quantgate.base.runfiles import CELLS, COMPARE_DIR, DELTA, JUDGE_REPORT, PAY_OFF, REQUESTS, SUMMARY
from quantgate.evals.comparefile import Comparison, load_comparison
from quantgate.evals.dataset import load_evalset
from quantgate.gate.decisionfile import load_run_decision, write_decision
from quantgate.gate.evidence import collect
from quantgate.gate.summaryfile import load_summary
from quantgate.judge.reportfile import load_judge_report
from quantgate.judge.run import JudgeEndpoint, JudgeSettings, run_judge
from quantgate.perf.compare import level_medians
from quantgate.perf.models import SLO, Decide, PerfResult, RunResult, Workload
from quantgate.perf.payofffile import load_pay_off
from quantgate.recall import score as recall_score
from quantgate.recall.resultfile import load_recall_cells, load_recall_delta
from quantgate.release import steps as rel
from quantgate.spec.resolve import load_spec
from tests._judge_fakes import FakeJudge, prefer, write_run

CAND = "w4a16-gptq"


def _evidence(run: Path, cache: Path, name: str, *, evals: Path, recall: Path, perf: Path, size: int) -> rel.Evidence:
    variant = rel.Variant(name=name, path=cache / "ckpt", scheme=None if name == "baseline" else name,
                          content_hash="0" * 64, size_bytes=size)
    return rel.Evidence(variant=variant, folder=run / name, cache=cache, serve_command=[], dtype=None,
                        evals={"default": evals}, recall=recall, perf=perf, served=True)


def _probe(folder: Path, model: str, tpots: list[float]) -> Path:
    """A perf probe folder (perf.json) with one run per repeat at concurrency 1."""
    runs = [RunResult(repeat=r, concurrency=1, num_prompts=8, completed=8, failed=0, error_rate=0.0,
                      output_tok_s=800 / t, tpot_p50_ms=t, goodput_rps=1.0, slo_attainment=1.0)
            for r, t in enumerate(tpots)]
    w = Workload(num_prompts=8, input_len=64, output_len=16, tokenizer="/tok", tokenizer_sha256="x", profile="latency",
                 slo=SLO(ttft_ms=200, tpot_ms=50, attainment=0.95), decide=[Decide(figure="tpot_p50_ms", at="lowest")])
    result = PerfResult(client="t", endpoint="http://x", model=model, workload=w, concurrency=[1], repeats=len(runs),
                        runs=runs, medians=level_medians(runs), weights_bytes=1000 if model == "baseline" else 400,
                        status="ok", started="t", seconds=40.0)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "perf.json").write_text(result.model_dump_json(indent=2), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A run folder whose comparison, recall delta, pay-off and judge report come from their real writers."""
    root = tmp_path_factory.mktemp("runfiles")
    run, cache = root / "run", root / "cache"
    es = load_evalset(EVAL_SETS / "default.jsonl")
    picked = [s for s in es.samples if s.category == "arithmetic_numbers"][:6] + \
        [s for s in es.samples if s.category == "proper_nouns"][:6]
    base = {s.id: s.references[0] for s in picked}
    cand = {s.id: (s.references[0] if k % 3 else "wrong " + s.references[0]) for k, s in enumerate(picked)}
    scores = {i: {"exact_match": float(cand[i] == base[i])} for i in cand}
    bdir = write_run(cache / "evals" / "base", es, base, "base-model", {i: {"exact_match": 1.0} for i in base})
    cdir = write_run(cache / "evals" / "cand", es, cand, "cand-model", scores)
    recall_cand = recall_dirs(cache / "recall", CAND, lose=3, errors=2)
    records = [json.loads(ln) for ln in (recall_cand / REQUESTS).read_text(encoding="utf-8").splitlines()]
    # cells.json as quantgate.recall.run._finish lays it out: run facts, then the real scorer's outcomes
    write_json(recall_cand / CELLS, {"status": "partial", "model": CAND, "endpoint": "http://x",
                                     "grid": {"lengths": [1024]}, "cost": {"needles": len(records)},
                                     **recall_score.cells(records)})
    b = _evidence(run, cache, "baseline", evals=bdir, recall=cache / "recall" / "baseline" / "recall",
                  perf=_probe(cache / "perf" / "base", "baseline", [20.0, 21.0, 19.5]), size=1000)
    c = _evidence(run, cache, CAND, evals=cdir, recall=recall_cand,
                  perf=_probe(cache / "perf" / "cand", CAND, [12.0, 12.5, 11.8]), size=400)
    comparison = rel.compare_variants(b, c, run)
    bad = {o for i, o in cand.items() if o != base[i]}
    with FakeJudge(prefer(bad | {"wrong"})) as srv:
        settings = JudgeSettings(calibration_per_type=1, concurrency=4,
                                 client={"backoff_s": 0.01, "backoff_max_s": 0.02})
        report = run_judge(JudgeEndpoint(url=srv.url, model="fake-model"), settings, evalset=es.path, baseline=bdir,
                           candidate=cdir, out=run / CAND / "judge")
    return {"run": run, "comparison": comparison, "report": report, "records": records, "recall_cand": recall_cand}


def _same(a, b) -> bool:
    both_nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return a == b or both_nan


def test_comparison_reads_back_through_its_model(written):
    path = written["run"] / COMPARE_DIR / f"{CAND}.json"
    cmp_ = load_comparison(path)
    raw = json.loads(path.read_text(encoding="utf-8"))["default"]
    assert written["comparison"].model_dump_json() == cmp_.model_dump_json()  # what the compare step returned
    got = cmp_.root["default"]
    em = got.metrics["exact_match"]
    assert em.binary and em.higher_is_better and em.overall.n == raw["metrics"]["exact_match"]["overall"]["n"] == 12
    assert em.overall.lost == 4 and em.overall.gained == 0
    for key in ("base_mean", "cand_mean", "delta", "ci_low", "ci_high", "p_harm", "mcnemar_p"):
        assert _same(getattr(em.overall, key), raw["metrics"]["exact_match"]["overall"][key]), key
    assert set(em.by_category) == {"arithmetic_numbers", "proper_nouns"}
    assert [f.id for f in got.regressions] == [r["id"] for r in raw["regressions"]]
    assert got.regressions[0].cand_output.startswith("wrong")
    assert got.pooled is not None and got.pooled.metrics_used == {"exact_match": 12}
    assert got.agreement.overall == pytest.approx(8 / 12)
    assert got.model_extra["evalset"]["sha256"] == raw["evalset"]["sha256"]  # keys the model does not name are kept
    ev = collect(written["run"], CAND)  # the gate reads it through the same model
    assert ev.metrics["default"]["exact_match"].n == 12 and "default" in ev.pooled


def test_recall_delta_and_cells_read_back_through_their_models(written):
    folder = written["run"] / CAND / "recall"
    delta, raw = load_recall_delta(folder / DELTA), json.loads((folder / DELTA).read_text())
    assert delta.n_paired == raw["n_paired"] == 38 and delta.n_error_excluded == 2
    assert delta.overall.base == 1.0 and delta.overall.delta == pytest.approx(-3 / 38)
    assert delta.regressions == ["r000", "r001", "r002"] and delta.baseline.endswith("baseline/recall")
    assert [(c.length, c.depth, c.kind, c.delta) for c in delta.cells] == \
        [(x["length"], x["depth"], x["kind"], x["delta"]) for x in raw["cells"]]
    cells = load_recall_cells(folder / CELLS)  # copied beside the delta by the compare step
    assert cells.status == "partial" and cells.overall.n_error == 2 and cells.overall.n == 38
    assert cells.cost["needles"] == len(written["records"]) and set(cells.by_kind) == {"single"}
    assert sum(c.n for c in cells.cells) == 38


def test_pay_off_reads_back_through_its_model(written):
    path = written["run"] / CAND / PAY_OFF
    pay, raw = load_pay_off(path), json.loads(path.read_text(encoding="utf-8"))
    assert pay.has_figures and pay.workload == "latency" and pay.concurrency == 1 and pay.repeats == 3
    (fig,) = pay.decide
    assert fig.figure == "tpot_p50_ms" and fig.lower_is_better and fig.ratio.value == raw["decide"][0]["ratio"]["value"]
    assert fig.ratio.value == pytest.approx(0.6, rel=0.01) and fig.ratio.low < fig.ratio.value < fig.ratio.high
    assert pay.size_ratio == pytest.approx(0.4) and pay.throughput_ratio == raw["throughput_ratio"] > 1.5
    assert pay.file.endswith("perf.json") and pay.intervals["method"] == "welch-log"
    assert collect(written["run"], CAND).pay_off.decide[0].figure == "tpot_p50_ms"


def test_judge_report_reads_back_through_its_model_and_round_trips(written):
    path = written["run"] / CAND / "judge" / JUDGE_REPORT
    rep, raw = load_judge_report(path), written["report"]
    assert rep.schema_version == raw["schema"] and rep.counts_as_evidence == raw["counts_as_evidence"]
    assert rep.calibration.n == raw["calibration"]["n"] > 0
    assert rep.calibration.reliable == raw["calibration"]["reliable"]
    o = rep.comparison.overall
    raw_o = raw["comparison"]["overall"]
    assert (o.win.count, o.tie.count, o.loss.count) == (raw_o["win"]["count"], raw_o["tie"]["count"], raw_o["loss"]["count"])
    assert o.loss.count == 4 and o.non_inferiority.n == raw["comparison"]["overall"]["non_inferiority"]["n"] == 12
    assert rep.comparison.winners == raw["comparison"]["winners"] and len(rep.comparison.worst_losses) == 4
    assert rep.meta["judge_model"] == "fake-model"
    # what a rewriter (quantgate review import) writes back is the file's content, NaN included
    assert json.dumps(rep.to_file(), indent=2) == json.dumps(json.loads(path.read_text()), indent=2)
    ev = collect(written["run"], CAND)
    assert ev.judge is not None and ev.judge.n == 12 and ev.judge.judged == raw["comparison"]["n_judged"]


def test_summary_reads_back_through_its_model(tmp_path):
    (tmp_path / "spec.yaml").write_text(f"version: 1\nname: t\nmodel: demo\nhardware: x86-cpu\nschemes: [{CAND}]\n")
    spec = load_spec(tmp_path / "spec.yaml")
    run = make_run(tmp_path, CAND)
    decisions = rel.gate(spec, run, [CAND])

    def ev(name: str, size: int) -> rel.Evidence:
        evidence = json.loads((run / name / "evidence.json").read_text())
        variant = rel.Variant(name=name, path=tmp_path, scheme=evidence["variant"]["scheme"], content_hash="0" * 64,
                              size_bytes=size)
        return rel.Evidence(variant=variant, folder=run / name, cache=tmp_path, serve_command=[], dtype=None,
                            evals=evidence["evals"], served=False)

    comparison = load_comparison(run / COMPARE_DIR / f"{CAND}.json")
    written = rel.finish_run(spec, run, ev("baseline", 1000), [(ev(CAND, 400), comparison)], decisions, {})
    write_summary(run, written)
    s = load_summary(run / SUMMARY)
    assert s.release == "t" and s.run == run.name and s.decision == written.decision == "PROMOTE"
    assert s.promoted == [CAND] and s.baseline.size_bytes == 1000 and s.baseline.parity is None
    row = s.candidates[CAND]
    assert row.scheme == CAND and row.size_ratio == 0.4 and row.decision == "PROMOTE" and row.registry is None
    m = row.metrics["default/exact_match"]
    assert m.n == written.candidates[CAND].metrics["default/exact_match"].n and m.delta == 0.0
    assert s == written  # what was made is what is read back
    assert row.regressions == 0 and row.agreement["default"] == 1.0 and s.policy["name"]



def test_decision_file_reads_back_through_its_model(tmp_path):
    """decision.json from the real gate, written through RunDecision (same keys in the same order as the plain dict
    it replaced: `ladder` only with a ladder) and read back to the same decisions, each check's `passed` derived."""
    (tmp_path / "spec.yaml").write_text(f"version: 1\nname: t\nmodel: demo\nhardware: x86-cpu\nschemes: [{CAND}]\n")
    run = make_run(tmp_path, CAND)
    decisions = rel.gate(load_spec(tmp_path / "spec.yaml"), run, [CAND])
    for ladder in (None, [{"scheme": CAND, "tried": True}]):
        path = write_decision(run, decisions, tmp_path / "decision.json", ladder=ladder)
        doc = json.loads(path.read_text(encoding="utf-8"))
        assert list(doc) == ["schema_version", "decision", "promoted", "run", "policy", "created", "candidates",
                             *(["ladder"] if ladder else [])]
        assert doc["candidates"][CAND] == decisions[0].model_dump(mode="json")
        back = load_run_decision(path)
        assert back.candidates == {CAND: decisions[0]} and back.ladder == ladder and back.promoted == CAND
        assert [c.passed for c in back.candidates[CAND].checks] == [c.passed for c in decisions[0].checks]

def _retype(path: Path, where: list, value) -> None:
    doc = json.loads(path.read_text(encoding="utf-8"))
    node = doc
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    path.write_text(json.dumps(doc), encoding="utf-8")


@pytest.mark.parametrize("rel_path, where, value, load, field", [
    (f"{COMPARE_DIR}/{CAND}.json", ["default", "metrics", "exact_match", "overall", "n"], "many", load_comparison,
     "default.metrics.exact_match.overall.n"),
    (f"{CAND}/judge/{JUDGE_REPORT}", ["comparison", "overall", "non_inferiority", "non_inferior"], "perhaps",
     load_judge_report, "comparison.overall.non_inferiority.non_inferior"),
    (f"{CAND}/recall/{DELTA}", ["overall", "delta"], "lower", load_recall_delta, "overall.delta"),
    (f"{CAND}/recall/{CELLS}", ["cells", 0, "length"], "long", load_recall_cells, "cells.0.length"),
    (f"{CAND}/{PAY_OFF}", ["decide", 0, "ratio", "value"], [1], load_pay_off, "decide.0.ratio.value"),
])
def test_a_wrongly_typed_field_is_refused_naming_file_and_field(written, tmp_path, rel_path, where, value, load, field):
    path = tmp_path / Path(rel_path).name
    path.write_text((written["run"] / rel_path).read_text(encoding="utf-8"), encoding="utf-8")
    load(path)  # the file as written loads
    _retype(path, where, value)
    with pytest.raises(QuantgateError) as err:
        load(path)
    assert err.value.path == str(path) and err.value.field == field and err.value.where == f"{path}: {field}"
    assert field in err.value.message
    assert "unexpected content" in err.value.message and err.value.fix


def test_summary_with_a_wrongly_typed_field_is_refused(tmp_path):
    path = tmp_path / SUMMARY
    write_json(path, {"release": "t", "candidates": {CAND: {"size_ratio": "small"}}})
    with pytest.raises(QuantgateError) as err:
        load_summary(path)
    assert f"{path}: candidates.{CAND}.size_ratio" == err.value.where


def test_not_an_object_missing_and_corrupt_files_are_named(tmp_path):
    path = tmp_path / "x.json"
    for text, words in (("[1, 2]", "expected a JSON dict, found list"), ("{broken", "corrupt JSON")):
        path.write_text(text)
        with pytest.raises(QuantgateError) as err:
            load_comparison(path) if text.startswith("{") else load_judge_report(path)
        assert words in err.value.message and err.value.where == str(path)
    with pytest.raises(QuantgateError, match="missing file"):
        load_summary(tmp_path / "none.json")
    assert Comparison.model_validate({}).root == {}


def test_a_summary_its_readers_would_refuse_cannot_be_made(tmp_path):
    """finish_run returns a Summary and write_summary writes only a Summary: a row its readers would refuse fails
    where it is made, and the file keeps the fields the summary was given."""
    with pytest.raises(ValidationError):
        Summary.model_validate({"decision": "PROMOTE", "candidates": {"int8": {"reasons": "not a list"}}})
    write_summary(tmp_path, Summary.model_validate({"decision": "REJECT", "candidates": {"int8": {"failure": "x"}}}))
    assert json.loads((tmp_path / "summary.json").read_text()) == {"decision": "REJECT", "candidates": {"int8": {"failure": "x"}}}
