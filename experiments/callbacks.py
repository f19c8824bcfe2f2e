"""Hydra callbacks of the experiments app.

``CompareOnMultirunEnd`` ends a multirun (``python -m experiments.run -m ...``) with its
comparison (for a capacity search, its Pareto front: ``experiments.capacity_search``): every job's results.jsonl on one figure per metric, lines labelled by the factors
that differ between jobs, plus summary.csv, in ``<sweep dir>/comparison`` (``experiments.compare``
on the sweep folder).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)


class CompareOnMultirunEnd(Callback):
    def __init__(self, metrics: list[str] | None = None, group_by: str | None = None) -> None:
        self.metrics = list(metrics) if metrics else None
        self.group_by = group_by

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from experiments.compare import main as compare

        sweep = Path(config.hydra.sweep.dir)
        if config.get("experiment", {}).get("runner", "sweep") == "capacity":
            from experiments.capacity_search import pareto

            pareto(sweep)  # a configuration search: its Pareto front, not concurrency curves
            return
        if len(list(sweep.rglob("results.jsonl"))) < 2:
            return  # one job (or none finished): nothing to compare
        argv = [str(sweep), "--out", str(sweep / "comparison")]
        if self.metrics:
            argv += ["--metrics", *self.metrics]
        if self.group_by:
            argv += ["--group-by", self.group_by]
        try:
            compare(argv)
        except SystemExit as exit_:  # compare's own argument errors: say so, keep the results
            log.warning("the multirun's comparison failed (%s); results are in %s", exit_, sweep)
            return
        log.info("comparison of the multirun: %s", sweep / "comparison")
        self._log_to_wandb(config, sweep, argv)

    def _log_to_wandb(self, config: DictConfig, sweep: Path, argv: list[str]) -> None:
        """The comparison as a W&B run of the sweep's group (``job_type="comparison"``)."""
        from experiments.compare import parse_args, prepare
        from research.tracking import log_comparison

        tracking = config.get("tracking") or {}
        mode = tracking.get("wandb_mode", "offline")
        if mode == "disabled":
            return
        args = parse_args(argv)
        series, rows, _ = prepare(args)
        name = config.get("experiment", {}).get("name", "sweep")
        stamp = "-".join(sweep.parts[-2:])
        run_dir = log_comparison(
            sweep / "comparison",
            series,
            rows,
            args.metrics,
            mode=mode,
            project=tracking.get("project", "research-serving"),
            group=f"{name}/{stamp}",
            name=f"{name} comparison",
        )
        log.info("W&B (%s) comparison run: %s", mode, run_dir)
