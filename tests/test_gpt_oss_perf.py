"""gpt-oss-120b in the simulator: sliding-window layers read at most their window, attention
sinks and expert biases are priced, experts are MXFP4 with bf16 attention (as openai ships it),
and the KV pool counts the sliding layers apart; the gpt_oss_spark sweep runs."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from research.config import register_configs, run_config_from
from research.models.presets import get_preset
from research.perf.attention import window_pairs
from research.perf.cost_model import CostModel, StepShape
from research.perf.kv_capacity import (
    kv_bytes_per_token,
    kv_capacity,
    sliding_blocks_per_seq,
    weight_bytes,
)

CONFIGS = str(Path(__file__).resolve().parents[1] / "configs")
GPT_OSS = get_preset("gpt-oss-120b")
ALL_FULL = dataclasses.replace(GPT_OSS, layer_types=())  # the same model priced without windows


def test_preset_shapes_and_published_parameter_count():
    assert GPT_OSS.sliding_layers == 18 and GPT_OSS.layer_window(0) == 128
    assert GPT_OSS.layer_window(1) is None
    assert GPT_OSS.rope_scaling.rope_type == "yarn" and GPT_OSS.rope_scaling.factor == 32
    total = weight_bytes(GPT_OSS, None, "float32") / 4  # parameters
    assert total / 1e9 == pytest.approx(116.8, rel=0.01)


def test_window_pairs_by_brute_force():
    for n, c, w in [(1, 0, 8), (1, 100, 8), (5, 3, 8), (20, 0, 8), (20, 5, 128), (3, 200, 128)]:
        assert window_pairs(n, c, w) == sum(min(c + i + 1, w) for i in range(n))


@pytest.mark.parametrize("batch", [1, 64])
def test_windowed_attention_reads_less_kv_for_long_contexts(batch):
    windowed, full = CostModel(GPT_OSS, "mxfp4", "gb10"), CostModel(ALL_FULL, "mxfp4", "gb10")
    short = StepShape.decode(batch, 100)  # inside the window: the same bytes
    assert windowed.breakdown(short)["attention_bytes"] == full.breakdown(short)["attention_bytes"]
    long = StepShape.decode(batch, 8000)
    got, ref = windowed.breakdown(long), full.breakdown(long)
    assert got["attention_bytes"] < 0.55 * ref["attention_bytes"]
    assert got["attention_flops"] < 0.55 * ref["attention_flops"]
    assert got["total_s"] < ref["total_s"]
    # Exactly: 18 full layers read the 8,001-token context, 18 sliding ones the 9 pages that
    # hold keys 7,873 .. 8,000 (whole pages of 16), plus every layer writes one token.
    per_layer = kv_bytes_per_token(GPT_OSS) / 36
    pages_full, pages_window = math.ceil(8001 / 16), 8000 // 16 - 7873 // 16 + 1
    read = batch * 16 * per_layer * (18 * pages_full + 18 * pages_window)
    expected = read / windowed.page_efficiency + batch * kv_bytes_per_token(GPT_OSS)
    assert got["attention_bytes"] == pytest.approx(expected)


def test_sinks_add_attention_flops():
    no_sinks = CostModel(dataclasses.replace(GPT_OSS, attention_sinks=False), "mxfp4", "gb10")
    with_sinks = CostModel(GPT_OSS, "mxfp4", "gb10")
    shape = StepShape.decode(4, 50)
    extra = (
        with_sinks.breakdown(shape)["attention_flops"]
        - no_sinks.breakdown(shape)["attention_flops"]
    )
    assert extra == 2 * 64 * 4 * 36


def test_mxfp4_experts_with_bf16_attention():
    cm = CostModel(GPT_OSS, "mxfp4", "gb10")
    d = f = 2880
    # One expert: gate, up, down as MXFP4 (half a byte per weight + one E8M0 byte per 32),
    # its bf16 biases beside them.
    assert cm.expert_bytes_per_layer[0] == 3 * d * f // 2 + 3 * d * f // 32 + 2 * (2 * f + d)
    attention = 2 * (2 * d * 64 * 64 + 2 * d * 8 * 64)  # q, o and k, v in bf16
    assert cm.dense_layer_bytes > 36 * attention
    # The checkpoint openai ships is ~65 GB.
    assert weight_bytes(GPT_OSS, "mxfp4") / 1e9 == pytest.approx(65.2, rel=0.01)


def test_kv_capacity_counts_sliding_layers_apart():
    cap = kv_capacity(GPT_OSS, "mxfp4", "gb10", 0.85, 16, max_num_seqs=1024)
    # A block holds 18 layers of one kind: the full-attention layers' share (REFERENCE).
    assert cap.kv_bytes_per_token == 36_864 == kv_bytes_per_token(GPT_OSS, layers="pool")
    assert cap.num_blocks == math.floor(cap.available_bytes / (16 * 36_864))
    assert sliding_blocks_per_seq(GPT_OSS, 16) == cap.sliding_blocks_per_seq == 9
    # 1,900 tokens: 119 blocks of the full layers, at most 9 of the sliding ones.
    assert cap.max_sequences(1900) == cap.num_blocks // (119 + 9)
    # Without windows every layer's KV grows with the sequence: about half as many fit.
    full = kv_capacity(ALL_FULL, "mxfp4", "gb10", 0.85, 16, max_num_seqs=1024)
    assert full.kv_bytes_per_token == 2 * 36_864 and full.sliding_blocks_per_seq == 0
    assert full.max_sequences(1900) < 0.55 * cap.max_sequences(1900)


def test_gpt_oss_spark_sweep_runs(tmp_path):
    from experiments.sweep import run_experiment

    register_configs()
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        run = run_config_from(
            compose(
                config_name="config",
                overrides=[
                    "experiment=gpt_oss_spark",
                    "experiment.concurrencies=[1,4]",
                    "experiment.prompts_per_concurrency=1",
                    "workload.output_len=40",
                    "tracking=disabled",
                ],
            )
        )
    assert run.model.model == "gpt-oss-120b" and run.quantization.quantization == "mxfp4"
    assert run.hardware.name == "gb10" and run.workload.input_len == 1500
    points = run_experiment(run, tmp_path / "run", progress=False)
    assert [p["max_concurrency"] for p in points] == [1, 4]
    assert all(p["failed"] == 0 and p["completed"] == p["max_concurrency"] for p in points)
    assert points[0]["per_user_tok_s"] > points[1]["per_user_tok_s"]
    assert points[0]["output_throughput"] < points[1]["output_throughput"]
