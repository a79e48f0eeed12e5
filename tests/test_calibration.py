"""Calibration data: the default set, user JSONL and datasets sources, refusals naming file:line, seeded sampling."""

from __future__ import annotations

import json

import pytest

from quantgate.base.errors import ConfigError
from quantgate.quantize.calibration import CalibrationSpec, DEFAULT_CALIBRATION, build, read_jsonl, select


def test_default_set_is_valid_and_mixes_text_and_chat():
    records = read_jsonl(DEFAULT_CALIBRATION)
    assert len(records) >= 32
    assert any("text" in r for r in records) and any("messages" in r for r in records)
    # not English only: quantization damage shows first on other scripts
    assert any(any(ord(c) > 0x3000 for c in json.dumps(r, ensure_ascii=False)) for r in records)


@pytest.mark.parametrize(
    "lines, message, line_no",
    [
        (['{"text": "ok"}', "{not json"], "invalid JSON", 2),
        (['{"text": "   "}'], "empty `text`", 1),
        (['{"prompt": "x"}'], "neither", 1),
        (['{"messages": [{"role": "robot", "content": "x"}]}'], "messages[0]", 1),
        (['[1, 2]'], "not a JSON object", 1),
    ],
)
def test_malformed_records_name_the_line(tmp_path, lines, message, line_no):
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as err:
        read_jsonl(path)
    assert message in err.value.render() and f"{path}:{line_no}" in err.value.render()


def test_empty_and_missing_files_are_refused(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match="no records"):
        read_jsonl(tmp_path / "e.jsonl")
    with pytest.raises(ConfigError, match="not found"):
        read_jsonl(tmp_path / "missing.jsonl")


def test_sampling_is_seeded_and_the_hash_follows_the_choice(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": f"sample {i}"}) + "\n" for i in range(50)))
    a = build(CalibrationSpec(path=path, seed=1), samples=10, max_seq_length=64)
    b = build(CalibrationSpec(path=path, seed=1), samples=10, max_seq_length=64)
    c = build(CalibrationSpec(path=path, seed=2), samples=10, max_seq_length=64)
    d = build(CalibrationSpec(path=path, seed=1), samples=10, max_seq_length=128)
    assert a.records == b.records and a.sha256 == b.sha256
    assert a.records != c.records and a.sha256 != c.sha256
    assert a.sha256 != d.sha256  # the length is part of what was calibrated
    assert len(a.records) == 10 and a.available == 50


def test_asking_for_more_samples_than_exist_uses_all():
    recs = [{"text": str(i)} for i in range(5)]
    assert sorted(r["text"] for r in select(recs, 64, seed=0)) == [str(i) for i in range(5)]


def test_default_is_used_when_no_source_is_given():
    cal = build(CalibrationSpec(), samples=8, max_seq_length=32)
    assert cal.source == str(DEFAULT_CALIBRATION) and len(cal.records) == 8


def test_path_and_dataset_are_exclusive(tmp_path):
    with pytest.raises(ValueError, match="either"):
        CalibrationSpec(path=tmp_path / "a.jsonl", dataset="x")


def test_datasets_source_reads_a_local_file_offline(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) + "\n" for i in range(6)))
    cal = build(CalibrationSpec(dataset=str(path)), samples=4, max_seq_length=32)
    assert cal.uses_chat and len(cal.records) == 4 and cal.source.startswith("datasets:")
    bad = tmp_path / "b.jsonl"
    bad.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(ConfigError, match="no `text`, `messages` or `prompt` column"):
        build(CalibrationSpec(dataset=str(bad)), samples=4, max_seq_length=32)


def test_a_teams_parquet_file_and_datasets_folder_calibrate_like_its_eval_sets(tmp_path):
    """`calibration.path` takes the tables eval sets come in: a Parquet file of chat `messages`, and a folder saved by
    `datasets` whose rows have only an eval set's `prompt` (one user turn each); a bad row is named."""
    import datasets

    chats = [{"messages": [{"role": "user", "content": f"Wie spät ist es in Zürich? {i}"},
                           {"role": "assistant", "content": "Es ist zehn Uhr."}]} for i in range(6)]
    parquet = tmp_path / "de.parquet"
    datasets.Dataset.from_list(chats).to_parquet(str(parquet))
    got = build(CalibrationSpec(path=parquet), samples=4, max_seq_length=64)
    assert got.available == 6 and len(got.records) == 4 and got.uses_chat
    assert got.records[0]["messages"][1] == {"role": "assistant", "content": "Es ist zehn Uhr."}
    assert got.source == f"{parquet}[train]"

    folder = tmp_path / "tickets"
    prompts = [{"id": f"t{i}", "prompt": f"Où est ma commande {i} ?", "category": "support"} for i in range(5)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(prompts)}).save_to_disk(str(folder))
    got = build(CalibrationSpec(path=folder), samples=10, max_seq_length=64)
    assert got.available == 5 and all(r["messages"][0]["role"] == "user" for r in got.records)
    with pytest.raises(ConfigError, match="no split 'test'"):
        build(CalibrationSpec(path=folder, split="test"), samples=2, max_seq_length=64)

    blank = tmp_path / "blank.parquet"
    datasets.Dataset.from_list([{"text": "fine"}, {"text": "  "}]).to_parquet(str(blank))
    with pytest.raises(ConfigError) as err:
        build(CalibrationSpec(path=blank), samples=2, max_seq_length=64)
    assert "row 2" in str(err.value) and "empty `text`" in str(err.value)
