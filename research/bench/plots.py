"""Paper-style figures from benchmark points (as ``read_results`` returns them).

Figures are drawn on ``matplotlib.figure.Figure`` objects and saved as files; pyplot and its
display backends are never touched. Each function takes either a list of points, grouped into one
line per configuration and each line named by what varies between them as ``key=value``
(``model=qwen3-coder-30b-a3b``: ``research.bench.stats.series_of``), or a dict {label: points}
that puts several result files, engines or ablations on the same axes.

The x axis is the concurrency (log2): a point's ``max_concurrency``, or ``num_prompts`` when all
requests were sent at once without a cap. Open-loop points (finite rate, no cap) have no
concurrency and are left out.

For a paper: each figure is saved as a 300-dpi PNG plus PDF and SVG beside it, sized for a
two-column page (7 in wide, or 3.5 in for one panel). TTFT is in seconds on a log axis;
throughput goes log when the lines span more than a decade (``log_y``). The legend keeps only
what differs between lines; what they share goes into one caption line under the figure
(``shared: hardware=gb10, engine=vllm, input_len=512, ...``). Simulated curves are dashed and
say so; the published single-request points of the calibration are drawn where a curve is of
their model on their machine; the per-user speed floors are labelled as floors, and per-user
tok/s is defined on the axis (1000 / median TPOT).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from research.bench.stats import (
    LABEL_SEPARATOR,
    METRIC_LABELS,
    concurrency,
    series_caption,
    series_of,
)

Point = Mapping[str, Any]
PointsOrSeries = Sequence[Point] | Mapping[str, Sequence[Point]]

# Per-user speed floors of the sizing method: comfortable and minimum.
SPEED_FLOORS_TOK_S = (15.0, 10.0)
FLOOR_NAMES = ("comfortable", "minimum")
FORMATS = (".pdf", ".svg")  # written beside every PNG
DPI = 300
WIDTH_IN = 7.0  # a two-column page's text width; one panel is half of it
CAPTION_FONTSIZE = 6
CAPTION_CHAR_WIDTH = 0.6  # mean glyph width in font sizes: ``key=value`` text runs wide


def _as_series(data: PointsOrSeries) -> dict[str, list[Point]]:
    """A caller's {name: points} as given; a list of points as one series per configuration,
    named by what varies between them (``research.bench.stats.series_of``)."""
    if isinstance(data, Mapping):
        return {str(label): list(points) for label, points in data.items()}
    return dict(series_of(data))


def _curve(points: Sequence[Point], metric: str) -> tuple[list[int], list[float]]:
    """(concurrency, mean of ``metric``) sorted by concurrency, repeats averaged; points lacking
    either are skipped."""
    xs, ys, _ = _curve_ci(points, metric)
    return xs, ys


def _curve_ci(
    points: Sequence[Point], metric: str
) -> tuple[list[int], list[float], list[tuple[float, float]]]:
    """``_curve`` plus each point's 95% bootstrap interval over its repeats ((nan, nan) for
    one run: ``research.bench.stats.bootstrap_ci``)."""
    from research.bench.stats import bootstrap_ci

    by_c: dict[int, list[float]] = {}
    for p in points:
        if (c := concurrency(p)) is not None and p.get(metric) is not None:
            by_c.setdefault(c, []).append(float(p[metric]))
    xs = sorted(by_c)
    return xs, [sum(by_c[c]) / len(by_c[c]) for c in xs], [bootstrap_ci(by_c[c]) for c in xs]


def _setup_x(ax: Any) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))  # 1, 2, 4 rather than 2^k
    ax.set_xlabel("concurrency", fontsize=7)
    ax.grid(True, which="both", alpha=0.3)


def _save(fig: Figure, path: str | Path) -> Path:
    """``path`` (PNG at 300 dpi) and the same figure as PDF and SVG beside it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    for suffix in FORMATS:
        fig.savefig(path.with_suffix(suffix))
    return path


def _parts(label: str) -> list[str]:
    """A series name's parts: its ``key=value`` items (``research.bench.stats.varying_labels``),
    or the words of a name without them."""
    return label.split(LABEL_SEPARATOR) if LABEL_SEPARATOR in label else label.split()


def _join(parts: Sequence[str], like: str) -> str:
    return (LABEL_SEPARATOR if LABEL_SEPARATOR in like else " ").join(parts)


def _short_labels(labels: Sequence[str]) -> tuple[dict[str, str], str]:
    """Legend entries without the parts every label shares, and those shared parts (", ")."""
    parts = [_parts(label) for label in labels]
    shared = [w for w in parts[0] if all(w in ps for ps in parts[1:])] if len(parts) > 1 else []
    short = {
        label: _join([w for w in ps if w not in shared], label) or label
        for label, ps in zip(labels, parts, strict=True)
    }
    return short, LABEL_SEPARATOR.join(shared)


def _is_simulated(points: Sequence[Point]) -> bool:
    return any(str(p.get("executor", "")).startswith("simulated") for p in points)


def caption(
    series: Mapping[str, Sequence[Point]],
    shared: str = "",
    axes: Sequence[Any] = (),
    style_note: str = "",
) -> str:
    """What every line shares, as one ``shared: key=value, ...`` line (the parts of the lines'
    names in ``shared``, then every configuration axis they agree on: machine, engine, format,
    workload, ...; ``research.bench.stats.series_caption``), then what the drawn styles mean,
    read back from the lines on ``axes`` so the caption cannot claim a style the figure does
    not use: dashed lines are called simulated only if every simulated line is dashed and no
    measured one is; error bars are named with their interval."""
    parts = []
    words = shared.split(LABEL_SEPARATOR) if shared else []
    if common := series_caption(series, extra=words):
        parts.append(common)
    if style_note:
        parts.append(style_note)
    lines = [ln for ax in axes for ln in ax.get_lines() if hasattr(ln, "simulated")]
    simulated = [ln for ln in lines if ln.simulated]
    if simulated:
        dashed_sim = all(ln.get_linestyle() == "--" for ln in simulated)
        dashed_real = any(ln.get_linestyle() == "--" for ln in lines if not ln.simulated)
        if dashed_sim and not dashed_real:
            parts.append("dashed: simulated (cost model), not measured")
        else:
            parts.append("(simulated): cost model, not measured")
    if any(getattr(ln, "has_error_bars", False) for ln in lines):
        reps = sorted({n for pts in series.values() for n in _repeat_counts(pts)} - {1})
        parts.append(
            f"lines: mean of {'/'.join(map(str, reps))} runs; error bars: 95% bootstrap CI"
        )
    return "; ".join(parts)


def _repeat_counts(points: Sequence[Point]) -> list[int]:
    counts: dict[int, int] = {}
    for p in points:
        if (c := concurrency(p)) is not None:
            counts[c] = counts.get(c, 0) + 1
    return list(counts.values())


def _published(points: Sequence[Point]) -> list[tuple[str, float]]:
    """(name, per-user tok/s) of the published single-request points of these curves' model
    on their machine (the calibration's), drawn at concurrency 1."""
    from research.perf.calibration import CALIBRATION_POINTS

    keys = {(p.get("model"), p.get("hardware"), p.get("quantization")) for p in points}
    return [
        (c.name, 1.0 / c.tpot_s)
        for c in CALIBRATION_POINTS
        if c.tpot_s is not None and (c.model, c.hardware, c.quantization or "none") in keys
    ]


def _plot_series(
    ax: Any,
    series: Mapping[str, Sequence[Point]],
    metric: str,
    names: Mapping[str, str],
    scale: float = 1.0,
    **style: Any,
) -> list[float]:
    """One line per series (the mean over repeats), with 95% bootstrap error bars where a
    point has repeats; simulated series are dashed unless ``style`` sets the line style."""
    values: list[float] = []
    for label, points in series.items():
        xs, ys, cis = _curve_ci(points, metric)
        ys = [y * scale for y in ys]
        values += ys
        simulated = _is_simulated(points)
        name = names[label] + (" (simulated)" if simulated else "")
        line_style = {"linestyle": "--" if simulated else "-"} | style
        (line,) = ax.plot(xs, ys, marker="o", markersize=3, label=name, **line_style)
        line.simulated = simulated  # what the caption reads back (``caption``)
        bars = [(x, y, lo * scale, hi * scale) for x, y, (lo, hi) in zip(xs, ys, cis, strict=True)
                if math.isfinite(lo)]  # fmt: skip
        if bars:
            bx, by, lo, hi = (list(v) for v in zip(*bars, strict=True))
            err = [[y - lo_ for y, lo_ in zip(by, lo, strict=True)],
                   [hi_ - y for y, hi_ in zip(by, hi, strict=True)]]  # fmt: skip
            ax.errorbar(bx, by, yerr=err, fmt="none", ecolor=line.get_color(), elinewidth=0.8,
                        capsize=2)  # fmt: skip
            values += lo + hi
            line.has_error_bars = True
    return values


def _y_axis(ax: Any, values: Sequence[float], log_y: bool | None) -> None:
    """Log when asked or when the values span more than a decade, else linear from 0. Log axes
    are labelled at 1-2-5 steps (at decades only past two decades), no minor labels: the
    default minor labels of a short log axis overlap at this size."""
    from matplotlib.ticker import LogLocator, NullFormatter

    positive = [v for v in values if v > 0]
    spans_decade = bool(positive) and max(positive) > 10 * min(positive)
    if log_y or (log_y is None and spans_decade):
        ax.set_yscale("log")
        decades = math.log10(max(positive) / min(positive)) if positive else 1.0
        subs = (1.0, 2.0, 5.0) if decades <= 2 else (1.0,)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        ax.set_ylim(bottom=0)


def _finish(
    fig: Figure, series: Mapping[str, Sequence[Point]], shared: str, style_note: str = ""
) -> None:
    """The caption under the axes, wrapped to the figure's width, as the figure's x super-label:
    the constrained layout makes room for it, so it overlaps no axis label."""
    text = caption(series, shared, fig.axes, style_note)
    if text:
        chars = int(fig.get_figwidth() * 72 / (CAPTION_FONTSIZE * CAPTION_CHAR_WIDTH))
        fig.supxlabel(textwrap.fill(text, chars), fontsize=CAPTION_FONTSIZE)


def plot_concurrency_curves(
    data: PointsOrSeries, path: str | Path, log_y: bool | None = None
) -> Path:
    """Aggregate output tok/s (left) and per-user tok/s (right) against concurrency, with the
    speed floors and the published single-request points."""
    return _save(concurrency_figure(data, log_y), path)


def concurrency_figure(data: PointsOrSeries, log_y: bool | None = None) -> Figure:
    series = _as_series(data)
    names, shared = _short_labels(list(series))
    fig = Figure(figsize=(WIDTH_IN, 2.9), layout="constrained")
    fig.get_layout_engine().set(h_pad=0.12)
    ax_total, ax_user = fig.subplots(1, 2)
    total = _plot_series(ax_total, series, "output_throughput", names)
    user = _plot_series(ax_user, series, "per_user_tok_s", names)
    for (floor, style), kind in zip(
        zip(SPEED_FLOORS_TOK_S, ("--", ":"), strict=True), FLOOR_NAMES, strict=True
    ):
        ax_user.axhline(
            floor, color="gray", linestyle=style, linewidth=0.8, label=f"{kind} floor {floor:g}"
        )
    published = _published([p for pts in series.values() for p in pts])
    for name, value in published:
        ax_user.plot([1], [value], marker="*", markersize=8, color="black", linestyle="none")
        ax_user.annotate(
            f"published {name}", (1, value), fontsize=5, xytext=(4, 2), textcoords="offset points"
        )
    for ax, metric, values in (
        (ax_total, "output_throughput", total),
        (ax_user, "per_user_tok_s", user + [v for _, v in published] + list(SPEED_FLOORS_TOK_S)),
    ):
        _setup_x(ax)
        ax.set_ylabel(METRIC_LABELS[metric], fontsize=7)
        ax.tick_params(labelsize=6)
        _y_axis(ax, values, log_y)
        ax.legend(fontsize=5)
    _finish(fig, series, shared)
    return fig


def plot_ttft(data: PointsOrSeries, path: str | Path) -> Path:
    """Median (solid) and p99 (dotted) time to first token against concurrency, in seconds on
    a log axis (TTFT spans decades between a light and a saturated server)."""
    return _save(ttft_figure(data), path)


def ttft_figure(data: PointsOrSeries) -> Figure:
    series = _as_series(data)
    names, shared = _short_labels(list(series))
    fig = Figure(figsize=(WIDTH_IN / 2, 2.9), layout="constrained")
    fig.get_layout_engine().set(h_pad=0.15)
    ax = fig.subplots()
    values: list[float] = []
    for label, points in series.items():
        xs, ys = _curve(points, "median_ttft_ms")
        values += [y / 1e3 for y in ys]
        simulated = " (simulated)" if _is_simulated(points) else ""
        (line,) = ax.plot(
            xs,
            [y / 1e3 for y in ys],
            marker="o",
            markersize=3,
            label=f"{names[label]}{simulated} median",
        )
        line.simulated = bool(simulated)
        xs, ys = _curve(points, "p99_ttft_ms")
        values += [y / 1e3 for y in ys]
        ax.plot(
            xs,
            [y / 1e3 for y in ys],
            marker="x",
            markersize=3,
            linestyle=":",
            color=line.get_color(),
            label=f"{names[label]} p99",
        )
    _setup_x(ax)
    _y_axis(ax, values, log_y=True)
    ax.set_ylabel("TTFT (s)", fontsize=7)
    ax.tick_params(labelsize=6)
    ax.legend(fontsize=5)
    _finish(fig, series, shared, "solid: median, dotted: p99")
    return fig


def plot_comparison(
    series: Mapping[str, Sequence[Point]],
    metric: str,
    path: str | Path,
    log_y: bool | None = None,
    styles: Mapping[str, Mapping[str, Any]] | None = None,
    style_note: str = "",
    facet_by: str | None = None,
) -> Path:
    """One line per label of ``metric`` against concurrency (block sizes, formats, engines...);
    TTFT metrics in seconds on a log axis; ``styles``: matplotlib line styles per label, and
    ``style_note`` what they encode (for the caption); ``facet_by``: one panel per value of
    that axis."""
    return _save(comparison_figure(series, metric, log_y, styles, style_note, facet_by), path)


def comparison_figure(
    series: Mapping[str, Sequence[Point]],
    metric: str,
    log_y: bool | None = None,
    styles: Mapping[str, Mapping[str, Any]] | None = None,
    style_note: str = "",
    facet_by: str | None = None,
) -> Figure:
    """One panel (or one per value of ``facet_by``, e.g. ``model``: models whose scales differ
    tenfold each get their own axis, titled ``model=...``), one line per series."""
    series = _as_series(series)
    facets: dict[str, dict[str, Sequence[Point]]] = {}
    for label, points in series.items():
        key = f"{facet_by}={points[0].get(facet_by)}" if facet_by and points else ""
        facets.setdefault(key, {})[label] = points
    n = len(facets)
    cols = min(n, 3)
    rows = -(-n // cols)
    width = WIDTH_IN / 2 if n == 1 else WIDTH_IN
    fig = Figure(figsize=(width, 2.6 * rows + 0.3), layout="constrained")
    fig.get_layout_engine().set(h_pad=0.15)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    is_ttft = "ttft" in metric
    names_all, shared = _short_labels(list(series))
    for ax, (facet, members) in zip(axes, facets.items(), strict=False):
        names = names_all
        if facet:
            value = facet.split("=", 1)[1]
            names = {
                label: _join(
                    [w for w in _parts(names_all[label]) if w not in (facet, value)],
                    names_all[label],
                )
                or names_all[label]
                for label in members
            }
            ax.set_title(facet, fontsize=7)
        values: list[float] = []
        for label in members:
            values += _plot_series(
                ax,
                {label: members[label]},
                metric,
                names,
                scale=1e-3 if is_ttft else 1.0,
                **dict((styles or {}).get(label, {})),
            )
        _setup_x(ax)
        label = METRIC_LABELS.get(metric, metric)
        ax.set_ylabel(label.replace("(ms)", "(s)") if is_ttft else label, fontsize=7)
        ax.tick_params(labelsize=6)
        _y_axis(ax, values, True if is_ttft else log_y)
        ax.legend(fontsize=5)
    note = ", ".join(x for x in (style_note, f"one panel per {facet_by}" if n > 1 else "") if x)
    _finish(fig, series, shared, note)
    return fig


def plot_all(data: PointsOrSeries, out_dir: str | Path) -> list[Path]:
    """The concurrency curves and the TTFT figure as PNG files in ``out_dir``."""
    out_dir = Path(out_dir)
    return [
        plot_concurrency_curves(data, out_dir / "concurrency_curves.png"),
        plot_ttft(data, out_dir / "ttft.png"),
    ]
