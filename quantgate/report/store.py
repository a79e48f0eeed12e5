"""Results store: every run's evidence in one SQLite file (results/quantgate.db), queryable across releases.

The schema is versioned: `schema_version` holds the version, and MIGRATIONS[i] takes a database from version i to
i + 1 (MIGRATIONS[0] creates version 1). Opening a database applies the missing migrations in one transaction.
A file that is not a sound SQLite database, or one from a newer quantgate, is refused with a clear error and
left untouched; the store can always be rebuilt from results/runs/ (`quantgate dashboard`).

Ingesting a run folder is idempotent: the run's rows are replaced as a whole, and skipped when the fingerprint
(sha256 over every evidence file read) is unchanged.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

from quantgate.base.errors import QuantgateError
from quantgate.base.paths import results_dir
from quantgate.report.runview import BASELINE, ReportGap, RunView, load_run, outcome_of, run_folders, size_ratio
from quantgate.report.sections import d as _dict, num as _num, outcome

HEADER = b"SQLite format 3\x00"
_V1 = """
CREATE TABLE schema_version (version INTEGER NOT NULL, applied_at TEXT NOT NULL);
CREATE TABLE runs (run_id TEXT PRIMARY KEY, folder TEXT, release TEXT, model TEXT, hardware TEXT, started TEXT,
                   decision TEXT, fingerprint TEXT, ingested_at TEXT);
CREATE TABLE variants (run_id TEXT, name TEXT, scheme TEXT, content_hash TEXT, size_bytes INTEGER,
                       PRIMARY KEY (run_id, name));
CREATE TABLE metrics (run_id TEXT, candidate TEXT, eval_set TEXT, metric TEXT, category TEXT, n INTEGER,
                      base_mean REAL, cand_mean REAL, delta REAL, ci_low REAL, ci_high REAL, mcnemar_p REAL,
                      PRIMARY KEY (run_id, candidate, eval_set, metric, category));
CREATE TABLE decisions (run_id TEXT, candidate TEXT, decision TEXT, reasons_json TEXT, checks_json TEXT,
                        PRIMARY KEY (run_id, candidate));
"""
_V2 = """
ALTER TABLE runs ADD COLUMN promoted TEXT;
ALTER TABLE runs ADD COLUMN policy_name TEXT;
ALTER TABLE runs ADD COLUMN policy_sha256 TEXT;
ALTER TABLE runs ADD COLUMN git_commit TEXT;
ALTER TABLE runs ADD COLUMN git_dirty INTEGER;
ALTER TABLE runs ADD COLUMN spec_json TEXT;
ALTER TABLE runs ADD COLUMN gaps_json TEXT;
ALTER TABLE variants ADD COLUMN decision TEXT;
ALTER TABLE variants ADD COLUMN size_ratio REAL;
ALTER TABLE variants ADD COLUMN throughput_ratio REAL;
ALTER TABLE variants ADD COLUMN recall_delta REAL;
CREATE TABLE checks (run_id TEXT, candidate TEXT, name TEXT, measured TEXT, limit_value TEXT, passed INTEGER,
                     required INTEGER, evidence_file TEXT, reason TEXT, PRIMARY KEY (run_id, candidate, name));
CREATE TABLE recall_cells (run_id TEXT, candidate TEXT, kind TEXT, length INTEGER, depth INTEGER, n INTEGER,
                           base REAL, cand REAL, delta REAL, base_exact REAL, cand_exact REAL,
                           PRIMARY KEY (run_id, candidate, kind, length, depth));
CREATE TABLE judge (run_id TEXT, candidate TEXT, reliable INTEGER, accuracy REAL, bar REAL, n INTEGER, net REAL,
                    lower_bound REAL, non_inferior INTEGER, counts_as_evidence INTEGER, human_reviewed INTEGER,
                    human_agreement REAL, PRIMARY KEY (run_id, candidate));
CREATE TABLE perf (run_id TEXT, variant TEXT, concurrency INTEGER, output_tok_s REAL, requests_s REAL,
                   ttft_p50_ms REAL, ttft_p95_ms REAL, itl_p50_ms REAL, itl_p95_ms REAL, error_rate REAL,
                   PRIMARY KEY (run_id, variant, concurrency));
CREATE TABLE versions (run_id TEXT, package TEXT, version TEXT, PRIMARY KEY (run_id, package));
CREATE TABLE hashes (run_id TEXT, subject TEXT, kind TEXT, sha256 TEXT, PRIMARY KEY (run_id, subject, kind));
CREATE INDEX metrics_by_metric ON metrics (metric, eval_set);
"""
_V3 = """
ALTER TABLE checks ADD COLUMN outcome TEXT;
ALTER TABLE checks ADD COLUMN mdd REAL;
ALTER TABLE checks ADD COLUMN power_n INTEGER;
ALTER TABLE checks ADD COLUMN limit_below_mdd INTEGER;
ALTER TABLE variants ADD COLUMN needs TEXT;
UPDATE checks SET outcome = CASE passed WHEN 1 THEN 'pass' WHEN 0 THEN 'fail' ELSE 'skipped' END;
CREATE INDEX checks_by_outcome ON checks (outcome)
"""
RUN_TABLES = ("runs", "variants", "metrics", "checks", "recall_cells", "judge", "perf", "versions", "hashes")


def _script(db: sqlite3.Connection, sql: str) -> None:
    """Statement by statement: executescript() would commit the migration's transaction first."""
    for stmt in sql.split(";"):
        if stmt.strip():
            db.execute(stmt)


def _m1(db: sqlite3.Connection) -> None:
    _script(db, _V1)


def _m2(db: sqlite3.Connection) -> None:
    """v1 -> v2: checks get their own table (moved from decisions.checks_json), more run and variant columns,
    recall cells, judge, perf, versions and hashes. Old runs keep their rows; their fingerprint is cleared so the
    next ingest of a folder that still exists fills the new tables."""
    _script(db, _V2)
    for run_id, cand, decision, checks in db.execute("SELECT run_id, candidate, decision, checks_json FROM decisions").fetchall():
        db.execute("UPDATE variants SET decision = ? WHERE run_id = ? AND name = ?", (decision, run_id, cand))
        for c in json.loads(checks or "[]"):
            db.execute("INSERT OR REPLACE INTO checks VALUES (?,?,?,?,?,?,?,?,?)",
                       (run_id, cand, c.get("name"), _text(c.get("measured")), _text(c.get("limit")),
                        _bool(c.get("passed")), _bool(c.get("required")), c.get("evidence_file"), c.get("reason")))
    db.execute("DROP TABLE decisions")
    db.execute("UPDATE runs SET fingerprint = NULL")


def _m3(db: sqlite3.Connection) -> None:
    """v2 -> v3, for the three-outcome gate (decision schema 2, quantgate/gate/models.py): each check's outcome
    (pass / fail / inconclusive / skipped), minimum detectable drop, its n and whether the limit lies below it; a
    candidate's `needs` (what would decide an INCONCLUSIVE one). Old check rows get the outcome their `passed` meant;
    fingerprints are cleared so the next ingest of a folder that still exists fills the new columns."""
    _script(db, _V3)
    db.execute("UPDATE runs SET fingerprint = NULL")


MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [_m1, _m2, _m3]
LATEST = len(MIGRATIONS)


def _text(x: Any) -> str | None:
    return None if x is None else str(x)


def _bool(x: Any) -> int | None:
    return None if x is None else int(bool(x))


def _corrupt(path: Path, why: str) -> QuantgateError:
    return QuantgateError(f"the results database is unusable: {why}; it was left as it is", where=str(path),
                          fix=f"move it aside (mv {path} {path}.bad); the next `quantgate dashboard` rebuilds the "
                              "store from results/runs/")


def default_path() -> Path:
    return results_dir() / "quantgate.db"


class Store:
    """An open results database, migrated to LATEST (or to `upto`, which only tests use)."""
    def __init__(self, path: Path | str | None = None, *, upto: int = LATEST):
        self.path = Path(path) if path else default_path()
        self._check_file()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            self.db.row_factory = sqlite3.Row
            ok = self.db.execute("PRAGMA quick_check").fetchone()[0]
        except sqlite3.DatabaseError as exc:
            raise _corrupt(self.path, str(exc)) from None
        if ok != "ok":
            self.db.close()
            raise _corrupt(self.path, f"integrity check failed ({ok})")
        self.version = self._migrate(upto)

    def _check_file(self) -> None:
        if self.path.exists():
            if not self.path.is_file():
                raise QuantgateError("the results database path is not a file", where=str(self.path),
                                     fix="remove or rename what is there")
            with self.path.open("rb") as fh:
                head = fh.read(len(HEADER))
            if head and head != HEADER:
                raise _corrupt(self.path, "not an SQLite database (wrong file header)")

    def current_version(self) -> int:
        tables = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "schema_version" not in tables:
            if tables:
                raise _corrupt(self.path, f"tables {sorted(tables)} but no schema_version: not a quantgate database")
            return 0
        row = self.db.execute("SELECT MAX(version) FROM schema_version").fetchone()
        return int(row[0] or 0)

    def _migrate(self, upto: int) -> int:
        try:
            version = self.current_version()
        except sqlite3.DatabaseError as exc:
            raise _corrupt(self.path, str(exc)) from None
        if version > LATEST:
            raise QuantgateError(f"the results database has schema version {version}; this quantgate knows up to "
                                 f"{LATEST}", where=str(self.path), fix="upgrade quantgate, or use another results folder")
        for target in range(version + 1, upto + 1):
            self.db.execute("BEGIN IMMEDIATE")
            try:
                MIGRATIONS[target - 1](self.db)
                self.db.execute("INSERT INTO schema_version VALUES (?, ?)", (target, _now()))
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
        return max(version, upto)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- ingest ---------------------------------------------------------------------------------------------

    def ingest(self, run: Path | str | RunView) -> str:
        """Store a run folder's evidence; returns 'new', 'updated' or 'unchanged'."""
        view = run if isinstance(run, RunView) else load_run(run)
        fp = fingerprint(view)
        old = self.db.execute("SELECT fingerprint FROM runs WHERE run_id = ?", (view.run_id,)).fetchone()
        if old is not None and old[0] == fp:
            return "unchanged"
        self.db.execute("BEGIN IMMEDIATE")
        try:
            for table in RUN_TABLES:
                self.db.execute(f"DELETE FROM {table} WHERE run_id = ?", (view.run_id,))
            for sql, rows in _safe_rows(view, fp):
                self.db.executemany(sql, rows)
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return "new" if old is None else "updated"

    # --- history --------------------------------------------------------------------------------------------

    def query(self, sql: str, *args: Any) -> list[dict]:
        return [dict(r) for r in self.db.execute(sql, args)]

    def runs(self, *, model: str | None = None, hardware: str | None = None, decision: str | None = None) -> list[dict]:
        where, args = _filters(model=model, hardware=hardware, decision=decision)
        return self.query(f"SELECT * FROM runs {where} ORDER BY started, run_id", *args)

    def candidates(self, **filters: str | None) -> list[dict]:
        """One row per (run, candidate): the run's model/hardware/time and the candidate's headline figures."""
        where, args = _filters(prefix="r.", **{k: v for k, v in filters.items() if k != "scheme"})
        if filters.get("scheme"):
            where += (" AND " if where else "WHERE ") + "v.scheme = ?"
            args.append(filters["scheme"])
        return self.query(
            "SELECT r.run_id, r.release, r.model, r.hardware, r.started, r.decision AS run_decision, v.name AS candidate, "
            "v.scheme, v.decision, v.needs, v.size_ratio, v.throughput_ratio, v.recall_delta, j.net AS judge_net "
            f"FROM variants v JOIN runs r USING (run_id) LEFT JOIN judge j ON j.run_id = v.run_id AND j.candidate = v.name "
            f"{where} {'AND' if where else 'WHERE'} v.name != 'baseline' ORDER BY r.started, r.run_id, v.name", *args)

    def metric_history(self, model: str | None, metric: str | None = None, category: str = "*") -> list[dict]:
        """Deltas of every candidate of `model` across runs, oldest first (category '*' is the overall figure)."""
        sql = ("SELECT r.started, r.run_id, m.candidate, v.scheme, m.eval_set, m.metric, m.n, m.base_mean, m.cand_mean, "
               "m.delta, m.ci_low, m.ci_high FROM metrics m JOIN runs r USING (run_id) "
               "LEFT JOIN variants v ON v.run_id = m.run_id AND v.name = m.candidate "
               "WHERE r.model IS ? AND m.category = ?")
        args: list[Any] = [model, category]
        if metric:
            sql += " AND m.metric = ?"
            args.append(metric)
        return self.query(sql + " ORDER BY r.started, r.run_id, m.candidate, m.eval_set, m.metric", *args)


def _filters(prefix: str = "", **kw: str | None) -> tuple[str, list]:
    conds = [(f"{prefix}{k} = ?", v) for k, v in kw.items() if v]
    return ("WHERE " + " AND ".join(c for c, _ in conds) if conds else ""), [v for _, v in conds]


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def fingerprint(view: RunView) -> str:
    h = hashlib.sha256()
    for p in sorted(set(view.files)):
        h.update(str(p).encode())
        try:
            h.update(hashlib.sha256(p.read_bytes()).digest())
        except OSError:
            h.update(b"?")
    return h.hexdigest()


def _safe_rows(view: RunView, fp: str) -> list[tuple[str, list[tuple]]]:
    """rows_of, or only the run's row when a file has an unexpected shape (the gap is stored with it)."""
    try:
        return rows_of(view, fp)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        view.gaps.append(ReportGap("store", None,
                                   f"unexpected content, only the run row is stored: {type(exc).__name__}: {exc}"))
        view.candidates, view.variants = {}, {BASELINE: view.variants[BASELINE].__class__(BASELINE)}
        return rows_of(view, fp)[:1]


COLUMNS: dict[str, tuple[str, ...]] = {  # what ingest writes, per table (named: ALTER TABLE appends columns)
    "runs": ("run_id", "folder", "release", "model", "hardware", "started", "decision", "fingerprint", "ingested_at",
             "promoted", "policy_name", "policy_sha256", "git_commit", "git_dirty", "spec_json", "gaps_json"),
    "variants": ("run_id", "name", "scheme", "content_hash", "size_bytes", "decision", "size_ratio", "throughput_ratio",
                 "recall_delta", "needs"),
    "metrics": ("run_id", "candidate", "eval_set", "metric", "category", "n", "base_mean", "cand_mean", "delta", "ci_low",
                "ci_high", "mcnemar_p"),
    "checks": ("run_id", "candidate", "name", "measured", "limit_value", "passed", "required", "evidence_file", "reason",
               "outcome", "mdd", "power_n", "limit_below_mdd"),
    "recall_cells": ("run_id", "candidate", "kind", "length", "depth", "n", "base", "cand", "delta", "base_exact",
                     "cand_exact"),
    "judge": ("run_id", "candidate", "reliable", "accuracy", "bar", "n", "net", "lower_bound", "non_inferior",
              "counts_as_evidence", "human_reviewed", "human_agreement"),
    "perf": ("run_id", "variant", "concurrency", "output_tok_s", "requests_s", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms",
             "itl_p95_ms", "error_rate"),
    "versions": ("run_id", "package", "version"),
    "hashes": ("run_id", "subject", "kind", "sha256"),
}
_PERF = ("output_tok_s", "requests_s", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms", "error_rate")


def _run_row(view: RunView, fp: str, policy: dict) -> tuple:
    git = view.run.git.model_dump() if view.run else {}
    decision = outcome_of(view)  # a failed or interrupted run: FAILED / INTERRUPTED (status.json)
    gaps = [{"what": g.what, "file": g.file, "reason": g.reason} for g in view.gaps]
    return (view.run_id, str(view.folder), view.get("release", "name"), view.get("model"), view.get("hardware"),
            view.started, decision, fp, _now(), (view.decision or {}).get("promoted"), policy.get("name"),
            policy.get("sha256"), git.get("commit"), _bool(git.get("dirty")), json.dumps(view.spec, sort_keys=True),
            json.dumps(gaps))


def _variant_rows(view: RunView, rows: dict[str, list[tuple]]) -> None:
    for name, v in view.variants.items():
        var = (v.evidence or {}).get("variant") or {}
        c = view.candidates.get(name)
        cdec, csum = (c and c.decision) or {}, (c and c.summary) or {}
        size = _num(var.get("size_bytes")) or _num(csum.get("size_bytes"))
        tput = _num(c.pay_off.throughput_ratio) if c and c.pay_off else None
        rdelta = _num(c.recall_delta.overall.delta) if c and c.recall_delta else None
        needs = cdec.get("needs") if isinstance(cdec.get("needs"), str) else None
        rows["variants"].append((view.run_id, name, var.get("scheme") or (v.quantization or {}).get("scheme"),
                                 var.get("content_hash"), size, cdec.get("decision") or csum.get("decision"),
                                 1.0 if name == BASELINE else size_ratio(view, name), tput, rdelta, needs))
        if var.get("content_hash"):
            rows["hashes"].append((view.run_id, name, "checkpoint", var["content_hash"]))
        src = ((v.quantization or {}).get("source") or {}).get("sha256")
        if src:
            rows["hashes"].append((view.run_id, name, "quantization_source", src))
        for m in (v.perf or {}).get("medians") or []:
            rows["perf"].append((view.run_id, name, m.get("concurrency"), *(_num(m.get(k)) for k in _PERF)))


def _check_row(run_id: str, cand: str, ch: dict) -> tuple:
    """Schema 2 checks carry `outcome` and `power`; schema 1 ones only `passed` (their outcome is derived)."""
    p = _dict(ch.get("power"))
    return (run_id, cand, ch.get("name"), _text(ch.get("measured")), _text(ch.get("limit")), _bool(ch.get("passed")),
            _bool(ch.get("required")), ch.get("evidence_file"), ch.get("reason"), outcome(ch), _num(p.get("mdd")),
            _num(p.get("n")), _bool(p.get("limit_below_mdd")) if p else None)


def _compare_rows(view: RunView, name: str, compare: dict, rows: dict[str, list[tuple]]) -> None:
    for set_name, rep in compare.items():
        if not isinstance(rep, dict):
            continue
        es = rep.get("evalset") or {}
        if es.get("sha256"):
            rows["hashes"].append((view.run_id, f"evalset:{set_name}", "evalset", es["sha256"]))
        for metric, m in (rep.get("metrics") or {}).items():
            for cat, s in {"*": m.get("overall") or {}, **(m.get("by_category") or {})}.items():
                rows["metrics"].append((view.run_id, name, set_name, metric, cat, s.get("n"), *(_num(s.get(k)) for k in (
                    "base_mean", "cand_mean", "delta", "ci_low", "ci_high", "mcnemar_p"))))


def _candidate_rows(view: RunView, rows: dict[str, list[tuple]]) -> None:
    for name, c in view.candidates.items():
        _compare_rows(view, name, c.compare or {}, rows)
        rows["checks"] += [_check_row(view.run_id, name, ch) for ch in (c.decision or {}).get("checks") or []]
        for cell in c.recall_delta.cells if c.recall_delta else []:
            rows["recall_cells"].append((view.run_id, name, cell.kind, cell.length, cell.depth, cell.n, *(
                _num(getattr(cell, k)) for k in ("base", "cand", "delta", "base_exact", "cand_exact"))))
        if c.judge:
            cal, ni = c.judge.calibration, c.judge.comparison.overall.non_inferiority  # quantgate.judge.reportfile
            human = c.human or c.judge.human or {}
            rows["judge"].append((view.run_id, name, _bool(cal.reliable), _num(cal.accuracy), _num(cal.bar), ni.n,
                                  _num(ni.net), _num(ni.lower_bound), _bool(ni.non_inferior),
                                  _bool(c.judge.counts_as_evidence),
                                  human.get("n_reviewed"), _num((human.get("agreement") or {}).get("rate"))))


def rows_of(view: RunView, fp: str) -> list[tuple[str, list[tuple]]]:
    """(INSERT statement, rows) for every table, from one run's evidence; the run's row first."""
    policy = _dict((view.decision or {}).get("policy") or (view.summary or {}).get("policy"))
    rows: dict[str, list[tuple]] = {t: [] for t in COLUMNS}
    rows["runs"].append(_run_row(view, fp, policy))
    _variant_rows(view, rows)
    _candidate_rows(view, rows)
    if policy.get("sha256"):
        rows["hashes"].append((view.run_id, f"policy:{policy.get('name')}", "policy", policy["sha256"]))
    rows["versions"] = [(view.run_id, k, _text(v)) for k, v in (view.run.packages if view.run else {}).items()]
    return [(f"INSERT OR REPLACE INTO {t} ({', '.join(cols)}) VALUES ({','.join('?' * len(cols))})",
             [tuple(_cell(x) for x in r) for r in rows[t]]) for t, cols in COLUMNS.items()]


def _cell(x: Any) -> Any:
    """A value SQLite can bind: an odd one from a file (an object, a list, a huge int) is stored as its JSON text."""
    if x is None or isinstance(x, (str, float)) or (isinstance(x, int) and -2**63 <= x < 2**63):
        return x
    return json.dumps(x, default=str)


def ingest_all(results: Path | str, store: Store) -> dict[str, str]:
    """Ingest every run folder under <results>/runs/; returns run id -> 'new' / 'updated' / 'unchanged'."""
    return {p.name: store.ingest(p) for p in run_folders(Path(results))}
