"""Run records: per-step wall times are appended in order, failed steps included; run ids stay inside
results/runs, default ones are unique, and a run folder is never reused."""

from __future__ import annotations

import json
import threading
import time

import pytest

from quantgate.base.errors import QuantgateError
from quantgate.release.runrecord import check_new_run_id, check_run_id, new_run_id, run_dir, timed, timings


def test_timed_appends_each_step_in_order_and_records_failures(tmp_path):
    with timed(tmp_path, "model"):
        time.sleep(0.2)
    with pytest.raises(ValueError):
        with timed(tmp_path, "quantize w4a16-gptq"):
            raise ValueError("boom")
    rows = timings(tmp_path)
    assert [(r.step, r.status) for r in rows] == [("model", "ok"), ("quantize w4a16-gptq", "failed")]
    # start and end are each rounded to 0.01 s: their difference is the 0.2 s slept within that rounding
    assert rows[0].seconds >= 0.2 and rows[0].end - rows[0].start >= 0.19 and rows[0].served is None


def test_a_step_adds_what_it_served_on_to_its_row_and_the_file_keeps_only_what_was_said(tmp_path):
    with timed(tmp_path, "serve and measure int8") as row:
        row.served, row.slot = True, "slot 1 (cores 1)"
    with timed(tmp_path, "quantize int8") as row:
        row.slot = None  # quantized on no slot of its own: said, so written
    with timed(tmp_path, "gate"):
        pass
    served, quantized, gate = json.loads((tmp_path / "timings.json").read_text())
    assert served["served"] is True and served["slot"] == "slot 1 (cores 1)"
    assert quantized["slot"] is None and "served" not in quantized
    assert "served" not in gate and "slot" not in gate
    assert [r.slot for r in timings(tmp_path)] == ["slot 1 (cores 1)", None, None]


def test_a_row_with_a_key_of_another_version_keeps_it_when_a_step_is_appended(tmp_path):
    (tmp_path / "timings.json").write_text(json.dumps([{"step": "model", "seconds": 0.1, "status": "ok", "start": 1.0,
                                                        "end": 1.1, "node": "host-a"}]))
    with timed(tmp_path, "gate"):
        pass
    first, second = json.loads((tmp_path / "timings.json").read_text())
    assert first == {"step": "model", "seconds": 0.1, "status": "ok", "start": 1.0, "end": 1.1, "node": "host-a"}
    assert second["step"] == "gate" and "node" not in second


def test_a_step_failing_while_the_release_is_being_stopped_is_recorded_as_stopped(tmp_path, monkeypatch):
    from quantgate.release import stopping

    stop = threading.Event()
    monkeypatch.setattr(stopping, "_stopping", stop)
    stop.set()  # as the first SIGTERM does, before it stops the servers
    with pytest.raises(ConnectionError):
        with timed(tmp_path, "serve and measure baseline"):
            raise ConnectionError("the server went away")
    assert [(r.step, r.status) for r in timings(tmp_path)] == [("serve and measure baseline", "stopped")]


def test_no_or_broken_timings_file_reads_as_empty(tmp_path):
    assert timings(tmp_path) == []
    (tmp_path / "timings.json").write_text("{not json")
    assert timings(tmp_path) == []


# --- run ids and run folders -------------------------------------------------------------------------------------


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTGATE_RESULTS", str(tmp_path / "results"))
    return tmp_path / "results"


@pytest.mark.parametrize("bad", ["../../x", "..", ".", "...", "", "/etc", "/tmp/run", "a/b", "a\\b", "-rf", ".hidden",
                                 "_x", "a b", "run\n", "x" * 129, "é", "a;rm", "$(id)"])
def test_a_run_id_that_is_no_plain_folder_name_is_refused(results, bad):
    with pytest.raises(QuantgateError) as err:
        run_dir(bad)
    assert "run id" in err.value.render() and err.value.fix
    with pytest.raises(QuantgateError):
        check_new_run_id(bad)
    runs = results / "runs"
    assert not (runs.exists() and any(runs.iterdir())) and not (results.parent / "x").exists()  # nothing was made


@pytest.mark.parametrize("good", ["demo", "demo-20240601T120000Z-a1b2c3", "a", "A.b_c-9", "x" * 128, "1..2"])
def test_plain_run_ids_make_their_folder_under_results_runs(results, good):
    path = run_dir(good)
    assert path == results / "runs" / good and path.is_dir()


def test_an_existing_run_folder_is_refused_not_reused(results):
    first = run_dir("r1")
    (first / "run.json").write_text("{}")
    check_new_run_id(None)
    with pytest.raises(QuantgateError) as err:
        check_new_run_id("r1")
    with pytest.raises(QuantgateError) as again:
        run_dir("r1")
    for e in (err.value, again.value):
        assert str(first) in e.render() and "run id" in e.fix
    assert (first / "run.json").read_text() == "{}"


def test_default_run_ids_differ_within_one_second_and_are_valid():
    ids = {new_run_id("demo") for _ in range(200)}
    assert len(ids) == 200
    for rid in ids:
        assert check_run_id(rid) == rid and rid.startswith("demo-")
    assert len(new_run_id("n" * 100)) <= 128  # the longest spec name still makes a valid id


def test_two_releases_asking_for_one_run_id_get_one_folder_between_them(results):
    got, refused = [], []

    def start() -> None:
        try:
            got.append(run_dir("same"))
        except QuantgateError:
            refused.append(1)

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 1 and len(refused) == 7


def test_steps_timed_in_parallel_lose_no_row(tmp_path):
    def one(i: int) -> None:
        with timed(tmp_path, f"step {i}"):
            time.sleep(0.01)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.step for r in timings(tmp_path)) == sorted(f"step {i}" for i in range(12))
