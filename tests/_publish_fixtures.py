"""A gated release run folder with a real checkpoint, as the release leaves it before promotion (no server, no model).

The evidence is _gate_fixtures.make_run's (real comparison, recall, fidelity and pay-off files over synthetic scores),
gated by the real gate under the default policy (which promotes it; `lose=` makes it REJECT). Added here is what the
release writes for a quantized candidate and the model card reads: its quantize manifest (with the real recipe
file's text), its plan (quantgate's real planner on a small Llama-shaped checkpoint), the dtype it was served with
and the spec's serving.extra_args in run.json.
"""

from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from _gate_fixtures import make_run
from _quant_fixtures import llama

from quantgate.base.paths import REPO
from quantgate.gate.evidence import gate_run
from quantgate.gate.policy import DEFAULT_POLICY
from quantgate.plan.build import build_plan
from quantgate.target.catalogue import checkpoint_hash

CAND = "w4a16-gptq"
EXTRA_ARGS = ["--max-num-seqs", "4"]


def _update(path: Path, **fields) -> None:
    doc = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**doc, **fields}, indent=2), encoding="utf-8")


def gated_run(root: Path, *, lose: dict[str, int] | None = None, hardware: str = "x86-cpu"):
    """(run folder, candidate checkpoint, decisions) of a gated one-candidate run under `root`."""
    run = make_run(root, CAND, lose=lose)
    ckpt = llama(root / "ckpt", hidden=96, inter=256)  # make_run's evidence names root/ckpt as the candidate's path
    shutil.copy(REPO / "tests" / "data" / "model_configs" / "smollm2-135m.json", ckpt / "config.json")  # the demo's shape
    plan = build_plan(ckpt, hardware, context=2048, concurrency=4)
    (run / CAND / "plan.json").write_text(plan.model_dump_json(indent=2), encoding="utf-8")
    evidence = json.loads((run / CAND / "evidence.json").read_text(encoding="utf-8"))
    evidence["variant"]["content_hash"] = checkpoint_hash(ckpt)
    _update(run / CAND / "evidence.json", variant=evidence["variant"], dtype="bfloat16")
    recipe = REPO / "quant_recipes" / f"{CAND}.yaml"
    (run / CAND / "quantization.json").write_text(json.dumps({
        "reused": False, "scheme": CAND, "recipe_file": str(recipe), "recipe_applied": recipe.read_text(encoding="utf-8"),
        "calibration": {"source": "quant_recipes/calibration/default.jsonl", "sha256": "ab" * 32, "samples": 64,
                        "max_seq_length": 256, "seed": 0, "tokens": 12000},
        "versions": {"llmcompressor": "0.14.0", "compressed-tensors": "0.19.0"}, "compression_ratio": 2.5}), encoding="utf-8")
    spec = json.loads((run / "run.json").read_text(encoding="utf-8"))["spec"]
    _update(run / "run.json", spec={**spec, "hardware": hardware, "workload": "latency",
                                    "serving": {"extra_args": EXTRA_ARGS}})
    decisions, _ = gate_run(run, DEFAULT_POLICY)
    return run, ckpt, decisions


class Receiver:
    """A real HTTP server on loopback that answers each POST with the next scripted status and keeps what it got."""

    def __init__(self, statuses: list[int], body: bytes = b'{"ok": true}'):
        self.got, self.statuses = [], list(statuses)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                outer.got.append((dict(self.headers), raw))
                status = outer.statuses.pop(0) if outer.statuses else 200
                self.send_response(status)
                self.send_header("Content-Length", str(0 if status == 204 else len(body)))
                self.end_headers()
                if status != 204:
                    self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
