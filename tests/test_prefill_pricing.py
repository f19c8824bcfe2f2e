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


def _simulated(path_s: float):
    from research.config import CacheConfig, SchedulerConfig
    from research.perf.cost_model import with_params
    from research.perf.host_model import simulated_engine

    s = resolve("vllm", "gb10", model="qwen3-coder-30b-a3b", quantization="awq",
                max_model_len=4096, enable_prefix_caching=False)  # fmt: skip
    cm = CostModel("qwen3-coder-30b-a3b", "awq", "gb10", **s.cost_model_options)
    return simulated_engine(
        with_params(cm, request_path_s=path_s),
        CacheConfig(block_size=16, num_kv_blocks=8000, enable_prefix_caching=False),
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=8192),
        4096,
    )


@pytest.mark.parametrize("concurrency", [1, 2])
def test_the_request_path_counts_in_ttft_and_holds_the_slot(concurrency):
    """A request reaches the engine request_path_s after its send: at one stream TTFT grows by
    exactly the path and TPOT not at all; at two streams a slot is held while its request is on
    the path (no more than two requests ever in flight or on the way)."""
    from research.bench.driver import run_benchmark
    from research.bench.workload import random_requests

    reqs = random_requests(6, 512, 16, seed=2)
    runs = {}
    for path in (0.0, 0.25):
        engine = _simulated(path)
        clock = engine.executor.clock
        runs[path] = run_benchmark(
            engine, reqs, max_concurrency=concurrency, clock=clock, sleep=clock.sleep,
            request_path_s=engine.executor.cost_model.params.request_path_s,
        ).records  # fmt: skip
    for base, slow in zip(runs[0.0], runs[0.25], strict=True):
        ttft = (slow.first_token_time - slow.send_time) - (base.first_token_time - base.send_time)
        if concurrency == 1:
            assert ttft == pytest.approx(0.25, abs=1e-9)
            assert slow.token_times[-1] - slow.first_token_time == pytest.approx(
                base.token_times[-1] - base.first_token_time, abs=1e-9
            )
        else:
            assert ttft >= 0.25 - 1e-9
    sends = sorted(r.send_time for r in runs[0.25])
    finishes = sorted(r.finish_time for r in runs[0.25])
    # closed loop: the (C+1)-th send waits for a finish, path included
    assert sends[concurrency] >= finishes[0] - 1e-9


def test_a_sessions_turns_pay_the_request_path_too():
    """Each turn of a conversation reaches the engine request_path_s after it is sent: one user's
    TTFT grows by exactly the path on every turn."""
    from research.bench.sessions import chat_sessions, run_sessions

    sessions = chat_sessions(1, turns=3, system_len=64, message_len=64, output_len=8,
                             think_time_s=2.0, seed=4)  # fmt: skip
    ttfts = {}
    for path in (0.0, 0.25):
        engine = _simulated(path)
        clock = engine.executor.clock
        result = run_sessions(engine, sessions, max_concurrency=1, clock=clock,
                              sleep=clock.sleep, request_path_s=path)  # fmt: skip
        ttfts[path] = [r.first_token_time - r.send_time for r in result.records]
    assert len(ttfts[0.25]) == 3
    for base, slow in zip(ttfts[0.0], ttfts[0.25], strict=True):
        assert slow - base == pytest.approx(0.25, abs=1e-9)
