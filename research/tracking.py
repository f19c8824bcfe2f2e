"""Experiment tracking: one W&B run per experiment, plus the files that exist regardless.

W&B runs in offline mode unless asked otherwise (``mode="online"``), so nothing needs a network
or a login; ``wandb sync <run dir>`` uploads an offline run later (``sync_command``).
``mode="disabled"`` skips W&B. results.jsonl, results.csv and the PNG plots are written by the
caller into the run directory whatever W&B does; this module logs the same rows into the run:

- ``max_concurrency`` is the x-axis of every metric (``define_metric``), and each row also
  carries its text fields (label, executor, model) so the W&B table can be grouped by them;
- the curves are native W&B line plots with one line per series (``line_series``: one per
  label, i.e. per model and engine), never one zig-zag across models;
- the summary is set explicitly, never "the last row logged": a headline per series (peak
  output tok/s, the concurrency it was reached at, per-user tok/s at the lowest and highest
  concurrency), repeats averaged;
- the run name is made of the swept values (``experiments.run.job_name``), the group is the
  sweep (experiment and the sweep's time stamp: two sweeps never share one), ``job_type`` the
  role (``run``, ``multirun-job``, ``comparison``); ``log_comparison`` adds the comparison of a
  multirun to its group: one panel per metric, a line per series, and the summary table;
- results.jsonl, results.csv and the figures are logged as one artifact.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

WANDB_MODES = ("offline", "online", "disabled")
# Curves drawn as native W&B line plots (x = max_concurrency) as well as PNG images.
LINE_PLOTS = ("output_throughput", "per_user_tok_s", "median_ttft_ms", "p99_ttft_ms")
X_AXIS = "max_concurrency"
TEXT_FIELDS = ("label", "model", "executor", "hardware", "quantization", "dtype")


class Tracker:
    """A W&B run in ``run_dir/wandb``; ``log_point`` per benchmark point, ``finish`` at the end."""

    def __init__(
        self,
        run_dir: str | Path,
        config: Mapping[str, Any],
        *,
        mode: str = "offline",
        project: str = "research-serving",
        name: str | None = None,
        group: str | None = None,
        tags: Sequence[str] = (),
        job_type: str = "sweep",
    ):
        if mode not in WANDB_MODES:
            raise ValueError(f"wandb mode must be one of {WANDB_MODES}, got {mode!r}")
        self.mode = mode
        self.points: list[dict[str, Any]] = []
        self.run: Any = None
        self.run_dir: Path | None = None
        self.out_dir = Path(run_dir)
        if mode == "disabled":
            return
        import wandb

        self.out_dir.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(
            project=project,
            name=name,
            group=group,
            tags=sorted({t[:64] for t in tags if t}),
            job_type=job_type,
            dir=str(run_dir),
            mode=mode,
            config=dict(config),
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )
        self.run.define_metric(X_AXIS)
        # No automatic summary (it would be whichever row was logged last): ``finish`` sets
        # the headline explicitly.
        self.run.define_metric("*", step_metric=X_AXIS, summary="none")
        self.run_dir = Path(self.run.dir).parent

    def log_point(self, point: Mapping[str, Any]) -> None:
        """One benchmark point: its numeric and text fields as a W&B row."""
        self.points.append(dict(point))
        if self.run is None:
            return
        row: dict[str, Any] = {
            k: v
            for k, v in point.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }
        row |= {k: str(point[k]) for k in TEXT_FIELDS if point.get(k) is not None}
        self.run.log(row)

    def log_plots(self, paths: Sequence[str | Path]) -> None:
        """The PNGs as images, and the sweep's curves as native W&B line plots, one line per
        series (label)."""
        if self.run is None:
            return
        import wandb

        media: dict[str, Any] = {Path(p).stem: wandb.Image(str(p)) for p in paths}
        for metric in LINE_PLOTS:
            series = self.series(metric)
            if series:
                media[f"curve/{metric}"] = wandb.plot.line_series(
                    xs=[[x for x, _ in pts] for pts in series.values()],
                    ys=[[y for _, y in pts] for pts in series.values()],
                    keys=list(series),
                    title=f"{metric} vs concurrency",
                    xname=X_AXIS,
                )
        self.run.log(media)

    def series(self, metric: str) -> dict[str, list[tuple[float, float]]]:
        """label -> [(max_concurrency, mean of metric over repeats)] sorted by concurrency."""
        out: dict[str, dict[float, list[float]]] = {}
        for p in self.points:
            x, y = p.get(X_AXIS), p.get(metric)
            if x is None or y is None or not math.isfinite(y):
                continue
            out.setdefault(str(p.get("label") or p.get("model")), {}).setdefault(x, []).append(y)
        return {k: sorted((x, sum(v) / len(v)) for x, v in by_x.items()) for k, by_x in out.items()}

    def headline(self) -> dict[str, float]:
        """Per series: peak output tok/s and where, per-user tok/s at both ends of the sweep."""
        out: dict[str, float] = {}
        for label, pts in self.series("output_throughput").items():
            peak_x, peak = max(pts, key=lambda xy: xy[1])
            out[f"{label}/peak_output_throughput"] = peak
            out[f"{label}/peak_at_concurrency"] = peak_x
        for label, pts in self.series("per_user_tok_s").items():
            out[f"{label}/per_user_tok_s_at_{pts[0][0]:g}"] = pts[0][1]
            out[f"{label}/per_user_tok_s_at_{pts[-1][0]:g}"] = pts[-1][1]
        return out

    def log_files(self, paths: Sequence[str | Path], name: str = "results") -> None:
        """results.jsonl, results.csv and figures as one artifact of the run."""
        if self.run is None:
            return
        import wandb

        artifact = wandb.Artifact(name, type="results")
        for path in paths:
            if Path(path).exists():
                artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def sync_command(self) -> str | None:
        """The command that uploads this run (offline runs only)."""
        if self.run_dir is None or self.mode != "offline":
            return None
        return f"wandb sync {self.run_dir}"

    def finish(self) -> None:
        if self.run is not None:
            self.run.summary.update(self.headline())
            self.run.finish()
            self.run = None


def log_comparison(
    out_dir: str | Path,
    series: Mapping[str, Sequence[Mapping[str, Any]]],
    rows: Sequence[Mapping[str, Any]],
    metrics: Sequence[str],
    *,
    mode: str = "offline",
    project: str = "research-serving",
    group: str | None = None,
    name: str | None = None,
) -> Path | None:
    """A W&B run (``job_type="comparison"``) holding a comparison: one line plot per metric
    with a line per series (means over repeats) and the summary rows (with their intervals) as
    a table. Returns the run's directory (None when disabled)."""
    if mode == "disabled":
        return None
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=project,
        name=name or f"{group or 'comparison'} comparison",
        group=group,
        job_type="comparison",
        dir=str(out_dir),
        mode=mode,
        settings=wandb.Settings(console="off", x_disable_stats=True),
    )
    media: dict[str, Any] = {}
    for metric in metrics:
        xs, ys, keys = [], [], []
        for label in series:
            pts = [r for r in rows if r["label"] == label and math.isfinite(r[f"{metric}_mean"])]
            if pts:
                xs.append([r["max_concurrency"] for r in pts])
                ys.append([r[f"{metric}_mean"] for r in pts])
                keys.append(label)
        if keys:
            media[f"comparison/{metric}"] = wandb.plot.line_series(
                xs=xs, ys=ys, keys=keys, title=f"{metric} vs concurrency", xname=X_AXIS
            )
    columns = list(dict.fromkeys(k for r in rows for k in r))
    media["comparison/summary"] = wandb.Table(
        columns=columns, data=[[r.get(c) for c in columns] for r in rows]
    )
    run.log(media)
    run.summary.update({"series": len(series), "points": sum(len(v) for v in series.values())})
    run_dir = Path(run.dir).parent
    run.finish()
    return run_dir
