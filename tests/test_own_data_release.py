"""A team's own release, end to end: a copied checkpoint as the model, a compressed-tensors checkpoint as the
candidate, two eval sets of its own (a Parquet file and a folder saved by `datasets`, with their own columns and
categories) under the DEFAULT policy. `release --check` says beforehand which of the policy's checks the sets do not
feed; the release then reaches a decision in which every check is fed or skipped as not applicable, none missing.
The two sets share a file name in two folders (`emea/tickets.parquet`, `apac/tickets`): both are evaluated and
gated, each under its own name (`emea.tickets`, `apac.tickets`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import datasets
import pytest

from quantgate.base.paths import REPO

META = """name: {name}
version: 1
default_max_tokens: 16
metrics:
  exact_match: {{higher_is_better: true, aggregation: mean}}
  token_f1: {{higher_is_better: true, aggregation: mean}}
categories: {{{cats}}}
source:
  columns: {{id: ref, prompt: question, references: answer, category: queue}}
  defaults: {{metrics: [exact_match, token_f1]}}
"""
SPEC = """\
version: 1
name: own-data
model: {model}
hardware: x86-cpu
context: 1024
concurrency: 2
schemes: []
candidates:
  - {{name: own-int8, checkpoint: {ckpt}}}
eval_sets: [{parquet}, {folder}]
eval: {{concurrency: 4}}
recall: {{lengths: [512], depths: [0, 25, 50, 75, 100], kinds: [number], samples: 2}}
perf: {{concurrency: [1], num_prompts: 4, input_len: 32, output_len: 8, repeats: 2}}
fidelity: {{draws: 1, context_prompts: 10, context_new_tokens: 32}}
"""
WORDS = ["red", "blue", "green", "black", "white"]


def rows(cats: list[str], start: int) -> list[dict]:
    """Ten rows per category: short questions a 135M model can answer in a word."""
    return [{"ref": f"Q{start + k}", "queue": cats[k % len(cats)],
             "question": f"Repeat this word and nothing else: {WORDS[k % 5]}", "answer": WORDS[k % 5]}
            for k in range(10 * len(cats))]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_teams_own_model_and_data_reach_a_decision_with_every_check_fed(demo_model, layer0_int8, prefect_api,
                                                                            tmp_path):
    model = tmp_path / "acme-support-135m"
    shutil.copytree(demo_model, model, copy_function=os.link)  # a team's checkpoint folder (hard links: no copy)
    (tmp_path / "emea").mkdir()
    parquet = tmp_path / "emea" / "tickets.parquet"
    datasets.Dataset.from_list(rows(["billing", "shipping"], 0)).to_parquet(str(parquet))
    (tmp_path / "emea" / "tickets.meta.yaml").write_text(META.format(name="tickets", cats="billing: x, shipping: y"))
    folder = tmp_path / "apac" / "tickets"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows(["returns", "warranty"], 100))}).save_to_disk(
        str(folder))
    (tmp_path / "apac" / "tickets.meta.yaml").write_text(META.format(name="tickets", cats="returns: x, warranty: y"))
    spec = tmp_path / "own.yaml"
    spec.write_text(SPEC.format(model=model, ckpt=layer0_int8, parquet=parquet, folder=folder))
    env = {**os.environ, "QUANTGATE_RESULTS": str(tmp_path / "results"), "PREFECT_HOME": str(tmp_path / "prefect"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONUNBUFFERED": "1", "PREFECT_API_URL": prefect_api}

    def quantgate(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "quantgate.cli.main", *args], capture_output=True, text=True,
                              env=env, cwd=REPO, timeout=1700)

    check = quantgate("release", str(spec), "--check")
    said = check.stdout + check.stderr
    assert f"ok evalset {parquet}" in said and f"ok evalset {folder}" in said, said
    for cat in ("arithmetic_numbers", "proper_nouns", "multilingual"):  # the default policy's categories: not ours
        assert f"unfed check category:{cat}: does not apply: no eval set has category '{cat}'" in said, said
    assert "INCONCLUSIVE on every run" not in said, said  # every required check is fed
    # ... and checked: the sets' own categories get task checks (own_categories), listed
    assert all(f"{s}/{cat} exact_match n=10" in said for s, cat in (("emea.tickets", "billing"),
                                                                    ("apac.tickets", "warranty"))), said
    # 10 prompts per slice are enough to judge, too few to bound a candidate at half its limits: exit 6, said so
    blocking = [x for x in said.splitlines() if x.startswith("warning spec") and "too few to bound" in x]
    assert check.returncode == 6 and blocking and all("fidelity per" in x for x in blocking), said

    proc = quantgate("release", str(spec), "--run-id", "own")
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode in (0, 3, 4), out  # PROMOTE, REJECT or INCONCLUSIVE: a decision, not a failed step
    cand = json.loads((tmp_path / "results" / "runs" / "own" / "decision.json").read_text())["candidates"]["own-int8"]
    checks = {c["name"]: c for c in cand["checks"]}
    assert not [c for c in cand["checks"] if "missing evidence" in c["reason"]], cand["reasons"]
    for cat in ("arithmetic_numbers", "proper_nouns", "multilingual"):
        (c,) = [c for name, c in checks.items() if name.startswith(f"category:{cat}/")]
        assert c["outcome"] == "skipped" and c["measured"] == "not applicable", c
    for cat in ("billing", "shipping", "returns", "warranty", "context:512"):  # fidelity judged in each own slice
        assert checks[f"fidelity:kl:{cat}"]["outcome"] in ("pass", "fail", "inconclusive"), checks[f"fidelity:kl:{cat}"]
    names = ("emea.tickets", "apac.tickets")
    assert {f"{c}:{n}" for c in ("primary", "pooled") for n in names} <= {n.split("/")[0] for n in checks}, checks
    assert {"category:emea.tickets/billing/exact_match", "category:apac.tickets/warranty/exact_match"} <= set(checks)
    run = tmp_path / "results" / "runs" / "own"
    window = json.loads((run / "perf-window" / "window.json").read_text())  # speed: side by side, paired, A/A
    assert window["rounds"] == 3 and [p["variant"] for p in window["probes"][:3]] == ["baseline", "own-int8",
                                                                                    "baseline"], window
    assert all(p["load_before"] is not None and p["busy_share"] is not None for p in window["probes"]), window
    pay_off = json.loads((run / "own-int8" / "pay_off.json").read_text())
    assert pay_off["intervals"]["method"] == "paired-log" and pay_off["window"]["rounds"] == 3, pay_off
    assert pay_off["floor"] and pay_off["floor"][0]["ratio"]["n_cand"] == 3, pay_off["floor"]
    speed = [c for name, c in checks.items() if name.startswith("pay_off:latency/")]
    assert speed and all("A/A floor" in c["reason"] for c in speed), speed
    evidence = json.loads((run / "own-int8" / "evidence.json").read_text())
    assert evidence["perf"] == str(run / "perf-window" / "own-int8"), evidence["perf"]
    assert sorted(evidence["evals"]) == sorted(names), evidence["evals"]  # each measured in its own folder
    assert len({*evidence["evals"].values()}) == 2
    print(json.dumps({"decision": cand["decision"], "reasons": cand["reasons"][:4]}, indent=1))
