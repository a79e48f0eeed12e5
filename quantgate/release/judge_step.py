"""The release's judge step (adapter): the spec's LLM judge on each candidate's answers against the baseline's.

Files, per candidate, where quantgate.gate.evidence reads them:
    <run>/<candidate>/judge/       quantgate.judge.run's run (report.json, report.md, judgements.jsonl, ...)
    <run>/<candidate>/judge/error.json   why the latest judge attempt failed (removed when one starts): the gate
                                   shows it as the judge evidence's gap, so a required judge fails closed
With `judge.serve`, one vLLM server answers for every candidate, planned like the variants but on one node:
    <run>/judge-server/{plan.json, server.log}
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from quantgate.base.runfiles import ERROR, JUDGE_DIR, JUDGE_REPORT
from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import write_json
from quantgate.gate.policy import load_policy
from quantgate.judge.reportfile import JudgeReport, load_judge_report
from quantgate.judge.run import JudgeEndpoint, run_judge
from quantgate.release.cachelayout import eval_sets_by_name
from quantgate.release.secrets import spec_api_key
from quantgate.spec.schema import JudgeSpec, ReleaseSpec, policy_path
from quantgate.release.variants import Variant, make_server, server_config, size_bytes
from quantgate.target.catalogue import checkpoint_hash, resolve_model

SERVER_DIR = "judge-server"
DEFAULT_MARGIN = 0.05


@dataclass
class ServedJudge:
    url: str
    model: str
    api_key: str | None
    model_hash: str | None                          # the served checkpoint's hash: spots a judge that is a judged model
    dead: Callable[[], str | None] = lambda: None   # why the served judge died, if it did


def api_key(j: JudgeSpec) -> str | None:
    """The remote judge's API key (environment variable or Prefect Secret block), or None."""
    return spec_api_key(j.api_key_env, j.prefect_secret, "judge")


def margin(spec: ReleaseSpec) -> float:
    """judge.margin, else the policy's judge margin (the gate's limit), else 0.05."""
    if spec.judge is not None and spec.judge.margin is not None:
        return spec.judge.margin
    policy = load_policy(policy_path(spec))
    return policy.judge.margin if policy.judge is not None else DEFAULT_MARGIN


@contextmanager
def judge_endpoint(spec: ReleaseSpec, run: Path, log: Callable[[str], None] = print) -> Iterator[ServedJudge]:
    """The spec's judge, ready to answer: the remote endpoint, or a vLLM server of `judge.serve` until exit."""
    j = spec.judge
    assert j is not None
    if j.endpoint is not None:
        yield ServedJudge(j.endpoint, j.model or "", api_key(j), None)
        return

    path = resolve_model(j.serve or "")
    variant = Variant(name="judge", path=path, content_hash=checkpoint_hash(path), size_bytes=size_bytes(path))
    one_node = spec.model_copy(update={"nodes": 1, "serving": spec.serving.model_copy(update={"replicas": None})})
    folder = run / SERVER_DIR
    server = make_server(server_config(one_node, variant, folder), folder)
    log(f"judge: serving {j.serve} with `{' '.join(server.command)}`")
    with server as srv:
        def dead() -> str | None:
            try:
                srv.raise_if_dead()
            except QuantgateError as exc:
                return exc.message
            return None

        yield ServedJudge(srv.base_url, variant.name, srv.api_key, variant.content_hash, dead)


def failure(run: Path, candidate: str) -> str | None:
    """Why the release's latest judge attempt on `candidate` failed, or None."""
    import json

    try:
        return json.loads((run / candidate / "judge" / ERROR).read_text(encoding="utf-8")).get("error")
    except (OSError, ValueError, AttributeError):
        return None


def _log_report(name: str, rep: JudgeReport, log: Callable[[str], None]) -> None:
    cal, ni = rep.calibration, rep.comparison.overall.non_inferiority
    log(f"{name}: judge calibration {cal.accuracy or 0.0:.0%} ({'reliable' if cal.reliable else 'UNRELIABLE'})"
        f", non-inferior: {ni.non_inferior}" + (f"; not stronger: {rep.judge_not_stronger}"
                                                 if rep.judge_not_stronger else ""))


def _short(exc: BaseException) -> str:
    text = exc.message if isinstance(exc, QuantgateError) else f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 400 else text[:400] + " ..."


def judge_candidates(spec: ReleaseSpec, run: Path, base, cands: list, log: Callable[[str], None] = print) -> dict[str, Path]:
    """Judge every candidate (Evidence) against the baseline (Evidence) on the first eval set; returns candidate ->
    report.json. A candidate whose judge run fails gets <cand>/judge/error.json; after all candidates are done, the
    failures are raised together (a retry resumes: judged pairs are never asked again)."""

    j = spec.judge
    if j is None or not cands:
        return {}
    (set_name, evalset), settings = next(iter(eval_sets_by_name(spec).items())), j.settings(margin(spec))
    outs = {c.variant.name: run / c.variant.name / JUDGE_DIR for c in cands}
    for out in outs.values():
        (out / ERROR).unlink(missing_ok=True)
    reports: dict[str, Path] = {}
    errors: dict[str, BaseException] = {}
    try:
        with judge_endpoint(spec, run, log) as ep:
            for c in cands:
                name = c.variant.name
                log(f"{name}: judging {j.limit or 'all'} pairs of {set_name} against the baseline ({ep.model})")
                try:
                    run_judge(JudgeEndpoint(url=ep.url, model=ep.model, api_key=ep.api_key, model_hash=ep.model_hash),
                              settings, evalset=evalset, baseline=base.evals[set_name],
                              candidate=c.evals[set_name], out=outs[name])
                except Exception as exc:  # noqa: BLE001 - recorded for the gate, raised below
                    why = ep.dead()
                    errors[name] = QuantgateError(why, where=str(run / SERVER_DIR)) if why else exc
                    continue
                reports[name] = outs[name] / JUDGE_REPORT
                _log_report(name, load_judge_report(reports[name]), log)
    except Exception as exc:  # noqa: BLE001 - no judge to ask (server start, API key): every candidate left fails
        for name in outs:
            if name not in reports:
                errors.setdefault(name, exc)
    for name, failure in errors.items():
        write_json(outs[name] / ERROR, {"error": _short(failure), "type": type(failure).__name__,
                                        "detail": failure.render() if isinstance(failure, QuantgateError) else repr(failure)})
    if errors:
        first = next(iter(errors.values()))
        raise QuantgateError(f"the judge failed for {', '.join(errors)}: {_short(first)}",
                             where=str(outs[next(iter(errors))] / ERROR),
                             fix="the gate reports the missing judge evidence (REJECT when the policy requires the judge); "
                                 "fix the judge and re-run the release with the same --run-id to resume") from first
    return reports
