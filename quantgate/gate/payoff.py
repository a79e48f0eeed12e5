"""Pay-off checks of the gate (pure, no I/O): quantization must buy something where the workload runs.

The policy's `pay_off` section (quantgate.gate.policy.PayOffCheck) says
- `max_size_ratio`: the candidate's checkpoint at most this share of the baseline's (every workload);
- `workloads.<profile>.min_speedup`: for the workload profile the probe ran (quant_recipes/workloads.yaml: latency,
  throughput, fit), each of the profile's pay-off figures must show the candidate at least this many times as fast
  as the baseline. With `bound: ci` the interval's worst end decides, as for the quality checks: PASS when even the
  worst end reaches the demand, FAIL when even the best end misses it (shown slower than demanded), INCONCLUSIVE
  when the interval straddles it (more repeats would decide) or has no interval (fewer than 2 runs a side);
- `workloads.<profile>.min_kv_tokens_ratio`: more KV cache capacity (the `fit` profile);
- `min_throughput_ratio`: the older point check of output tokens/s at the highest common level.
Where the ratios come from a side-by-side window (pay_off.json `floor` and `window`, quantgate.perf.rounds), each
figure is read against the A/A floor too: a speed-up must clear the baseline-against-itself interval, a slow-down
must lie below it, and a floor that excludes 1 makes every speed check of the window INCONCLUSIVE.
Speed is the ratio candidate/baseline for a rate (tokens/s, goodput) and its inverse for a latency, so "1.25x" always
means a quarter faster. The check names carry the profile (`pay_off:latency/tpot_p50_ms`) and so does the decision.
"""

from __future__ import annotations

from quantgate.gate.models import Check, GateEvidence, Ratio
from quantgate.gate.policy import GatePolicy, PayOffCheck
from quantgate.gate.statistical import finite, gap_of, missing
from quantgate.perf.intervals import RatioCI
from quantgate.perf.models import SpeedFigure
from quantgate.perf.rounds import floor_clears, floor_drifted, floor_speeds, rounds_needed, speedup

LABELS = {"output_tok_s": "output tokens/s", "requests_s": "requests/s", "goodput_rps": "goodput (requests/s within "
          "the SLO)", "ttft_p50_ms": "TTFT p50", "ttft_p95_ms": "TTFT p95", "itl_p50_ms": "ITL p50", "itl_p95_ms":
          "ITL p95", "tpot_p50_ms": "TPOT p50", "tpot_p95_ms": "TPOT p95", "e2el_p50_ms": "request latency p50"}


def speed(ratio: float | None, lower_is_better: bool) -> float | None:
    """How many times as fast as the baseline a candidate/baseline ratio makes the candidate (perf.rounds.speedup);
    None for no ratio."""
    return None if ratio is None else speedup(ratio, lower_is_better)


def speed_check(f: SpeedFigure, workload: str, demand: float, *, bound: str, required: bool, file: str | None,
                floor: RatioCI | None = None, rounds: int | None = None) -> Check:
    """One pay-off figure against the profile's demand (see the module doc), read against the A/A `floor` of its
    window where there is one (`rounds`: the window's)."""
    name = f"pay_off:{workload}/{f.figure}"
    where = f"at concurrency {f.concurrency}" if f.concurrency is not None else "at each variant's best level"
    r = f.ratio
    if r.value is None:
        why = f"{workload} profile: no {LABELS[f.figure]} for both variants {where}"
        return missing(name, required, why, file, demand, bound)
    point = speed(r.value, f.lower_is_better)
    assert point is not None  # r.value is not None (above)
    ends = sorted(x for x in (speed(r.low, f.lower_is_better), speed(r.high, f.lower_is_better)) if x is not None)
    ci = f"{r.level:.0%} CI {r.low:.3f}-{r.high:.3f}, n={r.n_base}+{r.n_cand} runs" if len(ends) == 2 else "no interval"
    head = (f"{workload} profile: {LABELS[f.figure]} {where}, candidate/baseline {r.value:.3f} ({ci}): "
            f"{point:.2f}x the baseline's speed")
    if bound == "ci" and len(ends) < 2:
        return Check(name=name, measured=round(point, 4), limit=demand, bound="ci", required=required,
                     outcome="inconclusive" if required else "skipped", evidence_file=file,
                     reason=f"{head}; fewer than 2 runs a side give no interval: probe with more repeats")
    worst, best = (ends[0], ends[-1]) if bound == "ci" else (point, point)
    outcome = "pass" if worst >= demand else "fail" if best < demand else "inconclusive"
    tail = {"pass": f"worst end {worst:.2f}x >= {demand:.2f}x: it pays off",
            "fail": f"{'best end' if bound == 'ci' else 'measured'} {best:.2f}x < {demand:.2f}x: slower than the "
                    f"{workload} profile demands where it will be used",
            "inconclusive": f"the interval {worst:.2f}x-{best:.2f}x straddles {demand:.2f}x: more repeats would decide"}
    reason = f"{head}; {tail[outcome]}"
    if floor is not None:
        outcome, reason = _against_floor(outcome, reason, (point, worst, best), demand, floor, f.lower_is_better,
                                         rounds)
    return Check(name=name, measured=round(worst, 4), limit=demand, bound=bound, required=required,
                 outcome=outcome, evidence_file=file, reason=reason)


def _against_floor(outcome: str, reason: str, speeds: tuple[float, float, float], demand: float, floor: RatioCI,
                   lower_is_better: bool, rounds: int | None) -> tuple[str, str]:
    """A speed figure of a side-by-side window read against the baseline against itself (quantgate.perf.rounds):
    a floor off 1 says the load changed within the rounds (INCONCLUSIVE whatever the figure); a speed-up (a demand
    of 1x or more) passes only beyond the floor's interval, and a slow-down fails only below it; otherwise
    INCONCLUSIVE, with the rounds a speed-up needs. `speeds`: the point, worst and best end, as speed-ups."""
    point, worst, best = speeds
    clear, said = floor_clears(worst, floor, lower_is_better)
    ends = floor_speeds(floor, lower_is_better)
    if ends is None:  # a figure the floor could not measure on both runs: read as without a floor
        return outcome, f"{reason} ({said})"
    near, far = ends
    if floor_drifted(floor):
        return "inconclusive", (f"{reason}; but the {said} excludes 1: the load changed within the rounds, so no "
                                "speed figure of this window can be trusted; run the release again on a quieter slot")
    if outcome == "fail":
        if best < near:
            return outcome, f"{reason} ({said})"
        return "inconclusive", (f"{reason}, but not below the {said}: the baseline against itself varies as much; "
                                "more rounds (perf.rounds) would decide")
    if outcome != "pass" or demand < 1.0 or clear:
        return outcome, f"{reason} ({said})"
    need = rounds_needed(point, worst, far, rounds) if rounds else None
    more = f"needs about {need} rounds (perf.rounds)" if need else "a speed-up this small cannot clear it"
    return "inconclusive", (f"{reason}, but not beyond the {said}: the baseline against itself varies as much; "
                            f"{more}")


def _ratio_check(name: str, got: Ratio | None, limit: float, at_most: bool, p: PayOffCheck, why: tuple[str, str | None]) -> Check:
    if got is None or not finite(got.value):
        return missing(name, p.required, why[0], why[1] or (got.file if got else None), limit)
    v = got.value
    ok = v <= limit if at_most else v >= limit
    rel = ("<=" if ok else ">") if at_most else (">=" if ok else "<")
    return Check(name=name, measured=round(v, 6), limit=limit, required=p.required,
                 outcome="pass" if ok else "fail", evidence_file=got.file, reason=f"candidate / baseline {v:.3f} {rel} {limit:.3f}")


def _speed_checks(policy: GatePolicy, p: PayOffCheck, ev: GateEvidence) -> list[Check]:
    figs = ev.pay_off
    if figs is None:
        why, file = gap_of(ev, "throughput", "no performance probe figures (pay_off.json)")
        return [missing("pay_off:speed", p.required, f"{why}: the workload's speed cannot be judged", file, None)]
    workload = figs.workload
    if workload is None:
        return [missing("pay_off:speed", p.required, "the probe ran no workload profile (perf.json without "
                        "workload.profile): probe with `quantgate perf --workload W`", figs.file, None)]
    demand = p.workloads.get(workload)  # type: ignore[call-overload]
    if demand is None or demand.min_speedup is None:
        return [Check(name=f"pay_off:{workload}/speed", measured=None, limit=None, required=False, outcome="skipped",
                      evidence_file=figs.file, reason=f"the policy demands no speed for the {workload} profile")]
    if not figs.decide:
        return [missing(f"pay_off:{workload}/speed", p.required, f"the {workload} probe has no pay-off figure",
                        figs.file, demand.min_speedup)]
    bound = p.bound or policy.bound
    rounds = figs.window.rounds if figs.window else None
    return [speed_check(f, workload, demand.min_speedup, bound=bound, required=p.required, file=figs.file,
                        floor=figs.floor_of(f), rounds=rounds) for f in figs.decide]


def pay_off_checks(policy: GatePolicy, ev: GateEvidence) -> list[Check]:
    """Every pay-off check the policy's `pay_off` section enables (see the module doc)."""
    p = policy.pay_off
    assert p is not None
    out = []
    if p.max_size_ratio is not None:
        out.append(_ratio_check("pay_off:size_ratio", ev.size_ratio, p.max_size_ratio, True, p,
                                gap_of(ev, "size", "no size ratio (candidate / baseline)")))
    if p.min_throughput_ratio is not None:
        out.append(_ratio_check("pay_off:throughput_ratio", ev.throughput_ratio, p.min_throughput_ratio, False, p,
                                gap_of(ev, "throughput", "no throughput ratio (candidate / baseline)")))
    if p.workloads:
        out += _speed_checks(policy, p, ev)
    figs = ev.pay_off
    demand = p.workloads.get(figs.workload) if figs and figs.workload else None  # type: ignore[call-overload]
    if demand is not None and demand.min_kv_tokens_ratio is not None:
        kv = Ratio(value=figs.kv_tokens_ratio, file=figs.file) if figs and figs.kv_tokens_ratio is not None else None
        out.append(_ratio_check(f"pay_off:{figs.workload}/kv_tokens_ratio", kv, demand.min_kv_tokens_ratio, False, p,  # type: ignore[union-attr]
                                ("no KV capacity of both variants in the server logs", None)))
    return out


def applied_workload(ev: GateEvidence) -> str | None:
    """The workload profile the pay-off checks judged (the one the probe ran)."""
    return ev.pay_off.workload if ev.pay_off is not None else None
