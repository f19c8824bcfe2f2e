"""research.tracking against a recording stand-in for wandb: what a W&B user sees (the x-axis,
one line per series, the summary, the artifact, the run's group and tags). The real offline
run is exercised end to end by tests/test_experiments.py."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from research.tracking import Tracker


class _Run:
    def __init__(self, root: Path, **kwargs):
        self.init = kwargs
        self.dir = str(root / "wandb" / "offline-run-x" / "files")
        self.metrics: list[tuple] = []
        self.rows: list[dict] = []
        self.summary: dict = {}
        self.artifacts: list = []
        self.finished = False

    def define_metric(self, name, step_metric=None, summary=None):
        self.metrics.append((name, step_metric))
        self.summaries = getattr(self, "summaries", {}) | {name: summary}

    def log(self, row):
        self.rows.append(row)

    def log_artifact(self, artifact):
        self.artifacts.append(artifact)

    def finish(self):
        self.finished = True


class _Artifact:
    def __init__(self, name, type):
        self.name, self.type, self.files = name, type, []

    def add_file(self, path):
        self.files.append(Path(path).name)


@pytest.fixture
def fake_wandb(monkeypatch, tmp_path):
    module = types.ModuleType("wandb")
    module.runs = []
    module.series_calls = []

    def init(**kwargs):
        module.runs.append(_Run(tmp_path, **kwargs))
        return module.runs[-1]

    def line_series(**kwargs):
        module.series_calls.append(kwargs)
        return ("line_series", kwargs["title"])

    module.init = init
    module.Settings = lambda **kw: kw
    module.Image = lambda path: ("image", Path(path).name)
    module.Artifact = _Artifact
    module.Table = lambda columns, data: ("table", columns, data)
    module.plot = types.SimpleNamespace(line_series=line_series)
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def _point(label: str, c: int, tput: float) -> dict:
    return {
        "label": label,
        "model": label.split()[-1],
        "executor": "simulated",
        "max_concurrency": c,
        "output_throughput": tput,
        "per_user_tok_s": tput / c,
        "median_ttft_ms": 10.0 * c,
        "nested": {"ignored": 1},
    }


def test_one_line_per_series_on_the_concurrency_axis_with_a_headline(fake_wandb, tmp_path):
    tracker = Tracker(
        tmp_path, {"a": 1}, name="job-x", group="reproduce_spark", tags=("gb10", "awq", "gb10")
    )
    run = fake_wandb.runs[0]
    assert (run.init["group"], run.init["job_type"], run.init["name"]) == (
        "reproduce_spark",
        "sweep",
        "job-x",
    )
    assert run.init["tags"] == ["awq", "gb10"]
    assert ("*", "max_concurrency") in run.metrics
    assert run.summaries["*"] == "none"  # no "last row logged" summary: finish sets it

    points = [_point("sim moe", c, 20.0 * c) for c in (8, 1, 32)]
    points += [_point("sim dense", c, t) for c, t in ((1, 5.0), (8, 30.0), (32, 25.0))]
    for p in points:
        tracker.log_point(p)
    assert run.rows[0]["max_concurrency"] == 8 and run.rows[0]["label"] == "sim moe"
    assert "nested" not in run.rows[0]

    png = tmp_path / "curves.png"
    png.write_bytes(b"png")
    tracker.log_plots([png])
    call = next(c for c in fake_wandb.series_calls if "output_throughput" in c["title"])
    assert call["keys"] == ["sim moe", "sim dense"]  # two lines, not one zig-zag
    assert call["xs"] == [[1, 8, 32], [1, 8, 32]]
    assert call["ys"][1] == [5.0, 30.0, 25.0]

    results = tmp_path / "results.jsonl"
    results.write_text("{}\n")
    tracker.log_files([results, png, tmp_path / "missing.csv"])
    assert run.artifacts[0].files == ["results.jsonl", "curves.png"]

    tracker.finish()
    assert run.finished
    assert run.summary["sim dense/peak_output_throughput"] == 30.0
    assert run.summary["sim dense/peak_at_concurrency"] == 8
    assert run.summary["sim moe/per_user_tok_s_at_32"] == pytest.approx(20.0)
    assert tracker.sync_command() == f"wandb sync {tmp_path / 'wandb' / 'offline-run-x'}"


def test_disabled_tracking_touches_nothing(fake_wandb, tmp_path):
    tracker = Tracker(tmp_path, {}, mode="disabled")
    tracker.log_point(_point("a", 1, 1.0))
    tracker.log_plots([])
    tracker.finish()
    assert fake_wandb.runs == [] and tracker.sync_command() is None


def test_repeats_are_averaged_into_one_line_and_the_headline(fake_wandb, tmp_path):
    tracker = Tracker(tmp_path, {}, name="x")
    for rep, t in enumerate((10.0, 14.0)):
        tracker.log_point(_point("sim moe", 8, t) | {"repeat": rep})
    tracker.log_point(_point("sim moe", 1, 3.0))
    assert tracker.series("output_throughput") == {"sim moe": [(1, 3.0), (8, 12.0)]}
    tracker.finish()
    assert fake_wandb.runs[0].summary["sim moe/peak_output_throughput"] == 12.0


def test_a_comparison_is_a_run_of_its_sweeps_group(fake_wandb, tmp_path):
    from research.bench.stats import series_of, summary_rows
    from research.tracking import log_comparison

    points = [_point(f"sim {m}", c, t) for m, t in (("a", 1.0), ("b", 2.0)) for c in (1, 8)]
    series = series_of(points)
    rows = summary_rows(series, ["output_throughput"])
    log_comparison(tmp_path, series, rows, ["output_throughput"], group="abl/2026-12-04-10-00")
    run = fake_wandb.runs[0]
    assert (run.init["job_type"], run.init["group"]) == ("comparison", "abl/2026-12-04-10-00")
    call = fake_wandb.series_calls[0]
    assert call["keys"] == ["model=a", "model=b"] and call["ys"] == [[1.0, 1.0], [2.0, 2.0]]
    table = run.rows[0]["comparison/summary"]
    assert "output_throughput_ci_lo" in table[1] and len(table[2]) == 4
    assert run.finished


def test_run_names_say_the_swept_values_and_groups_the_sweep():
    import types as t

    from hydra.types import RunMode

    from experiments.run import job_name, sweep_group
    from research.config import RunConfig

    run = RunConfig()
    overrides = ["experiment=reproduce_spark", "cache.block_size=8", "model=llama_3_3_70b",
                 "hydra.sweep.dir=/x", "tracking=disabled", "output_dir=/o"]  # fmt: skip
    assert job_name(run, overrides) == "concurrency_sweep block_size=8 model=llama_3_3_70b"
    hydra_cfg = t.SimpleNamespace(
        mode=RunMode.MULTIRUN,
        sweep=t.SimpleNamespace(dir="multirun/2026-12-04/10-00-00"),
        runtime=t.SimpleNamespace(output_dir="multirun/2026-12-04/10-00-00/0"),
    )
    assert sweep_group(run, hydra_cfg) == ("concurrency_sweep/2026-12-04-10-00-00", "multirun-job")
    hydra_cfg.mode = RunMode.RUN
    hydra_cfg.runtime.output_dir = "outputs/2026-12-04/11-00-00"
    assert sweep_group(run, hydra_cfg) == ("concurrency_sweep/2026-12-04-11-00-00", "run")
