"""The experiments app: Hydra composition against the RunConfig schema, and a whole sweep on
a tiny model leaving results.jsonl, plots and an offline W&B run in its directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from research.bench import read_results
from research.config import RunConfig, register_configs, run_config_from

CONFIGS = str(Path(__file__).resolve().parents[1] / "configs")
ROOT = Path(__file__).resolve().parents[1]


def _compose(overrides: list[str]) -> RunConfig:
    register_configs()
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        return run_config_from(compose(config_name="config", overrides=overrides))


def test_defaults_compose_to_the_dataclass_defaults_of_the_main_job():
    run = _compose([])
    assert run.model.model == "smollm2-135m"
    assert run.experiment.concurrencies == (1, 4, 16, 64)
    assert run.experiment.prompts_per_concurrency == 3
    assert run.tracking.wandb_mode == "offline"
    assert run.engine.name == "vllm"
    assert run.cache.block_size is None  # the engine profile's (vLLM: 16)
    from research.perf.engines.serving import from_run

    serving = from_run(run)
    assert (serving.profile.scheduling_policy, serving.block_size) == ("continuous", 16)


def test_groups_and_overrides_select_values():
    run = _compose(
        ["quantization=awq_kv_fp8", "engine=static", "cache.block_size=32", "workload=spark"]
    )
    assert (run.quantization.quantization, run.quantization.kv_cache_dtype) == ("awq", "fp8")
    assert run.engine.name == "static"
    assert run.cache.block_size == 32
    assert (run.workload.input_len, run.workload.output_len) == (512, 256)


@pytest.mark.parametrize(
    "override, error",
    [
        ("cache.block_size=sixteen", (ValidationError, ConfigCompositionException)),
        ("+cache.bogus=1", (ConfigCompositionException, ValidationError, ValueError)),
    ],
)
def test_schema_rejects_wrong_types_and_unknown_keys(override, error):
    with pytest.raises(error):
        _compose([override])


def test_dataclass_validation_runs_on_composed_values():
    with pytest.raises(ValueError, match="quantization must be one of"):
        _compose(["quantization.quantization=int3"])
    with pytest.raises(ValueError, match="range_ratio"):
        _compose(["workload.range_ratio=1.5"])


def test_sweep_writes_results_plots_and_offline_wandb(tmp_path):
    """The CLI end to end on tiny-llama: the same code path as the README's main job."""
    out = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "WANDB_SILENT": "true"}
    cmd = [
        sys.executable,
        "-m",
        "experiments.run",
        "model=tiny_llama",
        "experiment.concurrencies=[1,4]",
        "experiment.prompts_per_concurrency=2",
        "workload.input_len=16",
        "workload.output_len=8",
        "workload.range_ratio=0.5",
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = read_results(out / "results.jsonl")
    assert [p["max_concurrency"] for p in points] == [1, 4]
    for p, c in zip(points, (1, 4), strict=True):
        assert p["completed"] == 2 * c and p["failed"] == 0
        assert p["output_throughput"] > 0 and p["per_user_tok_s"] > 0
        assert p["executor"] == "real" and p["model"] == "tiny-llama"
        assert p["num_scheduler_steps"] == 1
        assert 0.0 <= p["host_overhead_fraction"] < 1.0
        # every step shape compiled before the clock, even with mixed lengths
        assert p["step_traces"] == 0 and p["new_compilations"] == 0
        # one forward pass per step, mixed steps included; the shapes it compiled, said
        assert p["forward_passes_per_step"] == 1.0 and p["compiled_shapes"] >= 1
        assert p["attention_backend_reason"]
        # roofline columns: the padded calls' work over the steps' time, against measured peaks
        assert p["peak_gflops"] > 0 and p["peak_gbps"] > 0
        assert p["achieved_gflops"] == pytest.approx(p["flops_fraction"] * p["peak_gflops"])
        assert 0 < p["flops_fraction"] < 1.0
    for p in points:  # provenance on every row
        assert len(p["git_commit"]) == 40 and isinstance(p["git_dirty"], bool)
        assert p["versions"]["jax"] and p["versions"]["python"]
        assert p["device_kind"] == "cpu" and p["device_count"] >= 1
        assert p["seeds"]["prompts"] == p["seeds"]["workload"] * 1_000_003 + p["max_concurrency"]
        assert p["config"]["model"]["model"] == "tiny-llama"
    import csv

    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["max_concurrency"]) for r in rows] == [1, 4]
    assert float(rows[1]["output_throughput"]) == pytest.approx(points[1]["output_throughput"])
    assert rows[0]["git_commit"] == points[0]["git_commit"]
    for name in ("concurrency_curves.png", "ttft.png"):
        assert (out / name).stat().st_size > 10_000
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), "no offline W&B run file"
    assert f"upload it with: wandb sync {runs[0]}" in proc.stdout
    # progress goes through logging: Hydra's run.log keeps it, with timestamps
    log = (tmp_path / "hydra" / "run.log").read_text()
    assert "KV cache: " in log and "[2/2] concurrency    4:" in log and "][INFO] - " in log
    config = json.loads((out / "run_config.json").read_text())
    assert config["model"]["model"] == "tiny-llama"
    assert "| ours tiny-llama | 4 |" in proc.stdout
    # vLLM's start-up line: the pool and how many of the workload's requests it holds
    assert (
        "KV cache: " in proc.stdout and "maximum concurrency for 24-token requests" in proc.stdout
    )
    # The same output_dir again would append a second run's points to the first's: refused.
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode != 0 and "already exists" in again.stderr
    assert len(read_results(out / "results.jsonl")) == 2


def test_compare_plots_several_result_files(tmp_path, capsys):
    from experiments.compare import main as compare

    for name, scale in (("a", 1.0), ("b", 2.0)):
        lines = [
            json.dumps({"max_concurrency": c, "output_throughput": scale * c, "median_tpot_ms": 10})
            for c in (1, 2, 4)
        ]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    paths = compare(
        [
            str(tmp_path / "a.jsonl"),
            str(tmp_path / "b.jsonl"),
            "--labels",
            "block16",
            "block32",
            "--metrics",
            "output_throughput",
            "--out",
            str(tmp_path / "cmp"),
        ]
    )
    assert [p.name for p in paths] == ["output_throughput.png"]
    assert paths[0].stat().st_size > 5_000
    out = capsys.readouterr().out
    assert "| block32 | 4 | 1 | 8.00 |" in out


def test_compare_reads_a_multirun_folder_in_job_order_with_labels_that_say_what_varied(
    tmp_path, capsys
):
    """A Hydra multirun folder as one argument: jobs in natural order (2 before 10), each line
    labelled by the factors that differ (key=value), what they share one line under the table; a
    misspelt metric is an error that lists the known ones."""
    from experiments.compare import main as compare

    for job, policy, block in ((10, "static", 16), (2, "continuous", 16), (3, "continuous", 8)):
        run = tmp_path / "multirun" / str(job) / "run"
        run.mkdir(parents=True)
        points = [
            {
                "label": "ours tiny-llama",
                "max_concurrency": c,
                "output_throughput": float(job * c),
                "scheduling_policy": policy,
                "block_size": block,
                "model": "tiny-llama",
            }
            for c in (1, 4)
        ]
        (run / "results.jsonl").write_text("".join(json.dumps(p) + "\n" for p in points))
    out_dir = tmp_path / "cmp"
    argv = [str(tmp_path / "multirun"), "--metrics", "output_throughput", "--out", str(out_dir)]
    compare(argv)
    table = capsys.readouterr().out
    labels = [
        "scheduling_policy=continuous, block_size=16",
        "scheduling_policy=continuous, block_size=8",
        "scheduling_policy=static, block_size=16",
    ]
    rows = [line for line in table.splitlines() if line.startswith("| scheduling_policy=")]
    assert [r.split(" | ")[0][2:] for r in rows[::2]] == labels  # jobs 2, 3, 10
    assert "| 4 | 1 | 40.0 |" in rows[-1]
    assert "\nshared: model=tiny-llama, request_rate=inf\n" in table
    assert "shared: model=tiny-llama, request_rate=inf" in (out_dir / "table.md").read_text()
    with pytest.raises(SystemExit):
        compare([*argv[:2], "output_througput", "--out", str(out_dir)])
    assert "no point has the metric(s) ['output_througput']" in capsys.readouterr().err


def test_an_override_nothing_reads_is_an_error():
    with pytest.raises(ValueError, match=r"unknown config keys \['foo'\]"):
        _compose(["+foo=1"])


def test_a_model_chosen_on_the_command_line_replaces_the_experiments_list():
    from experiments.run import model_override

    overrides = ["experiment=reproduce_spark", "model=llama_3_3_70b"]
    run = model_override(_compose(overrides), overrides)
    assert run.experiment.models == ("llama-3.3-70b",)
    both = model_override(_compose(overrides[:1]), overrides[:1])
    assert both.experiment.models == ("qwen3-coder-30b-a3b", "llama-3.3-70b")


def test_a_pool_smaller_than_one_request_says_so(tmp_path):
    from experiments.sweep import run_experiment

    run = _compose(
        [
            "model=tiny_llama",
            "experiment.concurrencies=[2]",
            "experiment.prompts_per_concurrency=1",
            "experiment.warmup=false",
            "workload.input_len=40",
            "workload.output_len=8",
            "cache.num_kv_blocks=2",
            "tracking=disabled",
        ]
    )
    with pytest.raises(ValueError, match=r"every request failed.*exceeds the whole KV pool"):
        run_experiment(run, tmp_path / "run", progress=False)


def test_compare_groups_by_factors_and_vllm_files_by_model(tmp_path, capsys):
    """--group-by labels lines by the chosen factors (colour by the first, style by the
    second) and writes summary.csv with PDF/SVG figures; vLLM --save-result files (one per
    concurrency) become one curve per model_id."""
    import csv

    from experiments.compare import main as compare
    from experiments.compare import styles

    for job, policy, block in ((0, "static", 16), (1, "continuous", 16), (2, "continuous", 8)):
        run = tmp_path / "multirun" / str(job)
        run.mkdir(parents=True)
        points = [
            {
                "label": "ours tiny-llama",
                "max_concurrency": c,
                "output_throughput": float((job + 1) * c),
                "scheduling_policy": policy,
                "block_size": block,
            }
            for c in (4, 1)
        ]
        (run / "results.jsonl").write_text("".join(json.dumps(p) + "\n" for p in points))
    out = tmp_path / "cmp"
    argv = [str(tmp_path / "multirun"), "--metrics", "output_throughput", "--out", str(out)]
    compare([*argv, "--group-by", "scheduling_policy,block_size"])
    with (out / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["label"], r["max_concurrency"]) for r in rows[:2]] == [
        ("scheduling_policy=static, block_size=16", "1"),
        ("scheduling_policy=static, block_size=16", "4"),
    ]
    assert len(rows) == 6 and float(rows[-1]["output_throughput_mean"]) == 12.0
    assert (out / "output_throughput.pdf").exists() and (out / "output_throughput.svg").exists()
    style = styles([r["label"] for r in rows[::2]])
    a, b, c = style.values()
    assert a["color"] != b["color"] == c["color"]  # colour: policy
    assert a["linestyle"] == b["linestyle"] != c["linestyle"]  # style: block size
    with pytest.raises(SystemExit):
        compare([*argv, "--group-by", "bogus"])
    assert "--group-by bogus: no point has it" in capsys.readouterr().err

    vllm = tmp_path / "vllm"
    vllm.mkdir()
    for model in ("org/a", "org/b"):
        for c in (1, 8):
            result = {
                "model_id": model,
                "max_concurrency": c,
                "num_prompts": 3 * c,
                "request_rate": "inf",
                "output_throughput": 10.0 * c,
            }
            (vllm / f"{model[-1]}-{c}.json").write_text(json.dumps(result))
    files = sorted(str(p) for p in vllm.glob("*.json"))
    capsys.readouterr()
    compare([*files, "--metrics", "output_throughput", "--out", str(tmp_path / "v")])
    with (tmp_path / "v" / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["label"], r["max_concurrency"]) for r in rows] == [
        ("org/a", "1"),
        ("org/a", "8"),
        ("org/b", "1"),
        ("org/b", "8"),
    ]


def test_a_multirun_ends_with_its_comparison(tmp_path):
    """One command from a -m sweep to a labelled comparison figure and summary.csv (the Hydra
    callback runs experiments.compare on the sweep folder)."""
    import csv

    sweep = tmp_path / "sweep"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [
        sys.executable,
        "-m",
        "experiments.run",
        "-m",
        "experiment=reproduce_spark",
        "model=llama_3_3_70b",
        "experiment.concurrencies=[1,8]",
        "experiment.prediction_band=false",
        "cache.block_size=16,32",
        "tracking=disabled",
        f"hydra.sweep.dir={sweep}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with (sweep / "comparison" / "summary.csv").open() as f:
        labels = [row["label"] for row in csv.DictReader(f)]
    # Named by what the sweep varied; what its jobs share is the tables' caption line.
    assert labels == ["block_size=16", "block_size=16", "block_size=32", "block_size=32"]
    table = (sweep / "comparison" / "table.md").read_text()
    assert "\nshared: model=llama-3.3-70b, hardware=gb10, engine=vllm, quantization=awq," in table
    for suffix in (".png", ".pdf", ".svg"):
        assert (sweep / "comparison" / f"output_throughput{suffix}").exists()


def test_preemptions_are_said(tmp_path, caplog):
    """Concurrency beyond the pool preempts, and the sweep says how often (it was silent)."""
    import logging

    from experiments.sweep import run_experiment

    run = _compose(
        [
            "model=tiny_llama",
            "experiment.concurrencies=[8]",
            "experiment.prompts_per_concurrency=1",
            "experiment.warmup=false",
            "workload.input_len=40",
            "workload.output_len=24",
            "cache.num_kv_blocks=12",
            "tracking=disabled",
        ]
    )
    with caplog.at_level(logging.INFO, logger="experiments.sweep"):
        (point,) = run_experiment(run, tmp_path / "run", progress=False)
    assert point["num_preemptions"] > 0 and point["failed"] == 0
    said = f"{point['num_preemptions']} preemptions: concurrency 8 needs more KV cache"
    assert said in caplog.text
    assert "maximum concurrency for 64-token requests: 3.0x" in caplog.text


@pytest.mark.parametrize(
    ("override", "label"),
    [("hardware.tensor_parallel_size=2", "ours-tp2"), ("hardware.num_replicas=2", "ours-x2")],
)
def test_real_tensor_parallel_and_replicas_run_from_hydra(override, label, tmp_path):
    """On this machine: TP over two XLA host devices (requested before JAX starts), and two
    replica processes behind the router, measured over HTTP; nothing lost in either."""
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    cmd = [
        sys.executable,
        "-m",
        "experiments.run",
        "model=tiny_llama",
        override,
        "model.max_model_len=64",
        "experiment.concurrencies=[1,4]",
        "experiment.prompts_per_concurrency=2",
        "workload.input_len=16",
        "workload.output_len=8",
        "tracking=disabled",
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = read_results(out / "results.jsonl")
    assert [p["completed"] for p in points] == [2, 8]
    assert all(p["failed"] == 0 and p["label"].startswith(label) for p in points)
