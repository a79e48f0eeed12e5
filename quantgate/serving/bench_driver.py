"""Run `vllm bench serve` several times in ONE process of the serving environment (no quantgate imports).

    SERVE_PYTHON bench_driver.py SPEC.json      the runs of one spec, then exit
    SERVE_PYTHON bench_driver.py --jobs         one job per line on stdin until EOF (a speed window's probes)

SPEC.json: {"runs": [{"argv": [...], "error_file": PATH}, ...]}. Each `argv` is exactly what follows
`vllm bench serve` on the command line (including --save-result/--result-dir/--result-filename), and is run
with vLLM's own parser and entry point, so the results are those of the real command. One process for all
runs saves vLLM's import (about 15 s here) per concurrency level and repeat. A run that raises writes the
exception to its `error_file` and the driver goes on with the next run. A run with a `gate` path waits for the
caller to write GATE.go (run it) or GATE.skip (skip it, the file says why): the caller decides from the runs so far
(quantgate.perf.probe: saturation, SLO, time budget). The API key comes from
$OPENAI_API_KEY, which vLLM's client reads.

With --jobs the process outlives one spec, so vLLM's import is paid once for many probes: each stdin line is
{"spec": PATH, "log": PATH, "done": PATH, "api_key": KEY or null}. The job's output goes to its own log, the key
to $OPENAI_API_KEY (through the pipe: never in a file or on a command line), and when its runs are over the driver
writes "0" (or the exception that stopped it) to `done`. EOF on stdin ends the process.
"""

import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_launcher


def _skip(gate: str | Path) -> Path:
    return Path(f"{gate}.skip")


def _released(gate: Path, wait_s: float = 900.0) -> bool:
    """Wait until the caller writes GATE.go (run it) or GATE.skip (skip it); a silent caller lets it run."""
    deadline = time.monotonic() + wait_s
    while not Path(f"{gate}.go").exists() and not _skip(gate).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _skip(gate).exists()


def run_spec(path: str) -> None:
    spec = json.loads(Path(path).read_text())
    vllm_launcher.metadata.version = vllm_launcher._vllm_version
    from vllm.benchmarks.serve import add_cli_args, main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for i, run in enumerate(spec["runs"]):
        if run.get("gate") and not _released(Path(run["gate"])):  # the caller decided this run should not start
            print(f"[bench_driver] run {i + 1}/{len(spec['runs'])} skipped: {_skip(run['gate']).read_text()}", flush=True)
            continue
        print(f"[bench_driver] run {i + 1}/{len(spec['runs'])}: vllm bench serve {' '.join(run['argv'])}", flush=True)
        parser = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(parser)
        try:
            bench_main(parser.parse_args(run["argv"]))
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            Path(run["error_file"]).write_text(json.dumps({"exception": detail}))
            print(f"[bench_driver] run {i + 1} failed: {detail}", flush=True)


def serve_jobs() -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        if job.get("api_key"):
            os.environ["OPENAI_API_KEY"] = job["api_key"]
        else:
            os.environ.pop("OPENAI_API_KEY", None)
        sys.stdout.flush()
        sys.stderr.flush()
        with open(job["log"], "ab") as log:  # this job's output into its own log
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        print(f"[bench_driver] job in process {os.getpid()}", flush=True)
        try:
            run_spec(job["spec"])
            said = "0"
        except (OSError, ValueError, KeyError) as exc:  # a job whose spec cannot be read: said, the next one runs
            said = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        sys.stdout.flush()
        sys.stderr.flush()
        tmp = Path(job["done"] + ".tmp")  # whole or absent: the caller reads it as soon as it exists
        tmp.write_text(said)
        os.replace(tmp, job["done"])


def main() -> int:
    if sys.argv[1] == "--jobs":
        serve_jobs()
    else:
        run_spec(sys.argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
