"""Prediction bands: one simulated run priced under each plausible assumption the calibration
points leave open, so a figure shows how much a prediction depends on them.

Two assumptions are not pinned by single-request points:

- the MoE routing law at batch (``research.perf.routing``): around the ``lognormal`` law of
  the workload's tokens (what experiments use) its shape's plausible range, the most and the
  least concentrated shapes public random-token batches imply (``RANDOM_TOKEN_SIGMA_RANGE``);
  around any other law, the optimistic corner ``hot_set`` (one global hot set: a batch never
  touches more experts than one prompt does) and the pessimistic corner ``uniform`` (no
  locality even inside a prompt: prefills touch every expert);
- how host time splits between per-step and per-sequence work: the fit gives their sum at
  batch 1; the corners put 0 and twice ``ASSUMED_PER_SEQ_OVERHEAD_S`` per sequence (keeping the
  batch-1 total).

Then the band is widened by how wrong the model is where it can be checked: the 5th to 95th
percentile of its signed error on public GB10 measurements it was not fitted on
(``research.perf.validation``, stored in ``data/validation_errors.json``), per model kind (MoE or
dense) and phase (decode errors for throughputs and TPOT, prefill errors for TTFT). A prediction
``p`` of a rate whose errors ran from ``r05`` to ``r95`` spans ``p / (1 + r95) .. p / (1 + r05)``;
a time, ``p * (1 + r05) .. p * (1 + r95)``. Those errors were measured on llama.cpp's engine
profile, the only one with public GB10 curves in the validation set: for vLLM they are a proxy.

``band_variants`` builds the two corner cost models (each corner takes the optimistic or the
pessimistic side of every assumption). In a closed loop with every request available at once,
the scheduler's decisions do not depend on how long steps take (a finished request's slot is
refilled for the next step whatever the clock says), so ``retime`` re-prices a recorded run step
by step under another cost model instead of simulating it again: exact, and a small fraction of
the run's cost. ``band_keys`` turns the variants' metrics into ``band_<metric>_lo`` / ``_hi``
keys of a results point; ``plot_prediction_bands`` draws them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from research.perf.cost_model import CostModel, StepShape
from research.perf.routing import DEFAULT_ROUTING, RANDOM_TOKEN_SIGMA_RANGE

BAND_METRICS = (
    "output_throughput",
    "total_token_throughput",
    "per_user_tok_s",
    "median_ttft_ms",
    "median_tpot_ms",
)


def band_variants(model: CostModel) -> dict[str, CostModel]:
    """The optimistic and pessimistic corners around ``model`` (module docstring)."""
    p, opts = model.params, model.options()
    host = p.per_step_overhead_s + p.per_seq_overhead_s  # what batch 1 pins
    lean = dataclasses.replace(p, per_step_overhead_s=host, per_seq_overhead_s=0.0)
    heavy_seq = 2 * p.per_seq_overhead_s
    heavy = dataclasses.replace(
        p, per_step_overhead_s=max(0.0, host - heavy_seq), per_seq_overhead_s=heavy_seq
    )
    corners = {"optimistic": (lean, "hot_set"), "pessimistic": (heavy, "uniform")}
    shapes: dict[str, dict] = {"optimistic": {}, "pessimistic": {}}
    if model.moe_routing == "lognormal":
        # Around a lognormal law the corners are its shape's plausible range: the most and the
        # least concentrated shapes public random-token batches imply (routing.py).
        lo, hi = RANDOM_TOKEN_SIGMA_RANGE
        corners = {"optimistic": (lean, "lognormal"), "pessimistic": (heavy, "lognormal")}
        shapes = {"optimistic": {"moe_load_sigma": hi}, "pessimistic": {"moe_load_sigma": lo}}
    out = {}
    for name, (params, law) in corners.items():
        routing = law if model.cfg.is_moe else DEFAULT_ROUTING
        out[name] = type(model)(
            model.cfg,
            model.quantization,
            model.hw,
            **(opts | {"params": params, "moe_routing": routing} | shapes[name]),
        )
    return out


def retime(
    result: Any, step_log: Sequence[tuple[float, float, StepShape]], model: CostModel
) -> Any:
    """``result`` (a ``BenchmarkResult`` of a closed-loop simulated run whose executor logged
    ``step_log``: (clock before, seconds, shape) per step) with every timestamp moved to where
    ``model``'s step times put it."""
    if not step_log:
        raise ValueError("no steps were logged for this run")
    moved: dict[float, float] = {}
    new_t, old_end = step_log[0][0], step_log[0][0]
    for before, seconds, shape in step_log:
        new_t += before - old_end  # an idle gap between steps stays as it was
        moved[before] = new_t
        new_t += model.step_time(shape)
        old_end = before + seconds  # the float the virtual clock held after the step
        moved[old_end] = new_t

    def at(t: float) -> float:
        try:
            return moved[t]
        except KeyError:
            raise ValueError(
                f"time {t} is not a step boundary of the log: retime needs a closed loop on one "
                "simulated box"
            ) from None

    records = [
        dataclasses.replace(
            r,
            send_time=at(r.send_time),
            first_token_time=None if r.first_token_time is None else at(r.first_token_time),
            token_times=[at(t) for t in r.token_times],
            finish_time=at(r.finish_time),
        )
        for r in result.records
    ]
    duration = max(r.finish_time for r in records) - min(r.send_time for r in records)
    return dataclasses.replace(result, records=records, duration=duration)


ERRORS_PATH = Path(__file__).parent / "data" / "validation_errors.json"
# Which validation errors widen which metric: (phase, is it a time).
METRIC_ERRORS = {
    "output_throughput": ("decode", False),
    "total_token_throughput": ("decode", False),
    "per_user_tok_s": ("decode", False),
    "median_tpot_ms": ("decode", True),
    "median_ttft_ms": ("prefill", True),
}


@functools.cache
def validation_errors() -> dict[str, dict[str, list[float]]]:
    """The stored signed-error quantiles (module docstring): kind -> phase -> [r05, r95]."""
    return json.loads(ERRORS_PATH.read_text())["signed_error"]


def widen(lo: float, hi: float, metric: str, moe: bool) -> tuple[float, float]:
    """``[lo, hi]`` widened by the validation errors of ``metric`` (module docstring)."""
    phase, is_time = METRIC_ERRORS[metric]
    r05, r95 = validation_errors()["moe" if moe else "dense"][phase]
    if is_time:
        return lo * min(1.0, 1 + r05), hi * max(1.0, 1 + r95)
    return lo / max(1.0, 1 + r95), hi / min(1.0, 1 + r05)


def band_keys(
    central: Mapping[str, Any],
    variants: Mapping[str, Mapping[str, Any]],
    moe: bool | None = None,
) -> dict:
    """``band_<metric>_lo`` / ``_hi`` over the central point and the variants' metrics, widened
    by the validation errors of a MoE (``moe=True``) or dense model (None: not widened)."""
    out: dict[str, Any] = {"band_variants": ",".join(variants)}
    if moe is not None:
        out["band_variants"] += ",validation_errors"
    for metric in BAND_METRICS:
        values = [m[metric] for m in (central, *variants.values()) if m.get(metric) is not None]
        if values:
            lo, hi = min(values), max(values)
            if moe is not None:
                lo, hi = widen(lo, hi, metric, moe)
            out[f"band_{metric}_lo"], out[f"band_{metric}_hi"] = lo, hi
    return out


def plot_prediction_bands(points: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """``prediction_bands_figure`` as a 300-dpi PNG with PDF and SVG beside it."""
    from research.bench import plots

    return plots._save(prediction_bands_figure(points), path)


def prediction_bands_figure(points: Sequence[Mapping[str, Any]]) -> Any:
    """Aggregate output tok/s, per-user tok/s and median TTFT against concurrency, one line per
    configuration (named by what varies between them) with its band shaded, log axes where the
    values span more than a decade, the caption under the panels (``research.bench.plots``)."""
    from matplotlib.figure import Figure

    from research.bench import plots

    metrics = ("output_throughput", "per_user_tok_s", "median_ttft_ms")
    fig = Figure(figsize=(plots.WIDTH_IN, 2.6), layout="constrained")
    axes = fig.subplots(1, len(metrics))
    series = plots._as_series([p for p in points if p.get("max_concurrency") is not None])
    names, shared = plots._short_labels(list(series))
    for ax, metric in zip(axes, metrics, strict=True):
        scale = 1e-3 if metric == "median_ttft_ms" else 1.0
        values: list[float] = []
        for label, pts in series.items():
            pts = sorted(pts, key=lambda p: p["max_concurrency"])
            xs = [p["max_concurrency"] for p in pts]
            ys = [p[metric] * scale for p in pts]
            (line,) = ax.plot(xs, ys, marker="o", markersize=3, label=names[label])
            lo = [p.get(f"band_{metric}_lo", p[metric]) * scale for p in pts]
            hi = [p.get(f"band_{metric}_hi", p[metric]) * scale for p in pts]
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
            values += ys + lo + hi
        plots._setup_x(ax)
        label = plots.METRIC_LABELS[metric]
        ax.set_ylabel(label.replace("(ms)", "(s)") if scale != 1.0 else label, fontsize=7)
        ax.tick_params(labelsize=6)
        plots._y_axis(ax, values, True if metric == "median_ttft_ms" else None)
    axes[0].legend(fontsize=5)
    text = plots.caption(series, shared)
    text += (
        "; solid line: prediction under the central assumptions; shaded band: optimistic to "
        "pessimistic corners (routing law, host time), widened by the 5-95% error on public GB10 "
        "measurements (research/perf/data/validation_errors.json)"
    )
    import textwrap

    chars = int(fig.get_figwidth() * 72 / (plots.CAPTION_FONTSIZE * plots.CAPTION_CHAR_WIDTH))
    fig.supxlabel(textwrap.fill(text, chars), fontsize=plots.CAPTION_FONTSIZE)
    return fig


__all__ = [
    "BAND_METRICS",
    "band_keys",
    "band_variants",
    "plot_prediction_bands",
    "prediction_bands_figure",
    "retime",
    "validation_errors",
    "widen",
]
