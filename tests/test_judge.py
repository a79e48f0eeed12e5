"""LLM-as-judge: verdict parsing, both-order combination, calibration pairs and scoring, statistics, the judge
client's retry paths against a fake endpoint, and one real run of the demo model judging itself (slow)."""

from __future__ import annotations

import json
import math
import random
import sys
from collections import Counter
from types import SimpleNamespace

import pytest

from quantgate.base.errors import ConfigError, QuantgateError
from quantgate.base.fileio import write_json
from quantgate.base.paths import EVAL_SETS, JUDGES, RELEASES
from quantgate.gate.checks import evaluate
from quantgate.gate.evidence import collect
from quantgate.gate.policy import load_policy
from quantgate.judge.core import (PairItem, combine, non_inferiority, outcomes, parse_verdict, rates, render,
                                  summarize_calibration, summarize_comparison, wilson)
from quantgate.judge.corrupt import (CalibrationConfig, calibration_pairs, change_number, proper_nouns, swap_name,
                                     truncate, untranslated)
from quantgate.judge.client import JudgeClientConfig, JudgeJob, judge_all
from quantgate.judge.core import Parsed
from quantgate.judge.run import JudgeEndpoint, JudgeSettings, load_calibration_config, load_judge, run_judge
from tests._fake_openai import FakeServer, kill_when
from tests._judge_fakes import FakeJudge, prefer, write_run

PAIRWISE = load_judge(JUDGES / "pairwise.md")
REFERENCE = load_judge(JUDGES / "reference.md")


# --- verdict parsing -------------------------------------------------------------------------------------

@pytest.mark.parametrize("reply, label, how", [
    ("Both are fine, A is shorter.\nVERDICT: A", "A", "strict"),
    ("VERDICT: TIE", "TIE", "strict"),
    ("  reasoning\n\nVERDICT: B  \n\n", "B", "strict"),
    ("verdict: b", "B", "tolerant"),                               # lower case
    ("**Verdict:** A", "A", "tolerant"),                            # markdown
    ("The verdict is TIE.", "TIE", "tolerant"),
    ("VERDICT: B\nI hope this helps!", "B", "tolerant"),            # extra text after the verdict
    ("Final verdict - a", "A", "tolerant"),
    ("B", "B", "tolerant"),                                         # a bare label
    ("Answer: **b**.", None, "invalid"),                            # no 'verdict', last line is not a bare label
    ("Answer A is good but B is better.", None, "invalid"),         # both letters, no verdict
    ("VERDICT: A\nVERDICT: B\nVERDICT: TIE", None, "invalid"),      # an echo of the options
    ("verdict: A.\nOn second thought, verdict: B", None, "invalid"),  # conflicting verdict lines
    ("My verdict: abstain", None, "invalid"),
    ("", None, "invalid"),
    (None, None, "invalid"),
    ("I cannot decide.", None, "invalid"),
])
def test_parse_pairwise(reply, label, how):
    p = parse_verdict(PAIRWISE, reply)
    assert (p.label, p.how) == (label, how)
    assert (p.reason is None) == (how != "invalid")


@pytest.mark.parametrize("reply, label", [
    ("Same facts.\nVERDICT: CORRECT", "CORRECT"),
    ("The number differs.\nVERDICT: INCORRECT", "INCORRECT"),
    ("verdict: incorrect", "INCORRECT"),   # the longer label is not read as its suffix
    ("Incorrect.", "INCORRECT"),
    ("VERDICT: A", None),
])
def test_parse_reference(reply, label):
    assert parse_verdict(REFERENCE, reply).label == label


def test_judge_files_load_and_bad_placeholder_is_named(tmp_path):
    assert PAIRWISE.spec.kind == "pairwise" and REFERENCE.spec.kind == "reference"
    (tmp_path / "j.md").write_text("{{question}} {{answer_c}}")
    (tmp_path / "j.yaml").write_text((JUDGES / "pairwise.yaml").read_text())
    with pytest.raises(ConfigError, match=r"answer_c"):
        load_judge(tmp_path / "j.md")
    (tmp_path / "j.yaml").write_text((JUDGES / "pairwise.yaml").read_text().replace("(A|B|TIE)", "A|B|TIE"))
    with pytest.raises(ConfigError, match=r"j.yaml:\d+ field 'grade_regex'.*capture group"):
        load_judge(tmp_path / "j.md")


def test_render_both_orders_and_optional_sections():
    it = PairItem("p1", "c", "Q?", first="base answer", second="cand answer", reference="gold", criteria=None)
    ab = render(PAIRWISE, it, "ab", show_reference=True)[-1]["content"]
    ba = render(PAIRWISE, it, "ba", show_reference=False)[-1]["content"]
    assert ab.index("base answer") < ab.index("cand answer") and ba.index("cand answer") < ba.index("base answer")
    assert "gold" in ab and "gold" not in ba
    assert "What a good answer does" not in ab  # no criteria -> no section
    assert "{{" not in ab + ba


# --- position bias ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("ab, ba, winner, consistent", [
    ("A", "B", "first", True),      # both orders pick the first answer
    ("B", "A", "second", True),
    ("TIE", "TIE", "tie", True),
    ("A", "A", "tie", False),       # position bias: always the first shown -> tie
    ("B", "B", "tie", False),
    ("A", "TIE", "tie", False),
    ("A", None, None, None),        # an invalid slot makes the pair invalid
])
def test_combine_pairwise(ab, ba, winner, consistent):
    assert combine("pairwise", {"ab": ab, "ba": ba}) == (winner, consistent)


@pytest.mark.parametrize("first, second, winner", [
    ("CORRECT", "INCORRECT", "first"), ("INCORRECT", "CORRECT", "second"),
    ("CORRECT", "CORRECT", "tie"), ("INCORRECT", "INCORRECT", "tie"), (None, "CORRECT", None)])
def test_combine_reference(first, second, winner):
    assert combine("reference", {"first": first, "second": second})[0] == winner


# --- calibration -----------------------------------------------------------------------------------------

POOL = ["Dunhollow", "Brindlemoor", "Halvard"]


@pytest.mark.parametrize("fn, ref, check", [
    (lambda r, g: change_number(r, g), "Work will cost 39 million.", lambda o: "39" not in o
     and o.startswith("Work will cost ") and o.endswith(" million.")),
    (lambda r, g: change_number(r, g), "no digits here", lambda o: o is None),
    (lambda r, g: swap_name(r, POOL, g), "The council of Brindlemoor voted.",
     lambda o: "Brindlemoor" not in o and any(p in o for p in POOL) and o.startswith("The council of ")),
    (lambda r, g: swap_name(r, POOL, g), "Halvard", lambda o: o in ("Dunhollow", "Brindlemoor")),
    (lambda r, g: swap_name(r, POOL, g), "The cat sleeps.", lambda o: o is None),   # sentence-initial 'The' is no name
    (lambda r, g: truncate(r), "one two three four", lambda o: o == "one two"),
    (lambda r, g: truncate(r), "Ankara", lambda o: o == "Ank"),
    (lambda r, g: truncate(r), "B", lambda o: o is None),
])
def test_corruptions(fn, ref, check):
    for seed in range(5):
        out = fn(ref, random.Random(seed))
        assert check(out), (ref, out)
        assert out == fn(ref, random.Random(seed))  # deterministic


def test_change_number_changes_the_value_not_the_neighbours():
    for seed in range(30):
        out = change_number("1653", random.Random(seed))
        assert out.isdigit() and out != "1653" and abs(int(out) - 1653) <= 9


def test_untranslated_and_proper_nouns():
    assert untranslated("Translate into French. Reply with the translation only: I like apples.",
                        "J'aime les pommes.") == "I like apples."
    assert untranslated("Repeat this name exactly, with nothing else: Ythsar Lohalisk", "Ythsar Lohalisk") is None
    assert [m.group() for m in proper_nouns("Heavy wind closed 22 schools in Brindlemoor.")] == ["Brindlemoor"]


def _sample(i, cat, prompt, ref):
    return SimpleNamespace(id=i, category=cat, references=[ref], criteria=None, prompt_text=lambda p=prompt: p)


SAMPLES = [
    _sample("n1", "arithmetic_numbers", "What is 2+2?", "4 apples and 17 pears"),
    _sample("n2", "summarization", "Sum:", "Halvard Systems sold 600 phones in Dunhollow."),
    _sample("p1", "proper_nouns", "Repeat: Velnix Brensardor", "Velnix Brensardor"),
    _sample("t1", "factual_qa", "Capital?", "Canberra"),
    _sample("l1", "multilingual", "Translate into German. Reply with the translation only: Thank you.", "Danke."),
    _sample("l2", "multilingual", "Translate into French. Reply with the translation only: Good night.", "Bonne nuit."),
]


def test_calibration_pairs_cover_each_type_deterministically():
    cfg = CalibrationConfig(seed=7, per_type=1)
    pairs = calibration_pairs(SAMPLES, cfg)
    assert sorted(p.corruption for p in pairs) == ["language", "name", "number", "truncate"]
    assert len({p.pair_id.split(":")[2] for p in pairs}) == len(pairs)  # one type per sample
    assert all(p.first == p.reference and p.second != p.first and p.kind == "calibration" for p in pairs)
    assert pairs == calibration_pairs(SAMPLES, cfg)
    lang = next(p for p in pairs if p.corruption == "language")
    assert lang.second in ("Thank you.", "Good night.")
    many = calibration_pairs(SAMPLES, CalibrationConfig(seed=7, per_type=10))
    assert len(many) == len(SAMPLES)  # each sample used once, wherever it fits


def _judged(pairs, decide):
    """Labels of a judge `decide(item, slot) -> label` for every slot of every pair."""
    return {p.pair_id: {s: decide(p, s) for s in ("ab", "ba")} for p in pairs}


def test_calibration_flags_always_a_and_random_judges():
    pairs = calibration_pairs(SAMPLES * 1, CalibrationConfig(seed=1, per_type=10)) * 8
    pairs = [PairItem(**{**p.__dict__, "pair_id": f"{p.pair_id}:{k}"}) for k, p in enumerate(pairs)]
    perfect = summarize_calibration(outcomes("pairwise", pairs, _judged(pairs, lambda p, s: "B" if s == "ba" else "A")), 0.8)
    always_a = summarize_calibration(outcomes("pairwise", pairs, _judged(pairs, lambda p, s: "A")), 0.8)
    rng = random.Random(3)
    rand = summarize_calibration(outcomes("pairwise", pairs, _judged(pairs, lambda p, s: rng.choice("AB") if rng.random() < .9 else "TIE")), 0.8)
    assert perfect["reliable"] and perfect["accuracy"] == 1.0
    assert not always_a["reliable"] and always_a["accuracy"] == 0.0
    assert not rand["reliable"] and rand["accuracy"] < 0.5
    assert "below the bar of 80%" in rand["reason"]
    assert set(perfect["by_type"]) == {"number", "name", "truncate", "language"}
    assert not summarize_calibration([], 0.8)["reliable"]


# --- statistics ------------------------------------------------------------------------------------------

def test_wilson_hand_computed():
    lo, hi = wilson(5, 10)  # centre 0.5, half width 1.96*sqrt(.025+1.96^2/400)/(1+1.96^2/10) = 0.2634
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0
    assert all(math.isnan(x) for x in wilson(0, 0))


@pytest.mark.parametrize("w, t, l, margin, lower, non_inf", [
    # net 0.4, per-pair variance 0.8 - 0.16 = 0.64, se = 0.8/sqrt(10) = 0.25298; lower = 0.4 - 1.6449*se
    (6, 2, 2, 0.05, -0.01612, True),
    (6, 2, 2, 0.01, -0.01612, False),
    (0, 10, 0, 0.05, 0.0, True),       # all ties: no spread, net 0 > -margin
    (0, 8, 2, 0.05, -0.40806, False),  # net -0.2, se = sqrt(.2-.04)/sqrt(10) = .12649; lower = -.2 - 1.6449*se
])
def test_non_inferiority(w, t, l, margin, lower, non_inf):
    r = non_inferiority(w, t, l, margin)
    assert r["lower_bound"] == pytest.approx(lower, abs=1e-4)
    assert r["non_inferior"] is non_inf
    if (w, t, l) == (6, 2, 2) and margin == 0.05:
        assert r["p_value"] == pytest.approx(0.0376, abs=5e-4)  # 1 - Phi(0.45 / 0.25298)


def test_rates_exclude_invalid_and_count_identical_as_tie():
    items = [PairItem(f"p{i}", "c", "q", "x", "y") for i in range(4)] + [PairItem("same", "d", "q", "z ", "z")]
    labels = {"p0": {"ab": "B", "ba": "A"}, "p1": {"ab": "A", "ba": "B"}, "p2": {"ab": "A", "ba": "A"},
              "p3": {"ab": None, "ba": "A"}}
    outs = outcomes("pairwise", items, labels)
    r = rates(outs)
    assert r["n"] == 4 and r["invalid"] == 1
    assert (r["win"]["count"], r["tie"]["count"], r["loss"]["count"]) == (1, 2, 1)
    assert not outs[-1].judged


# --- client and run against a fake judge -----------------------------------------------------------------

@pytest.fixture(scope="module")
def es():
    from quantgate.evals.dataset import load_evalset

    return load_evalset(EVAL_SETS / "default.jsonl")


def _runs(tmp_path, es, n=6):
    """Baseline answers = references; the candidate keeps every third one and spoils the rest. Also the set of
    bad answers (spoilt ones and calibration corruptions) that a perfect fake judge recognises."""
    picked = [s for s in es.samples if s.category == "arithmetic_numbers"][:n // 2] + \
        [s for s in es.samples if s.category == "proper_nouns"][:n - n // 2]
    base = {s.id: s.references[0] for s in picked}
    cand = {s.id: (s.references[0] if k % 3 == 0 else "wrong " + s.references[0]) for k, s in enumerate(picked)}
    cal = calibration_pairs(es.samples, load_calibration_config().model_copy(update={"per_type": 2}))
    bad = {p.second for p in cal} | {o for i, o in cand.items() if o != base[i]}
    return write_run(tmp_path / "base", es, base, "base-model"), write_run(tmp_path / "cand", es, cand, "cand-model"), bad


def _judge(url, es, tmp_path, b, c, **kw):
    settings = JudgeSettings(calibration_per_type=2, concurrency=4, client={"backoff_s": 0.01, "backoff_max_s": 0.02},
                             **kw)
    return run_judge(JudgeEndpoint(url=url, model="fake-model"), settings, evalset=es.path, baseline=b, candidate=c,
                     out=tmp_path / "j")


def test_run_with_perfect_fake_judge_then_resume(tmp_path, es):
    b, c, bad = _runs(tmp_path, es)
    with FakeJudge(prefer(bad)) as srv:
        rep = _judge(srv.url, es, tmp_path, b, c)
        first = len(srv.requests)
        rep2 = _judge(srv.url, es, tmp_path, b, c)
    assert rep["calibration"]["reliable"] and rep["calibration"]["accuracy"] == 1.0
    o = rep["comparison"]["overall"]
    assert (o["win"]["count"], o["tie"]["count"], o["loss"]["count"]) == (0, 2, 4)  # 2 identical, 4 worse
    assert rep["comparison"]["n_identical"] == 2 and rep["comparison"]["position_consistency"] == 1.0
    assert len(rep["comparison"]["worst_losses"]) == 4 and rep["comparison"]["worst_losses"][0]["candidate"].startswith("wrong")
    assert first == 2 * (8 + 4) and len(srv.requests) == first  # resume: nothing re-judged
    assert rep2["comparison"]["overall"] == o and rep["judge_not_stronger"] is None
    rec = json.loads((tmp_path / "j" / "judgements.jsonl").read_text().splitlines()[0])
    assert rec["messages"][0]["content"] and rec["replies"][0].endswith(("A", "B", "TIE"))
    md = (tmp_path / "j" / "report.md").read_text()
    assert "UNRELIABLE" not in md and "Worst losses" in md


def test_unparsable_verdict_gets_one_retry_then_counts_invalid(tmp_path, es):
    b, c, bad = _runs(tmp_path, es)
    perfect = prefer(bad)

    def decide(messages, n):
        if len(messages) > 1:                                    # the retry turn
            return "VERDICT: A" if "Velnix" in messages[0]["content"] else "still thinking"
        return "hmm" if "Repeat this name" in messages[0]["content"] else perfect(messages, n)

    with FakeJudge(decide) as srv:
        rep = _judge(srv.url, es, tmp_path, b, c, not_stronger=True)
    recs = [json.loads(x) for x in (tmp_path / "j" / "judgements.jsonl").read_text().splitlines()]
    retried = [r for r in recs if r["verdict_retry"]]
    assert retried and all(len(r["replies"]) == 2 and len(r["messages"]) == 1 for r in retried)
    assert {r["parsed"] for r in retried} <= {"strict", "invalid"}
    assert rep["parse"]["retried"] == len(retried) and rep["parse"]["invalid"] >= 1
    assert rep["comparison"]["invalid_pairs"] >= 1 and "NOT STRONGER" in (tmp_path / "j" / "report.md").read_text()


def test_unreachable_and_timing_out_judge(tmp_path, es):
    b, c, bad = _runs(tmp_path, es)
    with pytest.raises(QuantgateError, match="cannot reach the server"):
        _judge("http://127.0.0.1:9", es, tmp_path, b, c)
    with FakeJudge(prefer(bad), delay_s=0.5) as srv:
        with pytest.raises(QuantgateError, match="in a row.*ReadTimeout") as exc:
            _judge(srv.url, es, tmp_path, b, c, timeout_s=0.1)
    assert "judged pairs are kept" in exc.value.fix
    assert json.loads((tmp_path / "j" / "manifest.json").read_text())["status"] == "failed"


def test_5xx_is_retried(tmp_path, es):
    b, c, bad = _runs(tmp_path, es, n=3)
    with FakeJudge(prefer(bad)) as srv:
        srv.script = _FirstCall500()  # every prompt answers HTTP 500 once, then succeeds
        rep = _judge(srv.url, es, tmp_path, b, c)
    recs = [json.loads(x) for x in (tmp_path / "j" / "judgements.jsonl").read_text().splitlines()]
    assert all(r["error"] is None and r["http_attempts"] == 2 for r in recs)
    assert rep["calibration"]["accuracy"] == 1.0


class _FirstCall500(dict):
    def get(self, prompt, default=None):
        return ["500"]


# --- the judgements file: a kill loses no judged pair and leaves no torn line ----------------------------------

JUDGE_CHILD = """
import sys
from quantgate.judge.client import JudgeClientConfig, JudgeJob, judge_all
from quantgate.judge.core import Parsed
url, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
jobs = [JudgeJob(f"q{k}#{slot}", f"q{k}", slot, [{"role": "user", "content": f"q{k} {slot}"}])
        for k in range(n) for slot in ("ab", "ba")]
judge_all(jobs, path, JudgeClientConfig(endpoint=url, model="fake-model", concurrency=4),
          lambda text: Parsed("A", "strict"), "again")
"""


def _jobs(n: int) -> list[JudgeJob]:
    return [JudgeJob(f"q{k}#{slot}", f"q{k}", slot, [{"role": "user", "content": f"q{k} {slot}"}])
            for k in range(n) for slot in ("ab", "ba")]


def _judge_all(url, path, n):
    cfg = JudgeClientConfig(endpoint=url, model="fake-model", concurrency=4, backoff_s=0.01, backoff_max_s=0.02)
    return judge_all(_jobs(n), path, cfg, lambda text: Parsed("A", "strict"), "again")


def test_kill_half_way_then_resume_judges_every_pair_exactly_once(tmp_path):
    n, path = 40, tmp_path / "judgements.jsonl"
    with FakeServer(delay_s=0.05) as server:
        kill_when([sys.executable, "-c", JUDGE_CHILD, server.url, str(path), str(n)], path, 2 * n // 3)
        before = {json.loads(line)["id"] for line in path.read_text().splitlines()}
        assert 2 * n // 3 <= len(before) < 2 * n, "the kill must land half-way"
        calls_at_kill = dict(server.calls)
        stats = _judge_all(server.url, path, n)
    ids = Counter(json.loads(line)["id"] for line in path.read_text().splitlines())  # every line parses
    assert ids == {j.id: 1 for j in _jobs(n)}  # nothing lost, nothing judged twice
    assert stats["skipped"] == len(before) and stats["judged"] == 2 * n - len(before)
    for rid in before:  # judged before the kill: not asked again
        pair, slot = rid.split("#")
        assert server.calls[f"{pair} {slot}"] == calls_at_kill[f"{pair} {slot}"] == 1


def test_a_torn_last_judgement_is_cut_and_judged_again(tmp_path):
    path = tmp_path / "judgements.jsonl"
    with FakeServer() as server:
        _judge_all(server.url, path, 1)
        with path.open("a") as fh:
            fh.write('{"id": "q1#ab", "pair_id": "q1", "lab')  # a write cut by a kill
        stats = _judge_all(server.url, path, 2)
    lines = path.read_text().splitlines()
    assert Counter(json.loads(line)["id"] for line in lines) == {j.id: 1 for j in _jobs(2)}
    assert stats["skipped"] == 2 and stats["judged"] == 2


# --- the real thing --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_demo_model_judges_itself(tmp_path, es, demo_model, demo_server):
    """The demo model (135M) judges 3 pairs in both orders plus 4 calibration pairs: the run completes, every
    verdict is kept with prompt and reply, and the report says plainly that this judge is not stronger."""
    picked = [s for s in es.samples if s.category in ("arithmetic_numbers", "proper_nouns", "factual_qa")][::17][:3]
    base = {s.id: s.references[0] for s in picked}
    cand = {s.id: f"I think it is {s.references[0][:-1]}" for s in picked}
    b = write_run(tmp_path / "base", es, base, "demo")  # the judged runs name the model that also judges them
    c = write_run(tmp_path / "cand", es, cand, "demo")
    srv = demo_server
    rep = run_judge(JudgeEndpoint(url=srv.base_url, model="demo", api_key=srv.api_key),
                    JudgeSettings(calibration_per_type=1, concurrency=8), evalset=es.path, baseline=b, candidate=c,
                    out=tmp_path / "j")
    print(json.dumps({"calibration": {k: rep["calibration"][k] for k in ("accuracy", "correct", "n", "reliable")},
                      "parse": rep["parse"], "consistency": rep["comparison"]["position_consistency"],
                      "overall": {k: rep["comparison"]["overall"][k]["rate"] for k in ("win", "tie", "loss")}}))
    recs = [json.loads(x) for x in (tmp_path / "j" / "judgements.jsonl").read_text().splitlines()]
    assert len(recs) == 2 * (4 + 3) and all(r["error"] is None and r["replies"] for r in recs)
    assert rep["judge_not_stronger"] and "NOT STRONGER" in (tmp_path / "j" / "report.md").read_text()
    assert rep["counts_as_evidence"] == rep["calibration"]["reliable"]


def test_cli_judge_then_review_roundtrip(tmp_path, es):
    import csv

    from typer.testing import CliRunner

    from quantgate.cli.main import app

    b, c, bad = _runs(tmp_path, es)
    run = CliRunner().invoke
    with FakeJudge(prefer(bad)) as srv:
        r = run(app, ["judge", "--endpoint", srv.url, "--model", "fake-model", "--evalset", str(es.path),
                      "--base", str(b), "--cand", str(c), "--out", str(tmp_path / "j"), "--calibration-per-type", "1",
                      "--margin", "0.1"])
    assert r.exit_code == 0, r.output
    assert "calibration accuracy 100.0% (4/4)" in r.output and "loss 66.7%" in r.output  # 2 identical: ties
    r = run(app, ["review", "export", "--judge-dir", str(tmp_path / "j"), "--out", str(tmp_path / "send"), "--n", "4"])
    assert r.exit_code == 0 and "at least 50" in r.output, r.output
    rows = list(csv.DictReader((tmp_path / "send" / "review.csv").open(newline="")))
    key = json.loads((tmp_path / "j" / "review_key.json").read_text())
    for row in rows:  # the human agrees with the judge: the baseline is better
        row["choice"] = "A" if key["items"][row["review_id"]]["a"] == "baseline" else "B"
    with (tmp_path / "filled.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    r = run(app, ["review", "import", "--judge-dir", str(tmp_path / "j"), "--csv", str(tmp_path / "filled.csv")])
    assert r.exit_code == 0, r.output
    assert "loss 100.0%" in r.output and "agreement with the judge 100.0% over 4 pairs" in r.output


# --- the gate's cap on invalid verdicts -------------------------------------------------------------------------

def _mostly_invalid_report(tmp_path, invalid: int, total: int = 300):
    """A real judge summary where `invalid` of `total` judged pairs got no valid verdict and the rest are ties."""
    items = [PairItem(f"p{i}", "factual_qa", f"question {i}", f"baseline {i}", f"candidate {i}") for i in range(total)]
    labels = {f"p{i}": {"ab": None if i < invalid else "TIE", "ba": "TIE"} for i in range(total)}
    cmp_ = summarize_comparison(outcomes("pairwise", items, labels), margin=0.05)
    report = {"schema": 1, "calibration": {"accuracy": 1.0, "reliable": True, "reason": None}, "comparison": cmp_,
              "counts_as_evidence": True, "judge_not_stronger": None}
    write_json(tmp_path / "report.json", report)
    return tmp_path / "report.json"


@pytest.mark.parametrize("invalid, cap, outcome", [
    (290, None, "inconclusive"),   # the reproduction: 290 invalid of 300 used to pass the default policy
    (290, 1.0, "pass"),            # ... as it still does with the cap switched off
    (30, None, "pass"),            # 10.0%: at the default cap, not above it
    (31, None, "inconclusive"),
    (0, 0.0, "pass"),
])
def test_the_gate_caps_the_invalid_verdict_rate(tmp_path, invalid, cap, outcome):
    report = _mostly_invalid_report(tmp_path, invalid)
    policy = load_policy(RELEASES / "policies" / "default.yaml")
    assert policy.judge.max_invalid_rate == 0.1  # the default cap, from the policy file
    if cap is not None:
        policy = policy.model_copy(update={"judge": policy.judge.model_copy(update={"max_invalid_rate": cap})})
    ev = collect(tmp_path / "run", "int8-w8a8", judge_report=report)
    assert ev.judge.judged == 300 and ev.judge.invalid == invalid and ev.judge.n == 300 - invalid
    (check,) = [c for c in evaluate(policy, ev).checks if c.name == "judge:non_inferiority"]
    assert check.outcome == outcome, check.reason
    if outcome == "inconclusive":
        rate = f"{invalid / 300:.1%}"
        assert f"{invalid} of 300" in check.reason and rate in check.reason and "10.0%" in check.reason
        assert "max_invalid_rate" in check.reason
    print(f"\n{invalid} of 300 invalid, cap {cap if cap is not None else 0.1}: {check.outcome} ({check.reason[:90]})")
