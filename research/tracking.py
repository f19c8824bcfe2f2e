"""Experiment tracking: one W&B run per experiment, plus the files that exist regardless.

W&B runs in offline mode unless asked otherwise (``mode="online"``), so nothing needs a network
or a login; ``wandb sync <run dir>`` uploads an offline run later. ``mode="disabled"`` skips W&B.
results.jsonl and the PNG plots are written by the caller into the run directory whatever W&B
does; this module logs the same rows and images into the run.
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
    ):
        if mode not in WANDB_MODES:
            raise ValueError(f"wandb mode must be one of {WANDB_MODES}, got {mode!r}")
        self.mode = mode
        self.points: list[dict[str, Any]] = []
        self.run: Any = None
        self.run_dir: Path | None = None
        if mode == "disabled":
            return
        import wandb

        Path(run_dir).mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(
            project=project,
            name=name,
            dir=str(run_dir),
            mode=mode,
            config=dict(config),
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )
        self.run_dir = Path(self.run.dir).parent

    def log_point(self, point: Mapping[str, Any]) -> None:
        """One benchmark point: its numeric fields as a W&B row (step = point index)."""
        self.points.append(dict(point))
        if self.run is None:
            return
        row = {
            k: v
            for k, v in point.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }
        self.run.log(row, step=len(self.points) - 1)

    def log_plots(self, paths: Sequence[str | Path]) -> None:
        """The PNGs as images, and the sweep's curves as native W&B line plots."""
        if self.run is None:
            return
        import wandb

        media: dict[str, Any] = {Path(p).stem: wandb.Image(str(p)) for p in paths}
        swept = [p for p in self.points if p.get("max_concurrency") is not None]
        for metric in LINE_PLOTS:
            rows = [[p["max_concurrency"], p[metric]] for p in swept if p.get(metric) is not None]
            if rows:
                table = wandb.Table(data=rows, columns=["max_concurrency", metric])
                media[f"curve/{metric}"] = wandb.plot.line(
                    table, "max_concurrency", metric, title=f"{metric} vs concurrency"
                )
        self.run.log(media, step=len(self.points))

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
