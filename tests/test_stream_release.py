"""A verdict while the evidence streams in, on the real thing (slow): a release of the demo model whose candidate is a
real INT8 checkpoint damaged on purpose (its 16-bit layers rounded to 3 bits) runs the flow with the baseline and the
candidate side by side; the candidate's REJECT is decided at a streaming look, long before the baseline has sampled
every continuation, the baseline stops sampling there (the lines it wrote are kept for the next release), neither
side runs its eval sets after it, and the decision says at which look, on how many prompts of each slice and when.
A ladder of two such candidates starts its second rung at the first one's verdict, beside the baseline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from quantgate.base.paths import REPO
from quantgate.fidelity import sampling
from quantgate.target.catalogue import MANIFEST

SPEC = """\
version: 1
name: stream
model: demo
hardware: x86-cpu
context: 1024
concurrency: 4
schemes: []
candidates:
  - {{name: damaged, checkpoint: {checkpoint}}}
eval_sets: [{evalset}]
recall: null
perf: null
fidelity: {{draws: 2}}
"""


def _damage(src: Path, dst: Path, bits: int = 3) -> Path:
    """A copy of an INT8 W8A8 checkpoint (its scheme read from its config as int8-w8a8) whose 16-bit linear weights
    are rounded to `bits` bits per output channel: a candidate of a known scheme far beyond every fidelity limit."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if t.ndim == 2 and "proj" in name and t.is_floating_point():
                w = t.float()
                scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / (2 ** (bits - 1) - 1)
                tensors[name] = (torch.round(w / scale) * scale).to(t.dtype)
        save_file(tensors, f, metadata={"format": "pt"})
    (dst / MANIFEST).unlink(missing_ok=True)
    return dst


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_damaged_candidate_is_rejected_at_a_streaming_look_and_the_baseline_stops_sampling(
        tmp_path, layer0_int8, prefect_api):
    damaged = _damage(layer0_int8, tmp_path / "damaged")
    spec = tmp_path / "stream.yaml"
    spec.write_text(SPEC.format(checkpoint=damaged, evalset=REPO / "eval_sets" / "default.jsonl"))
    env = {**os.environ, "QUANTGATE_RESULTS": str(tmp_path / "results"), "PREFECT_HOME": str(tmp_path / "prefect"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONUNBUFFERED": "1", "PREFECT_API_URL": prefect_api}
    done = subprocess.run([sys.executable, "-m", "quantgate.cli.main", "release", str(spec), "--run-id", "streamed"],
                          capture_output=True, text=True, env=env, timeout=1400, cwd=REPO)
    out = done.stdout + done.stderr
    assert done.returncode == 3, out[-4000:]  # REJECT: a result, not an error
    assert "Traceback" not in out and "| ERROR" not in out, out[-4000:]
    run = tmp_path / "results" / "runs" / "streamed"
    decision = json.loads((run / "decision.json").read_text())["candidates"]["damaged"]
    look = decision["stream"]
    assert decision["decision"] == "REJECT" and look is not None, decision["reasons"]
    assert any(c["outcome"] == "fail" and c["name"].startswith("fidelity") for c in decision["checks"])
    # the sample count per slice and the time are in decision.json; fewer prompts than the full sample were read
    assert 10 <= look["n"] < look["total"] and sum(look["by_category"].values()) == look["n"], look
    assert look["elapsed_s"] > 0 and 0 < look["alpha"] <= look["spent"] < 0.05
    assert len(look["by_category"]) == 6 if look["scope"] == "pooled" else list(look["by_category"]) == [look["scope"]]
    record = json.loads((run / "fidelity" / "damaged.json").read_text())
    assert record["stream"] == look and 0 < len(record["samples"]) <= look["n"]
    ids, order = [s["id"] for s in record["samples"]], record["draw"]["order"]
    if look["scope"] == "pooled":  # a prefix of the whole stream
        assert set(ids) <= set(order[: look["n"]])
    else:  # a prefix of that slice's own order
        assert {s["category"] for s in record["samples"]} == {look["scope"]} and set(ids) <= set(order)
        assert max(order.index(i) for i in ids) < len(order) - (look["total"] - look["n"])
    # the baseline stopped sampling: the lines stay, marked stopped, for the next release to resume
    (samples,) = (tmp_path / "results").glob("cache/variants/*/fidelity/*-samples")
    manifest = sampling.SamplesManifest.read(samples)
    assert manifest is not None and manifest.stopped and manifest.status == "partial", manifest
    assert manifest.n_sampled is not None and manifest.n is not None and manifest.n_sampled < manifest.n
    # the release stopped measuring: the eval sets were skipped on both sides, and the gate says so, not "missing"
    for variant in ("damaged", "baseline"):
        ev = json.loads((run / variant / "evidence.json").read_text())
        assert "evals" in ev["skipped"] and ev["evals"] == {}, (variant, ev["skipped"], ev["evals"])
    task = [c for c in decision["checks"] if c["name"].split(":")[0] in ("primary", "pooled", "category")]
    assert task and all(c["outcome"] == "skipped" and "decided early" in c["reason"] for c in task), task
    assert f"decided at streaming look {look['index']} of {look['of']} of {look['scope']}" in done.stdout  # the CLI says
    summary = json.loads((run / "summary.json").read_text())
    assert any("at streaming look" in n for n in summary["notes"]), summary["notes"]
    print(f"\nstreamed REJECT at look {look['index']}/{look['of']}: {look['n']} of {look['total']} prompts "
          f"{look['by_category']}, {look['elapsed_s']} s in; baseline stopped at {manifest.n_sampled}/{manifest.n}")


# the same release as a ladder of two rungs, on fewer samples (what is tested is when each rung runs, not the looks)
LADDER = SPEC.replace("  - {{name: damaged, checkpoint: {checkpoint}}}\n",
                      "  - {{name: damaged, checkpoint: {checkpoint}}}\n  - {{name: worse, checkpoint: {worse}}}\n"
                      "ladder: true\neval: {{limit: 30}}\n").replace("fidelity: {{draws: 2}}", "fidelity: {{draws: 1, limit: 36}}")


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_ladder_starts_its_next_rung_at_the_first_rungs_early_reject_beside_the_baseline(
        tmp_path, layer0_int8, prefect_api):
    """Two damaged candidates as a ladder: the second rung's server starts as soon as the first is REJECTed early,
    on the slot it left, while the baseline is still being measured (not after it), and is REJECTed early too;
    the gate decides both rungs."""
    damaged, worse = _damage(layer0_int8, tmp_path / "damaged"), _damage(layer0_int8, tmp_path / "worse", bits=2)
    spec = tmp_path / "ladder.yaml"
    spec.write_text(LADDER.format(checkpoint=damaged, worse=worse, evalset=REPO / "eval_sets" / "default.jsonl"))
    env = {**os.environ, "QUANTGATE_RESULTS": str(tmp_path / "results"), "PREFECT_HOME": str(tmp_path / "prefect"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONUNBUFFERED": "1", "PREFECT_API_URL": prefect_api}
    done = subprocess.run([sys.executable, "-m", "quantgate.cli.main", "release", str(spec), "--run-id", "ladder"],
                          capture_output=True, text=True, env=env, timeout=1400, cwd=REPO)
    out = done.stdout + done.stderr
    assert done.returncode == 3 and "Traceback" not in out, out[-4000:]
    run = tmp_path / "results" / "runs" / "ladder"
    decisions = json.loads((run / "decision.json").read_text())["candidates"]
    assert [decisions[c]["decision"] for c in ("damaged", "worse")] == ["REJECT", "REJECT"], decisions
    for rung in ("damaged", "worse"):  # each decided early by fidelity: its eval sets never ran
        ev = json.loads((run / rung / "evidence.json").read_text())
        assert ev["decided"] and "evals" in ev["skipped"], (rung, ev["skipped"])
    rows = {r["step"]: r for r in json.loads((run / "timings.json").read_text())}
    base, first, second = (rows[f"serve and measure {v}"] for v in ("baseline", "damaged", "worse"))
    # the second rung's server was started at the first rung's verdict, while the baseline was still measured
    assert second["start"] - first["end"] < 10 and second["start"] < base["end"], rows
    summary = json.loads((run / "summary.json").read_text())
    assert [(r["scheme"], r["status"]) for r in summary["ladder"]] == [("damaged", "REJECT"), ("worse", "REJECT")]
