"""lm-evaluation-harness tasks as eval sets (quantgate.evals.lmeval, quantgate.evals.lmeval_tasks).

Fast: the converter on a samples file recorded from a real lm-eval run against the demo model's vLLM server
(tests/data/lmeval/samples_qg_numbers.jsonl, trimmed), spec validation, the cache folder, the command line.
Slow: lm-eval itself as a child process, against a fake server where a failure must be scripted (a request that
keeps failing, an answer with no content: a real vLLM server gives neither on demand), and against the real demo
vLLM server through the release's own code path (run_spec_task into the variant cache's folder, compare_dirs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _fake_openai import FakeServer

from quantgate.base.errors import ConfigError, QuantgateError
from quantgate.base.paths import EVAL_SETS, REPO
from quantgate.evals import lmeval
from quantgate.evals.lmeval_tasks import (DEFAULT_INCLUDE, NO_ANSWER, LmEvalSpec, answered_in_log, convert, set_name,
                                          task_digest, task_of)
from quantgate.evals.run import compare_dirs, load_run
from quantgate.gate.evidence import comparison_evidence
from quantgate.release.cachelayout import eval_complete, eval_dirs, lmeval_dir
from quantgate.spec.resolve import load_spec
from quantgate.base.http import Endpoint

DATA = Path(__file__).parent / "data" / "lmeval"
RECORDED = DATA / "samples_qg_numbers.jsonl"
TASK = EVAL_SETS / "lm_eval" / "qg_numbers.yaml"
SPEC = "version: 1\nname: x\nmodel: demo\nhardware: x86-cpu\nschemes: [int8-w8a8]\nrecall: null\n"


def recorded() -> list[dict]:
    return [json.loads(line) for line in RECORDED.read_text(encoding="utf-8").splitlines() if line.strip()]


def last_integer(text: str) -> str | None:
    found = re.findall(r"-?[0-9]+", text)
    return found[-1] if found else None


# --- the converter, on lm-eval's own output ----------------------------------------------------------------

def test_recorded_samples_convert_to_quantgate_records():
    lines = recorded()
    results, scores, used = convert(lines, "qg_numbers", ["exact_match"])
    assert used == "last_integer" and len(results) == len(scores) == len(lines) >= 10
    assert [r["id"] for r in results] == [ln["doc"]["id"] for ln in lines]  # the documents' own ids, in order
    for ln, r, s in zip(lines, results, scores):
        assert r["output"] == ln["resps"][0][0] and r["filtered"] == ln["filtered_resps"][0] and r["error"] is None
        assert s == {"id": ln["doc"]["id"], "category": "qg_numbers", "scores": {"exact_match": ln["exact_match"]},
                     "references": [ln["target"]]}
        # lm-eval's score agrees with the task's rule, recomputed here from the raw reply
        assert s["scores"]["exact_match"] == float(last_integer(r["output"]) == ln["target"])
    right = sum(s["scores"]["exact_match"] for s in scores)
    assert 0 < right < len(scores)  # the recording has both kinds, so both paths above ran


def test_failed_samples_other_filters_and_ids():
    lines = recorded()[:4]
    lines[1] = {**lines[1], "resps": [[NO_ANSWER]]}  # lm-eval's placeholder for a reply with no content
    other = [{**ln, "filter": "another", "exact_match": 0.0} for ln in lines]  # a second filter's lines are ignored
    no_id = [{**ln, "doc": {k: v for k, v in ln["doc"].items() if k != "id"}} for ln in lines]
    results, scores, _ = convert(lines + other, "qg_numbers", ["exact_match"])
    assert len(results) == 4 and [r["id"] for r in results if r["error"]] == [lines[1]["doc"]["id"]]
    assert {s["id"] for s in scores} == {ln["doc"]["id"] for ln in lines} - {lines[1]["doc"]["id"]}
    assert all(s["scores"]["exact_match"] == ln["exact_match"] for s, ln in zip(scores, [lines[0], *lines[2:]]))
    assert [r["id"] for r in convert(no_id, "t", ["exact_match"])[0]] == [str(ln["doc_id"]) for ln in lines]
    with pytest.raises(ConfigError, match="two documents of task 't' have the id"):
        convert([lines[0], lines[0]], "t", ["exact_match"])
    with pytest.raises(ConfigError, match="not a per-sample number"):
        convert([{**lines[0], "exact_match": ["a", "b"]}], "t", ["exact_match"])


def scored_folder(tmp_path: Path, name: str, lines: list[dict]) -> Path:
    """A run folder as run_lm_eval leaves it, from sample lines: the same writer, and a complete manifest."""
    out = tmp_path / name
    out.mkdir()
    samples = out / "samples_qg_numbers_recorded.jsonl"
    samples.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    lmeval.write_scored(out, "qg_numbers", ["exact_match"], samples)
    (out / "manifest.json").write_text(json.dumps({"status": "complete", "model": name, "evalset": {
        "name": set_name("qg_numbers"), "sha256": task_digest(TASK)}}))
    return out


def test_compare_and_gate_read_a_task_like_a_jsonl_set(tmp_path):
    lines = recorded()
    broken = next(ln["doc"]["id"] for ln in lines if ln["exact_match"] == 1.0)  # right in the baseline, wrong after
    cand = [{**ln, "resps": [["no idea"]], "filtered_resps": ["[invalid]"], "exact_match": 0.0}
            if ln["doc"]["id"] == broken else ln for ln in lines]
    report = compare_dirs(scored_folder(tmp_path, "base", lines), scored_folder(tmp_path, "cand", cand))
    em = report["metrics"]["exact_match"]["overall"]
    assert report["n_paired"] == len(lines) and em["lost"] == 1 and em["gained"] == 0
    assert [r["id"] for r in report["regressions"]] == [broken] and report["regressions"][0]["cand_output"] == "no idea"
    assert report["pooled"]["metrics_used"] == {"exact_match": len(lines)}
    ev: dict = {"metrics": {}, "categories": {}, "pooled": {}}
    comparison_evidence({set_name("qg_numbers"): report}, tmp_path / "compare.json", ev)
    assert set(ev["metrics"]["lm_eval:qg_numbers"]) == {"exact_match"} and "lm_eval:qg_numbers" in ev["pooled"]


def test_progress_count_from_lm_eval_log():
    assert answered_in_log("Running generate_until requests\n") == 0
    log = "Requesting API:   0%|          | 0/40 [00:00<?, ?it/s]\rRequesting API:  45%|####5     | 18/40 [00:03<00:04]"
    assert answered_in_log(log) == 18


# --- the spec: tasks found on disk, refused with the field and line --------------------------------------

def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


def test_spec_with_a_local_task_loads_and_names_its_eval_set(tmp_path):
    spec = load_spec(write(tmp_path, SPEC + "lm_eval: {tasks: [qg_numbers], limit: 20}\n"))
    assert spec.lm_eval.include_path == DEFAULT_INCLUDE and spec.lm_eval.task_file("qg_numbers").parent == DEFAULT_INCLUDE
    assert set_name("qg_numbers") == "lm_eval:qg_numbers" and task_of("lm_eval:qg_numbers") == "qg_numbers"
    assert task_of("default") is None
    assert load_spec(DATA / "release.yaml").lm_eval.tasks == ["qg_numbers"]


BAD_TASKS = DATA / "tasks"


@pytest.mark.parametrize("body, line, field, words", [
    ("lm_eval:\n  tasks:\n    - qg_numbers\n    - qg_nmbers\n", 10, "lm_eval.tasks' (list item 2)",
     f"no lm-eval task 'qg_nmbers' under {DEFAULT_INCLUDE}; tasks found there: qg_numbers"),
    (f"lm_eval:\n  include_path: {BAD_TASKS}\n  tasks:\n    - qg_choice\n", 10, "lm_eval.tasks' (list item 1)",
     "task 'qg_choice' is multiple_choice: a chat endpoint answers generate_until tasks only"),
    (f"lm_eval:\n  include_path: {BAD_TASKS}\n  tasks:\n    - qg_acc\n", 10, "lm_eval.tasks' (list item 1)",
     "task 'qg_acc' scores ['acc']"),
    (f"lm_eval:\n  include_path: {BAD_TASKS}\n  tasks:\n    - qg_numbers\n", 10, "lm_eval.tasks' (list item 1)",
     "tasks found there: qg_acc, qg_choice"),
    ("lm_eval: {tasks: [qg_numbers], include_path: nowhere}", 7, "lm_eval.include_path'", "not a folder"),
    ("lm_eval: {tasks: []}", 7, "lm_eval.tasks'", "at least 1"),
    ("lm_eval: {tasks: [qg_numbers], limit: 0}", 7, "lm_eval.limit'", "greater than or equal to 1"),
    ("lm_eval: {tasks: [qg_numbers], shots: 5}", 7, "lm_eval.shots'", "Extra inputs"),
])
def test_spec_mistakes_name_the_line(tmp_path, body, line, field, words):
    path = write(tmp_path, SPEC + body + "\n")
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    text = err.value.render()
    assert f"{path}:{line} field '{field}" in text and words in text, text


# --- the cache folder: what decides the answers decides the folder --------------------------------------------

def test_cache_folder_follows_task_files_and_settings(tmp_path):
    include = tmp_path / "tasks"
    shutil.copytree(DEFAULT_INCLUDE, include)
    lm = LmEvalSpec.model_validate({"tasks": ["qg_numbers"], "include_path": str(include), "limit": 20})
    cache = tmp_path / "cache"
    first = lmeval_dir(cache, lm, "qg_numbers")
    assert first.parent == cache / "evals" and first.name.startswith("lm_eval-qg_numbers-") and first.name.endswith("-20")
    assert lmeval_dir(cache, lm, "qg_numbers") == first  # stable
    assert lmeval_dir(cache, lm.model_copy(update={"concurrency": 2}), "qg_numbers") == first  # not an answer's cause
    assert lmeval_dir(cache, lm.model_copy(update={"num_fewshot": 3}), "qg_numbers") != first
    assert lmeval_dir(cache, lm.model_copy(update={"limit": None}), "qg_numbers").name.endswith("-all")
    data = include / "qg_numbers.jsonl"
    data.write_text(data.read_text().replace('"answer": "12"', '"answer": "13"', 1))
    assert lmeval_dir(cache, lm, "qg_numbers") != first  # a changed data file is another eval set
    digest = task_digest(include / "qg_numbers.yaml")
    (include / "qg_numbers.yaml").write_text((include / "qg_numbers.yaml").read_text() + "# a comment\n")
    assert task_digest(include / "qg_numbers.yaml") != digest


def test_release_eval_folders_hold_sets_and_tasks(tmp_path):
    spec = load_spec(DATA / "release.yaml")
    dirs = eval_dirs(tmp_path, spec)
    assert set(dirs) == {"default", "lm_eval:qg_numbers"}
    assert dirs["lm_eval:qg_numbers"] == lmeval_dir(tmp_path, spec.lm_eval, "qg_numbers")


def test_release_check_accepts_the_lm_eval_spec():
    r = subprocess.run([sys.executable, "-m", "quantgate.cli", "release", str(DATA / "release.yaml"), "--check"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr


# --- the command line: the key stays off it -------------------------------------------------------------------

def test_argv_carries_no_key_and_refuses_names_it_cannot_carry(tmp_path):
    argv = lmeval.lm_eval_argv(Path("/py"), "qg_numbers", DEFAULT_INCLUDE, "http://127.0.0.1:9/v1", "demo", tmp_path,
                               concurrency=4, limit=20, num_fewshot=None)
    joined = " ".join(argv)
    assert "local-chat-completions" in joined and "base_url=http://127.0.0.1:9/v1/chat/completions" in joined
    assert "num_concurrent=4" in joined and "--limit 20" in joined and "--num_fewshot" not in joined
    assert "--apply_chat_template" in argv and "--log_samples" in argv and "api_key" not in joined.lower()
    assert lmeval._child_env("s3cret")["OPENAI_API_KEY"] == "s3cret"  # the key goes in the child's environment
    with pytest.raises(QuantgateError, match="--model_args cannot carry"):
        lmeval.lm_eval_argv(Path("/py"), "t", DEFAULT_INCLUDE, "http://h:1", "a,b", tmp_path, concurrency=1, limit=None,
                            num_fewshot=None)


def test_eval_command_takes_one_of_set_or_task(tmp_path):
    from typer.testing import CliRunner

    from quantgate.cli.main import app

    base = ["eval", "--endpoint", "http://127.0.0.1:9", "--model", "m", "--out", str(tmp_path / "o")]
    r = CliRunner().invoke(app, base)
    assert isinstance(r.exception, ConfigError) and "exactly one of --evalset or --lm-eval-task" in str(r.exception)
    r = CliRunner().invoke(app, [*base, "--lm-eval-task", "qg_nmbers"])
    assert isinstance(r.exception, ConfigError) and "tasks found there: qg_numbers" in str(r.exception)


# --- lm-eval as a child process ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_failed_run_resumes_and_empty_answers_make_a_partial_run(tmp_path):
    """Fake server (a real vLLM server neither fails nor answers with no content on demand)."""
    docs = [json.loads(x) for x in TASK.with_suffix(".jsonl").read_text().splitlines()][:6]
    with FakeServer() as server:
        server.answer = lambda p: next(d["answer"] for d in docs if d["question"] == p)
        server.script[docs[2]["question"]] = ["500"] * 3  # lm-eval's 3 attempts all fail: the run fails
        with pytest.raises(QuantgateError, match="lm-eval exited with code"):
            lmeval.run_lm_eval(TASK, "qg_numbers", Endpoint(server.url, "fake-model", "k"), tmp_path / "r", limit=6,
                               concurrency=2)
        assert json.loads((tmp_path / "r" / "manifest.json").read_text())["status"] == "failed"
        asked = len(server.requests)
        summary = lmeval.run_lm_eval(TASK, "qg_numbers", Endpoint(server.url, "fake-model", "k"), tmp_path / "r",
                                     limit=6, concurrency=2)
        assert summary["n_answered"] == 6 and eval_complete(tmp_path / "r")
        assert summary["metrics"]["exact_match"]["overall"]["mean"] == 1.0
        assert len(server.requests) - asked < 6  # the answers of the failed run came from lm-eval's response cache

        server.answer = lambda p: None if p == docs[0]["question"] else "0"  # no content for one: lm-eval's placeholder
        summary = lmeval.run_lm_eval(TASK, "qg_numbers", Endpoint(server.url, "fake-model", "k"), tmp_path / "p",
                                     limit=6, concurrency=2, max_error_rate=0.5)
        manifest, records = load_run(tmp_path / "p")
        assert manifest["status"] == "partial" and summary["n_failed"] == 1 and len(records) == 5
        assert docs[0]["id"] not in {r["id"] for r in records}


@pytest.mark.slow
def test_local_task_against_the_demo_server_pairs_with_itself(demo_server, tmp_path):
    """The release's path: run_spec_task into a variant cache's folder, twice on one server: identical answers."""
    lm = LmEvalSpec.model_validate({"tasks": ["qg_numbers"], "limit": 20, "concurrency": 8})
    folders = {}
    for name in ("base", "cand"):
        folders[name] = lmeval_dir(tmp_path / name, lm, "qg_numbers")
        summary = lmeval.run_spec_task(lm, "qg_numbers", demo_server.endpoint, folders[name],
                                       model_hash=f"sha256:{name}", label=name)
        assert summary["n_samples"] == 20 and summary["n_failed"] == 0 and eval_complete(folders[name])
    log = (folders["base"] / "lm_eval.log").read_text()
    assert demo_server.api_key not in log and demo_server.api_key not in " ".join(os.environ.values())
    report = compare_dirs(folders["base"], folders["cand"])
    em = report["metrics"]["exact_match"]["overall"]
    assert report["n_paired"] == 20 and report["agreement"]["overall"] == 1.0
    assert em["delta"] == 0 and em["lost"] == em["gained"] == 0 and not report["regressions"]
    print(f"qg_numbers on the demo model: exact_match {em['base_mean']:.2f} over 20 documents")


@pytest.mark.slow
def test_release_step_measures_the_task_into_the_variant_cache(demo_model, tmp_path, monkeypatch):
    """steps.serve_and_evaluate, the release's own step, on a spec whose only measurement is an lm-eval task: its
    folder is the planned one, complete, in evidence.json as `lm_eval:qg_numbers`; a second call serves nothing."""
    from quantgate.release import steps
    from quantgate.release.variants import baseline_variant

    monkeypatch.setenv("QUANTGATE_RESULTS", str(tmp_path / "results"))  # a fresh cache: this run measures
    path = tmp_path / "spec.yaml"
    path.write_text(f"version: 1\nname: t\nmodel: {demo_model}\nhardware: x86-cpu\nschemes: [int8-w8a8]\ncontext: 1024\n"
                    "recall: null\nperf: null\nfidelity: null\nserving: {enforce_eager: true}\n"
                    "lm_eval: {tasks: [qg_numbers], limit: 10, concurrency: 8}\n")
    spec, variant, lines = load_spec(path), baseline_variant(demo_model), []
    planned = steps.planned_evals(spec, variant, tmp_path / "run", None)
    ev = steps.serve_and_evaluate(steps.MeasureRequest(spec, variant, tmp_path / "run", parity=False), log=lines.append)
    assert ev.served and ev.evals == planned and set(planned) == {"lm_eval:qg_numbers"}
    assert eval_complete(planned["lm_eval:qg_numbers"]) and any("lm-eval task qg_numbers" in x for x in lines)
    evidence = json.loads((tmp_path / "run" / "baseline" / "evidence.json").read_text())
    assert evidence["evals"] == {"lm_eval:qg_numbers": str(planned["lm_eval:qg_numbers"])}
    again = steps.serve_and_evaluate(steps.MeasureRequest(spec, variant, tmp_path / "run2", parity=False),
                                     log=lines.append)
    assert not again.served and again.evals == planned
