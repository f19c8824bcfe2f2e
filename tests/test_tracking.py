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

    def define_metric(self, name, step_metric=None):
        self.metrics.append((name, step_metric))

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
