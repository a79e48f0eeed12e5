"""`quantgate gate --policy FILE --evidence RUN_DIR [--candidate NAME]`: the promotion gate on a finished run.

Exit codes: 0 PROMOTE, 3 REJECT (harm detected), 4 INCONCLUSIVE (too little evidence to decide), 2 bad input (a policy
that does not validate, a missing run folder); the same codes as `quantgate release`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from quantgate.base.errors import QuantgateError
from quantgate.gate.evidence import gate_run, overall
from quantgate.gate.models import EXIT_CODES


def gate(
    policy: Annotated[Path, typer.Option(help="gate policy YAML, e.g. releases/policies/default.yaml")],
    evidence: Annotated[Path, typer.Option(help="run folder of a release (results/runs/<run-id>)")],
    candidate: Annotated[Optional[list[str]], typer.Option(help="candidate (scheme id) to gate; repeatable; "
                                                                 "default: every candidate compared in the run")] = None,
    out: Annotated[Optional[Path], typer.Option(help="write the decision here instead of <run>/decision.json")] = None,
) -> None:
    """Check a release's evidence against a policy; write decision.json; exit 0 PROMOTE, 3 REJECT, 4 INCONCLUSIVE."""
    try:
        decisions, path = gate_run(evidence, policy, candidate or None, out=out)
    except QuantgateError as exc:
        print(f"error: {exc.render()}", file=sys.stderr)
        raise typer.Exit(2) from None
    for d in decisions:
        print(f"{d.candidate} ({d.scheme or 'scheme unknown'}, family {d.family or '-'}): {d.decision}")
        for c in d.checks:
            mark = {"pass": "pass", "fail": "FAIL", "inconclusive": "UNSURE", "skipped": "skip"}[c.outcome]
            print(f"  [{mark}] {c.name}: {c.reason}")
        if d.needs:
            print(f"  needs: {d.needs}")
    verdict = overall([d.decision for d in decisions])
    promoted = next((d.candidate for d in decisions if d.promoted), None)
    print(f"decision: {verdict}{' ' + promoted if promoted else ''} -> {path}")
    raise typer.Exit(EXIT_CODES[verdict])
