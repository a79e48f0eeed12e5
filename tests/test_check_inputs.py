"""`quantgate check` and the shared readers against inputs that used to pass `check` and fail later, or crash: one
case per gap, each refused (or accepted with a note where the check could not be made) naming the file, the line and
the field, never with a traceback. Files are small and written into tmp_path; the real CLI runs as in test_check.py.

Fast: no server, no model loading (checkpoint folders hold a config.json and a header-only safetensors file)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quantgate.base.errors import ConfigError, QuantgateError
from quantgate.base.paths import REPO
from quantgate.base.yamlconfig import MAX_DEPTH, read_yaml
from quantgate.evals.dataset import load_evalset
from quantgate.gate.policy import load_policy
from quantgate.judge.review import check_csv, load_key
from quantgate.spec.external import checkpoint_problems
from quantgate.spec.resolve import load_spec

META = "name: t\nversion: 1\nmetrics:\n  exact_match: {higher_is_better: true, aggregation: mean}\n"
SAMPLE = {"id": "s", "category": "factual_qa", "prompt": "Capital of France?", "references": ["Paris"],
          "metrics": ["exact_match"]}
INT8_CONFIG = REPO / "tests" / "data" / "external" / "int8-w8a8" / "config.json"
SPEC = "version: 1\nname: x\nhardware: a100\nrecall: null\n"  # a GPU profile: no kernel probe, no serving env
POLICY = "version: 1\nname: p\nsource: test\nerror_rate: {max: 0.02}\n"
DEEP = 100_000  # levels: far past Python's recursion limit


def quantgate(*args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "quantgate.cli", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    return r


def evalset(folder: Path, name: str, lines: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.meta.yaml").write_text(META)
    path = folder / f"{name}.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def samples(n: int) -> list[str]:
    return [json.dumps({**SAMPLE, "id": f"s{i}"}) for i in range(n)]


def safetensors(path: Path, dtypes: dict[str, str]) -> None:
    """A header-only safetensors file: each tensor one element of its dtype (enough for the header check)."""
    size = {"I8": 1, "U8": 1, "F8_E4M3": 1, "BF16": 2, "I32": 4, "F32": 4}
    header, offset = {}, 0
    for name, dtype in dtypes.items():
        header[name] = {"dtype": dtype, "shape": [1], "data_offsets": [offset, offset + size[dtype]]}
        offset += size[dtype]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def checkpoint(folder: Path, config: dict | Path | None = None, dtypes: dict[str, str] | None = None) -> Path:
    folder.mkdir(parents=True)
    if config is not None:
        (folder / "config.json").write_text(config.read_text() if isinstance(config, Path) else json.dumps(config))
    if dtypes:
        safetensors(folder / "model.safetensors", dtypes)
    return folder


# --- 1. prompt length: needs a context, from --context, --spec or --model; without one a note ----------------------

@pytest.mark.parametrize("option", ["none", "--context", "--spec", "--model"])
def test_a_prompt_longer_than_the_context_is_refused_at_its_line(tmp_path, option):
    path = evalset(tmp_path, "long", samples(100) + [json.dumps({**SAMPLE, "id": "big", "prompt": "x" * 40_000})])
    spec = tmp_path / "ctx.yaml"
    spec.write_text(SPEC + "model: demo\nschemes: [int8-w8a8]\ncontext: 8192\n")
    model = checkpoint(tmp_path / "model", {"max_position_embeddings": 8192})
    args = {"none": [], "--context": ["--context", "8192"], "--spec": ["--spec", str(spec)],
            "--model": ["--model", str(model)]}[option]
    r = quantgate("check", str(path), *args)
    if option == "none":
        assert r.returncode == 0 and f"ok evalset {path}" in r.stdout, r.stdout + r.stderr
        assert f"note evalset {path}: prompt lengths not checked: no context given" in r.stderr, r.stderr
        return
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{path}:101: 1 problem(s) in the eval set: prompt of 10000 tokens (estimate: characters/4) + max_tokens " \
           "32 exceeds the served context of 8192 tokens" in r.stderr, r.stderr
    assert "prompt lengths not checked" not in r.stderr


def test_a_context_option_that_cannot_be_used_is_an_error_of_its_own(tmp_path):
    config = checkpoint(tmp_path / "m", {"hidden_size": 8}) / "config.json"
    r = quantgate("check", "releases/policies/default.yaml", "--model", str(config.parent))
    assert r.returncode == 2 and f"{config}: config.json has no max_position_embeddings" in r.stderr, r.stderr
    assert "ok policy releases/policies/default.yaml" in r.stdout


# --- 2. review ids: matched against the key (file or judge folder); without one a note ----------------------------

@pytest.mark.parametrize("key", ["none", "file", "judge folder"])
def test_a_review_id_not_in_the_key_is_refused_at_its_line(tmp_path, key):
    csv = tmp_path / "review.csv"
    csv.write_text("review_id,choice\nR001,A\nR002,B\nR999,TIE\n")
    judge = tmp_path / "judge"
    judge.mkdir()
    items = {"R001": {"pair_id": "p1", "a": "baseline"}, "R002": {"pair_id": "p2", "a": "candidate"}}
    (judge / "review_key.json").write_text(json.dumps({"schema": 1, "seed": 0, "items": items}))
    args = {"none": [], "file": ["--review-key", str(judge / "review_key.json")],
            "judge folder": ["--review-key", str(judge)]}[key]
    r = quantgate("check", str(csv), *args)
    if key == "none":
        assert r.returncode == 0 and "note review" in r.stderr and "not matched against a key" in r.stderr, r.stderr
        return
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{csv}:4: 1 bad row(s) in the review CSV: unknown review_id 'R999' (not in the key)" in r.stderr, r.stderr


@pytest.mark.parametrize("text, where, words", [
    ('{"items": {"R001": {"pair_id": "p1", "a": "left"}}}', "field 'items.R001'", "expected {pair_id"),
    ('{"schema": 1}', "field 'items'", "no 'items' mapping"),
    ('{"schema": 1,\n "items": {,}}', ":2", "not JSON"),
    ("[" * DEEP + "]" * DEEP, "review_key.json", "nested too deeply"),
])
def test_a_bad_review_key_is_refused_naming_the_file(tmp_path, text, where, words):
    (tmp_path / "review_key.json").write_text(text)
    with pytest.raises(QuantgateError) as err:
        load_key(tmp_path)  # the judge folder: its review_key.json
    assert where in err.value.render() and words in err.value.message, err.value.render()


def test_check_csv_and_review_import_share_the_key_check(tmp_path):
    csv = tmp_path / "review.csv"
    csv.write_text("review_id,choice\nR001,A\nR999,B\n")
    (tmp_path / "review_key.json").write_text(json.dumps({"items": {"R001": {"pair_id": "p1", "a": "baseline"}}}))
    assert check_csv(csv) == 2  # no key: ids not matched
    with pytest.raises(QuantgateError) as err:
        check_csv(csv, load_key(tmp_path))
    assert err.value.where == f"{csv}:3" and "unknown review_id 'R999' (not in the key)" in err.value.message


# --- 3. the top level's own line, after leading comments -------------------------------------------------------------

@pytest.mark.parametrize("kind", [[], ["--kind", "spec"]])
def test_a_top_level_list_is_refused_at_the_line_it_starts(tmp_path, kind):
    path = tmp_path / "list.yaml"
    path.write_text("# a release spec\n- model: demo\n- hardware: a100\n")
    r = quantgate("check", *kind, str(path))
    assert r.returncode == 2 and f"{path}:2: expected a mapping at the top level, got a list" in r.stderr, r.stderr


def test_loaders_name_the_top_level_line(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("# comment\n\n# another\n[1, 2]\n")
    with pytest.raises(ConfigError) as err:
        load_policy(path)
    assert err.value.where == f"{path}:4"


# --- 4. parser limits: nesting, digits, dates, aliases ------------------------------------------------------------

def test_parser_limits_are_input_errors_at_their_line(tmp_path):
    head = samples(3)
    files = {
        "array": evalset(tmp_path, "array", head + ["[" * DEEP + "]" * DEEP]),
        "object": evalset(tmp_path, "object", head + ['{"a":' * DEEP + "1" + "}" * DEEP]),
        "digits": evalset(tmp_path, "digits", head + ['{"id": 1' + "0" * 5000 + "}"]),
    }
    spec = tmp_path / "deep_spec.yaml"
    spec.write_text("# nested\n" + SPEC + "model: demo\nschemes: " + "[" * DEEP + "]" * DEEP + "\n")
    policy = tmp_path / "deep_policy.yaml"
    policy.write_text(POLICY.replace("error_rate: {max: 0.02}", "error_rate:\n")
                      + "".join("  " * i + "k:\n" for i in range(1, 150)))
    date = tmp_path / "date_policy.yaml"
    date.write_text(POLICY + "notes: 2024-13-01\n")
    r = quantgate("check", *map(str, [*files.values(), spec, policy, date]))
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr
    for name in ("array", "object"):
        assert f"{files[name]}:4: 1 problem(s) in the eval set: invalid JSON: nested too deeply for the parser" in err, err
    assert f"{files['digits']}:4: 1 problem(s) in the eval set: invalid JSON: a value Python cannot read: Exceeds the " \
           "limit (4300 digits)" in err, err
    assert f"{spec}:7: invalid YAML: nested more than {MAX_DEPTH} levels deep" in err, err
    assert f"{policy}:104: invalid YAML: nested more than {MAX_DEPTH} levels deep" in err, err
    assert f"{date}:5: invalid YAML: the value '2024-13-01' cannot be read: month must be in 1..12" in err, err
    assert "unexpected" not in err and "quantgate bug" not in err, err


def test_every_command_reading_an_eval_set_refuses_deep_nesting(tmp_path):
    """`quantgate judge` reads the eval set first (load_evalset): an input error naming the line, exit 2."""
    path = evalset(tmp_path, "deep", samples(3) + ["[" * DEEP + "]" * DEEP])
    r = quantgate("judge", "--endpoint", "http://127.0.0.1:9", "--model", "m", "--evalset", str(path),
                  "--baseline", str(tmp_path / "b"), "--candidate", str(tmp_path / "c"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and f"error: {path}:4: 1 problem(s) in the eval set: invalid JSON: nested too deeply" \
        in r.stderr, r.stderr
    with pytest.raises(ConfigError) as err:
        load_evalset(path, with_dataset=False)
    assert err.value.where == f"{path}:4"


def test_yaml_aliases_that_expand_past_the_limit_are_refused(tmp_path):
    rows = ["a: &a [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]"]
    rows += [f"{b}: &{b} [{', '.join([f'*{a}'] * 10)}]" for a, b in zip("abcde", "bcdef")]
    rows += ["g: [" + ", ".join(["*f"] * 10) + "]"]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(ConfigError) as err:
        read_yaml(path)
    assert "expands to more than" in err.value.message and err.value.where.startswith(f"{path}:"), err.value.render()


def test_a_review_csv_field_past_the_csv_limit_names_its_line(tmp_path):
    path = tmp_path / "review.csv"
    path.write_text("review_id,choice,comment\nR001,A,ok\nR002,B," + "x" * 200_000 + "\n")
    with pytest.raises(QuantgateError) as err:
        check_csv(path)
    assert err.value.where == f"{path}:3" and "unreadable CSV row: field larger than field limit" in err.value.message


# --- 5. model and checkpoint folders ------------------------------------------------------------------------------

INT8_TENSORS = {"model.layers.0.mlp.down_proj.weight": "I8", "model.layers.0.mlp.down_proj.weight_scale": "BF16"}
BF16_TENSORS = {"model.layers.0.mlp.down_proj.weight": "BF16"}


def test_model_and_checkpoint_folders_are_looked_at(tmp_path):
    os.symlink("loop", tmp_path / "loop")
    good = checkpoint(tmp_path / "good", {"max_position_embeddings": 8192}, BF16_TENSORS)
    checkpoint(tmp_path / "noconfig", None, BF16_TENSORS)
    checkpoint(tmp_path / "noweights", {"max_position_embeddings": 8192})
    checkpoint(tmp_path / "int8", INT8_CONFIG, INT8_TENSORS)
    checkpoint(tmp_path / "int8_on_bf16", INT8_CONFIG, BF16_TENSORS)
    checkpoint(tmp_path / "int8_noweights", INT8_CONFIG)
    models = SPEC + "schemes: [int8-w8a8]\nmodel: {}\n"
    cands = SPEC + "model: {}\ncandidates:\n  - {{name: ext, checkpoint: {}}}\n"
    specs = {
        "model_loop": (models.format(tmp_path / "loop"), 6, "model", "is a symlink loop"),
        "model_missing": (models.format(tmp_path / "nowhere"), 6, "model", "not found"),
        "model_noconfig": (models.format(tmp_path / "noconfig"), 6, "model", "no config.json in"),
        "model_noweights": (models.format(tmp_path / "noweights"), 6, "model", "no weights files in"),
        "model_beside_the_spec": (models.format("good"), 6, "model", f"not from the spec's: write {good}"),
        # a relative name that is a loop beside the spec (check runs elsewhere): named, not an unexpected RuntimeError
        "model_loop_beside_the_spec": (models.format("loop"), 6, "model", f"not from the spec's: write {tmp_path}"),
        "evalset_loop": (models.format(good) + "eval_sets: [loop]\n", 7, "eval_sets",
                         "a symlink loop or a broken link"),
        "ckpt_loop": (cands.format("demo", "loop"), 7, "candidates.0.checkpoint", "is a symlink loop"),
        "ckpt_noweights": (cands.format("demo", "int8_noweights"), 7, "candidates.0.checkpoint", "no weights files"),
        "ckpt_scheme": (cands.format("demo", "int8_on_bf16"), 7, "candidates.0.checkpoint",
                        "config.json declares int8-w8a8 but the weights hold no int8 (I8) weight tensors, only BF16"),
    }
    paths = {}
    for name, (text, *_) in specs.items():
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(text)
    ok = tmp_path / "ok.yaml"
    ok.write_text(cands.format(good, "int8"))
    r = quantgate("check", *map(str, [*paths.values(), ok]))
    assert r.returncode == 2, r.stdout + r.stderr
    blocks = {b.split("\n", 1)[0]: b for b in ("\n" + r.stderr).split("\nerror spec ")[1:]}
    for name, (_, line, field, words) in specs.items():
        block = blocks.get(str(paths[name]), "")
        assert f"{paths[name]}:{line} field '{field}'" in block and words in block, (name, r.stderr)
    assert f"ok spec {ok}" in r.stdout, r.stdout + r.stderr
    assert "unexpected" not in r.stderr, r.stderr


def test_load_spec_refuses_a_looping_path_naming_its_line(tmp_path):
    """No raw RuntimeError/OSError from load_spec; a model folder that is not there yet still loads (fetched later)."""
    os.symlink("loop", tmp_path / "loop")
    for text, line, field in ((SPEC + "model: demo\ncandidates:\n  - {name: e, checkpoint: loop}\n", 7,
                               "candidates.0.checkpoint"),
                              (SPEC + f"schemes: [int8-w8a8]\nmodel: {tmp_path / 'loop'}\n", 6, "model"),
                              (SPEC + "model: demo\nschemes: [int8-w8a8]\npublish:\n  - {folder: loop}\n", 8,
                               "publish.0.folder")):  # any validator's path: load_model names the field
        path = tmp_path / "spec.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError) as err:
            load_spec(path)
        assert f"{path}:{line} field '{field}'" in err.value.render() and "symlink loop" in err.value.message
    path.write_text(SPEC + f"schemes: [int8-w8a8]\nmodel: {tmp_path / 'later'}\n")
    assert load_spec(path).model == str(tmp_path / "later")


def test_release_refuses_a_looping_checkpoint_before_starting_anything(tmp_path):
    os.symlink("loop", tmp_path / "loop")
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC + "model: demo\ncandidates:\n  - {name: e, checkpoint: loop}\n")
    r = quantgate("release", str(path))
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{path}:7 field 'candidates.0.checkpoint': checkpoint folder {tmp_path / 'loop'} is a symlink loop" \
        in r.stderr, r.stderr
    # what only `check` reads (the weights' dtypes against the declared scheme) is refused by `release` as well,
    # before the run folder or Prefect exists
    checkpoint(tmp_path / "int8_on_bf16", INT8_CONFIG, BF16_TENSORS)
    path.write_text(SPEC + "model: demo\ncandidates:\n  - {name: e, checkpoint: int8_on_bf16}\n")
    r = subprocess.run([sys.executable, "-m", "quantgate.cli", "release", str(path)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "QUANTGATE_RESULTS": str(tmp_path / "results"),
                                                    "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and "the weights hold no int8 (I8) weight tensors" in r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "results").exists()


def test_checkpoint_problems_reads_headers_only(tmp_path):
    int8 = checkpoint(tmp_path / "int8", INT8_CONFIG, INT8_TENSORS)
    assert checkpoint_problems(int8, "int8-w8a8") == []
    assert "no FP8" in checkpoint_problems(int8, "fp8-dynamic")[0]
    dense = json.loads(INT8_CONFIG.read_text())
    dense["quantization_config"]["format"] = "dense"  # 16-bit weights quantized at load: nothing to tell
    (int8 / "config.json").write_text(json.dumps(dense))
    safetensors(int8 / "model.safetensors", BF16_TENSORS)
    assert checkpoint_problems(int8, "int8-w8a8") == []
    (int8 / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-00002.safetensors"}}))
    assert "names model-00002.safetensors, which is not in" in checkpoint_problems(int8, "int8-w8a8")[0]
    (int8 / "model.safetensors").write_bytes(b"\xff" * 4)
    assert "no readable safetensors file" in checkpoint_problems(int8)[-1]


def test_a_truncated_weights_file_is_refused_by_check_in_seconds(tmp_path):
    """An interrupted copy: the header is whole, the tensor data is not. vLLM found it only when loading, minutes
    into a release; `release --check` names the file and exits 2."""
    int8 = checkpoint(tmp_path / "int8", INT8_CONFIG, INT8_TENSORS)
    weights = int8 / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:-3])
    assert f"truncated: the file has {len(whole) - 3:,} bytes, its header describes {len(whole):,}" in \
        checkpoint_problems(int8, "int8-w8a8")[0]
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC + f"model: demo\ncandidates:\n  - {{name: e, checkpoint: {int8}}}\n")
    t0 = time.monotonic()
    r = quantgate("release", str(path), "--check")
    assert r.returncode == 2 and "truncated" in r.stderr and str(weights) in r.stderr, r.stdout + r.stderr
    assert time.monotonic() - t0 < 60


# --- 6. eval sets that share a file name: each evaluated and gated under its own name, or refused ----------------

def test_sets_sharing_a_file_name_get_names_that_tell_them_apart(tmp_path):
    """The cache, the evidence, compare files and the gate key a set by its name: by the stem alone, a second
    `small.jsonl` was filed under the first's name and never evaluated."""
    from quantgate.release.cachelayout import eval_dirs
    from quantgate.evals.setsource import set_names

    a, b = evalset(tmp_path / "a", "small", samples(3)), evalset(tmp_path / "b", "small", samples(4))
    tickets = evalset(tmp_path, "tickets", samples(2))
    parquet = tickets.with_suffix(".parquet")
    parquet.write_bytes(b"PAR1")
    assert set_names([a, b, tickets, parquet]) == ["a.small", "b.small", "tickets.jsonl", "tickets.parquet"]
    assert set_names([a, tickets]) == ["small", "tickets"]  # a unique stem keeps the name runs always had
    assert set_names([a, b.with_suffix(".parquet")]) == ["a.small", "b.small"]  # folders first, where they differ
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC + f"model: demo\nschemes: [int8-w8a8]\neval_sets: [{a}, {b}]\n")
    spec = load_spec(path)
    dirs = eval_dirs(tmp_path / "cache", spec)
    assert list(dirs) == ["a.small", "b.small"] and dirs["a.small"] != dirs["b.small"], dirs


def test_one_set_listed_twice_is_refused_at_its_line_naming_both(tmp_path):
    a = evalset(tmp_path / "a", "small", samples(3))
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC + f"model: demo\nschemes: [int8-w8a8]\neval_sets:\n  - {a}\n  - a/small.jsonl\n")
    r = quantgate("check", str(path))
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{path}:9 field 'eval_sets' (list item 2): eval sets {a} (list item 1) and {a} would both be named " \
           "'small'" in r.stderr and "the same file is listed twice; list it once" in r.stderr, r.stderr


# --- 7. a sidecar's column mapping against the file's columns; row-level decoding -----------------------------------



def mapped(id: str = "ticket_id", ref: str = "answer") -> str:
    """A sidecar mapping the table's columns (line 7: columns.id, line 9: columns.references)."""
    return META + f"source:\n  columns:\n    id: {id}\n    prompt: question\n    references: {ref}\n  defaults: " \
        "{category: factual_qa, metrics: [exact_match]}\n"


def table_set(folder: Path, name: str, suffix: str, meta: str, rows: list[dict] | None = None) -> Path:
    import datasets

    rows = rows if rows is not None else [{"ticket_id": f"T{k}", "question": f"Q{k}?", "answer": f"A{k}"}
                                          for k in range(30)]
    path = folder / f"{name}{suffix}"
    if suffix == ".parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        path.write_text("ticket_id,question,answer\n" + "".join(f"{r['ticket_id']},{r['question']},{r['answer']}\n"
                                                              for r in rows), encoding="utf-8")
    (folder / f"{name}.meta.yaml").write_text(meta)
    return path


def test_a_column_mapping_that_names_no_column_is_refused_at_the_sidecar_line(tmp_path):
    """`id: ticket_no` over a `ticket_id` column gave ids row-1 ... row-30; `references: answer_text` over an
    `answer` column gave 30 row errors naming no sidecar line."""
    ids = table_set(tmp_path, "ids", ".parquet", mapped(id="ticket_no"))
    refs = table_set(tmp_path, "refs", ".csv", mapped(ref="answer_text"))
    good = table_set(tmp_path, "good", ".csv", mapped())
    r = quantgate("check", str(ids), str(refs), str(good))
    assert r.returncode == 2 and f"ok evalset {good}" in r.stdout, r.stdout + r.stderr
    assert f"{tmp_path / 'ids.meta.yaml'}:7 field 'source.columns.id': source.columns.id maps column 'ticket_no' " \
           "(did you mean 'ticket_id'?), which the file does not have; its columns: ticket_id, question, answer" \
           in r.stderr, r.stderr
    assert f"{tmp_path / 'refs.meta.yaml'}:9 field 'source.columns.references': source.columns.references maps " \
           "column 'answer_text'" in r.stderr and r.stderr.count("answer_text") == 1, r.stderr


def test_a_lone_surrogate_is_refused_at_its_line_by_check_and_by_eval(tmp_path):
    """json.loads takes `\\ud83d` alone; `quantgate eval` then died with a UnicodeEncodeError traceback, sent
    nothing and left its manifest `running`."""
    from _fake_openai import FakeServer

    lines = samples(8) + [json.dumps({**SAMPLE, "id": "s8"}).replace("Capital", "\\ud83d Capital")]
    path = evalset(tmp_path, "emoji", lines)
    where = f"{path}:9: 1 problem(s) in the eval set: field 'prompt': a lone surrogate escape \\ud83d at character 1"
    r = quantgate("check", str(path))
    assert r.returncode == 2 and where in r.stderr, r.stderr
    out = tmp_path / "run"
    with FakeServer() as server:
        r = quantgate("eval", "--endpoint", server.url, "--model", "fake-model", "--evalset", str(path), "--out",
                      str(out), "--no-progress")
        assert not server.requests
    assert r.returncode == 2 and where in r.stderr, r.stdout + r.stderr
    assert not (out / "manifest.json").exists()


@pytest.mark.parametrize("encoding, name", [("utf-16", "UTF-16LE"), ("utf-16-be", "UTF-16BE"), ("utf-32", "UTF-32LE")])
def test_a_utf16_file_is_one_error_saying_how_to_save_it_as_utf8(tmp_path, encoding, name):
    jsonl = evalset(tmp_path / "j", "wide", samples(21))
    jsonl.write_bytes(jsonl.read_text().encode(encoding))
    csv = table_set(tmp_path, "wide", ".csv", mapped())
    csv.write_bytes(csv.read_text().encode(encoding))
    r = quantgate("check", str(jsonl), str(csv))
    assert r.returncode == 2, r.stdout + r.stderr
    for path in (jsonl, csv):
        assert f"{path}:1: the file is {name}, not UTF-8" in r.stderr, r.stderr
        assert f"fix: save it as UTF-8: `iconv -f {name} -t UTF-8 {path.name} > wide.utf8{path.suffix}`" in r.stderr
    assert r.stderr.count("not UTF-8") == 2, r.stderr  # one cause, one message per file


def test_a_csv_reference_cut_short_is_refused_at_its_row(tmp_path):
    path = tmp_path / "cut.csv"
    path.write_text('ticket_id,question,answer\nT1,Three?,"[""tres"", ""three""]"\nT2,Three again?,"[""tres"", "\n',
                    encoding="utf-8")
    (tmp_path / "cut.meta.yaml").write_text(mapped())
    with pytest.raises(ConfigError) as err:
        load_evalset(path)
    assert err.value.where == f"{path}:row 2" and "column 'answer': starts like a JSON array but is not one" \
        in err.value.message, err.value.render()
    path.write_text('ticket_id,question,answer\nT1,Cite?,"[""[1] Smith""]"\n', encoding="utf-8")
    assert load_evalset(path).samples[0].references == ["[1] Smith"]  # the one-item array the fix suggests


@pytest.mark.parametrize("kind", ["parquet", "csv header", "csv empty", "datasets folder"])
def test_a_set_with_no_rows_says_no_rows(tmp_path, kind):
    """datasets said "BatchSize must be greater than 0" or "Instruction "train" corresponds to no data!"."""
    import datasets

    meta = mapped()
    if kind == "parquet":
        path = table_set(tmp_path, "none", ".parquet", meta)
        datasets.Dataset.from_dict({"ticket_id": [], "question": [], "answer": []}).to_parquet(str(path))
    elif kind == "datasets folder":
        path = tmp_path / "none"
        datasets.Dataset.from_dict({"ticket_id": [], "question": [], "answer": []}).save_to_disk(str(path))
        (tmp_path / "none.meta.yaml").write_text(meta)
    else:
        path = table_set(tmp_path, "none", ".csv", meta)
        path.write_text("ticket_id,question,answer\n" if kind == "csv header" else "")
    with pytest.raises(ConfigError) as err:
        load_evalset(path)
    assert err.value.message.startswith("no rows") and err.value.where == str(path), err.value.render()


# --- 8. what the release would refuse before work, refused by check -------------------------------------------------

def test_a_context_longer_than_the_models_is_refused_at_its_line(tmp_path):
    """vLLM refused the --max-model-len 13 s into the release: exit 1 and a Prefect traceback in the log."""
    model = checkpoint(tmp_path / "m", {"max_position_embeddings": 8192}, BF16_TENSORS)
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC + f"model: {model}\nschemes: [int8-w8a8]\ncontext: 131072\n")
    r = quantgate("check", str(path))
    assert r.returncode == 2 and f"{path}:7 field 'context': context 131072 is longer than the model's " \
        f"max_position_embeddings 8192 ({model / 'config.json'})" in r.stderr, r.stderr
    path.write_text(SPEC + f"model: {model}\nschemes: [int8-w8a8]\ncontext: 8192\n")
    r = quantgate("check", str(path))
    assert f"ok spec {path}" in r.stdout, r.stdout + r.stderr


def test_a_store_url_fsspec_cannot_open_is_refused_at_its_line(tmp_path):
    """`executor.store: 'sftpx://...'` was `ok spec`; the release refused it 1.7 s in, naming no line."""
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC + "model: demo\nschemes: [int8-w8a8]\nexecutor:\n  kind: pools\n  store: 'sftpx://host/x'\n")
    for args in (["check", str(path)], ["release", str(path), "--check"]):
        r = quantgate(*args)
        assert r.returncode == 2 and f"{path}:9 field 'executor.store': cannot open the results store " \
            "sftpx://host/x: Protocol not known: sftpx (did you mean 'sftp'?); the store takes s3://, s3a://, gs://" \
            in r.stderr and "fix: give one of those" in r.stderr, (args, r.stderr)


def test_schemes_for_a_model_quantized_already_are_refused_unless_the_spec_says_so(tmp_path):
    """An INT8 compressed-tensors checkpoint as `model` with `schemes: [w4a16-gptq]` was `ok spec`: the release
    would have quantized the quantized weights again and gated them against a baseline that is no 16-bit model."""
    model = checkpoint(tmp_path / "int8", INT8_CONFIG, INT8_TENSORS)
    path, again = tmp_path / "spec.yaml", tmp_path / "again.yaml"
    path.write_text(SPEC + f"model: {model}\nschemes: [w4a16-gptq]\n")
    again.write_text(SPEC + f"model: {model}\nschemes: [w4a16-gptq]\nquantization: {{requantize: true}}\n")
    r = quantgate("check", str(path), str(again))
    assert r.returncode == 2 and f"ok spec {again}" in r.stdout, r.stdout + r.stderr
    assert f"{path}:5 field 'model': model {model} is quantized already: {model / 'config.json'} field " \
           "'quantization_config' holds compressed-tensors" in r.stderr, r.stderr
    assert "schemes w4a16-gptq would quantize it again" in r.stderr and "set `quantization.requantize: true`" \
        in r.stderr, r.stderr


def test_an_unknown_scheme_spelling_says_which_scheme_it_means(tmp_path):
    """`INT8-W8A8` was "does not run on x86-cpu": it is no scheme at all."""
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC + "model: demo\nschemes: [w4a16-gptq, INT8-W8A8]\n")
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    assert err.value.where == f"{path}:6 field 'schemes' (list item 2)", err.value.render()
    assert err.value.message.startswith("unknown scheme 'INT8-W8A8' (did you mean 'int8-w8a8'?); "
                                        "quant_recipes/schemes.yaml has: ") and "run on" not in err.value.message


def test_a_category_the_policy_requires_and_no_set_has_is_refused_at_the_policys_line(tmp_path):
    """`poetry` in a policy, in no set of the spec: a warning and exit 0, naming neither the policy nor its line."""
    es = evalset(tmp_path, "small", samples(12))
    required, optional = tmp_path / "required.yaml", tmp_path / "optional.yaml"
    required.write_text(POLICY + "categories:\n  poetry: {metric: chrf, max_relative_drop: 0.05, required: true}\n")
    optional.write_text(POLICY + "categories:\n  poetry: {metric: chrf, max_relative_drop: 0.05}\n")
    specs = {}
    for policy in (required, optional):
        specs[policy] = tmp_path / f"spec_{policy.stem}.yaml"
        specs[policy].write_text(SPEC + f"model: demo\nschemes: [int8-w8a8]\neval_sets: [{es}]\npolicy: {policy}\n")
    r = quantgate("check", str(specs[required]))
    assert r.returncode == 2 and f"error spec {specs[required]}" in r.stderr, r.stdout + r.stderr
    assert f"{required}:6 field 'categories.poetry': the policy requires category 'poetry' (`required: true`), " \
           "but no eval set has category 'poetry' (the sets have: factual_qa)" in r.stderr, r.stderr
    assert "fix: add samples of category 'poetry' to an eval set the spec lists" in r.stderr and \
        "set categories.poetry.required: false in the policy" in r.stderr, r.stderr
    r = quantgate("check", str(specs[optional]))
    assert r.returncode == 0 and f"ok spec {specs[optional]}" in r.stdout, r.stdout + r.stderr
    assert f"{optional}:6 field 'categories.poetry': unfed check category:poetry: does not apply" in r.stderr


def test_a_policy_field_that_points_at_another_kind_of_file_is_refused_at_the_specs_line(tmp_path):
    """`policy:` naming an eval set gave a page of schema errors in the eval set, naming neither spec nor field."""
    es = evalset(tmp_path, "small", samples(3))
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC + f"model: demo\nschemes: [int8-w8a8]\npolicy: {es}\n")
    r = quantgate("release", str(path), "--check")
    assert r.returncode == 2 and f"{path}:7 field 'policy': {es} is not a gate policy: it reads as an eval set" \
        in r.stderr and "fix: point `policy` at a gate policy YAML" in r.stderr, r.stderr
    assert "field 'version'" not in r.stderr and "error policy" not in r.stderr, r.stderr


# --- 9. one cause, one message -----------------------------------------------------------------------------------

def test_a_nan_limit_is_not_a_number(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(POLICY.replace("0.02", ".nan") + "categories:\n  factual_qa: {metric: chrf, max_relative_drop: "
                    ".NaN}\nfidelity:\n  families: {int8: {max_kl: .inf}}\n")
    with pytest.raises(ConfigError) as err:
        load_policy(path)
    text = err.value.render()
    assert f"{path}:4 field 'error_rate.max': not a number (NaN): write the value as a number" in text, text
    assert f"{path}:6 field 'categories.factual_qa.max_relative_drop': not a number (NaN)" in text, text
    assert f"{path}:8 field 'fidelity.families.int8.max_kl': inf is not a finite number" in text, text
    assert "less than or equal" not in text and "greater than" not in text, text


def test_a_tool_turn_in_a_chat_log_is_refused_naming_the_row(tmp_path):
    """eval_sets/README.md promises "tool turns are refused, naming the row"; it was "content is NoneType"."""
    path = tmp_path / "traffic.jsonl"
    ask = {"role": "user", "content": "Where is my order 42?"}
    rows = [[ask, {"role": "assistant", "content": "It ships today."}],
            [ask, {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
             {"role": "tool", "tool_call_id": "c1", "content": "shipped"}, {"role": "assistant", "content": "Shipped."}],
            [ask, {"role": "tool", "content": "shipped"}, {"role": "assistant", "content": "Shipped."}]]
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    (tmp_path / "traffic.meta.yaml").write_text(META + "source: {format: chat, defaults: {category: factual_qa, "
                                                "metrics: [exact_match]}}\n")
    with pytest.raises(ConfigError) as err:
        load_evalset(path)
    text = err.value.render()
    assert err.value.where == f"{path}:2" and "2 problem(s)" in text, text
    assert "column 'messages': message 1: an assistant turn with tool_calls: tool turns are refused" in text, text
    assert f"{path}:3: column 'messages': message 1: role 'tool': tool turns are refused" in text, text
    assert "NoneType" not in text, text


def test_category_names_are_one_name_in_nfc(tmp_path):
    """An NFD and an NFC `résumé` showed as two categories with the same name."""
    nfc, nfd = "r\u00e9sum\u00e9", "re\u0301sume\u0301"
    path = evalset(tmp_path, "cv", [json.dumps({**SAMPLE, "id": f"s{i}", "category": (nfc, nfd)[i % 2]})
                                    for i in range(4)])
    (tmp_path / "cv.meta.yaml").write_text(META + f"categories: {{{nfd}: CVs}}\n")
    assert {s.category for s in load_evalset(path).samples} == {nfc}
    (tmp_path / "cv.meta.yaml").write_text(META + f"categories:\n  {nfd}: CVs\n  {nfc}: CVs again\n")
    with pytest.raises(ConfigError) as err:
        load_evalset(path)
    assert err.value.where.startswith(f"{tmp_path / 'cv.meta.yaml'}:") and "declared twice" in err.value.message
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY + f"categories:\n  {nfd}: {{metric: exact_match, max_relative_drop: 0.05}}\n")
    assert list(load_policy(policy).categories) == [nfc]


def test_a_sidecar_without_categories_takes_the_default_sets(tmp_path):
    """`trivia` passed a sidecar that declares no `categories:` (an earlier version refused it: the one list);
    the sidecar's own `source.defaults.category` is a declaration of its own."""
    path = evalset(tmp_path, "quiz", samples(2) + [json.dumps({**SAMPLE, "id": "t", "category": "trivia"})])
    with pytest.raises(ConfigError) as err:
        load_evalset(path)
    assert err.value.where == f"{path}:3" and "category 'trivia' is not one of the default set's categories " \
        "(factual_qa, arithmetic_numbers" in err.value.message, err.value.render()
    assert "declare the set's own in its sidecar (`categories: {trivia: what it holds}`)" in err.value.message
    (tmp_path / "quiz.meta.yaml").write_text(META + "categories: {factual_qa: facts, trivia: odd facts}\n")
    assert len(load_evalset(path).samples) == 3


# --- 10. records: a killed run is known as interrupted, a stopped one names its step -----------------------------

def test_runs_shows_a_killed_release_as_interrupted_and_a_stopped_one_names_its_step(tmp_path):
    """A SIGKILLed run was "no decision" forever; a SIGTERMed one's status.json had no step."""
    from typer.testing import CliRunner

    from quantgate.base.runstatus import load_status
    from quantgate.cli.main import app

    results = tmp_path / "results"
    script = ("import sys, time\nfrom pathlib import Path\nfrom quantgate.release.runrecord import recording_status, "
              "timed\nfrom quantgate.release.stopping import on_stop_signals\nrun = Path(sys.argv[1])\n"
              "with on_stop_signals(), recording_status(run), timed(run, 'serve and measure baseline'):\n"
              "    print('ready', flush=True)\n    time.sleep(120)\n")
    procs = {}
    for name in ("killed", "stopped"):
        run = results / "runs" / f"r-{name}"
        run.mkdir(parents=True)
        (run / "run.json").write_text(json.dumps({"spec": {"name": "demo", "model": "demo", "schemes": ["int8-w8a8"]}}))
        procs[name] = subprocess.Popen([sys.executable, "-c", script, str(run)], stdout=subprocess.PIPE, text=True,
                                       cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert procs[name].stdout.readline().strip() == "ready"
    listed = CliRunner().invoke(app, ["runs", "--results", str(results)]).output
    assert listed.count("no decision") == 2 and "INTERRUPTED" not in listed, listed  # both owners alive
    procs["killed"].kill()
    procs["stopped"].terminate()
    assert procs["killed"].wait(60) == -9 and procs["stopped"].wait(60) == 143
    st = load_status(results / "runs" / "r-stopped")
    assert (st.status, st.step, st.signal) == ("interrupted", "serve and measure baseline", "SIGTERM"), st
    lines = {ln.split()[0]: ln for ln in CliRunner().invoke(app, ["runs", "--results", str(results)]).output.splitlines()}
    assert "INTERRUPTED (no status.json, and no live process holds status.json.lock (pid " \
           f"{procs['killed'].pid} on host" in lines["r-killed"], lines
    assert "INTERRUPTED" in lines["r-stopped"] and "status.json.lock" not in lines["r-stopped"], lines
    res = CliRunner().invoke(app, ["runs", "--results", str(results), "--decision", "interrupted"])
    assert sorted(ln.split()[0] for ln in res.output.splitlines()) == ["r-killed", "r-stopped"], res.output
    res = CliRunner().invoke(app, ["show", "r-killed", "--results", str(results)])
    assert res.output.startswith("INTERRUPTED: run r-killed") and "its release process is gone" in res.output
