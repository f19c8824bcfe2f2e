"""The vLLM profile of the GB10 validation (research.perf.validation_vllm): a published
continuous-batching curve replayed through our engine and scheduler, the client's arithmetic,
and error bounds on the points that were not fitted."""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from research.config import QUANTIZED_LAYER_GROUPS
from research.perf import routing, validation_vllm
from research.perf.calibration import params_for
from research.perf.cost_model import CostModel, StepShape
from research.perf.validation import GGUF_MODELS, PROFILES, implied_sigma, validate
from research.perf.validation_vllm import (
    VLLM_SOURCES,
    BurstPoint,
    cost_model,
    load_burst_points,
    replay,
)
from research.perf.validation_vllm import validate as validate_vllm

SOURCE = "kubis_gptoss120b_topology"
GPT_OSS_120B = "ggml-org/gpt-oss-120b-GGUF"


@pytest.fixture(scope="module")
def curve():
    return validate_vllm(moe_routing="lognormal")


def test_the_published_curve_is_loaded_whole():
    pts = load_burst_points()
    assert [p.concurrency for p in pts] == [1, 2, 4, 8, 16, 32, 64]
    assert {(p.input_len, p.output_len) for p in pts} == {(1024, 128)}
    assert all(p.source == SOURCE and p.published > 0 for p in pts)


def test_one_stream_replays_as_its_decode_steps():
    """C = 1: llama-benchy's rate is (tokens - 1) / (end - first token): the mean of the decode
    steps after 1024 .. 1150 cached tokens, nothing of the prefill."""
    p = BurstPoint(SOURCE, "openai/gpt-oss-120b", 1, 1024, 128, 1.0)
    cm = cost_model(SOURCE, params_for("gb10"), moe_routing="lognormal")
    steps = sum(cm.step_time(StepShape.decode(1, 1024 + i)) for i in range(127))
    assert replay(p, cm)["rate"] == pytest.approx(127 / steps, rel=1e-6)


def test_the_rate_window_holds_the_other_requests_prefills():
    """At C = 64 the 64 prompts (65,536 tokens) do not fit one 8,192-token step: the window
    opens at the first request's first token while 56 prompts still wait, so the client's rate
    is below the decode-only rate of 64 streams; and at C = 8 every prompt fits one step."""
    cm = cost_model(SOURCE, params_for("gb10"), moe_routing="lognormal")
    for c, below in ((64, True), (8, False)):
        p = BurstPoint(SOURCE, "openai/gpt-oss-120b", c, 1024, 128, 1.0)
        run = replay(p, cm)
        decode = sum(cm.step_time(StepShape.decode(c, 1024 + i)) for i in range(127))
        decode_only = c * 127 / decode
        if below:
            assert run["rate"] < 0.9 * decode_only
            assert max(run["ttft"]) > 4 * min(run["ttft"])
        else:
            assert run["rate"] == pytest.approx(decode_only, rel=0.02)
            assert max(run["ttft"]) == pytest.approx(min(run["ttft"]))


def test_predictions_past_one_stream_are_bounded(curve):
    """Fitted on C = 1 only; C = 2 .. 64 predicted: median 9.4%, worst +21.6% (C = 64) today.
    The growth C = 32 / C = 1 (published 5.54x) within 15%."""
    rows, params = curve
    assert [r.fitted for r in rows] == [True] + [False] * 6
    errors = [abs(r.error) for r in rows if not r.fitted]
    assert statistics.median(errors) < 0.10
    assert max(errors) < 0.25
    by_c = {r.point.concurrency: r for r in rows}
    growth = (by_c[32].predicted / by_c[1].predicted) / (
        by_c[32].point.published / by_c[1].point.published
    )
    assert abs(growth - 1) < 0.15
    assert 0 < params[SOURCE].bandwidth_efficiency <= 1


def test_gpt_oss_20b_routing_shape_does_not_carry_over_to_120b():
    """The shape measured on gpt-oss-20b's router (1.0) predicts the 120b's curve 45% too flat
    at C = 32: the 120b's inferred shape is what the curve needs, not decoration."""
    rows, _ = validate_vllm(moe_routing="lognormal", moe_load_sigma=routing.LOAD_SIGMA)
    by_c = {r.point.concurrency: r for r in rows}
    assert by_c[32].error < -0.30


def test_inferred_120b_shape_is_the_mean_the_llama_cpp_points_imply():
    """INFERRED_SIGMA_GPT_OSS_120B is recomputed: the mean over the three llama.cpp revisions of
    the shape that meets B=32 pp=512, and those points are the ones marked fitted."""
    pts = [p for p in __import__("research.perf.validation", fromlist=["x"]).load_points()
           if p.model == GPT_OSS_120B]  # fmt: skip
    rows, params = validate(pts, moe_routing="lognormal")
    implied = implied_sigma(rows, params)
    assert len(implied) == 3
    mean = statistics.mean(implied.values())
    assert mean == pytest.approx(routing.INFERRED_SIGMA_GPT_OSS_120B, abs=0.05)
    fitted = {r.point.label for r in rows if r.fitted}
    assert PROFILES["llama.cpp"].routing_fit[GPT_OSS_120B] in fitted
    assert GGUF_MODELS[GPT_OSS_120B][0] in routing.LOAD_SIGMAS


def test_a_builds_kernels_and_layers_are_options_a_user_sets():
    """The replayed build's flags (--mxfp4-layers moe,qkv,o,lm_head; CUTLASS MXFP4 MoE) are
    config options: a simulated run with quantization.quantized_layers and engine.gemm_kernels
    prices steps exactly as the validation's replay does, and differently from vLLM's
    published image (Marlin, bf16 attention). Kernels or layers a run cannot use fail."""
    from research.perf.engines.serving import from_run
    from tests.test_experiments import _compose

    base = ["executor=simulated", "hardware=gb10", "model=gpt_oss_120b", "quantization=mxfp4",
            "quantization.kv_cache_dtype=fp8", "model.max_model_len=4096",
            "cache.enable_prefix_caching=false"]  # fmt: skip
    build = ["quantization.quantized_layers=[moe,qkv,o,lm_head]",
             "engine.gemm_kernels={dense:cutlass_fp4,expert:cutlass_fp4}"]  # fmt: skip
    options = from_run(_compose([*base, *build])).cost_model_options
    ours = CostModel("gpt-oss-120b", "mxfp4", "gb10", kv_cache_dtype="fp8", **options)
    replay = validation_vllm.cost_model(SOURCE, ours.params)
    image = CostModel(
        "gpt-oss-120b", "mxfp4", "gb10", kv_cache_dtype="fp8",
        **from_run(_compose(base)).cost_model_options,
    )  # fmt: skip
    for shape in (StepShape.prefill(2048), StepShape.decode(32, 1024)):
        assert ours.step_time(shape) == replay.step_time(shape)
        assert ours.step_time(shape) < image.step_time(shape)
    with pytest.raises(ValueError, match="quantized_layers must be a non-empty list"):
        _compose([*base, "quantization.quantized_layers=[attention]"])
    with pytest.raises(Exception, match="attention"):  # Hydra: not a key of engine.gemm_kernels
        _compose([*base, "engine.gemm_kernels={attention:marlin}"])
    wrong = from_run(_compose([*base, "engine.gemm_kernels={expert:cutlass_fp8}"]))
    with pytest.raises(ValueError, match="'cutlass_fp8' runs fp8, not mxfp4"):
        CostModel("gpt-oss-120b", "mxfp4", "gb10", **wrong.cost_model_options)
    with pytest.raises(ValueError, match="price a simulated engine"):
        from_run(_compose(["engine.gemm_kernels={dense:marlin}"]))


def test_quantized_weights_and_weight_only_options():
    """--mxfp4-layers moe,qkv,o,lm_head: attention and the output layer in MXFP4 (about a
    quarter of their bf16 bytes); weight-only kernels run the GEMMs in bf16."""
    s = VLLM_SOURCES[SOURCE]
    base = CostModel("gpt-oss-120b", "mxfp4", "gb10")
    keys = [k for g in s["quantized_layers"] for k in QUANTIZED_LAYER_GROUPS[g]]
    more = CostModel("gpt-oss-120b", "mxfp4", "gb10", quantized_weights=tuple(keys))
    assert more.lm_head_bytes < 0.3 * base.lm_head_bytes
    assert more.dense_layer_bytes < 0.4 * base.dense_layer_bytes
    assert more.expert_bytes_per_layer == base.expert_bytes_per_layer
    assert (base.compute_dtype, base.dequantizes) == ("fp4", False)
    wo = CostModel("gpt-oss-120b", "mxfp4", "gb10", weight_only=True)
    assert (wo.compute_dtype, wo.dequantizes) == ("bf16", True)
    assert CostModel("gpt-oss-120b", "mxfp4", "gb10", **more.options()).lm_head_bytes == (
        more.lm_head_bytes
    )
    with pytest.raises(ValueError, match="quantized_weights needs an engine weight format"):
        CostModel("gpt-oss-120b", "gguf_mxfp4", "gb10", quantized_weights=("wq",))
    assert dataclasses.is_dataclass(load_burst_points()[0])
