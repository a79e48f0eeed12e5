"""`quantgate judge` and `quantgate review export|import`: thin commands over quantgate.judge.run and
quantgate.judge.review (imports stay lazy)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from quantgate.base.paths import JUDGES
from quantgate.base.runfiles import JUDGE_REPORT
from quantgate.judge.report import warnings
from quantgate.judge.reportfile import load_judge_report
from quantgate.judge.review import MIN_PAIRS, export_review, import_review
from quantgate.judge.run import JudgeEndpoint, JudgeSettings, run_judge
from quantgate.release.secrets import read_api_key


def judge_cmd(
    endpoint: Annotated[str, typer.Option(help="judge server (OpenAI-compatible), e.g. http://127.0.0.1:8000")],
    model: Annotated[str, typer.Option("--model", "--judge-model", help="judge model name as served")],
    evalset: Annotated[Path, typer.Option(help="eval set JSONL both runs used")],
    baseline: Annotated[Path, typer.Option("--baseline", "--base", help="baseline run directory (quantgate eval)")],
    candidate: Annotated[Path, typer.Option("--candidate", "--cand", help="candidate run directory (quantgate eval)")],
    out: Annotated[Path, typer.Option(help="output directory; re-running into it resumes")],
    judge: Annotated[Path, typer.Option(help="judge template (sidecar .yaml beside it)")] = JUDGES / "pairwise.md",
    calibration_bar: Annotated[float | None, typer.Option(min=0.0, max=1.0, help="calibration accuracy below which the judge is unreliable (default: judges/calibration.yaml)")] = None,
    margin: Annotated[float, typer.Option(min=0.0, max=1.0, help="non-inferiority margin on win rate - loss rate")] = 0.05,
    api_key_env: Annotated[str | None, typer.Option(help="environment variable holding the judge's API key")] = None,
    prefect_secret: Annotated[str | None, typer.Option(help="Prefect Secret block holding the API key (optional)")] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="judge requests in flight")] = 8,
    timeout: Annotated[float, typer.Option(help="seconds per judge request")] = 120.0,
    limit: Annotated[int | None, typer.Option(min=1, help="judge only the first N pairs")] = None,
    calibration_per_type: Annotated[int | None, typer.Option(min=1, help="calibration pairs per corruption type")] = None,
    judge_model_hash: Annotated[str | None, typer.Option(help="judge checkpoint hash, to spot a judge that is a judged model")] = None,
    judge_not_stronger: Annotated[bool, typer.Option(help="declare that the judge is not stronger than the judged models")] = False,
    seed: Annotated[int, typer.Option(help="seed sent with every judge request")] = 0,
) -> None:
    """Calibrate an LLM judge, then judge candidate vs baseline answers pairwise in both orders."""
    at = JudgeEndpoint(url=endpoint, model=model, api_key=read_api_key(api_key_env, prefect_secret),
                       model_hash=judge_model_hash)
    settings = JudgeSettings(template=judge, calibration_bar=calibration_bar, calibration_per_type=calibration_per_type,
                             margin=margin, not_stronger=judge_not_stronger, concurrency=concurrency, timeout_s=timeout,
                             limit=limit, seed=seed)
    run_judge(at, settings, evalset=evalset, baseline=baseline, candidate=candidate, out=out)
    report = load_judge_report(out / JUDGE_REPORT)
    cal, o = report.calibration, report.comparison.overall
    for w in warnings(report):
        print(w.replace("**", ""))
    print(f"calibration accuracy {cal.accuracy:.1%} ({cal.correct}/{cal.n}), bar {cal.bar:.0%}")
    print(f"candidate win {o.win.rate:.1%}  tie {o.tie.rate:.1%}  loss {o.loss.rate:.1%}  "
          f"(n={o.n}, invalid {o.invalid}); non-inferior: {o.non_inferiority.non_inferior}")
    print(f"report: {out / 'report.md'}")


review_app = typer.Typer(help="Human review of judged pairs: blinded export, import of the filled CSV.",
                         no_args_is_help=True)


@review_app.command("export")
def review_export(
    judge_dir: Annotated[Path, typer.Option(help="output directory of `quantgate judge`")],
    out: Annotated[Path, typer.Option(help="where review.csv and review.html go (to send to reviewers)")],
    n: Annotated[int, typer.Option(min=1, help="pairs to export (the practice is 50 or more)")] = 50,
    seed: Annotated[int, typer.Option(help="seed of the sample and of the A/B order")] = 0,
    key: Annotated[Path | None, typer.Option(help="key file (default: <judge-dir>/review_key.json); keep it from reviewers")] = None,
    include_identical: Annotated[bool, typer.Option(help="also export pairs whose answers are identical")] = False,
) -> None:
    """Export a stratified, blinded sample of pairs as CSV and a self-contained HTML form."""
    if n < MIN_PAIRS:
        print(f"warning: {n} pairs; a human review should cover at least {MIN_PAIRS}")
    paths = export_review(judge_dir, out, n=n, seed=seed, key_path=key, include_identical=include_identical)
    print(f"for reviewers: {paths['csv']}  {paths['html']}\nkey (do not send): {paths['key']}")


@review_app.command("import")
def review_import(
    judge_dir: Annotated[Path, typer.Option(help="output directory of `quantgate judge`")],
    csv: Annotated[Path, typer.Option(help="the filled review CSV")],
    key: Annotated[Path | None, typer.Option(help="key file (default: <judge-dir>/review_key.json)")] = None,
) -> None:
    """Import a filled review CSV: human win rate and human-judge agreement, added to the judge report."""
    h = import_review(judge_dir, csv, key)
    r, a = h["rates"], h["agreement"]
    print(f"{h['n_reviewed']} reviewed: candidate win {r['win']['rate']:.1%} tie {r['tie']['rate']:.1%} "
          f"loss {r['loss']['rate']:.1%}; agreement with the judge {a['rate']:.1%} over {a['n']} pairs")
    print(f"report: {judge_dir / 'report.md'}")
