"""Deciding early (quantgate.release.early): the gate's own fidelity checks, read from the run's fidelity files, and
the order of a variant's measurement steps with a REJECT decided (the recall grid and the perf probe do not run).
The real path (a damaged candidate rejected early by real fidelity) is tests/test_gate_real.py's."""

from __future__ import annotations

from pathlib import Path

from _gate_fixtures import fidelity_file

from quantgate.base.paths import EVAL_SETS, RELEASES
from quantgate.gate.early import early_fidelity_checks
from quantgate.release.early import EarlyDecision, Verdicts, early_decision
from quantgate.release.measurements import EvalSets, VariantJob, ordered_steps
from quantgate.spec.resolve import load_spec
from quantgate.release.variants import Variant

POLICY = RELEASES / "policies" / "default.yaml"
SPEC = f"""\
version: 1
name: early
model: demo
hardware: a100
schemes: [int8-w8a8]
eval_sets: [{EVAL_SETS / 'default.jsonl'}]
recall: {{lengths: [512], depths: [50], kinds: [number], samples: 1}}
perf: {{concurrency: [1], num_prompts: 4, input_len: 32, output_len: 8, repeats: 1, rounds: null}}
"""


def _run(tmp_path: Path, kl: float) -> Path:
    run = tmp_path / f"run-{kl}"
    fidelity_file(run / "fidelity" / "int8-w8a8.json", kl, n=120)
    fidelity_file(run / "fidelity" / "floor.json", 0.0002, top1=0.998, n=120)
    return run


def test_a_candidate_far_beyond_its_kl_limit_fails_the_gates_own_early_check(tmp_path):
    bad = early_fidelity_checks(_run(tmp_path, 0.30), POLICY, "int8-w8a8", "int8-w8a8", ([120, 300], 120))
    assert "fidelity:kl" in {c.name for c in bad if c.outcome == "fail"}, [(c.name, c.outcome) for c in bad]
    close = early_fidelity_checks(_run(tmp_path, 0.002), POLICY, "int8-w8a8", "int8-w8a8", ([120, 300], 120))
    assert close and not any(c.outcome == "fail" for c in close)
    # no fidelity files: nothing fails (the checks are inconclusive: missing evidence decides nothing early)
    assert not any(c.outcome == "fail" for c in early_fidelity_checks(tmp_path / "empty", POLICY, "int8-w8a8",
                                                                       "int8-w8a8"))


def _steps(tmp_path: Path, early: EarlyDecision | None, baseline: bool = False, parts: int = 1,
           verdicts: Verdicts | None = None) -> list:
    """The registry's steps for a variant with every kind pending (quantgate.release.measurements)."""
    spec = load_spec(_spec(tmp_path))
    variant = Variant(name="baseline" if baseline else "int8-w8a8", path=tmp_path, content_hash="0" * 64,
                      size_bytes=1)
    fid = {"main": tmp_path / "main", **({"alt": tmp_path / "alt"} if baseline else {})}
    ref = {"default": tmp_path / "cache" / "evals" / "default"}
    job = VariantJob(spec=spec, variant=variant, run=tmp_path, folder=tmp_path, cache=tmp_path / "cache",
                     tokenizer=tmp_path, reference=ref, baseline=baseline, log=lambda _: None, parts=parts,
                     verdicts=verdicts)
    folders = {"evals": {"default": tmp_path / "ev"}, "recall": {"recall": tmp_path / "recall"},
               "perf": {"perf": tmp_path / "perf"}, "fidelity": fid}
    return ordered_steps(job, folders, {k: list(v) for k, v in folders.items()}, early)


def _spec(tmp_path: Path) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC)
    return path


def test_a_decided_reject_skips_the_eval_sets_the_recall_grid_and_the_perf_probe_and_says_why(tmp_path):
    spec = load_spec(_spec(tmp_path))
    cand = Variant(name="int8-w8a8", path=tmp_path, scheme="int8-w8a8", content_hash="0" * 64, size_bytes=1)
    early = early_decision(spec, tmp_path, cand, {"default": tmp_path / "ev"}, None, log=lambda _: None)
    assert early is not None and early.looks == ([120], 120)  # the flow's own plan of looks
    assert early_decision(spec, tmp_path, cand, None, None, log=print) is None  # the baseline decides nothing
    no_early = spec.model_copy(update={"decide_early": False})
    assert early_decision(no_early, tmp_path, cand, {"default": tmp_path}, None, log=print) is None
    steps = _steps(tmp_path, early)
    # deciding early, in one part (no slot lent: no baseline sampling beside it to score ahead of): fidelity after the
    # eval sets, before what it may skip
    assert [s.name for s in steps] == ["eval default", "fidelity (main)", "recall", "perf"]
    assert [s.name for s in _steps(tmp_path, None)] == ["eval default", "recall", "perf", "fidelity (main)"]
    # the baseline samples, then scores both paths, then the rest: its candidates can score and decide early
    assert [s.name for s in _steps(tmp_path, None, baseline=True)] == [
        "fidelity (samples)", "fidelity (main)", "fidelity (alt)", "eval default", "recall", "perf"]
    by_name = {s.name: s for s in steps}
    early.reason = "fidelity:kl: KL 0.3 > limit 0.02"  # what judge() sets when a check fails
    by_name["eval default"].run(None)  # a server would be asked for something: None would raise
    by_name["recall"].run(None)
    by_name["perf"].run(None)
    assert set(early.skipped) == {"evals", "recall", "perf"} and "REJECT by fidelity" in early.skipped["recall"]
    assert not early.skips("fidelity")  # only what cannot change a decided REJECT is skipped
    # what the evidence records: no eval folder not measured (a set cached before the decision stays)
    (tmp_path / "ev").mkdir()
    assert EvalSets().record({"default": tmp_path / "ev"}, early.skipped) == {"evals": {}}
    assert EvalSets().record({"default": tmp_path / "ev"}, {}) == {"evals": {"default": tmp_path / "ev"}}


def test_scored_in_parts_the_skips_wait_for_the_part_that_decides(tmp_path):
    """A candidate whose slots may be lent scores its fidelity in parts; a server done with its part that takes the
    recall grid waits until no part is in flight, so the REJECT decided by the last part still skips it."""
    import threading

    spec = load_spec(_spec(tmp_path))
    cand = Variant(name="int8-w8a8", path=tmp_path, scheme="int8-w8a8", content_hash="0" * 64, size_bytes=1)
    early = early_decision(spec, tmp_path, cand, {"default": tmp_path / "ev"}, None, log=lambda _: None)
    assert early is not None
    names = [s.name for s in _steps(tmp_path, early, parts=3)]
    assert names == ["fidelity (main, ahead of the samples)", "fidelity (main, part 1/3)",
                     "fidelity (main, part 2/3)", "fidelity (main, part 3/3)", "eval default", "recall", "perf"]
    assert [s.name for s in _steps(tmp_path, None, baseline=True, parts=3)][:3] == [  # the baseline: whole
        "fidelity (samples)", "fidelity (main)", "fidelity (alt)"]
    answers: list[bool] = []
    with early.scoring():  # the last part is still being scored elsewhere
        asking = threading.Thread(target=lambda: answers.append(early.skips("recall")))
        asking.start()
        asking.join(0.3)
        assert asking.is_alive() and answers == []  # the recall grid waits for the decision
        early.reason = "fidelity:kl: KL 0.3 > limit 0.02"  # that part's judge() decided
    asking.join(5)
    assert answers == [True] and "recall" in early.skipped
    with early.scoring():
        pass
    assert early.skips("perf") and not early.skips("eval default")  # nothing in flight: no wait


def test_the_gate_says_which_evidence_was_not_measured_and_why(tmp_path):
    import json

    from quantgate.gate.evidence import collect

    run = _run(tmp_path, 0.30)
    why = "decided early: REJECT by fidelity (fidelity:kl: ...)"
    (run / "int8-w8a8").mkdir()
    (run / "int8-w8a8" / "evidence.json").write_text(json.dumps({"skipped": {"recall": why, "perf": why},
                                                                  "decided": "fidelity:kl: ..."}))
    ev = collect(run, "int8-w8a8")
    assert ev.gaps["recall"].reason == f"not measured: {why}" and ev.gaps["throughput"].reason == f"not measured: {why}"
    assert ev.gaps["judge"].reason.startswith("not judged: decided early")


def test_the_decision_says_skipped_on_purpose_only_while_a_failed_check_decides_it(tmp_path):
    import json

    from quantgate.gate.checks import DECIDED_EARLY, evaluate
    from quantgate.gate.evidence import collect
    from quantgate.gate.policy import load_policy

    policy, why = load_policy(POLICY), "decided early: REJECT by fidelity (fidelity:kl: ...)"
    for kl in (0.30, 0.002):
        run = _run(tmp_path, kl)
        (run / "int8-w8a8").mkdir()
        (run / "int8-w8a8" / "evidence.json").write_text(json.dumps({"skipped": {"recall": why, "perf": why},
                                                                      "decided": "fidelity:kl: ..."}))
        ev = collect(run, "int8-w8a8").model_copy(update={"scheme": "int8-w8a8"})
        by_name = {c.name: c for c in evaluate(policy, ev).checks}
        skipped = [by_name[n] for n in ("recall:recall", "pay_off:speed", "judge:non_inferiority") if n in by_name]
        assert len(skipped) >= 2, sorted(by_name)
        if kl == 0.30:  # REJECT: the skipped steps say so, not "missing evidence"
            assert all(c.outcome == "skipped" and c.reason.startswith(DECIDED_EARLY) for c in skipped), skipped
        else:  # nothing fails (say, a policy re-read with other limits): missing evidence stays missing
            assert by_name["recall:recall"].outcome == "inconclusive"
            assert "missing evidence (required)" in by_name["recall:recall"].reason


def test_without_the_baselines_dumps_nothing_is_decided_and_nothing_fails(tmp_path):
    spec = load_spec(_spec(tmp_path))
    cand = Variant(name="int8-w8a8", path=tmp_path, scheme="int8-w8a8", content_hash="0" * 64, size_bytes=1)
    said: list[str] = []
    early = early_decision(spec, tmp_path / "run", cand, {"default": tmp_path / "cache" / "evals" / "d"}, None,
                           log=said.append)
    early.verdicts = Verdicts(["int8-w8a8"])
    early.judge(tmp_path / "cand-main")  # no dump anywhere: a measurement must not fail for an optimisation
    assert early.reason is None and not early.skips("recall") and "not deciding early" in said[-1]
    assert early.verdicts.settled == {"int8-w8a8"} and not early.verdicts.rejected  # judged: nothing more to wait for


def test_the_baseline_skips_its_evals_recall_and_perf_once_every_candidate_is_rejected_early(tmp_path):
    verdicts = Verdicts(["int8-w8a8", "w4a16-gptq"])
    steps = {s.name: s for s in _steps(tmp_path, None, baseline=True, verdicts=verdicts)}
    assert steps["recall"].wanted() and steps["perf"].wanted() and steps["eval default"].wanted()
    verdicts.reject("int8-w8a8")
    assert steps["recall"].wanted() and not verdicts.skips("recall")  # one candidate is still undecided
    assert not verdicts.skips("evals")
    verdicts.reject("w4a16-gptq")
    assert not any(steps[s].wanted() for s in ("eval default", "recall", "perf"))  # no extra server starts for them
    for s in ("eval default", "recall", "perf"):
        steps[s].run(None)  # a server would be asked for something: None would raise
    assert set(verdicts.skipped) == {"evals", "recall", "perf"}
    assert "(int8-w8a8, w4a16-gptq)" in verdicts.skipped["recall"] and not verdicts.skips("fidelity")
    # a candidate's own steps are its own EarlyDecision's to skip, not the release's
    cand = {s.name: s for s in _steps(tmp_path, None, verdicts=verdicts)}
    assert cand["recall"].wanted is None


def test_a_baseline_left_with_only_skippable_steps_waits_for_every_verdict_first(tmp_path):
    """An unchanged re-run of a release whose baseline skipped its recall grid and perf probe: the baseline starts
    no server for them before every candidate has settled, and none at all when every one is rejected."""
    import threading

    verdicts = Verdicts(["a", "b"])
    todo = {"evals": [], "fidelity": [], "recall": ["recall"], "perf": ["perf"]}
    waiting = threading.Thread(target=verdicts.drop_skippable, args=(todo,))
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive()  # b has not settled
    verdicts.reject("a")
    verdicts.settle("b")  # judged, not rejected (or its job ended)
    waiting.join(5)
    assert not waiting.is_alive() and todo["recall"] == ["recall"] and todo["perf"] == ["perf"]  # measured
    verdicts.reject("b")
    verdicts.drop_skippable(todo)
    assert todo["recall"] == [] and todo["perf"] == []
    more = {"evals": ["default"], "recall": ["recall"]}  # other work to serve for: no wait, nothing dropped here
    Verdicts(["c"]).drop_skippable(more)
    assert more == {"evals": ["default"], "recall": ["recall"]}
    # eval sets alone are skipped once decided but never waited for: every undecided candidate is gated on them
    evals = {"evals": ["default"]}
    Verdicts(["c"]).drop_skippable(evals)  # c unsettled: a wait would hang here
    assert evals == {"evals": ["default"]}
