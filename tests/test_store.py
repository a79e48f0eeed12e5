"""Results store (quantgate.report.store): ingest of real run-folder shapes, idempotence, history, migration, corruption."""

from __future__ import annotations

import json
import re
import os
import sqlite3
from pathlib import Path

import pytest
from _report_fixtures import CAND, POLICY, as_schema1, inconclusive_run, release_run

from quantgate.base.errors import QuantgateError
from quantgate.gate.evidence import gate_run
from quantgate.report.store import LATEST, Store, ingest_all

R1, R2, R3 = "demo-20261101T100000Z", "demo-20261102T100000Z", "demo-20261105T100000Z"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("results")
    release_run(root, R1, lose={"proper_nouns": 6}, recall_lose=2)
    release_run(root, R2)
    return root


@pytest.fixture(scope="module")
def results3(tmp_path_factory) -> Path:
    """R1, R2 and an INCONCLUSIVE run (schema 2 at full stretch)."""
    root = tmp_path_factory.mktemp("results3")
    release_run(root, R1, lose={"proper_nouns": 6}, recall_lose=2)
    release_run(root, R2)
    inconclusive_run(root, R3)
    return root


def count(store: Store, table: str, run_id: str) -> int:
    return store.db.execute(f"SELECT COUNT(*) FROM {table} WHERE run_id = ?", (run_id,)).fetchone()[0]


def test_ingest_stores_every_kind_of_evidence(results, tmp_path):
    run = results / "runs" / R1
    cmp_ = json.loads((run / "compare" / f"{CAND}.json").read_text())["default"]
    decision = json.loads((run / "decision.json").read_text())
    delta = json.loads((run / CAND / "recall" / "delta.json").read_text())
    with Store(tmp_path / "q.db") as store:
        assert store.ingest(run) == "new"
        expected_metrics = sum(1 + len(m["by_category"]) for m in cmp_["metrics"].values())
        assert count(store, "metrics", R1) == expected_metrics
        assert count(store, "checks", R1) == len(decision["candidates"][CAND]["checks"])
        assert count(store, "recall_cells", R1) == len(delta["cells"])
        pn = store.query("SELECT * FROM metrics WHERE run_id=? AND category='proper_nouns'", R1)[0]
        src = cmp_["metrics"]["exact_match"]["by_category"]["proper_nouns"]
        assert (pn["delta"], pn["ci_low"], pn["ci_high"], pn["n"]) == pytest.approx(
            (src["delta"], src["ci_low"], src["ci_high"], src["n"]))
        run_row = store.runs()[0]
        assert run_row["decision"] == decision["decision"] == "REJECT" and run_row["model"] == "demo"
        assert run_row["policy_sha256"] == decision["policy"]["sha256"] and run_row["git_commit"].startswith("0123")
        v = store.query("SELECT * FROM variants WHERE run_id=? AND name=?", R1, CAND)[0]
        assert v["size_ratio"] == pytest.approx(0.4) and v["throughput_ratio"] == 1.4
        assert v["recall_delta"] == pytest.approx(delta["overall"]["delta"]) and v["decision"] == "REJECT"
        j = store.query("SELECT * FROM judge WHERE run_id=?", R1)[0]
        assert j["reliable"] == 1 and j["human_reviewed"] == 48 and j["net"] == pytest.approx(0.02)
        assert {r["package"] for r in store.query("SELECT * FROM versions WHERE run_id=?", R1)} == {"quantgate", "torch"}
        assert {r["kind"] for r in store.query("SELECT * FROM hashes WHERE run_id=?", R1)} == {"policy", "quantization_source"}


def test_ingest_is_idempotent_and_replaces_a_changed_run(results, tmp_path):
    run = results / "runs" / R2
    with Store(tmp_path / "q.db") as store:
        assert store.ingest(run) == "new"
        before = {t: count(store, t, R2) for t in ("metrics", "checks", "recall_cells", "variants")}
        assert store.ingest(run) == "unchanged"
        (run / "decision.json").write_text(json.dumps({**json.loads((run / "decision.json").read_text()),
                                                       "decision": "REJECT"}))
        try:
            assert store.ingest(run) == "updated"
            assert {t: count(store, t, R2) for t in before} == before  # replaced, not duplicated
            assert store.runs()[0]["decision"] == "REJECT"
        finally:
            (run / "decision.json").write_text(json.dumps({**json.loads((run / "decision.json").read_text()),
                                                           "decision": "PROMOTE"}))


def test_history_queries_order_runs_and_filter(results, tmp_path):
    with Store(tmp_path / "q.db") as store:
        assert ingest_all(results, store) == {R1: "new", R2: "new"}
        hist = store.metric_history("demo", "exact_match")
        assert [h["run_id"] for h in hist] == [R1, R2]
        assert hist[0]["delta"] < 0 and hist[1]["delta"] == 0
        assert [c["decision"] for c in store.candidates()] == ["REJECT", "PROMOTE"]
        assert [c["run_id"] for c in store.candidates(decision="PROMOTE")] == [R2]
        assert store.candidates(scheme="no-such-scheme") == [] and store.candidates(hardware="x86-cpu")
        assert store.metric_history("other-model") == []


def test_corrupt_evidence_is_stored_as_a_gap(results, tmp_path):
    run = tmp_path / "runs" / "bad-20261103T100000Z"
    import shutil

    shutil.copytree(results / "runs" / R1, run)
    (run / "compare" / f"{CAND}.json").write_text("{not json")
    (run / CAND / "judge" / "report.json").write_text("[1, 2]")
    with Store(tmp_path / "q.db") as store:
        assert store.ingest(run) == "new"
        assert count(store, "metrics", run.name) == 0 and count(store, "checks", run.name) > 0
        gaps = json.loads(store.runs()[0]["gaps_json"])
        assert any("corrupt JSON" in g["reason"] and g["file"].endswith(f"{CAND}.json") for g in gaps)
        assert any("expected a JSON dict" in g["reason"] for g in gaps)


def test_migration_from_v1_keeps_data(results, tmp_path):
    path = tmp_path / "old.db"
    with Store(path, upto=1) as old:  # the previous schema, from the first migration as written
        assert old.version == 1
        old.db.execute("INSERT INTO runs VALUES (?,?,?,?,?,?,?,?,?)",
                       (R1, str(results / "runs" / R1), "demo", "demo", "x86-cpu", "2026-11-01T10:00:00+00:00",
                        "REJECT", "v1-fingerprint", "2026-11-01T11:00:00+00:00"))
        old.db.execute("INSERT INTO variants VALUES (?,?,?,?,?)", (R1, CAND, CAND, "abc", 400))
        old.db.execute("INSERT INTO metrics VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                       (R1, CAND, "default", "exact_match", "*", 100, 0.8, 0.74, -0.06, -0.11, -0.02, 0.03))
        checks = [{"name": "engine_parity", "measured": "pass", "limit": "pass", "passed": True, "required": True,
                   "evidence_file": "e.json", "reason": "ok"},
                  {"name": "primary:default/exact_match", "measured": 0.1375, "limit": 0.03, "passed": False,
                   "required": True, "evidence_file": None, "reason": "too much"}]
        old.db.execute("INSERT INTO decisions VALUES (?,?,?,?,?)", (R1, CAND, "REJECT", "[]", json.dumps(checks)))
    with Store(path) as new:
        assert new.version == LATEST == 3
        assert [r["version"] for r in new.query("SELECT version FROM schema_version ORDER BY version")] == [1, 2, 3]
        run = new.runs()[0]
        assert (run["run_id"], run["decision"], run["fingerprint"]) == (R1, "REJECT", None)
        assert new.query("SELECT decision FROM variants WHERE name=?", CAND)[0]["decision"] == "REJECT"
        moved = new.query("SELECT name, passed, measured, outcome, mdd FROM checks ORDER BY name")
        assert moved == [{"name": "engine_parity", "passed": 1, "measured": "pass", "outcome": "pass", "mdd": None},
                         {"name": "primary:default/exact_match", "passed": 0, "measured": "0.1375", "outcome": "fail",
                          "mdd": None}]
        assert new.metric_history("demo")[0]["delta"] == -0.06
        assert "decisions" not in {r["name"] for r in new.query("SELECT name FROM sqlite_master WHERE type='table'")}
        assert new.ingest(results / "runs" / R1) == "updated"  # the cleared fingerprint makes it refill the new tables
        assert count(new, "recall_cells", R1) > 0


def _valid_db(path: Path) -> Path:
    Store(path).close()
    return path


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(b"this is not a database at all" * 10), "wrong file header"),
    (lambda p: p.write_bytes(_valid_db(p).read_bytes()[:5000]), "unusable"),
    (lambda p: sqlite3.connect(p).execute("CREATE TABLE other (x)").connection.commit(), "not a quantgate database"),
])
def test_corrupt_database_is_refused_and_left_untouched(tmp_path, damage, message):
    path = tmp_path / "quantgate.db"
    damage(path)
    before = path.read_bytes()
    mtime = os.stat(path).st_mtime_ns
    with pytest.raises(QuantgateError) as err:
        Store(path)
    assert message in str(err.value) and str(path) in str(err.value) and "mv " in err.value.fix
    assert path.read_bytes() == before and os.stat(path).st_mtime_ns == mtime


def test_database_from_a_newer_quantgate_is_refused(tmp_path):
    path = _valid_db(tmp_path / "q.db")
    con = sqlite3.connect(path)
    con.execute("INSERT INTO schema_version VALUES (99, 'later')")
    con.commit()
    con.close()
    with pytest.raises(QuantgateError, match="schema version 99"):
        Store(path)


# --- schema 3: check outcomes, minimum detectable drops, INCONCLUSIVE -------------------------------------------

def test_ingest_stores_outcomes_mdd_and_inconclusive(results3, tmp_path):
    run = results3 / "runs" / R3
    dec = json.loads((run / "decision.json").read_text())
    with Store(tmp_path / "q.db") as store:
        assert store.ingest(run) == "new"
        assert store.runs()[0]["decision"] == dec["decision"] == "INCONCLUSIVE"
        v = store.query("SELECT decision, needs FROM variants WHERE run_id=? AND name=?", R3, CAND)[0]
        assert v == {"decision": "INCONCLUSIVE", "needs": dec["candidates"][CAND]["needs"]}
        rows = {r["name"]: r for r in store.query("SELECT * FROM checks WHERE run_id=?", R3)}
        for ch in dec["candidates"][CAND]["checks"]:
            row, p = rows[ch["name"]], ch["power"] or {}
            assert row["outcome"] == ch["outcome"] and row["passed"] == (None if ch["passed"] is None else int(ch["passed"]))
            assert row["mdd"] == pytest.approx(p.get("mdd")) and row["power_n"] == p.get("n")
            assert row["limit_below_mdd"] == (int(p["limit_below_mdd"]) if p else None)
        assert [r["name"] for r in store.query("SELECT name FROM checks WHERE outcome='inconclusive'")] == \
            ["primary:default/numeric_match"]
        assert [c["run_id"] for c in store.candidates(decision="INCONCLUSIVE")] == [R3]


def test_schema1_decision_ingests_with_derived_outcomes(results3, tmp_path):
    import shutil

    run = tmp_path / "runs" / R3
    shutil.copytree(results3 / "runs" / R3, run)
    as_schema1(run)
    with Store(tmp_path / "q.db") as store:
        store.ingest(run)
        got = {r["name"]: (r["outcome"], r["mdd"]) for r in store.query("SELECT name, outcome, mdd FROM checks")}
        assert got["primary:default/numeric_match"] == ("fail", None) and got["engine_parity"] == ("pass", None)
        assert store.runs()[0]["decision"] == "REJECT"


def test_migration_from_v2_keeps_rows(results3, tmp_path):
    path = tmp_path / "v2.db"
    with Store(path, upto=2) as old:  # the previous schema version, as its migrations wrote it
        assert old.version == 2
        old.db.execute("INSERT INTO runs (run_id, folder, release, model, hardware, started, decision, fingerprint, "
                       "promoted) VALUES (?,?,?,?,?,?,?,?,?)",
                       (R3, str(results3 / "runs" / R3), "demo", "demo", "x86-cpu", "2026-11-05T10:00:00+00:00",
                        "REJECT", "v2-fingerprint", None))
        old.db.execute("INSERT INTO variants VALUES (?,?,?,?,?,?,?,?,?)",
                       (R3, CAND, CAND, "abc", 400, "REJECT", 0.4, 1.4, 0.0))
        old.db.execute("INSERT INTO checks VALUES (?,?,?,?,?,?,?,?,?)",
                       (R3, CAND, "primary:default/numeric_match", "0.075", "0.03", 0, 1, None, "too much"))
        old.db.execute("INSERT INTO checks VALUES (?,?,?,?,?,?,?,?,?)",
                       (R3, CAND, "judge:non_inferiority", None, "-0.05", None, 0, None, "skipped"))
        old.db.execute("INSERT INTO metrics VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                       (R3, CAND, "default", "numeric_match", "*", 50, 0.8, 0.8, 0.0, -0.06, 0.06, 1.0))
    with Store(path) as new:
        assert new.version == LATEST == 3
        assert [r["version"] for r in new.query("SELECT version FROM schema_version ORDER BY version")] == [1, 2, 3]
        cols = {r["name"] for r in new.query("PRAGMA table_info(checks)")}
        assert {"outcome", "mdd", "power_n", "limit_below_mdd"} <= cols
        assert "needs" in {r["name"] for r in new.query("PRAGMA table_info(variants)")}
        assert new.query("SELECT name, outcome, passed, mdd FROM checks ORDER BY name") == [
            {"name": "judge:non_inferiority", "outcome": "skipped", "passed": None, "mdd": None},
            {"name": "primary:default/numeric_match", "outcome": "fail", "passed": 0, "mdd": None}]
        run = new.runs()[0]
        assert (run["decision"], run["fingerprint"], run["model"]) == ("REJECT", None, "demo")
        assert new.query("SELECT size_ratio, needs FROM variants")[0] == {"size_ratio": 0.4, "needs": None}
        assert new.metric_history("demo")[0]["ci_low"] == -0.06
        # the cleared fingerprint makes the next ingest refill the run with the new columns
        assert new.ingest(results3 / "runs" / R3) == "updated"
        assert new.runs()[0]["decision"] == "INCONCLUSIVE"
        row = new.query("SELECT outcome, mdd FROM checks WHERE name='primary:default/numeric_match'")[0]
        assert row["outcome"] == "inconclusive" and row["mdd"] > 0.03


def test_dashboard_shows_inconclusive(results3, tmp_path):
    from quantgate.report.dashboard import build

    index = build(results3, tmp_path / "q.db", log=lambda *_: None).read_text()
    options = re.findall(r'<option value="([A-Z]+)">', index)
    assert options == ["PROMOTE", "REJECT", "INCONCLUSIVE"]
    assert index.count('data-decision="INCONCLUSIVE"') == 1
    row = index[index.index('data-decision="INCONCLUSIVE"'):].split("</tr>")[0]
    assert '<span class="badge INCONCLUSIVE" title="to decide: about' in row and "needs about" in row
    assert re.search(r"\.INCONCLUSIVE\b[^{]*\{[^}]*background", index)


def test_real_gate_outcomes_are_stored(results3, tmp_path):
    import shutil

    run = tmp_path / "runs" / R3
    shutil.copytree(results3 / "runs" / R3, run)
    (d,), _ = gate_run(run, POLICY)
    with Store(tmp_path / "q.db") as store:
        store.ingest(run)
        rows = {r["name"]: r for r in store.query("SELECT * FROM checks")}
        assert set(rows) == {c.name for c in d.checks}
        for c in d.checks:
            assert rows[c.name]["outcome"] == c.outcome
            assert rows[c.name]["mdd"] == pytest.approx(c.power.mdd if c.power else None)
        assert store.runs()[0]["decision"] == d.decision
