"""Markdown of a judge report (report.json -> report.md). Pure. Warnings come first and in plain words."""

from __future__ import annotations

import math

from quantgate.judge.reportfile import Calibration, JudgeReport, Rate


def _pct(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1%}"


def _ci(r: Rate | dict) -> str:
    r = r if isinstance(r, Rate) else Rate.model_validate(r)
    return f"{_pct(r.rate)} [{_pct(r.ci_low)}, {_pct(r.ci_high)}]"


def _quote(text: str | None) -> str:
    return "> " + (text or "(none)").replace("\n", "\n> ")


def warnings(report: JudgeReport) -> list[str]:
    out = []
    cal = report.calibration
    if not cal.reliable:
        out.append(f"**JUDGE UNRELIABLE**: {cal.reason} ({cal.correct}/{cal.n} calibration pairs right). "
                   "Its verdicts below do NOT count as evidence of quality.")
    if report.judge_not_stronger:
        out.append(f"**JUDGE NOT STRONGER THAN THE JUDGED MODEL**: {report.judge_not_stronger}. A judge should "
                   "be stronger than the model it judges; treat its verdicts as a smoke test only.")
    cmp_ = report.comparison
    if cmp_.invalid_rate > 0.1:
        out.append(f"**MANY INVALID VERDICTS**: {_pct(cmp_.invalid_rate)} of judged pairs had an unparsable verdict.")
    return out


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _calibration(cal: Calibration) -> list[str]:
    lines = ["## Calibration", "",
             f"Accuracy {_pct(cal.accuracy)} ({cal.correct}/{cal.n}, 95% CI [{_pct(cal.ci_low)}, "
             f"{_pct(cal.ci_high)}]), bar {_pct(cal.bar)}: **{'reliable' if cal.reliable else 'unreliable'}**.",
             "", "| corruption | n | right | accuracy | invalid |", "|---|---:|---:|---:|---:|"]
    return lines + [f"| {t} | {a.n} | {a.correct} | {_pct(a.accuracy)} | {a.invalid} |" for t, a in cal.by_type.items()]


def _comparison(report: JudgeReport) -> list[str]:
    cmp_ = report.comparison
    o, ni = cmp_.overall, cmp_.overall.non_inferiority
    lines = ["", "## Pairwise comparison (candidate vs baseline, both orders)", "",
             f"{cmp_.n_pairs} pairs ({cmp_.n_identical} identical answers counted as ties without asking), "
             f"{o.n} valid, {cmp_.invalid_pairs} invalid (invalid rate {_pct(cmp_.invalid_rate)}); "
             f"position consistency {_pct(cmp_.position_consistency)}.", "",
             "| category | n | win | tie | loss | invalid |", "|---|---:|---:|---:|---:|---:|",
             f"| **all** | {o.n} | {_ci(o.win)} | {_ci(o.tie)} | {_ci(o.loss)} | {o.invalid} |"]
    lines += [f"| {c} | {r.n} | {_ci(r.win)} | {_ci(r.tie)} | {_ci(r.loss)} | {r.invalid} |"
              for c, r in cmp_.by_category.items()]
    verdict = "non-inferior" if ni.non_inferior else "NOT shown non-inferior"
    if not report.counts_as_evidence:
        verdict += " (not evidence: the judge is unreliable)"
    conf = None if ni.alpha is None else 1 - ni.alpha
    lines += ["", f"Non-inferiority (win - loss > -{_num(ni.margin, '.2f')}): net {_num(ni.net, '+.3f')}, one-sided "
              f"{_num(conf, '.0%')} lower bound {_num(ni.lower_bound, '+.3f')}, p = {_num(ni.p_value, '.3g')}: "
              f"**{verdict}**."]
    p = report.parse
    return lines + ["", f"Verdict parsing: {p.get('strict', 0)} strict, {p.get('tolerant', 0)} tolerant, "
                    f"{p.get('invalid', 0)} invalid, {p.get('retried', 0)} needed the one retry."]


def _worst(report: JudgeReport) -> list[str]:
    if not report.comparison.worst_losses:
        return []
    lines = ["", "## Worst losses", ""]
    for w in report.comparison.worst_losses:
        drop = "" if w.score_drop is None else f", metric drop {w.score_drop:+.3f}"
        lines += [f"### {w.pair_id} ({w.category}{drop})", "", "Request:", _quote(w.question), "",
                  "Reference:", _quote(w.reference), "", "Baseline:", _quote(w.baseline), "",
                  "Candidate:", _quote(w.candidate), ""]
    return lines


def _human(h: dict | None) -> list[str]:
    """The human review section (`quantgate review import` output, kept as written)."""
    if not h:
        return []
    hr, agree = h["rates"], h["agreement"]
    return ["", "## Human review", "",
            f"{h['n_reviewed']} of {h['n_exported']} exported pairs reviewed ({h['n_blank']} left blank).", "",
            f"Human: candidate win {_ci(hr['win'])}, tie {_ci(hr['tie'])}, loss {_ci(hr['loss'])}.", "",
            f"Human-judge agreement: {_pct(agree['rate'])} over {agree['n']} pairs "
            f"(95% CI [{_pct(agree['ci_low'])}, {_pct(agree['ci_high'])}])."]


def render_markdown(report: JudgeReport) -> str:
    meta = report.meta
    lines = [f"# Judge report: {meta.get('candidate', {}).get('model')} vs {meta.get('baseline', {}).get('model')}", ""]
    lines += [f"- {w}" for w in warnings(report)] or ["- Judge calibrated above the bar; verdicts count as evidence."]
    judge = meta.get("judge", {})
    lines += ["", f"Judge: `{meta.get('judge_model')}` with {judge.get('name')} v{judge.get('version')} "
              f"({judge.get('kind')}); eval set {meta.get('evalset', {}).get('name')}.", ""]
    lines += _calibration(report.calibration) + _comparison(report) + _worst(report) + _human(report.human)
    return "\n".join(lines) + "\n"
