"""Run `vllm bench serve` several times in ONE process of the serving environment (no quantgate imports).

    SERVE_PYTHON bench_driver.py SPEC.json

SPEC.json: {"runs": [{"argv": [...], "error_file": PATH}, ...]}. Each `argv` is exactly what follows
`vllm bench serve` on the command line (including --save-result/--result-dir/--result-filename), and is run
with vLLM's own parser and entry point, so the results are those of the real command. One process for all
runs saves vLLM's import (about 15 s here) per concurrency level and repeat. A run that raises writes the
exception to its `error_file` and the driver goes on with the next run. A run with a `gate` path waits for the
caller to write GATE.go (run it) or GATE.skip (skip it, the file says why): the caller decides from the runs so far
(quantgate.perf.probe: saturation, SLO, time budget). The API key comes from
$OPENAI_API_KEY, which vLLM's client reads.
"""

import json
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


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
