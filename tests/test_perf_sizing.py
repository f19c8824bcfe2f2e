"""research.perf.sizing: streams at a speed floor, duty cycle, users under a Poisson margin."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from research.perf.sizing import (
    SizingResult,
    curve_from_points,
    duty_cycle,
    floor_crossing,
    main,
    max_users_for_streams,
    size_users,
    streams_at_floor,
)

# A hand-made MoE-like curve: (max_concurrency, per-user tok/s).
CURVE = [(1, 80.0), (8, 50.0), (32, 18.0), (64, 12.0), (128, 7.0)]


def test_streams_interpolate_between_measured_points():
    # 15 lies between 18 (at 32) and 12 (at 64): 32 + (18 - 15) / (18 - 12) * (64 - 32) = 48.
    assert streams_at_floor(CURVE, 15.0) == pytest.approx(48.0)
    # 10 lies between 12 (at 64) and 7 (at 128): 64 + (12 - 10) / (12 - 7) * 64 = 89.6.
    assert streams_at_floor(CURVE, 10.0) == pytest.approx(89.6)
    assert streams_at_floor(reversed(CURVE), 15.0) == pytest.approx(48.0)  # order does not matter
    # A floor equal to a measured value crosses exactly there.
    assert streams_at_floor(CURVE, 18.0) == pytest.approx(32.0)
    assert streams_at_floor(CURVE, 80.0) == pytest.approx(1.0)


def test_streams_edge_cases():
    assert floor_crossing(CURVE, 100.0) == (0.0, False)  # even one stream is below the floor
    assert floor_crossing(CURVE, 5.0) == (128.0, True)  # never below: a lower bound
    assert floor_crossing([(4, 20.0)], 15.0) == (4.0, True)
    assert floor_crossing([(4, 10.0)], 15.0) == (0.0, False)
    # The first crossing counts, even if the curve comes back above the floor later.
    assert streams_at_floor([(1, 20), (2, 10), (4, 16), (8, 5)], 15) == pytest.approx(1.5)


def test_streams_errors():
    with pytest.raises(ValueError, match="no points"):
        streams_at_floor([], 15)
    with pytest.raises(ValueError, match="repeats a concurrency"):
        streams_at_floor([(1, 20), (1, 18), (2, 10)], 15)
    with pytest.raises(ValueError, match="concurrency"):
        streams_at_floor([(0, 20)], 15)
    with pytest.raises(ValueError, match="tok/s"):
        streams_at_floor([(1, -2)], 15)
    with pytest.raises(ValueError, match="floor_tok_s"):
        streams_at_floor(CURVE, 0)


def test_duty_cycle_is_reference_23_percent():
    # (400 / 15 + 1) / 120 = 27.667 / 120 = 0.2306
    assert duty_cycle() == pytest.approx((400 / 15 + 1) / 120)
    assert round(duty_cycle(), 2) == 0.23
    assert duty_cycle(400, 10.0, 1.0, 120.0) == pytest.approx(41 / 120)
    with pytest.raises(ValueError):
        duty_cycle(tok_s=0)
    with pytest.raises(ValueError):
        duty_cycle(period_s=-1)


def test_max_users_by_hand():
    duty = (400 / 15 + 1) / 120
    # 148 users: a = 34.122, a + 2.33 sqrt(a) = 34.122 + 13.611 = 47.73 <= 48;
    # 149 users: a = 34.353, 34.353 + 13.656 = 48.009 > 48.
    assert max_users_for_streams(48.0, duty) == 148
    assert (
        148 * duty + 2.33 * math.sqrt(148 * duty) <= 48 < 149 * duty + 2.33 * math.sqrt(149 * duty)
    )
    # An exact fit is kept: duty 1, z 2, 4 users -> 4 + 2 * 2 = 8 streams.
    assert max_users_for_streams(8.0, 1.0, z=2.0) == 4
    assert max_users_for_streams(7.999, 1.0, z=2.0) == 3
    assert max_users_for_streams(10.0, 0.5, z=0.0) == 20  # no margin: streams / duty
    assert max_users_for_streams(0.0, duty) == 0
    assert max_users_for_streams(1.0, duty) == 0  # one user needs 0.23 + 2.33 * 0.48 = 1.35


def test_max_users_agrees_with_a_linear_scan():
    for streams in (0.5, 1.0, 3.0, 10.0, 32.0, 47.5, 100.0, 257.3):
        for duty in (0.05, 0.2306, 0.5, 1.0, 2.0):
            n = 0
            while (n + 1) * duty + 2.33 * math.sqrt((n + 1) * duty) <= streams:
                n += 1
            assert max_users_for_streams(streams, duty) == n, (streams, duty)


def test_max_users_errors():
    with pytest.raises(ValueError, match="streams"):
        max_users_for_streams(-1.0, 0.2)
    with pytest.raises(ValueError, match="duty"):
        max_users_for_streams(10.0, 0.0)
    with pytest.raises(ValueError, match="z"):
        max_users_for_streams(10.0, 0.2, z=-1)


def test_size_users_hand_made_curve():
    r = size_users(CURVE)  # floor 15 tok/s, 400 tokens, every 120 s, 1 s TTFT
    assert r.streams == pytest.approx(48.0) and not r.streams_lower_bound
    assert r.duty_cycle == pytest.approx(0.230556, rel=1e-5)
    assert r.users == 148
    assert r.average_streams == pytest.approx(148 * r.duty_cycle)
    assert r.peak_streams == pytest.approx(r.average_streams + 2.33 * math.sqrt(r.average_streams))
    assert r.peak_streams <= r.streams

    r10 = size_users(CURVE, floor_tok_s=10.0)
    # streams 89.6, duty 41/120; 205 users: 70.04 + 2.33 * 8.369 = 89.54 <= 89.6 (206: 89.93).
    assert r10.streams == pytest.approx(89.6)
    assert r10.duty_cycle == pytest.approx(41 / 120)
    assert r10.users == 205

    low = size_users(CURVE, floor_tok_s=5.0)
    assert low.streams == 128 and low.streams_lower_bound
    none = size_users(CURVE, floor_tok_s=100.0)
    assert (none.streams, none.users, none.average_streams) == (0.0, 0, 0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.users = 1
    assert isinstance(r, SizingResult)


def test_curve_from_points_skips_and_averages():
    points = [
        {"max_concurrency": 8, "per_user_tok_s": 40.0},
        {"max_concurrency": 1, "per_user_tok_s": 80.0},
        {"max_concurrency": 8, "per_user_tok_s": 44.0},
        {"max_concurrency": None, "per_user_tok_s": 10.0},  # a request-rate run
        {"max_concurrency": 32, "per_user_tok_s": None},
    ]
    assert curve_from_points(points) == [(1.0, 80.0), (8.0, 42.0)]


def test_cli_reads_ours_and_vllm_results(tmp_path, capsys):
    ours = tmp_path / "results.jsonl"
    with ours.open("w") as f:
        for c, v in CURVE:
            point = {"model": "moe", "quantization": "awq", "max_concurrency": c}
            f.write(json.dumps(point | {"per_user_tok_s": v}) + "\n")
        for c, v in [(1, 6.0), (8, 5.0)]:
            f.write(
                json.dumps({"model": "dense", "max_concurrency": c, "per_user_tok_s": v}) + "\n"
            )
    # A vLLM --save-result file: no per_user_tok_s, only median TPOT (1000 / 50 ms = 20 tok/s).
    vllm = tmp_path / "vllm.json"
    vllm.write_text(
        json.dumps(
            [
                {"model_id": "big", "max_concurrency": 1, "median_tpot_ms": 50.0, "ttfts": [0.1]},
                {"model_id": "big", "max_concurrency": 4, "median_tpot_ms": 100.0},
            ]
        )
    )
    assert main([str(ours), str(vllm), "--floor", "15", "--floor", "10"]) == 0
    out = capsys.readouterr().out
    assert "| model=moe, quantization=awq | 15 | 48.0 | 23.1% | 148 |" in out
    assert "| model=moe, quantization=awq | 10 | 89.6 | 34.2% | 205 |" in out
    assert "| model=dense | 15 | 0.0 |" in out
    # big: 20 tok/s at 1, 10 at 4 -> floor 15 at 1 + 5/10 * 3 = 2.5 streams
    assert "| model=big | 15 | 2.5 |" in out
    assert "| model=big | 10 | >= 4.0 |" in out and "lower bound" in out
    assert "shared:" not in out  # no key has one value on every curve


def test_cli_as_a_module(tmp_path):
    import subprocess
    import sys

    import research.perf

    assert research.perf.size_users is size_users  # public name, loaded on first use
    path = tmp_path / "results.jsonl"
    path.write_text(
        "\n".join(
            json.dumps({"model": "m", "max_concurrency": c, "per_user_tok_s": v}) for c, v in CURVE
        )
    )
    run = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "research.perf.sizing", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "| model=m | 15 | 48.0 | 23.1% | 148 |" in run.stdout and not run.stderr


def test_cli_takes_a_run_directory(tmp_path, capsys):
    """A run (or multirun) folder stands for the results.jsonl files below it; a folder with
    none is a clear error, not IsADirectoryError."""
    run = tmp_path / "outputs" / "run"
    run.mkdir(parents=True)
    lines = [{"model": "moe", "max_concurrency": c, "per_user_tok_s": v} for c, v in CURVE]
    (run / "results.jsonl").write_text("".join(json.dumps(p) + "\n" for p in lines))
    assert main([str(tmp_path / "outputs"), "--floor", "15"]) == 0
    assert "| model=moe | 15 | 48.0 |" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        main([str(tmp_path / "empty")])
    assert "no results.jsonl below it" in capsys.readouterr().err


# One configuration of experiment=reproduce_spark as its results rows carry it.
SPARK = {
    "model": "qwen3-coder-30b-a3b",
    "label": "simulated-gb10 qwen3-coder-30b-a3b awq",
    "hardware": "gb10",
    "engine": "vllm",
    "quantization": "awq",
    "kv_cache_dtype": "auto",
    "dtype": "bfloat16",
    "executor": "simulated",
    "block_size": 16,
    "enable_prefix_caching": True,
    "input_len": 512,
    "output_len": 256,
    "request_rate": "inf",
}


def test_varying_labels_name_what_varies_and_caption_what_is_shared():
    from research.bench.stats import varying_labels

    keys = ("model", "hardware", "engine", "quantization", "block_size")
    rows = [
        {"model": "qwen3-coder-30b-a3b", "hardware": "gb10", "engine": "vllm",
         "quantization": "awq", "block_size": 16},
        {"model": "llama-3.3-70b", "hardware": "gb10", "engine": "vllm",
         "quantization": "awq", "block_size": 16},
        {"model": "llama-3.3-70b", "hardware": "gb10", "engine": "vllm",
         "quantization": "fp8", "block_size": 16},
    ]  # fmt: skip
    labels, caption = varying_labels(rows, keys)
    assert labels == [
        "model=qwen3-coder-30b-a3b, quantization=awq",
        "model=llama-3.3-70b, quantization=awq",
        "model=llama-3.3-70b, quantization=fp8",
    ]
    assert caption == "shared: hardware=gb10, engine=vllm, block_size=16"
    # One field apart: only that field names the curves.
    labels, caption = varying_labels(rows[1:], keys)
    assert labels == ["quantization=awq", "quantization=fp8"]
    assert caption == "shared: model=llama-3.3-70b, hardware=gb10, engine=vllm, block_size=16"
    # One run, or all equal: the model names the curve, the caption holds the rest.
    labels, caption = varying_labels(rows[:1], keys)
    assert labels == ["model=qwen3-coder-30b-a3b"]
    assert caption == "shared: hardware=gb10, engine=vllm, quantization=awq, block_size=16"
    # A key one run lacks (no speculation) is left out of its name, or written key=- when the
    # name would otherwise be empty.
    spec = [{"model": "m"}, {"model": "m", "speculative_method": "ngram"}]
    assert varying_labels(spec, ("model", "speculative_method")) == (
        ["speculative_method=-", "speculative_method=ngram"],
        "shared: model=m",
    )


def test_cli_names_curves_by_what_varies(tmp_path, capsys):
    """reproduce_spark's two models and an fp8 run in one folder: each curve is named by the
    keys that differ (key=value), the keys every curve shares are one line under the table."""
    run = tmp_path / "run"
    run.mkdir()
    configs = [
        SPARK,
        SPARK | {"model": "llama-3.3-70b", "label": "simulated-gb10 llama-3.3-70b awq"},
        SPARK | {"quantization": "fp8", "label": "simulated-gb10 qwen3-coder-30b-a3b fp8"},
    ]
    lines = [
        config | {"max_concurrency": c, "per_user_tok_s": v} for config in configs for c, v in CURVE
    ]
    (run / "results.jsonl").write_text("".join(json.dumps(p) + "\n" for p in lines))
    assert main([str(tmp_path), "--floor", "15"]) == 0
    out = capsys.readouterr().out
    curves = [line.split(" | ")[0][2:] for line in out.splitlines() if line.startswith("| model")]
    assert curves == [
        "model=qwen3-coder-30b-a3b, quantization=awq",
        "model=llama-3.3-70b, quantization=awq",
        "model=qwen3-coder-30b-a3b, quantization=fp8",
    ]
    shared = [line for line in out.splitlines() if line.startswith("shared: ")]
    assert shared == [
        "shared: hardware=gb10, engine=vllm, kv_cache_dtype=auto, dtype=bfloat16, "
        "executor=simulated, block_size=16, enable_prefix_caching=True, input_len=512, "
        "output_len=256"
    ]
    # One configuration: named by its model, everything else in the caption.
    (run / "results.jsonl").write_text("".join(json.dumps(p) + "\n" for p in lines[: len(CURVE)]))
    assert main([str(tmp_path), "--floor", "15"]) == 0
    out = capsys.readouterr().out
    assert "| model=qwen3-coder-30b-a3b | 15 | 48.0 | 23.1% | 148 |" in out
    assert "shared: hardware=gb10, engine=vllm, quantization=awq, kv_cache_dtype=auto" in out
