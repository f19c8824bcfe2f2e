"""research.perf.cost_model: calibration on the two single-stream points, and the model's shape."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from research.perf.calibration import (
    CALIBRATED,
    CALIBRATION_POINTS,
    calibration_report,
    fit_calibration,
    predict_single_stream,
)
from research.perf.cost_model import (
    CostModel,
    StepShape,
    expected_distinct_experts,
    step_shape_from_plan,
)
from research.perf.kv_capacity import weight_bytes

QWEN = "qwen3-coder-30b-a3b"
LLAMA = "llama-3.3-70b"


def test_calibration_points_met_within_5_percent():
    rows = calibration_report()
    assert len(rows) == 4
    for row in rows:
        assert abs(row["error_pct"]) < 5.0, row
    # The stored calibration is the fit of the published points, not a hand-typed constant.
    assert fit_calibration(CALIBRATION_POINTS) == CALIBRATED["gb10"]
    p = CALIBRATED["gb10"]
    assert 0.5 < p.bandwidth_efficiency <= 1.0
    assert 0.2 < p.compute_efficiency <= 1.0
    assert 0.0 <= p.per_step_overhead_s < 0.01
    assert 0.0 < p.moe_hot_fraction <= 1.0


def test_single_stream_matches_reference_figures():
    qwen = predict_single_stream(QWEN, "awq", "gb10")
    llama = predict_single_stream(LLAMA, "awq", "gb10")
    assert qwen["tok_s"] == pytest.approx(80.9, rel=0.05)
    assert llama["tok_s"] == pytest.approx(6.0, rel=0.05)
    assert qwen["ttft_ms"] == pytest.approx(37, rel=0.05)
    assert llama["ttft_ms"] == pytest.approx(186, rel=0.05)


@pytest.mark.parametrize("model", [QWEN, LLAMA])
def test_bf16_slower_than_awq_at_concurrency_one(model):
    shape = StepShape.decode(1, 512)
    bf16 = CostModel(model, None, "gb10").step_time(shape)
    awq = CostModel(model, "awq", "gb10").step_time(shape)
    assert bf16 > 1.5 * awq


@pytest.mark.parametrize("model", [QWEN, LLAMA])
def test_decode_batching_is_sublinear(model):
    cm = CostModel(model, "awq", "gb10")
    batches = [1, 2, 4, 8, 16, 32, 64]
    times = [cm.step_time(StepShape.decode(b, 640)) for b in batches]
    throughput = [b / t for b, t in zip(batches, times, strict=True)]
    assert all(b >= a for a, b in itertools.pairwise(times))  # steps get longer...
    assert all(b >= a for a, b in itertools.pairwise(throughput))  # ...but amortize
    assert times[-1] < 64 * times[0]


def test_distinct_experts_by_hand():
    assert expected_distinct_experts(128, 8, 1) == pytest.approx(8.0)
    assert expected_distinct_experts(128, 8, 2) == pytest.approx(128 * (1 - (120 / 128) ** 2))
    assert expected_distinct_experts(128, 8, 2) == pytest.approx(16 - 8 * 8 / 128)
    assert expected_distinct_experts(128, 8, 10_000) == pytest.approx(128.0)
    assert expected_distinct_experts(128, 8, 0) == 0.0


def test_distinct_experts_monte_carlo():
    rng = np.random.default_rng(0)
    e, k = 128, 8
    for t in (1, 4, 16, 64):
        trials = 2000
        counts = []
        for _ in range(trials):
            picks = np.argsort(rng.random((t, e)), axis=1)[:, :k]  # k distinct experts per token
            counts.append(len(np.unique(picks)))
        assert np.mean(counts) == pytest.approx(expected_distinct_experts(e, k, t), rel=0.02)


def test_moe_routing_laws_order():
    shape = StepShape.prefill(128)
    by = {
        r: CostModel(QWEN, "awq", "gb10", moe_routing=r).breakdown(shape)
        for r in ("hot_set", "uniform", "all")
    }
    assert by["all"]["distinct_experts_per_layer"] == 128
    assert (
        by["hot_set"]["distinct_experts_per_layer"]
        < by["uniform"]["distinct_experts_per_layer"]
        <= 128
    )
    one = CostModel(QWEN, "awq", "gb10").breakdown(StepShape.decode(1, 128))
    assert one["distinct_experts_per_layer"] == pytest.approx(8.0)


@pytest.mark.parametrize("model", [QWEN, LLAMA])
@pytest.mark.parametrize("shape", [StepShape.decode(1, 300), StepShape.prefill(512, 64)])
def test_breakdown_sums(model, shape):
    bd = CostModel(model, "awq", "gb10").breakdown(shape)
    parts = [k for k in bd if k.startswith("bytes_") and k != "bytes_total"]
    assert bd["bytes_total"] == pytest.approx(sum(bd[k] for k in parts))
    fparts = ("flops_linear", "flops_lm_head", "flops_attention")
    assert bd["flops_total"] == pytest.approx(sum(bd[k] for k in fparts))
    assert bd["total_s"] == pytest.approx(
        max(bd["memory_time_s"], bd["compute_time_s"]) + bd["overhead_s"]
    )


def test_dense_70b_step_reads_all_weights():
    cm = CostModel(LLAMA, "awq", "gb10")
    bd = cm.breakdown(StepShape.decode(1, 128))
    weights = bd["bytes_dense_weights"] + bd["bytes_lm_head"]
    embed = 128256 * 8192 * 2  # the embedding table is looked up, not streamed
    assert weights == pytest.approx(weight_bytes(LLAMA, "awq") - embed, rel=1e-6)
    assert bd["bytes_total"] == pytest.approx(weights, rel=0.01)


def test_moe_all_routing_reads_all_weights():
    bd = CostModel(QWEN, "awq", "gb10", moe_routing="all").breakdown(StepShape.decode(1, 0))
    weights = bd["bytes_dense_weights"] + bd["bytes_expert_weights"] + bd["bytes_lm_head"]
    embed = 151936 * 2048 * 2
    assert weights == pytest.approx(weight_bytes(QWEN, "awq") - embed, rel=1e-6)


def test_prefill_attention_flops_quadratic():
    cm = CostModel(LLAMA, "awq", "gb10")
    a1 = cm.breakdown(StepShape.prefill(1024))["flops_attention"]
    a2 = cm.breakdown(StepShape.prefill(2048))["flops_attention"]
    assert a2 > 3.9 * a1
    # Causal keys including self: n(n+1)/2 per layer and head.
    assert a1 == 4 * 64 * 128 * 80 * (1024 * 1025 // 2)
    # A chunk after a cached prefix reads the same keys as the tail of a whole prefill.
    tail = cm.breakdown(StepShape.prefill(1024, 1024))["flops_attention"]
    assert a1 + tail == pytest.approx(a2)


def test_kv_read_once_per_sequence():
    cm = CostModel(LLAMA, "awq", "gb10")
    bd = cm.breakdown(StepShape(((256, 100), (1, 50))))
    assert bd["bytes_kv_read"] == (356 + 51) * cm.kv_bytes_per_token
    assert bd["bytes_kv_write"] == 257 * cm.kv_bytes_per_token


def test_step_shape_from_plan_duck_typed():
    item = SimpleNamespace
    plan = SimpleNamespace(
        decodes=[item(start=300, num_new_tokens=1), item(start=7, num_new_tokens=1)],
        prefills=[item(start=32, num_new_tokens=64)],
    )
    assert step_shape_from_plan(plan) == StepShape(((1, 300), (1, 7), (64, 32)))
    assert step_shape_from_plan(plan).num_tokens == 66


def test_h200_faster_and_fp4_dtype():
    gb10 = predict_single_stream(LLAMA, "awq", "gb10")
    h200 = predict_single_stream(LLAMA, "awq", "h200")
    assert h200["tok_s"] > 5 * gb10["tok_s"]
    assert h200["ttft_ms"] < gb10["ttft_ms"]
    assert CostModel(LLAMA, "nvfp4", "gb10").compute_dtype == "fp4"
    assert CostModel(LLAMA, "nvfp4", "h200").compute_dtype == "bf16"
    assert CostModel(LLAMA, "fp8", "h200").compute_dtype == "fp8"
    assert CostModel(LLAMA, "awq", "h200").compute_dtype == "bf16"


def test_no_jax_import():
    code = "import sys, research.perf.cost_model; assert 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bad_inputs():
    with pytest.raises(ValueError):
        StepShape(((0, 5),))
    with pytest.raises(ValueError):
        CostModel(QWEN, "awq", "gb10", moe_routing="zipf")
    assert math.isfinite(CostModel(QWEN, None, "h200").step_time(StepShape.decode(256, 4096)))
