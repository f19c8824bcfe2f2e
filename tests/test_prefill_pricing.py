"""Prefill priced by the kernel each engine runs, mixed steps priced with their prompt chunk,
and decode under arriving traffic: what TTFT and ITL in the simulator stand on."""

from __future__ import annotations

import itertools
import statistics
from types import SimpleNamespace

import pytest

from research.perf import measurements
from research.perf.cost_model import CostModel, StepShape, step_shape_from_plan
from research.perf.engines import resolve
from research.perf.gemm import KERNELS, kernel_format
from research.perf.hardware import get_hardware


def _vllm(model: str, quantization: str) -> CostModel:
    s = resolve("vllm", "gb10", model=model, quantization=quantization)
    return CostModel(model, s.quantization, "gb10", **s.cost_model_options)


def test_vllm_on_gb10_prices_mxfp4_experts_at_marlins_bf16_rate_not_fp4():
    """vLLM's published images run 4-bit MoE through Marlin (W4A16) on sm_121: an 8192-token
    prefill's expert GEMMs take FLOPs / (W4A16 efficiency x the bf16 rate), several times what
    the FP4 tensor-core rate would charge."""
    cm = _vllm("gpt-oss-120b", "mxfp4")
    assert cm.gemm_kernels["expert"] == "marlin"
    bd = cm.price(cm.work(StepShape.prefill(8192))[0])["expert_gemm"]
    hw = get_hardware("gb10")
    w4a16 = cm.params.expert_gemm_efficiency * hw.sustained_flops("bf16")
    assert bd["compute_s"] == pytest.approx(bd["flops"] / w4a16)
    fp4 = bd["flops"] / (cm.params.native_gemm_efficiency * hw.sustained_flops("fp4"))
    assert bd["compute_s"] > 3 * fp4
    assert KERNELS["marlin"].math == "bf16" and KERNELS["marlin"].dequantizes


def test_a_build_with_cutlass_fp4_prices_the_fp4_path():
    s = resolve("vllm", "gb10", model="gpt-oss-120b", quantization="mxfp4")
    options = s.cost_model_options | {"gemm_kernels": {"expert": "cutlass_fp4"}}
    native = CostModel("gpt-oss-120b", "mxfp4", "gb10", **options)
    marlin = _vllm("gpt-oss-120b", "mxfp4")
    shape = StepShape.prefill(8192)
    assert native.step_time(shape) < 0.5 * marlin.step_time(shape)


def test_kernels_refuse_formats_they_do_not_run():
    hw = get_hardware("gb10")
    with pytest.raises(ValueError, match="'mmq' runs q8_0, gguf_mxfp4, not nvfp4"):
        kernel_format("mmq", "nvfp4", hw, "bfloat16")
    with pytest.raises(ValueError, match="needs fp4 tensor cores; h200 has none"):
        kernel_format("cutlass_fp4", "nvfp4", get_hardware("h200"), "bfloat16")
    with pytest.raises(ValueError, match=r"runs GGUF files: quantization must be one of .*mxfp4"):
        resolve("llama_cpp", "gb10", model="gpt-oss-120b", quantization="nvfp4")


def test_a_mixed_step_is_priced_as_its_prompt_chunk_plus_its_decodes():
    decodes = [SimpleNamespace(start=1000 + i, num_new_tokens=1) for i in range(16)]
    chunk = SimpleNamespace(start=0, num_new_tokens=2048)
    plan = SimpleNamespace(decodes=decodes, prefills=[chunk], verifies=[])
    shape = step_shape_from_plan(plan)
    assert shape.num_tokens == 16 + 2048 and (2048, 0) in shape.seqs
    cm = _vllm("qwen3-coder-30b-a3b", "awq")
    only_decodes = StepShape(tuple((1, 1000 + i) for i in range(16)))
    # the chunk's GEMM FLOPs alone take longer than the decodes' whole step
    assert cm.step_time(shape) > 2 * cm.step_time(only_decodes)


def _open_loop_itls(rate: float, n: int = 24) -> list[float]:
    from research.bench.driver import run_benchmark
    from research.bench.workload import random_requests
    from research.config import CacheConfig, SchedulerConfig
    from research.perf.host_model import simulated_engine

    s = resolve("vllm", "gb10", model="gpt-oss-120b", quantization="mxfp4",
                max_model_len=4096, enable_prefix_caching=False)  # fmt: skip
    cm = CostModel("gpt-oss-120b", s.quantization, "gb10", kv_cache_dtype="fp8",
                   **s.cost_model_options)  # fmt: skip
    engine = simulated_engine(
        cm,
        CacheConfig(block_size=16, num_kv_blocks=20000, enable_prefix_caching=False),
        SchedulerConfig(max_num_seqs=s.max_num_seqs, max_num_batched_tokens=8192),
        4096,
    )
    reqs = random_requests(n, 3000, 200, seed=1)
    clock = engine.executor.clock
    result = run_benchmark(engine, reqs, request_rate=rate, burstiness=1.0, seed=3,
                           clock=clock, sleep=clock.sleep)  # fmt: skip
    return [b - a for r in result.records for a, b in itertools.pairwise(r.token_times)]


def test_median_itl_rises_with_the_arrival_rate():
    """Each arriving 3,000-token prompt shares a step with everyone's decodes (vLLM's budget
    holds it whole): the faster prompts arrive, the more decode steps carry one."""
    slow, fast = (statistics.median(_open_loop_itls(rate)) for rate in (0.1, 1.0))
    assert fast > 1.3 * slow, (slow, fast)


def test_a_record_without_a_source_is_refused():
    data = {"sources": {"a": {"url": "https://x", "title": "t"}}, "records": [{"model": "m"}]}
    with pytest.raises(ValueError, match=r"record 0 .* has no source"):
        measurements.check_sources(data)
    data["records"] = [{"source": "b"}]
    with pytest.raises(ValueError, match="unknown source 'b'"):
        measurements.check_sources(data)
    prefill = [r for r in measurements.records() if r.get("kind") == "prefill"]
    assert prefill and all(
        {"preset", "engine", "quantization", "raw_row"} <= set(r) for r in prefill
    )
