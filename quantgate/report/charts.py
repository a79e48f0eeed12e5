"""Charts of the report and dashboard (matplotlib, Agg) as inline SVG, so the HTML stays self-contained and a
browser (or a test) can read each chart's labels and marks from the page: text stays text (svg.fonttype none), and
the marks a reader must find carry ids (`slice-<measure>-<i>`, `limit-<measure>-<i>` in the fidelity chart).
Every id is prefixed with the chart's name, so several charts on one page do not share one. A chart with nothing
to draw is None (the page says so in words instead of drawing empty axes); legends sit outside the axes, where
they cover no data, and candidates are told apart by the legend rather than by labels placed on the points."""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Sequence
from pathlib import Path

COLOURS = {"pass": "#17702a", "fail": "#b22222", "inconclusive": "#6a4fb3", None: "#566372"}
MAX_TICKS = 8  # run labels on a trend's axis; more runs show every k-th label


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _svg(fig, name: str) -> str:
    """The figure as an <svg> element for inline use, its ids prefixed with `name`."""
    plt = _plt()
    buf = io.StringIO()
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": name}):
        fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]  # no XML declaration or doctype inside HTML
    return re.sub(r'(\bid="|url\(#|href="#)', rf"\g<1>{name}-", svg)


def png_uri(path: Path) -> str | None:
    """A PNG file as a data: URI; None when it is not a readable PNG."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        return None
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _legend_outside(ax, **kw) -> None:
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, **kw)


def forest(rows: Sequence[dict], title: str, name: str = "forest") -> str | None:
    """Deltas with their CIs, one line per row {label, delta, ci_low, ci_high}; None when nothing is plottable."""
    rows = [r for r in rows if r.get("delta") is not None]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 0.8 + 0.26 * len(rows)), layout="constrained")
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
    return _svg(fig, name)


def fidelity_slices(rows: Sequence[dict], name: str = "fidelity") -> str | None:
    """Fidelity by slice (quantgate.report.fidelitysection.slices): left KL, right top-1 agreement, one row per
    slice (the pooled sample first), labelled with the one-sided level of its bound: a dot at the mean, a bar to the
    bound the gate judged, the slice's limit as a red tick, coloured by the check's outcome (a failing slice red,
    with its label in red)."""
    measures = [(k, t) for k, t in (("kl", "KL, nats/token (upper bound judged)"),
                                    ("top1", "top-1 agreement (lower bound judged)")) if any(r["measure"] == k for r in rows)]
    if not measures:
        return None
    plt = _plt()
    names = list(dict.fromkeys(r["slice"] for r in rows))
    fig, axes = plt.subplots(1, len(measures), figsize=(10, 1.1 + 0.3 * len(names)), layout="constrained",
                             squeeze=False)
    for ax, (key, title) in zip(axes[0], measures):
        for r in (r for r in rows if r["measure"] == key):
            i, color = names.index(r["slice"]), COLOURS.get(r["outcome"], COLOURS[None])
            (dot,) = ax.plot([r["mean"]], [i], "o", color=color, ms=5)
            dot.set_gid(f"slice-{key}-{i}")
            if r["bound"] is not None:
                ax.plot([r["mean"], r["bound"]], [i, i], color=color, lw=2)
                ax.plot([r["bound"]], [i], "|", color=color, ms=9, mew=2)
            if r["limit"] is not None:
                (lim,) = ax.plot([r["limit"], r["limit"]], [i - 0.4, i + 0.4], color="#b22222", lw=1.5)
                lim.set_gid(f"limit-{key}-{i}")
        levels = {r["slice"]: r.get("level") for r in rows if r["measure"] == key}
        ax.set_yticks(range(len(names)), [_with_level(n, levels.get(n)) for n in names], fontsize=8)
        for label, slice_name in zip(ax.get_yticklabels(), names):
            if any(r["slice"] == slice_name and r["outcome"] == "fail" for r in rows):
                label.set_color(COLOURS["fail"])
        ax.set_ylim(len(names) - 0.5, -0.5)
        if key == "kl":
            ax.set_xlim(left=0)
        else:
            ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:.0%}"))
        ax.set_title(title, fontsize=9)
        ax.grid(axis="x", color="#eee")
    handles = [plt.Line2D([], [], color=c, marker="o", lw=2, label=o) for o, c in COLOURS.items() if o]
    handles.append(plt.Line2D([], [], color="#b22222", lw=1.5, label="limit"))
    _legend_outside(axes[0][-1], handles=handles)
    return _svg(fig, name)


def _with_level(name: str, level: float | None) -> str:
    return name if level is None else f"{name} ({level * 100:.4g}%)"


def trade_off(points: Sequence[dict], name: str = "trade-off") -> str | None:
    """Quality vs size and speed vs size, per candidate {name, size_ratio, throughput_ratio, deltas: [(metric, d,
    lo, hi)]}, each panel drawn only when it has data (None when neither has). Quality: each metric's delta with
    its CI against the size ratio, the metrics spread side by side around their candidate's x over most of the room
    between candidates, the baseline the dashed line at 0; speed: the throughput ratio, the baseline the star at
    (1, 1)."""
    pts = [p for p in points if p.get("size_ratio") is not None]
    quality = [p for p in pts if any(d is not None for _m, d, *_ in p["deltas"])]
    speed = [p for p in pts if p.get("throughput_ratio") is not None]
    panels = [k for k, has in (("quality", quality), ("speed", speed)) if has]
    if not panels:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels) + 1.6, 3.6), layout="constrained", squeeze=False)
    markers = "osD^vP"
    for ax, panel in zip(axes[0], panels):
        xs = [p["size_ratio"] for p in (quality if panel == "quality" else speed)] + ([] if panel == "quality" else [1.0])
        gaps = [b - a for a, b in zip(sorted(set(xs)), sorted(set(xs))[1:])]
        step = min(gaps, default=0.2)
        if panel == "quality":
            _quality(ax, quality, step, markers)
        else:
            for k, p in enumerate(speed):
                ax.plot([p["size_ratio"]], [p["throughput_ratio"]], markers[k % len(markers)], color="k", ms=7,
                        label=p["name"])
            ax.plot([1.0], [1.0], "k*", ms=11, label="baseline")
            ax.axhline(1, color="#888", lw=1, ls="--")
            ax.set_ylabel("output tokens/s, candidate / baseline")
            ax.set_title("speed vs size", fontsize=10)
            _legend_outside(ax)
        ax.set_xlim(min(xs) - 0.5 * step, max(xs) + 0.5 * step)
        ax.set_xlabel("size, candidate / baseline")
    return _svg(fig, name)


def _quality(ax, pts: Sequence[dict], step: float, markers: str) -> None:
    metrics = sorted({m for p in pts for m, d, *_ in p["deltas"] if d is not None})
    colors = _plt().rcParams["axes.prop_cycle"].by_key()["color"]
    for k, p in enumerate(pts):
        for j, metric in enumerate(metrics):
            for m, d, lo, hi in p["deltas"]:
                if m != metric or d is None:
                    continue
                x = p["size_ratio"] + 0.7 * step * (j - (len(metrics) - 1) / 2) / max(len(metrics), 1)
                err = [[d - lo if lo is not None else 0], [hi - d if hi is not None else 0]]
                ax.errorbar([x], [d], yerr=err, fmt=markers[k % len(markers)], color=colors[j % len(colors)],
                            capsize=2, ms=5, label=metric if k == 0 else None)
    for k, p in enumerate(pts):  # the candidates' markers, in black, for the legend
        ax.plot([], [], markers[k % len(markers)], color="k", label=p["name"])
    ax.axhline(0, color="#888", lw=1, ls="--", label="baseline")
    ax.set_ylabel("quality delta (95% CI)")
    ax.set_title("quality vs size", fontsize=10)
    _legend_outside(ax)


def run_ticks(ax, labels: Sequence[str]) -> None:
    """Run labels on a categorical x axis, horizontal, at most MAX_TICKS of them (every k-th, the last always)."""
    step = max(1, -(-len(labels) // MAX_TICKS))
    shown = sorted({*range(0, len(labels), step), len(labels) - 1})
    ax.set_xticks(shown, [labels[i] for i in shown], fontsize=7)
    ax.set_xlim(-0.5, len(labels) - 0.5)


def trend(series: dict[str, list[tuple[str, float | None, float | None, float | None]]], title: str, ylabel: str,
          labels: dict[str, str] | None = None, name: str = "trend") -> str | None:
    """Lines over runs: label -> [(run id, value, ci_low, ci_high)], in run order; `labels`: run id -> the text
    on the axis (default: the id)."""
    series = {k: v for k, v in series.items() if any(x[1] is not None for x in v)}
    if not series:
        return None
    plt = _plt()
    runs = list(dict.fromkeys(r for v in series.values() for r, *_ in v))
    fig, ax = plt.subplots(figsize=(8, 3), layout="constrained")
    for label, pts in series.items():
        xs = [runs.index(r) for r, y, *_ in pts if y is not None]
        ys = [y for _, y, *_ in pts if y is not None]
        (line,) = ax.plot(xs, ys, "o-", label=label)
        band = [(runs.index(r), lo, hi) for r, y, lo, hi in pts if lo is not None and hi is not None]
        if band:
            ax.fill_between([b[0] for b in band], [b[1] for b in band], [b[2] for b in band], alpha=0.15,
                            color=line.get_color())
    run_ticks(ax, [(labels or {}).get(r, r) for r in runs])
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    _legend_outside(ax)
    return _svg(fig, name)


def fidelity_trend(points: Sequence[dict], title: str, labels: dict[str, str], name: str = "fidelity-trend") -> str | None:
    """The deciding figure over releases: per run {run_id, measure ("kl"/"top1"), mean, bound, limit, outcome},
    KL (left) and top-1 (right), each run's mean with a bar to its 95% bound, coloured by the check's outcome,
    and the limit as a dashed line per run."""
    measures = [k for k in ("kl", "top1") if any(p["measure"] == k and p["mean"] is not None for p in points)]
    if not measures:
        return None
    plt = _plt()
    runs = list(dict.fromkeys(p["run_id"] for p in points))
    fig, axes = plt.subplots(1, len(measures), figsize=(5 * len(measures) + 1.2, 3), layout="constrained", squeeze=False)
    for ax, key in zip(axes[0], measures):
        mine = [p for p in points if p["measure"] == key and p["mean"] is not None]
        for p in mine:
            i, color = runs.index(p["run_id"]), COLOURS.get(p["outcome"], COLOURS[None])
            ax.plot([i], [p["mean"]], "o", color=color)
            if p["bound"] is not None:
                ax.plot([i, i], [p["mean"], p["bound"]], color=color, lw=2)
        lims = [(runs.index(p["run_id"]), p["limit"]) for p in mine if p["limit"] is not None]
        if lims:
            ax.step([x for x, _ in lims], [y for _, y in lims], where="mid", color="#b22222", lw=1, ls="--")
        run_ticks(ax, [labels.get(r, r) for r in runs])
        if key == "top1":
            ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:.0%}"))
        ax.set_title(("KL, nats/token (95% upper bound)" if key == "kl" else "top-1 agreement (95% lower bound)"),
                     fontsize=9)
    handles = [plt.Line2D([], [], color=c, marker="o", lw=2, label=o) for o, c in COLOURS.items() if o]
    handles.append(plt.Line2D([], [], color="#b22222", lw=1, ls="--", label="limit"))
    _legend_outside(axes[0][-1], handles=handles)
    fig.suptitle(title, fontsize=10)
    return _svg(fig, name)


def perf_curves(curves: Sequence[dict | None], name: str = "perf-curves") -> str | None:
    """Goodput and latency against concurrency, one line per variant (quantgate.report.sections.perf_curve), with
    the SLO drawn: left, requests/s within the SLO; right, TTFT p95 (solid) and TPOT p95 (dashed) in ms, the SLO
    limits as horizontal lines. The goodput panel only when there is an SLO; None when nothing is plottable."""
    drawn = [c for c in curves if c and c.get("levels")]
    if not drawn:
        return None
    plt = _plt()
    good = any(lv["goodput_rps"] is not None for c in drawn for lv in c["levels"])
    fig, axes = plt.subplots(1, 2 if good else 1, figsize=(11 if good else 6.5, 3.8), layout="constrained", squeeze=False)
    ga, la = (axes[0][0], axes[0][1]) if good else (None, axes[0][0])
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, c in enumerate(drawn):
        color = colors[i % len(colors)]
        xs = [lv["concurrency"] for lv in c["levels"]]
        if ga is not None:
            ga.plot(xs, [lv["goodput_rps"] if lv["goodput_rps"] is not None else float("nan") for lv in c["levels"]],
                    "o-", color=color, label=c["name"])
        for key, style, what in (("ttft_p95_ms", "o-", "TTFT p95"), ("tpot_p95_ms", "s--", "TPOT p95")):
            ys = [lv[key] for lv in c["levels"]]
            if any(y is not None for y in ys):
                la.plot(xs, [y if y is not None else float("nan") for y in ys], style, color=color, label=f"{c['name']} {what}")
    slo = next((c["slo"] for c in drawn if c.get("slo")), None)
    for key, style, what in (("ttft_ms", "-", "TTFT SLO"), ("tpot_ms", "--", "TPOT SLO")):
        if slo and slo.get(key) is not None:
            la.axhline(slo[key], color="#b22", lw=1, ls=style, label=f"{what} {slo[key]:g} ms")
    ticks = sorted({lv["concurrency"] for c in drawn for lv in c["levels"]})
    for ax in [a for a in (ga, la) if a is not None]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("concurrency")
        _legend_outside(ax)
    if ga is not None:
        ga.set_ylim(bottom=0)
        ga.set_ylabel("goodput, requests/s within the SLO")
        ga.set_title("goodput vs concurrency", fontsize=10)
    la.set_yscale("log")
    la.set_ylabel("ms (log)")
    la.set_title("latency vs concurrency", fontsize=10)
    return _svg(fig, name)
