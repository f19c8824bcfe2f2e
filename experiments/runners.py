"""What an experiment config runs (``experiment.runner``): the concurrency sweep, or a runner for
an experiment that is not one. Each takes ``(run, out_dir, job_name=..., group=...,
job_type=...)`` and returns the points it wrote to ``out_dir/results.jsonl``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from research.config import RunConfig


def _sweep(run: RunConfig, out_dir: str | Path, **kw: Any) -> list[dict]:
    from experiments.sweep import run_experiment

    return run_experiment(run, out_dir, **kw)


def _validate_host(run: RunConfig, out_dir: str | Path, **kw: Any) -> list[dict]:
    from experiments.validate_host import validate_host

    return validate_host(run, out_dir)


def _validate_gb10(run: RunConfig, out_dir: str | Path, **kw: Any) -> list[dict]:
    from experiments.validate_gb10 import validate_gb10

    return validate_gb10(run, out_dir)


def _engine_comparison(run: RunConfig, out_dir: str | Path, **kw: Any) -> list[dict]:
    from experiments.engine_comparison import engine_comparison

    return engine_comparison(run, out_dir, **kw)


def _capacity(run: RunConfig, out_dir: str | Path, **kw: Any) -> list[dict]:
    from experiments.capacity import capacity

    return capacity(run, out_dir, **kw)


RUNNERS: dict[str, Callable[..., list[dict]]] = {
    "sweep": _sweep,
    "validate_host": _validate_host,
    "validate_gb10": _validate_gb10,
    "engine_comparison": _engine_comparison,
    "capacity": _capacity,
}


def get_runner(name: str) -> Callable[..., list[dict]]:
    if name not in RUNNERS:
        raise ValueError(f"unknown experiment.runner {name!r}; expected one of {sorted(RUNNERS)}")
    return RUNNERS[name]
