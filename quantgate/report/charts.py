"""Charts of the report and dashboard (matplotlib, Agg) as data: URIs, so the HTML stays self-contained."""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _uri(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    _plt().close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def png_uri(path: Path) -> str | None:
    """A PNG file as a data: URI; None when it is not a readable PNG."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        return None
    return "data:image/png;base64," + base64.b64encode(data).decode()


def forest(rows: Sequence[dict], title: str) -> str | None:
    """Deltas with their CIs, one line per row {label, delta, ci_low, ci_high}; None when nothing is plottable."""
    rows = [r for r in rows if r.get("delta") is not None]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 0.8 + 0.32 * len(rows)), layout="constrained")
    for i, r in enumerate(rows):
        lo, hi = r.get("ci_low"), r.get("ci_high")
        color = "#b22" if hi is not None and hi < 0 else ("#272" if lo is not None and lo > 0 else "#345")
        if lo is not None and hi is not None:
            ax.plot([lo, hi], [i, i], color=color, lw=2)
        ax.plot([r["delta"]], [i], "o", color=color)
    ax.axvline(0, color="#888", lw=1, ls="--")
    ax.set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("candidate - baseline (95% CI)")
    ax.set_title(title, fontsize=10)
    return _uri(fig)


def trade_off(points: Sequence[dict]) -> str | None:
    """Quality vs size vs speed: per candidate {name, size_ratio, throughput_ratio, deltas: [(metric, d, lo, hi)]}.
    Left: metric deltas against the size ratio; right: throughput ratio against the size ratio. Baseline at x=1."""
    pts = [p for p in points if p.get("size_ratio") is not None]
    if not pts:
        return None
    plt = _plt()
    fig, (qa, sa) = plt.subplots(1, 2, figsize=(10, 3.8), layout="constrained")
    metrics = sorted({m for p in pts for m, *_ in p["deltas"]})
    for k, metric in enumerate(metrics):
        err: list[list[float]]
        xs, ys, err = [], [], [[], []]
        for p in pts:
            for m, d, lo, hi in p["deltas"]:
                if m == metric and d is not None:
                    xs.append(p["size_ratio"] + 0.004 * (k - len(metrics) / 2))
                    ys.append(d)
                    err[0].append(d - lo if lo is not None else 0)
                    err[1].append(hi - d if hi is not None else 0)
        if xs:
            qa.errorbar(xs, ys, yerr=err, fmt="o", capsize=3, label=metric)
    qa.axhline(0, color="#888", lw=1, ls="--")
    qa.plot([1.0], [0.0], "k*", ms=10, label="baseline")
    qa.set_xlabel("size, candidate / baseline")
    qa.set_ylabel("quality delta (95% CI)")
    qa.set_title("quality vs size", fontsize=10)
    qa.legend(fontsize=7, loc="best")
    sa.plot([1.0], [1.0], "k*", ms=10, label="baseline")
    for p in pts:
        if p.get("throughput_ratio") is not None:
            sa.plot([p["size_ratio"]], [p["throughput_ratio"]], "o", ms=8)
            sa.annotate(p["name"], (p["size_ratio"], p["throughput_ratio"]), fontsize=8, xytext=(4, 4), textcoords="offset points")
        for _m, d, *_ in p["deltas"][:1]:
            qa.annotate(p["name"], (p["size_ratio"], d if d is not None else 0), fontsize=8, xytext=(4, -10),
                        textcoords="offset points")
    if not any(p.get("throughput_ratio") is not None for p in pts):
        sa.text(0.5, 0.5, "no performance probe figures", ha="center", va="center", transform=sa.transAxes)
    sa.axhline(1, color="#888", lw=1, ls="--")
    sa.set_xlabel("size, candidate / baseline")
    sa.set_ylabel("output tokens/s, candidate / baseline")
    sa.set_title("speed vs size", fontsize=10)
    return _uri(fig)


def trend(series: dict[str, list[tuple[str, float | None, float | None, float | None]]], title: str, ylabel: str) -> str | None:
    """Lines over runs: label -> [(run label, value, ci_low, ci_high)], in run order."""
    series = {k: v for k, v in series.items() if any(x[1] is not None for x in v)}
    if not series:
        return None
    plt = _plt()
    runs = list(dict.fromkeys(r for v in series.values() for r, *_ in v))
    fig, ax = plt.subplots(figsize=(7, 3), layout="constrained")
    for label, pts in series.items():
        xs = [runs.index(r) for r, y, *_ in pts if y is not None]
        ys = [y for _, y, *_ in pts if y is not None]
        ax.plot(xs, ys, "o-", label=label)
        band = [(runs.index(r), lo, hi) for r, y, lo, hi in pts if lo is not None and hi is not None]
        if band:
            ax.fill_between([b[0] for b in band], [b[1] for b in band], [b[2] for b in band], alpha=0.15)
    ax.set_xticks(range(len(runs)), [r[-16:] for r in runs], rotation=20, fontsize=7, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="best")
    return _uri(fig)


def perf_curves(curves: Sequence[dict | None]) -> str | None:
    """Goodput and latency against concurrency, one line per variant (quantgate.report.sections.perf_curve), with
    the SLO drawn: left, requests/s within the SLO (dotted: all requests/s would need the SLO met); right, TTFT p95
    (solid) and TPOT p95 (dashed) in ms, the SLO limits as horizontal lines. None when nothing is plottable."""
    drawn = [c for c in curves if c and c.get("levels")]
    if not drawn:
        return None
    plt = _plt()
    fig, (ga, la) = plt.subplots(1, 2, figsize=(10, 3.8), layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, c in enumerate(drawn):
        color = colors[i % len(colors)]
        xs = [lv["concurrency"] for lv in c["levels"]]
        good = [lv["goodput_rps"] for lv in c["levels"]]
        if any(g is not None for g in good):
            ga.plot(xs, [g if g is not None else float("nan") for g in good], "o-", color=color, label=c["name"])
        for key, style, what in (("ttft_p95_ms", "o-", "TTFT p95"), ("tpot_p95_ms", "s--", "TPOT p95")):
            ys = [lv[key] for lv in c["levels"]]
            if any(y is not None for y in ys):
                la.plot(xs, [y if y is not None else float("nan") for y in ys], style, color=color, label=f"{c['name']} {what}")
    slo = next((c["slo"] for c in drawn if c.get("slo")), None)
    if slo:
        for key, style, what in (("ttft_ms", "-", "TTFT SLO"), ("tpot_ms", "--", "TPOT SLO")):
            if slo.get(key) is not None:
                la.axhline(slo[key], color="#b22", lw=1, ls=style, label=f"{what} {slo[key]:g} ms")
    ticks = sorted({lv["concurrency"] for c in drawn for lv in c["levels"]})
    for ax in (ga, la):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("concurrency")
    ga.set_ylim(bottom=0)
    if not any(lv["goodput_rps"] is not None for c in drawn for lv in c["levels"]):
        ga.text(0.5, 0.5, "no SLO: no goodput", ha="center", va="center", transform=ga.transAxes)
    ga.set_ylabel("goodput, requests/s within the SLO")
    ga.set_title("goodput vs concurrency", fontsize=10)
    la.set_yscale("log")
    la.set_ylabel("ms (log)")
    la.set_title("latency vs concurrency", fontsize=10)
    ga.legend(fontsize=7, loc="best")
    la.legend(fontsize=6, loc="best")
    return _uri(fig)
