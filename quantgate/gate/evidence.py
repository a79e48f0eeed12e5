"""Collect one candidate's evidence from a release run folder into `quantgate.gate.checks.GateEvidence` (adapter).

Files read (written by the release flow, quantgate/release/steps.py, and the tools it calls):
    <run>/compare/<candidate>.json        {eval set: quantgate.evals.run.compare_dirs output}: metrics, categories
    <run>/<variant>/evidence.json         variant (scheme, size_bytes), eval run folders; the baseline's parity;
                                          serve_command: a KV cache dtype other than the baseline's makes
                                          the recall check required (GateEvidence.kv_cache)
    <eval run>/summary.json, manifest.json  error rate per eval set (a 'failed' status carries one too)
    <run>/<candidate>/quantization.json   scheme, compression ratio (<run>/summary.json: size ratio) if not there
    <run>/<candidate>/recall/delta.json   `quantgate recall --baseline` output; with both requests.jsonl files a
                                          paired bootstrap CI of the recall delta is computed here
    <run>/<candidate>/judge/report.json   `quantgate judge` report (calibration, non-inferiority)
    <run>/<candidate>/judge/error.json    why the release's judge step failed (newer than any report.json there):
                                          the judge slot's gap then carries that reason
    <run>/<candidate>/pay_off.json        quantgate.perf.compare output: workload profile, pay-off figures
    <run>/fidelity/<candidate>.json       per-sample fidelity against the baseline (or a streaming look's prefix)
    <run>/fidelity/floor.json             the same for the baseline against itself on another execution path
    <run>/<candidate>/error.json          the candidate's vLLM server could not start or died (release flow): the
                                          gate rejects it with that reason (a `serving` check), whatever else is there
Evidence that cannot exist for a variant (evidence.json's `not_applicable`: an endpoint has no checkpoint files, an
endpoint baseline no local weights for engine parity) becomes a gap marked not applicable, with the variant's reason,
which the policy's `not_applicable` accepts or not (quantgate.gate.checks); a step skipped on purpose
(`skipped`), a gap marked decided early.
The recall folder, judge report and pay-off figures can be given directly instead. A file that is missing,
unreadable or of the wrong shape becomes an entry of `GateEvidence.gaps` with the reason: never an exception.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from quantgate.base.runfiles import (COMPARE_DIR, DELTA, ERROR, EVIDENCE, FIDELITY_FLOOR, JUDGE_DIR, JUDGE_REPORT,
                                     MANIFEST, PAY_OFF, QUANTIZATION, REQUESTS, SUMMARY)
from quantgate.base.errors import QuantgateError
from quantgate.base.pairedstat import PairedStat
from quantgate.base.runinfo import load_run_record
from quantgate.base.stats import num as _num
from quantgate.base.typedfile import RunFileError
from quantgate.evals.compare import paired_stats
from quantgate.evals.comparefile import Comparison, load_comparison
from quantgate.evals.manifestfile import parse_manifest
from quantgate.fidelity.record import load_fidelity_record
from quantgate.gate import kinds
from quantgate.gate.checks import evaluate
from quantgate.gate.decisionfile import policy_ref, write_decision
from quantgate.gate.failurefile import serving_failure, with_failure
from quantgate.gate.fidelityevidence import fidelity_evidence
from quantgate.gate.looks import spend
from quantgate.gate.repairfile import repair_note
from quantgate.gate.models import (Decision, Gap, GateEvidence, JudgeEvidence, Look,
                                   KvCacheChange, ParityEvidence, RateEvidence, Ratio)
from quantgate.gate.policy import load_policy
from quantgate.gate.sizeratio import size_ratio
from quantgate.gate.summaryfile import load_summary
from quantgate.judge.reportfile import load_judge_report
from quantgate.perf.payofffile import PayOff, load_pay_off
from quantgate.quantize.manifest import read_quantization
from quantgate.recall.resultfile import load_recall_delta

BASELINE = "baseline"


class _Bad(Exception):
    """A file that cannot serve as evidence; the message is the reason."""


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _Bad(f"missing file {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise _Bad(f"cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise _Bad(f"corrupt JSON in {path}: {exc.msg} at line {exc.lineno}") from None


def _stat(d: PairedStat, higher: bool, file: Path, binary: bool = False) -> PairedStat:
    """A comparison file's statistic as the gate reads it: a mean over no sample (NaN) as None, and what it is."""
    return PairedStat(n=d.n, **{k: _num(getattr(d, k)) for k in ("base_mean", "cand_mean", "delta", "ci_low", "ci_high",
                                                                  "sd_diff", "discordance", "p_harm")},
                      higher_is_better=higher, binary=binary, file=str(file))


def candidates(run: Path | str) -> list[str]:
    """Candidates of the run: those with a comparison, and the spec's schemes and `candidates` that have a folder in it
    (their comparison may be missing: the gate then rejects them), in the spec's scheme order (run.json)."""
    run = Path(run)
    try:
        spec = load_run_record(run).spec
        order = [str(s) for s in spec["schemes"]] + [str(c["name"]) for c in spec.get("candidates") or []]
    except (QuantgateError, KeyError, TypeError):
        order = []
    found = {p.stem for p in (run / COMPARE_DIR).glob("*.json")} | {s for s in order if (run / s).is_dir()}
    return sorted(found, key=lambda c: (order.index(c) if c in order else len(order), c))


def _compare(run: Path, cand: str, ev: dict) -> None:
    path = run / COMPARE_DIR / f"{cand}.json"
    data = load_comparison(path)
    if not data.root:
        raise _Bad(f"{path} holds no eval set comparison")
    comparison_evidence(data, path, ev)


def comparison_evidence(data: Comparison | Mapping[str, Mapping], path: Path, ev: dict) -> None:
    """Fill ev's metrics, categories and pooled slots from {eval set: quantgate.evals.compare output}."""
    data = data if isinstance(data, Comparison) else Comparison.model_validate(data)
    for set_name, report in data.root.items():
        for metric, m in report.metrics.items():
            ev["metrics"].setdefault(set_name, {})[metric] = _stat(m.overall, m.higher_is_better, path, m.binary)
            for cat, d in m.by_category.items():
                ev["categories"].setdefault(set_name, {}).setdefault(cat, {})[metric] = _stat(d, m.higher_is_better,
                                                                                               path, m.binary)
        if report.pooled is not None:
            ev["pooled"][set_name] = _stat(report.pooled, True, path, True)


def _eval_error_rate(variant: str, set_name: str, folder: Path) -> RateEvidence:
    if (summary := folder / SUMMARY).is_file():
        s = _read(summary)
        return RateEvidence(name=f"{variant}/{set_name}", rate=_num(s.get("error_rate")), n=int(s.get("n_samples") or 0),
                            file=str(summary))
    manifest = parse_manifest(_read(folder / MANIFEST))  # content that does not fit its model: a gap (_try)
    if manifest.status == "failed" and _num(manifest.error_rate) is not None:
        return RateEvidence(name=f"{variant}/{set_name}", rate=_num(manifest.error_rate),
                            n=int(manifest.n_samples or 0), file=str(folder / MANIFEST))
    raise _Bad(f"eval run {folder} has no summary.json (status {manifest.status!r})")


def _variant(run: Path, name: str, ev: dict) -> dict:
    """evidence.json of a variant; its eval sets' error rates go into ev['error_rates']."""
    path = run / name / EVIDENCE
    data = _read(path)
    problems = []
    for set_name, folder in sorted((data.get("evals") or {}).items()):
        try:
            ev["error_rates"].append(_eval_error_rate(name, set_name, Path(folder)))
        except _Bad as exc:
            problems.append(str(exc))
    if problems:
        _gap(ev, "error_rate", "; ".join(problems), str(path))
    return data


def kv_cache_change(base: Mapping | None, cand: Mapping | None, file: str) -> KvCacheChange | None:
    """The KV cache dtypes of the two servers (--kv-cache-dtype in evidence.json's serve_command; absent: auto) when
    they differ; None when they match or a command is not known."""
    def dtype(ev: Mapping | None) -> str | None:
        cmd = (ev or {}).get("serve_command")
        if not isinstance(cmd, list) or not cmd:  # no command (e.g. an endpoint): the dtype is not known
            return None
        flags = {a.split("=", 1)[0]: (a.split("=", 1)[1] if "=" in a else (cmd[i + 1] if i + 1 < len(cmd) else ""))
                 for i, a in enumerate(cmd) if isinstance(a, str) and a.startswith("--kv-cache-dtype")}
        return str(flags.get("--kv-cache-dtype", "auto"))
    b, c = dtype(base), dtype(cand)
    return KvCacheChange(baseline=b, candidate=c, file=file) if b and c and b != c else None


def _gap(ev: dict, slot: str, reason: str, file: str | None = None) -> None:
    old = ev["gaps"].get(slot)
    ev["gaps"][slot] = Gap(reason=f"{old.reason}; {reason}" if old else reason, file=(old.file if old else None) or file)


def _not_applicable(ev: dict, slot: str, variants: list[dict | None], file: str) -> bool:
    """Mark `slot` not applicable, with the reasons, where the variants' evidence.json say so; True when marked."""
    why = [str(r) for v in variants if isinstance(v, Mapping) and (r := (v.get("not_applicable") or {}).get(slot))]
    if why:
        ev["gaps"][slot] = Gap(reason="; ".join(why), file=file, not_applicable=True)
    return bool(why)


def _try(ev: dict, slot: str, fn, *args) -> Any:
    try:
        return fn(*args)
    except _Bad as exc:
        _gap(ev, slot, str(exc))
    except RunFileError as exc:  # a typed run-folder file that does not load (quantgate.base.typedfile)
        _gap(ev, slot, f"{exc.message} ({exc.where})", exc.path)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        _gap(ev, slot, f"unexpected content ({type(exc).__name__}: {exc})")
    return None


def _scheme_and_size(run: Path, cand: str, base_ev: dict | None, cand_ev: dict | None, ev: dict) -> None:
    cv = (cand_ev or {}).get("variant") or {}
    bv = (base_ev or {}).get("variant") or {}
    quant = _try(ev, "scheme", read_quantization, run / cand / QUANTIZATION) if not cv.get("scheme") else None
    ev["scheme"] = cv.get("scheme") or (quant.scheme if quant else None)
    if ev["scheme"]:
        ev["gaps"].pop("scheme", None)
    try:
        stated = load_summary(run / SUMMARY).candidates[cand].size_ratio
    except (QuantgateError, KeyError):
        stated = None
    found = size_ratio(cv.get("size_bytes"), bv.get("size_bytes"), stated, quant.compression_ratio if quant else None)
    if found is not None:
        files = {"sizes": run / cand / EVIDENCE, "stated": run / SUMMARY,
                 "compression": run / cand / QUANTIZATION}
        ev["size_ratio"] = Ratio(value=found[0], file=str(files[found[1]]))
        return
    _gap(ev, "size", "no checkpoint sizes in evidence.json, summary.json or quantization.json", str(run / cand))


def _recall(folder: Path, ev: dict) -> None:
    path = folder / DELTA
    delta = load_recall_delta(path)
    whole = delta.overall
    pairs: dict[str, list[tuple[float, float]]] = {}
    base_dir = Path(delta.baseline) if delta.baseline else None
    if base_dir is not None and (base_dir / REQUESTS).is_file() and (folder / REQUESTS).is_file():
        pairs = _recall_pairs(base_dir / REQUESTS, folder / REQUESTS)
    for measure in ("recall", "exact"):
        key = "" if measure == "recall" else "_exact"
        harm = paired_harm(pairs.get(measure) or [], binary=measure == "exact")
        base, cand, diff = (_num(getattr(whole, f"{side}{key}")) for side in ("base", "cand", "delta"))
        ev["recall"][measure] = PairedStat(n=delta.n_paired, base_mean=base, cand_mean=cand, delta=diff,
                                           binary=measure == "exact", file=str(path), **harm)
    for key, at in sorted(pairs.items()):
        if key.startswith("recall@") and at:
            bm, cm = sum(x for x, _ in at) / len(at), sum(y for _, y in at) / len(at)
            ev["recall_by_length"][key.removeprefix("recall@")] = PairedStat(
                n=len(at), base_mean=bm, cand_mean=cm, delta=cm - bm, file=str(path), **paired_harm(at, binary=False))
    if not pairs:
        _gap(ev, "recall", f"per-request records of the baseline ({base_dir}) or candidate ({folder}) are missing: "
             "no confidence interval", str(path))
    n_err = delta.n_error_excluded
    n_all = n_err + delta.n_paired
    if n_all:
        ev["error_rates"].append(RateEvidence(name="recall", rate=n_err / n_all, n=n_all, file=str(path)))


class _Measure:
    def __init__(self, binary: bool):
        self.higher_is_better, self.binary = True, binary


def paired_harm(pairs: list[tuple[float, float]], binary: bool) -> dict[str, float | None]:
    """The paired statistics the gate's harm test and power statement need, from (baseline, candidate) pairs
    (quantgate.evals.compare.paired_stats, as for the eval sets)."""
    if not pairs:
        return {}
    st = paired_stats(pairs, _Measure(binary))
    return {k: _num(getattr(st, k)) for k in ("ci_low", "ci_high", "sd_diff", "p_harm", "discordance")}


def _recall_pairs(base: Path, cand: Path) -> dict[str, list[tuple[float, float]]]:
    def load(p: Path) -> dict[str, dict]:
        try:
            return {r["id"]: r for r in (json.loads(ln) for ln in p.read_text(encoding="utf-8").splitlines() if ln.strip())}
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise _Bad(f"unreadable {p}: {exc}") from None

    b, c = load(base), load(cand)
    ids = sorted(i for i in set(b) & set(c) if b[i].get("error") is None and c[i].get("error") is None)
    out = {"recall": [(float(b[i]["recall"]), float(c[i]["recall"])) for i in ids],
           "exact": [(float(bool(b[i]["exact"])), float(bool(c[i]["exact"]))) for i in ids]}
    for i in ids:  # each context length on its own: damage confined to long contexts is diluted in the overall
        if b[i].get("length") is not None:
            out.setdefault(f"recall@{b[i]['length']}", []).append((float(b[i]["recall"]), float(c[i]["recall"])))
    return out


def _judge(path: Path, ev: dict) -> None:
    failed = path.with_name(ERROR)
    if failed.is_file() and (not path.is_file() or failed.stat().st_mtime >= path.stat().st_mtime):
        err = _read(failed)
        raise _Bad(f"the judge run failed ({failed}): {err.get('error') if isinstance(err, dict) else err}")
    r = load_judge_report(path)
    ni = r.comparison.overall.non_inferiority
    ev["judge"] = JudgeEvidence(counts_as_evidence=r.counts_as_evidence, reason=r.calibration.reason,
                                not_stronger=r.judge_not_stronger, n=ni.n, net=_num(ni.net),
                                judged=r.comparison.n_judged, invalid=r.comparison.invalid_pairs,
                                lower_bound=_num(ni.lower_bound), file=str(path))


def _fidelity_pair(run: Path, cand: str, level: float, growth: float, ev: dict) -> None:
    for slot, path, weight in (("fidelity", run / "fidelity" / f"{cand}.json", growth),
                               ("floor", run / FIDELITY_FLOOR, 1.0)):
        rec = load_fidelity_record(path)
        if not rec.samples:
            raise _Bad(f"{path} holds no scored sample")
        if rec.stream is not None:
            ev["stream"], level, weight = rec.stream, 1 - 2 * rec.stream.alpha, 1.0
        ev[slot] = fidelity_evidence(rec.samples, level, str(path), estimator=rec.kl_estimator, growth=weight)


def _pay_off(source: Mapping | Path, ev: dict) -> None:
    file = None if isinstance(source, Mapping) else str(source)
    doc = PayOff.model_validate(source) if isinstance(source, Mapping) else load_pay_off(source)
    if doc.has_figures:  # a workload profile's figures with intervals (quantgate.perf.compare)
        ev["pay_off"] = doc.figures(file)
    value = _num(doc.throughput_ratio)
    if value is None:
        raise _Bad(f"no numeric 'throughput_ratio' in {file or 'the pay-off figures'}")
    ev["throughput_ratio"] = Ratio(value=value, file=doc.file or file)
    if _num(doc.size_ratio) is not None:  # an explicit figure wins over the checkpoint sizes
        ev["size_ratio"] = Ratio(value=_num(doc.size_ratio), file=doc.file or file)


def collect(run: Path | str, candidate: str, *, recall_dir: Path | str | None = None,
            judge_report: Path | str | None = None, pay_off: Mapping | Path | str | None = None,
            fidelity_level: float = 0.90, fidelity_growth: float = 1.0) -> GateEvidence:
    """Evidence of `candidate` (a scheme id, the variant's folder name) from a run folder; see the module docstring.

    `pay_off` may be a mapping {"throughput_ratio": float, "size_ratio"?: float, "file"?: str} from the flow.
    Fidelity intervals at `fidelity_level` (two-sided: 1 - 2 * alpha); pooled, eval prompts weigh `fidelity_growth`."""
    run = Path(run)
    ev: dict[str, Any] = {"candidate": candidate, "metrics": {}, "categories": {}, "pooled": {}, "recall": {},
                          "recall_by_length": {}, "error_rates": [], "gaps": {}}
    _try(ev, "compare", _compare, run, candidate, ev)
    _try(ev, "fidelity", _fidelity_pair, run, candidate, fidelity_level, fidelity_growth, ev)
    base_ev = _try(ev, "error_rate", _variant, run, BASELINE, ev)
    cand_ev = _try(ev, "error_rate", _variant, run, candidate, ev)
    parity = (base_ev or {}).get("parity")
    if isinstance(parity, Mapping) and parity.get("verdict"):
        ev["parity"] = ParityEvidence(verdict=str(parity["verdict"]), reason=str(parity.get("reason") or ""),
                                      file=str(run / BASELINE / EVIDENCE))
    elif not _not_applicable(ev, "parity", [base_ev], str(run / BASELINE / EVIDENCE)):
        _gap(ev, "parity", "no engine parity verdict in the baseline's evidence.json", str(run / BASELINE / EVIDENCE))
    _scheme_and_size(run, candidate, base_ev, cand_ev, ev)
    ev["kv_cache"] = kv_cache_change(base_ev, cand_ev, str(run / candidate / EVIDENCE))
    _try(ev, "recall", _recall, Path(recall_dir) if recall_dir else run / candidate / "recall", ev)
    _try(ev, "judge", _judge, Path(judge_report) if judge_report else run / candidate / JUDGE_DIR / JUDGE_REPORT, ev)
    ev["kinds"] = kinds.read(run, candidate)  # the comparisons of the registered kinds (quantgate.gate.kinds)
    source = pay_off if pay_off is not None else run / candidate / PAY_OFF
    if isinstance(source, (str, Path)):
        source = Path(source)
    if isinstance(source, Mapping) or source.is_file():
        _try(ev, "throughput", _pay_off, source, ev)
    else:
        _gap(ev, "throughput", f"no performance probe figures ({source})", str(source))
    if _not_applicable(ev, "size", [base_ev, cand_ev], str(run / candidate / EVIDENCE)):
        ev.pop("size_ratio", None)  # no files on one side: no ratio, whatever else (the probe's figures) stated
    decided, file = (cand_ev or {}).get("decided"), str(run / candidate / EVIDENCE)
    for step, why in ((cand_ev or {}).get("skipped") or {}).items():  # decided early (quantgate.release.early)
        for slot in _slots_of(step, ev):
            ev["gaps"][slot] = Gap(reason=f"not measured: {why}", decided_early=True, file=file)
    if decided and ev.get("judge") is None:  # the judge skipped it (release.steps.judge)
        ev["gaps"]["judge"] = Gap(reason=f"not judged: decided early: REJECT by fidelity ({decided})",
                                  decided_early=True, file=file)
    return GateEvidence(**ev)


def _slots_of(step: str, ev: dict) -> list[str]:
    """The evidence slots a step skipped on purpose leaves empty (skipped eval sets: their error rates, too, when
    no side has one)."""
    return {"perf": ["throughput"], "evals": ["compare"] + ([] if ev["error_rates"] else ["error_rate"])}.get(step, [step])


def gate_run(run: Path | str, policy_path: Path | str, candidate_names: list[str] | None = None, *,
             out: Path | str | None = None, **how: Any) -> tuple[list[Decision], Path]:
    """`decide_run` (`how`: its keywords), then decision.json written (`out`: there instead): `quantgate gate`."""
    decisions = decide_run(run, policy_path, candidate_names, **how)
    return decisions, write_decision(Path(run), decisions, out)


def decide_run(run: Path | str, policy_path: Path | str, candidate_names: list[str] | None = None, *,
               pay_off: Mapping[str, Mapping] | None = None, recall_dirs: Mapping[str, Path | str] | None = None,
               judge_reports: Mapping[str, Path | str] | None = None,
               looks: tuple[list[int], int] | None = None,
               split: Mapping[str, Look] | None = None) -> list[Decision]:
    """Load the policy and gate each candidate of the run (default: `candidates(run)`); nothing is written.

    Per candidate, optional: `pay_off` {"throughput_ratio": float, ...} from the performance probe, the recall
    folder and the judge report when they are not at the default places (see `collect`). `looks`: (the fidelity
    sample sizes planned at each look, this look's size) of a sequential design: the fidelity bounds are judged at
    this look's share of the policy's alpha (quantgate.gate.looks); None: one look at the full alpha. `split`:
    candidate -> its look when a repair rung splits the alpha (quantgate.gate.looks.repair_split); a repaired
    candidate's decision says what it keeps (quantgate.gate.repairfile).
    Raises ConfigError for a bad policy and QuantgateError when the run has no candidate to gate."""
    policy = load_policy(policy_path)
    run = Path(run)
    if not run.is_dir():
        raise QuantgateError("run folder not found", where=str(run), fix="give a results/runs/<run-id> folder")
    names = candidate_names or candidates(run)
    if not names:
        raise QuantgateError("no candidate to gate: the run has no compare/<candidate>.json", where=str(run),
                             fix="name the candidates to gate, or finish the release's compare step first")
    ref: dict[str, str | int] = {"name": policy.name, "version": policy.version, **policy_ref(policy_path)}
    planned = spend(policy.fidelity.alpha, *looks) if looks is not None and policy.fidelity else None
    decisions = []
    for name in names:
        look = (split or {}).get(name, planned) if policy.fidelity else None
        level = 1 - 2 * (look.alpha if look else policy.fidelity.alpha) if policy.fidelity else 0.90
        d = evaluate(policy, collect(run, name, pay_off=(pay_off or {}).get(name), recall_dir=(recall_dirs or {}).get(name),
                                     judge_report=(judge_reports or {}).get(name), fidelity_level=level,
                                     fidelity_growth=look.growth if look else 1.0), ref, look=look)
        if (note := repair_note(run, name)) is not None:
            d = d.model_copy(update={"repair": note})
        decisions.append(with_failure(d, failed) if (failed := serving_failure(run, name)) else d)
    return decisions
