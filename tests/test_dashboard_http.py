"""The dashboard's HTTP server, over real HTTP on loopback: it answers only requests addressed to itself by name
(Host header: DNS rebinding is refused) and serves only report files, never the results database or anything else."""

from __future__ import annotations

import http.client
import os
import re
import threading
from pathlib import Path

import pytest
from _report_fixtures import CAND, release_run

from quantgate.report.dashboard import build, host_problem, serve, servable

RUN = "demo-20261101T100000Z"
DB_MAGIC = b"SQLite format 3"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("results")
    run = release_run(root, RUN)
    build(root, log=lambda s: None)  # writes results/quantgate.db, the run's report and the index
    assert (root / "quantgate.db").read_bytes().startswith(DB_MAGIC)
    # files that are not reports, each of which a careless static server would hand out
    (run / CAND / "server.log").write_text("INFO api key sk-secret\n")
    (run / CAND / "judge" / "review_key.json").write_text('{"pair-1": "A is the baseline"}\n')
    (run / ".hidden.json").write_text("{}\n")
    answers = root / "cache" / "variants" / "k" / "evals" / "set-abc-all"
    answers.mkdir(parents=True)
    (answers / "results.jsonl").write_text('{"id": "1", "output": "an answer"}\n')
    (answers / "summary.json").write_text('{"n_samples": 1}\n')
    (root / "checkpoints" / "x").mkdir(parents=True)
    (root / "checkpoints" / "x" / "config.json").write_text("{}\n")
    os.symlink(root / "quantgate.db", run / "db-link.json")  # a link that dresses the database as evidence
    return root


@pytest.fixture(scope="module")
def server(results):
    srv = serve(results, 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(10)


def get(server, path: str, host: str | None = "default") -> tuple[int, bytes, dict]:
    """A raw GET with exactly the Host header given ("default": 127.0.0.1:<port>; None: no Host header at all)."""
    port = server.server_address[1]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
        if host is not None:
            conn.putheader("Host", f"127.0.0.1:{port}" if host == "default" else host)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, resp.read(), dict(resp.getheaders())
    finally:
        conn.close()


def links(html: bytes) -> list[str]:
    return [h for h in re.findall(r'href="([^"#]+)', html.decode()) if not h.startswith(("data:", "http"))]


def test_reports_and_the_evidence_they_link_are_served(server, results):
    status, index, _ = get(server, "/dashboard/index.html")
    assert status == 200 and b"<html" in index.lower()
    reports = links(index)
    assert reports == [f"../runs/{RUN}/report.html"], reports
    status, report, _ = get(server, f"/runs/{RUN}/report.html")
    assert status == 200 and RUN.encode() in report
    assert get(server, f"/runs/{RUN}/report.md")[0] == 200
    evidence = links(report)
    assert len(evidence) >= 5, evidence  # decision, summary, comparison, judge report, ...
    for href in evidence:
        url = "/" + os.path.normpath(f"runs/{RUN}/{href}")
        status, body, _ = get(server, url)
        assert status == 200 and body == (results / url.lstrip("/")).read_bytes(), url
    status, _, headers = get(server, "/")
    assert status == 302 and headers["Location"] == "/dashboard/index.html"
    print(f"\nserved: the index, {len(reports)} report, report.md, {len(evidence)} linked evidence files")


REFUSED = ["/quantgate.db", "/quantgate.db-journal", "/runs/", f"/runs/{RUN}/", f"/runs/{RUN}/{CAND}/server.log",
           f"/runs/{RUN}/{CAND}/judge/review_key.json", f"/runs/{RUN}/.hidden.json", f"/runs/{RUN}/db-link.json",
           "/cache/variants/k/evals/set-abc-all/results.jsonl", "/checkpoints/x/config.json", "/dashboard/",
           "/../quantgate.db", f"/runs/{RUN}/../../quantgate.db", "/runs/%2e%2e/quantgate.db",
           f"/runs/{RUN}/..%2f..%2fquantgate.db", "/%2Fetc/passwd", "/etc/passwd", f"/runs/{RUN}\\..\\..\\quantgate.db"]


@pytest.mark.parametrize("path", REFUSED)
def test_nothing_but_report_files_is_served(server, path):
    status, body, _ = get(server, path)
    assert status in (302, 404), (path, status)  # "/dashboard/" redirects to the index
    assert DB_MAGIC not in body and b"sk-secret" not in body and b"an answer" not in body and b"baseline" not in body


def test_evidence_json_in_the_cache_is_served_but_answers_are_not(server):
    assert get(server, "/cache/variants/k/evals/set-abc-all/summary.json")[0] == 200
    assert get(server, "/cache/variants/k/evals/set-abc-all/results.jsonl")[0] == 404


@pytest.mark.parametrize("host, status", [
    ("evil.example", 421),                 # DNS rebinding: a page of evil.example whose name now resolves to 127.0.0.1
    ("evil.example:{port}", 421),
    ("127.0.0.1.evil.example:{port}", 421),
    ("127.0.0.1:1", 421),                  # another port: another server
    ("127.0.0.1:x", 400),
    (None, 400),                           # no Host header at all
    ("", 400),
    ("localhost:{port}", 200),
    ("LOCALHOST", 200),
    ("127.0.0.1", 200),
])
def test_the_host_header_must_name_this_server(server, host, status):
    port = server.server_address[1]
    got, body, _ = get(server, "/dashboard/index.html", host=None if host is None else host.format(port=port))
    assert got == status, (host, got, body[:200])
    if status != 200:
        assert b"<table" not in body  # the refusal carries no dashboard content


def test_servable_and_host_problem_directly(results):
    assert servable(results, f"/runs/{RUN}/report.html") == (results / "runs" / RUN / "report.html").resolve()
    assert servable(results, f"/runs/{RUN}/decision.json?x=1#top") is not None
    assert servable(results, "/quantgate.db") is None and servable(results, f"/runs/{RUN}/db-link.json") is None
    assert servable(results, f"/runs/{RUN}/{CAND}/report.html") is None  # a report is at the top of its run
    assert host_problem("localhost:8765", {"127.0.0.1", "localhost"}, 8765) is None
    assert host_problem("[::1]:8765", {"127.0.0.1", "localhost"}, 8765)[0] == 421
