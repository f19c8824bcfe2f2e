"""Paper-style figures from benchmark points (as ``read_results`` returns them).

Figures are drawn on ``matplotlib.figure.Figure`` objects and saved as files; pyplot and its
display backends are never touched. Each function takes either a list of points, grouped into one
line per label (a point's ``label``, else its ``model``), or a dict {label: points} that puts
several result files, engines or ablations on the same axes.

The x axis is the concurrency (log2): a point's ``max_concurrency``, or ``num_prompts`` when all
requests were sent at once without a cap. Open-loop points (finite rate, no cap) have no
concurrency and are left out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

Point = Mapping[str, Any]
PointsOrSeries = Sequence[Point] | Mapping[str, Sequence[Point]]

# Per-user speed floors of the sizing method (REFERENCE.md section 1): comfortable and minimum.
SPEED_FLOORS_TOK_S = (15.0, 10.0)

METRIC_LABELS = {
    "output_throughput": "aggregate output tok/s",
    "total_token_throughput": "total (prompt + output) tok/s",
    "request_throughput": "requests/s",
    "per_user_tok_s": "per-user tok/s",
    "median_ttft_ms": "median TTFT (ms)",
    "p99_ttft_ms": "p99 TTFT (ms)",
    "median_tpot_ms": "median TPOT (ms)",
    "median_itl_ms": "median ITL (ms)",
    "median_e2el_ms": "median E2EL (ms)",
}


def concurrency(point: Point) -> int | None:
    """How many requests a point kept in flight: its cap, or all of them when sent at once."""
    if point.get("max_concurrency") is not None:
        return int(point["max_concurrency"])
    if math.isinf(float(point.get("request_rate", math.inf))):
        return int(point["num_prompts"])
    return None


def _label(point: Point) -> str:
    return str(point.get("label") or point.get("model") or "results")


def _as_series(data: PointsOrSeries) -> dict[str, list[Point]]:
    if isinstance(data, Mapping):
        return {str(label): list(points) for label, points in data.items()}
    series: dict[str, list[Point]] = {}
    for point in data:
        series.setdefault(_label(point), []).append(point)
    return series


def _curve(points: Sequence[Point], metric: str) -> tuple[list[int], list[float]]:
    """(concurrency, metric) pairs sorted by concurrency; points lacking either are skipped."""
    pairs = sorted(
        (c, float(p[metric]))
        for p in points
        if (c := concurrency(p)) is not None and p.get(metric) is not None
    )
    return [c for c, _ in pairs], [v for _, v in pairs]


def _setup_x(ax: Any) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))  # 1, 2, 4 rather than 2^k
    ax.set_xlabel("concurrency")
    ax.grid(True, which="both", alpha=0.3)


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def plot_concurrency_curves(data: PointsOrSeries, path: str | Path) -> Path:
    """Aggregate output tok/s (left) and per-user tok/s (right) against concurrency."""
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax_total, ax_user = fig.subplots(1, 2)
    for label, points in _as_series(data).items():
        ax_total.plot(*_curve(points, "output_throughput"), marker="o", label=label)
        ax_user.plot(*_curve(points, "per_user_tok_s"), marker="o", label=label)
    for floor, style in zip(SPEED_FLOORS_TOK_S, ("--", ":"), strict=True):
        ax_user.axhline(floor, color="gray", linestyle=style, linewidth=1, label=f"{floor:g} tok/s")
    for ax, metric in ((ax_total, "output_throughput"), (ax_user, "per_user_tok_s")):
        _setup_x(ax)
        ax.set_ylabel(METRIC_LABELS[metric])
        ax.set_ylim(bottom=0)
        ax.legend(fontsize="small")
    fig.suptitle("Throughput against concurrency")
    return _save(fig, path)


def plot_ttft(data: PointsOrSeries, path: str | Path) -> Path:
    """Median (solid) and p99 (dashed) time to first token against concurrency."""
    fig = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.subplots()
    for label, points in _as_series(data).items():
        (line,) = ax.plot(*_curve(points, "median_ttft_ms"), marker="o", label=f"{label} median")
        ax.plot(
            *_curve(points, "p99_ttft_ms"),
            marker="x",
            linestyle="--",
            color=line.get_color(),
            label=f"{label} p99",
        )
    _setup_x(ax)
    ax.set_ylabel("TTFT (ms)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")
    ax.set_title("Time to first token against concurrency")
    return _save(fig, path)


def plot_comparison(series: Mapping[str, Sequence[Point]], metric: str, path: str | Path) -> Path:
    """One line per label of ``metric`` against concurrency (block sizes, formats, engines...)."""
    fig = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.subplots()
    for label, points in _as_series(series).items():
        ax.plot(*_curve(points, metric), marker="o", label=label)
    _setup_x(ax)
    ax.set_ylabel(METRIC_LABELS.get(metric, metric))
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")
    ax.set_title(f"{METRIC_LABELS.get(metric, metric)} against concurrency")
    return _save(fig, path)


def plot_all(data: PointsOrSeries, out_dir: str | Path) -> list[Path]:
    """The concurrency curves and the TTFT figure as PNG files in ``out_dir``."""
    out_dir = Path(out_dir)
    return [
        plot_concurrency_curves(data, out_dir / "concurrency_curves.png"),
        plot_ttft(data, out_dir / "ttft.png"),
    ]
