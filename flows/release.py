"""The release flow's entry for Prefect deployments (prefect.yaml: `flows/release.py:release`) and for running it as a
script: the flow itself is `quantgate.release.flow.release`.

    python flows/release.py SPEC        # as `quantgate release SPEC` runs it, without the CLI's input checks
"""

from __future__ import annotations

import sys

import quantgate.pools  # noqa: F401  (registers `executor: pools` with the flow: quantgate.release.executors)
from quantgate.release.flow import release
from quantgate.release.stopping import run_flow

__all__ = ["release"]

if __name__ == "__main__":
    # as `quantgate release` runs it: SIGTERM/SIGHUP/SIGINT stop every server and child of the release, Prefect's
    # temporary API server (guarded: it dies with this process, even a SIGKILLed one) last, and exit 143/129/130
    run_flow(release, spec=sys.argv[1] if len(sys.argv) > 1 else "releases/demo.yaml")
