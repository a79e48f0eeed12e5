"""The judge's verdicts are cached by their inputs: a second release with the same judge, eval folders and margin
copies them and asks no judge; any changed input asks again. `run_judge` here is a stand-in that writes a report
the way quantgate.release.judge_step does (the real judge needs a served model: tests/test_release_e2e.py)."""

from __future__ import annotations

import json
from pathlib import Path

from quantgate.base.paths import EVAL_SETS
from quantgate.release import judge_cache
from quantgate.spec.resolve import load_spec
from quantgate.release.variants import Evidence, Variant


def _spec(tmp_path: Path, limit: int):
    f = tmp_path / f"spec-{limit}.yaml"
    f.write_text("version: 1\nname: j\nmodel: demo\nhardware: x86-cpu\ncontext: 2048\nconcurrency: 2\n"
                 f"schemes: [w4a16-gptq]\neval_sets: [{EVAL_SETS / 'default.jsonl'}]\nrecall: null\n"
                 f"judge: {{serve: demo, limit: {limit}}}\n")
    return load_spec(f)


def _evidence(tmp_path: Path, name: str) -> Evidence:
    v = Variant(name=name, path=tmp_path, content_hash=name * 4, size_bytes=1)
    return Evidence(variant=v, folder=tmp_path / name, cache=tmp_path / "cache" / name, serve_command=["vllm"],
                    dtype=None, evals={"default": tmp_path / "cache" / name / "evals"}, served=True)


def test_second_release_copies_the_verdicts_and_asks_no_judge(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTGATE_RESULTS", str(tmp_path / "results"))
    spec, base, cand = _spec(tmp_path, 5), _evidence(tmp_path, "baseline"), _evidence(tmp_path, "w4a16")
    asked: list[list[str]] = []

    def run_judge(spec, run, baseline, candidates, log=print):
        asked.append([c.variant.name for c in candidates])
        out = {}
        for c in candidates:
            d = run / c.variant.name / "judge"
            d.mkdir(parents=True)
            (d / "report.json").write_text(json.dumps({"verdict": f"judged in {run.name}"}))
            out[c.variant.name] = d / "report.json"
        return out

    first = judge_cache.judge(spec, tmp_path / "run1", base, [cand], run_judge, log=lambda _: None)
    second = judge_cache.judge(spec, tmp_path / "run2", base, [cand], run_judge, log=lambda _: None)
    assert asked == [["w4a16"]]  # the second release asked nobody
    assert json.loads(second["w4a16"].read_text()) == json.loads(first["w4a16"].read_text()) == {"verdict": "judged in run1"}
    judge_cache.judge(_spec(tmp_path, 7), tmp_path / "run3", base, [cand], run_judge, log=lambda _: None)
    assert asked == [["w4a16"], ["w4a16"]]  # another judge limit: judged again


def test_a_failed_judge_run_is_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTGATE_RESULTS", str(tmp_path / "results"))
    spec, base, cand = _spec(tmp_path, 5), _evidence(tmp_path, "baseline"), _evidence(tmp_path, "w4a16")
    calls = []

    def failing(spec, run, baseline, candidates, log=print):
        calls.append(run.name)
        d = run / "w4a16" / "judge"
        d.mkdir(parents=True)
        (d / "report.json").write_text("{}")
        (d / "error.json").write_text('{"error": "judge server died"}')
        raise RuntimeError("judge server died")

    for run in ("r1", "r2"):
        try:
            judge_cache.judge(spec, tmp_path / run, base, [cand], failing, log=lambda _: None)
        except RuntimeError:
            pass
    assert calls == ["r1", "r2"]
