"""`quantgate gate --policy FILE --evidence RUN_DIR [--candidate NAME]`: the promotion gate on a finished run.

Exit codes: 0 PROMOTE, 3 REJECT (harm detected), 4 INCONCLUSIVE (too little evidence to decide), 2 bad input (a policy
that does not validate, a missing run folder); the same codes as `quantgate release`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from quantgate.base.errors import QuantgateError
from quantgate.gate.decisionfile import overall
from quantgate.gate.evidence import gate_run
from quantgate.gate.models import EXIT_CODES
from quantgate.gate.policy import DEFAULT_POLICY, load_policy
from quantgate.gate.sizing import recall_sizing, sizing
from quantgate.report.junit import Inconclusive, write_junit


def gate(
    policy: Annotated[Path, typer.Option(help="gate policy YAML, e.g. releases/policies/default.yaml")],
    evidence: Annotated[Path, typer.Option(help="run folder of a release (results/runs/<run-id>)")],
    candidate: Annotated[list[str] | None, typer.Option(help="candidate (scheme id) to gate; repeatable; "
                                                                 "default: every candidate compared in the run")] = None,
    out: Annotated[Path | None, typer.Option(help="write the decision here instead of <run>/decision.json")] = None,
    junit_inconclusive: Annotated[Inconclusive, typer.Option(
        help="decision.junit.xml: an INCONCLUSIVE candidate and its inconclusive checks as `failure` (CI shows "
             "that nothing was promoted) or `skipped`")] = "failure",
) -> None:
    """Check a release's evidence against a policy; write decision.json; exit 0 PROMOTE, 3 REJECT, 4 INCONCLUSIVE."""
    try:
        decisions, path = gate_run(evidence, policy, candidate or None, out=out)
        write_junit(path, junit_inconclusive)  # decision.junit.xml next to it, for CI
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


def sizing_cmd(
    policy: Annotated[Path, typer.Option(help="gate policy YAML")] = DEFAULT_POLICY,
    family: Annotated[str, typer.Option(help="scheme family whose limits to size (fp8, int8, w4a16, ...)")] = "w4a16",
    n: Annotated[list[int] | None, typer.Option(help="paired samples per check; repeatable")] = None,
    base: Annotated[float, typer.Option(help="baseline accuracy of the binary measure")] = 0.4,
    discordance: Annotated[float, typer.Option(help="share of samples that change either way")] = 0.10,
    needles: Annotated[list[int] | None, typer.Option(help="recall needles (paired) to size; repeatable")] = None,
    recall_base: Annotated[float, typer.Option(help="baseline recall per needle")] = 0.5,
    design_effect: Annotated[float, typer.Option(help="needles sharing a haystack count as n / this independent "
                                                      "ones (a run's recall delta.json reports it)")] = 1.0,
) -> None:
    """How large an eval set and a recall grid must be: each check's minimum detectable drop at n, against its limit."""
    try:
        pol = load_policy(policy)
    except QuantgateError as exc:
        print(f"error: {exc.render()}", file=sys.stderr)
        raise typer.Exit(2) from None
    known = sorted(set(pol.primary.families if pol.primary else ()) | set(pol.fidelity.families if pol.fidelity else ()))
    if family not in known:
        print(f"error: --family {family!r} is not a family of policy {pol.name} ({policy}): one of {', '.join(known)}",
              file=sys.stderr)
        raise typer.Exit(2)
    checks = ["pooled", "primary", *[f"category:{c}" for c in pol.categories]]
    print(f"policy {pol.name}, family {family}: relative minimum detectable drop at {pol.statistics.power:.0%} power "
          f"(baseline accuracy {base:.0%}, {discordance:.0%} of samples discordant)")
    print("| n | " + " | ".join(checks) + " |\n|---|" + "---|" * len(checks))
    for size in n or [100, 300, 500, 1000, 3000, 10000]:
        rows = {r.check: r for r in sizing(pol, family, {c: size for c in checks}, base=base, discordance=discordance)}
        print(f"| {size} | " + " | ".join(f"{rows[c].mdd:.1%}" + (" *" if rows[c].below else "") if c in rows else "-"
                                          for c in checks) + " |")
    limits = {r.check: r for r in sizing(pol, family, {c: 1 for c in checks}, base=base, discordance=discordance)}
    print("limits: " + ", ".join(f"{c} {r.limit:.1%} (provable from about {r.needs} samples)" for c, r in limits.items()))
    print("* limit below the minimum detectable drop: the check detects harm there, fidelity carries the proof")
    _recall_rows(pol, len(checks), needles or [60, 120, 240, 480], recall_base, discordance, design_effect)


def _recall_rows(pol, other_checks: int, needles: list[int], base: float, discordance: float, deff: float) -> None:
    """The recall check's rows: its minimum detectable drop at each needle count (quantgate.gate.sizing)."""
    rows = [r for n in needles if (r := recall_sizing(pol, n, other_checks=other_checks, base=base,
                                                      discordance=discordance, design_effect=deff)) is not None]
    if not rows:
        print("recall: the policy has no recall check")
        return
    unit = "relative" if pol.recall.kind == "relative" else "absolute"
    print(f"\nrecall ({unit} drop, baseline recall {base:.0%}, design effect {deff:g}):")
    print("| needles | MDD | limit |\n|---|---|---|")
    for r in rows:
        print(f"| {r.n} | {r.mdd:.1%}{' *' if r.below else ''} | {r.limit:.1%} |")
    print(f"recall limit {rows[0].limit:.1%} provable from about {rows[0].needs} needles")
