"""Simulated multiruns on Hydra's joblib launcher, and a killed multirun run again: the same
summary as one uninterrupted, sequential run (experiments.sweep.point_key / completed_points)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

from tests.test_experiments import ROOT

SWEEP = [
    "experiment=reproduce_spark",
    "model=llama_3_3_70b",
    "experiment.concurrencies=[1,8]",
    "experiment.prediction_band=false",
    "cache.block_size=8,16,32",
    "tracking=disabled",
]


def _multirun(sweep_dir, *extra):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [
        sys.executable,
        "-m",
        "experiments.run",
        "-m",
        *SWEEP,
        *extra,
        f"hydra.sweep.dir={sweep_dir}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _summary(sweep_dir):
    with (sweep_dir / "comparison" / "summary.csv").open() as f:
        return [{k: v for k, v in row.items()} for row in csv.DictReader(f)]


@pytest.mark.slow  # three multiruns in subprocesses (about 40 s)
def test_joblib_equals_sequential_and_a_killed_multirun_computes_only_what_is_missing(tmp_path):
    sequential, parallel = tmp_path / "seq", tmp_path / "par"
    seq = _multirun(sequential, "hydra/launcher=basic")
    par = _multirun(parallel)  # executor=simulated picks Hydra's joblib launcher
    assert "Joblib.Parallel" in par.stdout + par.stderr and "Joblib" not in seq.stdout + seq.stderr
    assert _summary(parallel) == _summary(sequential)

    # Interrupt job 0 after its first point (a torn last line) and job 2 before any point.
    first = parallel / "0" / "results.jsonl"
    lines = first.read_text().splitlines()
    first.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])
    (parallel / "2" / "results.jsonl").unlink()
    again = _multirun(parallel)
    log = again.stdout + again.stderr
    # Job 0 keeps its one complete point, job 1 both of its points, job 2 computes both.
    assert "skipped 1 point(s) already complete" in log
    assert "skipped 2 point(s) already complete" in log and log.count("skipped") == 2
    assert _summary(parallel) == _summary(sequential)
    assert [json.loads(x)["max_concurrency"] for x in first.read_text().splitlines()] == [1, 8]
