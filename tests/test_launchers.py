"""Simulated multiruns on Hydra's launchers: joblib, and a killed multirun run again, give the
same summary as one uninterrupted, sequential run (experiments.sweep.point_key /
completed_points); joblib, submitit_local and a local Ray cluster give the same sweep."""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

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


# The same two-job simulated sweep on each of Hydra's local launchers: joblib (a dependency),
# submitit_local (the `slurm` extra: submitit_slurm's executor, run on this machine) and ray
# (the `ray` extra: a local Ray cluster started for the sweep and stopped at its end). Each
# launcher's jobs must land in <sweep dir>/<job number>, where the end-of-sweep comparison
# (experiments/callbacks.py) reads them and writes <sweep dir>/comparison/summary.csv.
TWO_JOBS = [
    "experiment=reproduce_spark",
    "model=llama_3_3_70b",
    "experiment.concurrencies=[1,4]",
    "experiment.prompts_per_concurrency=2",
    "experiment.prediction_band=false",
    "workload.input_len=64",
    "workload.output_len=16",
    # The swept axis: two jobs, whose figures differ at concurrency 4 (2 sequences at a time).
    "engine.max_num_seqs=2,4",
    "tracking=disabled",
]

# hydra/launcher option: (the library it drives, the launcher class Hydra records per job).
LAUNCHERS = {
    "joblib": ("joblib", "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"),
    "submitit_local": (
        "submitit",
        "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher",
    ),
    "ray": ("ray", "hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher"),
}

# summary.csv is compared whole: it holds the series' axes and statistics of figures measured
# on the simulator's virtual clock, and no wall-clock time, path, job id or timestamp column.
# Each job's results.jsonl is compared too, less these keys, which legitimately differ between
# two runs of the same job:
RUN_DEPENDENT = {
    "date": "the wall-clock time the point was written",
    "point_key": "hashes the code with the config (experiments.sweep.point_key: the diff of a "
    "dirty checkout), so an edit to a tracked file between two launchers' runs changes it",
}


def _missing_launchers() -> dict[str, str]:
    """The launchers whose Hydra plugin or library is not installed, with what installs them."""
    from experiments.run import PLUGINS

    missing = {}
    for launcher, (library, _) in LAUNCHERS.items():
        plugin, extra = PLUGINS[f"hydra/launcher={launcher}"]
        if not all(importlib.util.find_spec(m) is not None for m in (plugin, library)):
            missing[launcher] = f"pip install -e '.[{extra}]'" if extra else "pip install -e ."
    return missing


def _session(sid: int) -> dict[int, str]:
    """Live processes (zombies aside) of session ``sid``, by pid, with their command lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, _, _, session = entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[:4]
            cmdline = entry.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(session) == sid and state != "Z":
            found[int(entry.name)] = cmdline.strip()
    return found


def _launch(launcher: str, sweep_dir, *extra: str) -> str:
    """One multirun of TWO_JOBS on ``launcher`` in its own session; fails if any process it
    started (a Ray node's daemons and workers, submitit's or joblib's workers) outlives it."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)  # never join a cluster named by the environment
    # Ray's token authentication with a token of this run's own, given in the environment:
    # otherwise a new local node writes one to ~/.ray/auth_token.
    env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    cmd = [sys.executable, "-m", "experiments.run", "-m", *TWO_JOBS]
    cmd += [f"hydra/launcher={launcher}", f"hydra.sweep.dir={sweep_dir}", *extra]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its session id is its pid: every descendant carries it
    )
    try:
        log, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        left = {}
        if Path("/proc").is_dir():
            deadline = time.monotonic() + 15
            while (left := _session(proc.pid)) and time.monotonic() < deadline:
                time.sleep(0.5)
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, f"{launcher}:\n{log[-3000:]}"
    assert not left, f"{launcher} left processes running: {left}"
    return log


def _jobs(sweep_dir, launcher_class: str) -> list[list[dict]]:
    """Each job's results.jsonl, by job number, less RUN_DEPENDENT; each job must have run
    under ``launcher_class`` (its .hydra/hydra.yaml)."""
    jobs = []
    for num in range(2):
        job = sweep_dir / str(num)
        assert (job / "results.jsonl").is_file(), f"no results.jsonl of job {num} in {job}"
        assert OmegaConf.load(job / ".hydra" / "hydra.yaml").hydra.launcher._target_ == (
            launcher_class
        )
        rows = [json.loads(line) for line in (job / "results.jsonl").read_text().splitlines()]
        jobs.append([{k: v for k, v in r.items() if k not in RUN_DEPENDENT} for r in rows])
    return jobs


@pytest.mark.slow  # three two-job multiruns in subprocesses, one on a fresh Ray node (30-45 s on two cores)
def test_joblib_submitit_and_ray_launchers_write_the_same_sweep(tmp_path):
    missing = _missing_launchers()
    if missing and os.environ.get("RESEARCH_REQUIRE_LAUNCHERS") == "1":
        pytest.fail(f"RESEARCH_REQUIRE_LAUNCHERS=1 and launchers are not installed: {missing}")
    present = [launcher for launcher in LAUNCHERS if launcher not in missing]
    if len(present) < 2:
        pytest.skip(f"Hydra launchers not installed: {missing}")

    # Ray's own folder (sockets, logs) outside tmp_path: its socket paths must stay short.
    ray_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
    extra = {
        "ray": [
            "hydra.launcher.ray.init.address=local",  # a new local node, never a running one
            "++hydra.launcher.ray.init.num_cpus=2",
            "++hydra.launcher.ray.init.include_dashboard=false",
            f"++hydra.launcher.ray.init._temp_dir={ray_dir}",
        ],
    }
    summaries, jobs = {}, {}
    try:
        for launcher in present:
            sweep_dir = tmp_path / launcher
            log = _launch(launcher, sweep_dir, *extra.get(launcher, []))
            if launcher == "ray":  # a node of its own for the sweep (and gone after: _launch)
                assert "Started a local Ray instance" in log
            summary = sweep_dir / "comparison" / "summary.csv"
            assert summary.is_file(), f"{launcher}'s multirun wrote no {summary}"
            summaries[launcher] = _summary(sweep_dir)
            jobs[launcher] = _jobs(sweep_dir, LAUNCHERS[launcher][1])
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)

    first, *others = present
    reference = summaries[first]
    # A real two-job sweep: both values of the axis, two concurrencies each, different figures.
    assert sorted((r["max_num_seqs"], r["max_concurrency"]) for r in reference) == [
        ("2", "1"),
        ("2", "4"),
        ("4", "1"),
        ("4", "4"),
    ]
    at_4 = {
        r["max_num_seqs"]: r["output_throughput_mean"]
        for r in reference
        if r["max_concurrency"] == "4"
    }
    assert at_4["2"] != at_4["4"]
    assert not set(reference[0]) & set(RUN_DEPENDENT)
    for launcher in others:
        assert summaries[launcher] == reference, f"{launcher}'s summary.csv differs from {first}'s"
        assert jobs[launcher] == jobs[first], f"{launcher}'s jobs differ from {first}'s"
    if missing:
        pytest.skip(f"checked {present}; not installed: {missing}")
