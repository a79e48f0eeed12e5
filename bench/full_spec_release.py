"""One short real release whose spec uses every deployment field at once, on this machine.

    .venv/bin/python bench/full_spec_release.py [--work /tmp/qg-full]

What it sets up, all real and on loopback:
- an existing INT8 W8A8 checkpoint of the demo model (llmcompressor on the first decoder layer only, seconds);
- a vLLM server of the demo model that quantgate does not start: the baseline endpoint, an endpoint candidate (the
  same server under a second name: an A/A candidate) and the judge endpoint;
- an HTTP receiver for the decision webhook.
The spec then uses: `hardware: auto`, `schemes: {auto: 1}` with `skip_unsupported`, `candidates:` (a checkpoint and an
endpoint), `baseline:` (an endpoint), `lm_eval:` tasks, the serving knobs, `judge:` on an endpoint, `adaptive:`,
`publish:` (a folder) and `notify:` (the receiver). It runs `quantgate release --check`, then the release, and prints
what each field did: the decision per candidate, the serve steps' overlap, the published copy, the webhook it got.
The policy is tests/test_release_e2e.py's lenient one for a 135M model on a few samples, with endpoint.yaml's
`not_applicable` (checks an endpoint cannot feed are skipped), so that candidates can be promoted and the publishing
step has entries to copy; `--strict` uses releases/policies/endpoint.yaml as it is. The release's own output goes to
<work>/release.log.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from quantgate.base.paths import RELEASES  # noqa: E402
from quantgate.quantize.calibration import CalibrationSpec  # noqa: E402
from quantgate.quantize.recipes import RecipeOverrides  # noqa: E402
from quantgate.quantize.run import QuantizeRequest, quantize  # noqa: E402
from quantgate.serving.server import ServerConfig, VLLMServer  # noqa: E402
from quantgate.target.catalogue import ensure_demo_model  # noqa: E402

KEY_VAR, HOOK_VAR = "QG_FULL_ENDPOINT_KEY", "QG_FULL_HOOK_SECRET"
LAYER0 = r"re:model\.layers\.([1-9]|[12][0-9])\..*"
SPEC = """\
version: 1
name: full-spec
model: demo
hardware: auto
workload: latency
context: 1024
concurrency: 2
schemes: {{auto: 1}}
skip_unsupported: true
candidates:
  - {{name: ext-int8, checkpoint: {ckpt}}}
  - {{name: prod-endpoint, endpoint: {url}, model: demo, api_key_env: {key}}}
baseline: {{endpoint: {url}, model: demo, api_key_env: {key}}}
eval_sets: [{evalset}]
lm_eval: {{tasks: [qg_numbers], limit: 6, concurrency: 2}}
judge: {{endpoint: {url}, model: demo, api_key_env: {key}, limit: 2, calibration_per_type: 1, not_stronger: true}}
policy: {policy}
quantization: {{calibration: {{samples: 8, max_seq_length: 64}}}}
serving: {{max_num_seqs: 4, enable_prefix_caching: true, startup_timeout_s: 900}}
eval: {{limit: 30, concurrency: 4}}
recall: {{lengths: [256], depths: [0, 100], kinds: [number], samples: 1}}
perf: {{concurrency: [1], num_prompts: 4, input_len: 32, output_len: 8, repeats: 2}}
fidelity: {{limit: 4}}
adaptive: {{max_eval_samples: 40, rounds: 1}}
publish: [{{folder: published}}]
notify: [{{url: "{hook}", secret_env: {hook_var}}}]
"""


class Receiver:
    """Keeps every POST it gets; answers 200."""

    def __init__(self) -> None:
        self.got: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                outer.got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def lenient_policy(path: Path) -> Path:
    """tests/test_release_e2e.py's lenient policy (limits a 135M model on a few samples can meet), with the endpoint
    policy's answers for what an endpoint cannot give (no parity, no size: skipped) and no size demand on the
    checkpoint candidate, which is quantized in one layer only. The endpoint candidate's scheme stays `external`, which
    no family holds (a policy names schemes it knows): its decision shows what that means."""
    sys.path.insert(0, str(REPO / "tests"))
    from test_release_e2e import lenient_policy as e2e_lenient  # one lenient policy, not a second copy

    doc = yaml.safe_load(e2e_lenient(path).read_text())
    doc["not_applicable"] = yaml.safe_load((RELEASES / "policies" / "endpoint.yaml").read_text())["not_applicable"]
    doc["pay_off"]["max_size_ratio"] = 1.0
    path.write_text(yaml.safe_dump(doc))
    return path


def int8_checkpoint(work: Path, model: Path) -> Path:
    req = QuantizeRequest(model=model, scheme="int8-w8a8", out=work / "ckpt-int8", hardware="x86-cpu",
                          overrides=RecipeOverrides(ignore=[LAYER0]), calibration=CalibrationSpec(samples=4, max_seq_length=32))
    return quantize(req).out


def quantgate(args: list[str], env: dict, log: Path) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "quantgate.cli.main", *args], env=env, cwd=REPO, text=True,
                          capture_output=True)
    log.write_text(proc.stdout + proc.stderr)
    print(f"$ quantgate {' '.join(args)}  -> exit {proc.returncode} in {time.monotonic() - t0:.0f} s")
    return proc


def overlap(run: Path) -> list[str]:
    rows = [r for r in json.loads((run / "timings.json").read_text()) if r["step"].startswith("serve and measure ")]
    out = [f"  {r['step']}: slot {r.get('slot')}, {r['start']:.0f}-{r['end']:.0f} s" for r in rows]
    pairs = [(a["step"], b["step"]) for i, a in enumerate(rows) for b in rows[i + 1:]
             if min(a["end"], b["end"]) > max(a["start"], b["start"])]
    return out + [f"  overlapping: {pairs or 'none'}"]


def report(run: Path, rx: Receiver, work: Path) -> None:
    summary = json.loads((run / "summary.json").read_text())
    print(f"decision: {summary['decision']}; machine: {summary.get('machine') or ''}")
    for name, cand in summary["candidates"].items():
        reasons = "; ".join(cand.get("reasons", [])[:2])
        print(f"  {name} ({cand.get('scheme')}): {cand['decision']} {reasons}")
    print("serve steps:", *overlap(run), sep="\n")
    print("lm_eval sets:", sorted({k.split("/")[0] for c in summary["candidates"].values() for k in c.get("metrics", {})
                                   if k.startswith("lm_eval:")}))
    print("published:", [str(p.relative_to(work)) for p in sorted((work / "published").glob("*/*"))])
    print("publish records:", summary.get("publish"))
    print("webhook got:", [(b["run"], b["decision"]) for b in rx.got])
    print("notify records:", summary.get("notify"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/qg-full"))
    ap.add_argument("--strict", action="store_true", help="releases/policies/endpoint.yaml as it is")
    args = ap.parse_args()
    print(f"CPU: {platform.processor() or platform.machine()}; {os.cpu_count()} cores")
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    model = ensure_demo_model()
    ckpt = int8_checkpoint(args.work, model)
    rx = Receiver()
    cfg = ServerConfig(model=model, name="demo", args=["--enforce-eager", "--dtype", "float32", "--max-model-len", "2048"],
                       env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    with VLLMServer(cfg, log_path=args.work / "endpoint.log") as srv:
        spec = args.work / "full.yaml"
        spec.write_text(SPEC.format(ckpt=ckpt, url=srv.base_url, key=KEY_VAR, evalset=REPO / "eval_sets" / "default.jsonl",
                                    policy=RELEASES / "policies" / "endpoint.yaml" if args.strict else
                                    lenient_policy(args.work / "lenient.yaml"), hook=rx.url, hook_var=HOOK_VAR))
        env = {**os.environ, KEY_VAR: srv.api_key or "", HOOK_VAR: "s3cret", "QUANTGATE_RESULTS": str(args.work / "results"),
               "PREFECT_HOME": str(args.work / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        check = quantgate(["release", "--check", str(spec)], env, args.work / "check.log")
        print(check.stdout[-3000:], check.stderr[-2000:])
        if check.returncode != 0:
            return check.returncode
        proc = quantgate(["release", str(spec), "--run-id", "full"], env, args.work / "release.log")
        if proc.returncode not in (0, 3, 4):
            print(proc.stdout[-4000:], proc.stderr[-4000:])
            return proc.returncode
        print("\n".join(proc.stdout.splitlines()[-30:]))
    report(args.work / "results" / "runs" / "full", rx, args.work)
    print(f"(the work folder {args.work} is left for inspection)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
