"""What the simulator's structure must show: block size moves capacity and step time the way
the physics says, a dense model falls off once its pool forces preemption, host time grows with
the batch, and prediction bands re-price a run exactly."""

from __future__ import annotations

import dataclasses

import pytest

from research.bench import random_requests, run_benchmark
from research.llm import LLM
from research.perf import kv_capacity
from research.perf.bands import band_variants, retime
from research.perf.cost_model import CostModel, StepShape, with_params

QWEN = "qwen3-coder-30b-a3b"
LLAMA = "llama-3.3-70b"


def _sim(model: str, **kw) -> LLM:
    base = dict(
        executor="simulated",
        hardware="gb10",
        quantization="awq",
        max_model_len=4096,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=0.85,
    )
    return LLM(model, **(base | kw))


def _run(llm: LLM, c: int, input_len: int, output_len: int, prompts=None):
    e = llm.engine
    reqs = prompts or random_requests(3 * c, input_len, output_len, vocab_size=1000, seed=c)
    return run_benchmark(e, reqs, max_concurrency=c, clock=e.clock, sleep=e.executor.clock.sleep)


def test_block_size_8_vs_64_moves_capacity_and_step_time():
    """Larger blocks waste more of each sequence's last block (fewer sequences fit) but make
    fewer, larger page transfers (attention reads faster): docs/simulator.md, "What block size changes"."""
    small, large = (kv_capacity(QWEN, "awq", "gb10", 0.85, bs) for bs in (8, 64))
    assert abs(small.num_tokens - large.num_tokens) <= 64  # the same memory...
    assert small.max_sequences(520) > large.max_sequences(520)  # ...holds more 520-token seqs
    assert small.max_sequences(520) / large.max_sequences(520) == pytest.approx(72 / 65, rel=0.01)
    shape = StepShape.decode(64, 1000)
    t8, t64 = (CostModel(LLAMA, "awq", "gb10", block_size=bs).breakdown(shape) for bs in (8, 64))
    assert t8["attention_s"] > 1.05 * t64["attention_s"]
    assert t8["total_s"] > t64["total_s"]
    # Only the attention operator sees the page size.
    assert t8["dense_gemm_s"] == t64["dense_gemm_s"]


def test_prefix_cache_hits_whole_blocks_only():
    """Two prompts sharing 100 tokens: 8-token blocks reuse 96 of them, 64-token blocks 64."""
    shared = list(range(1, 101))
    prompts = [
        dataclasses.replace(r, prompt_token_ids=shared + r.prompt_token_ids[100:])
        for r in random_requests(2, 160, 4, vocab_size=1000, seed=3)
    ]
    ttfts = {}
    for bs in (8, 64):
        llm = _sim(QWEN, block_size=bs)
        llm.engine.executor.step_log = []
        r = _run(llm, 1, 0, 0, prompts)
        prefills = [shape for _, _, shape in llm.engine.executor.step_log if shape.num_tokens > 1]
        cached = {8: 96, 64: 64}[bs]
        assert prefills[-1].seqs == ((160 - cached, cached),)
        ttfts[bs] = r.records[1].ttft
    assert ttfts[8] < ttfts[64]


def test_dense_throughput_falls_once_the_pool_forces_preemption():
    """A 70B with a pool for 96 sequences of 512 tokens: up to there aggregate output tok/s
    rises; past it the newest requests are preempted and recomputed as prefills, which on GB10
    compete for the same compute as the (then compute-heavy) decodes, and it falls."""
    llm = _sim(LLAMA, num_kv_blocks=96 * 512 // 16)
    agg = {}
    for c in (48, 96, 128):
        r = _run(llm, c, 256, 256)
        agg[c] = r.metrics()["output_throughput"]
        preempted = sum(rec.num_preemptions for rec in r.records)
        assert (preempted > 0) == (c > 96), (c, preempted)
    assert agg[96] > agg[48]
    assert agg[128] < 0.95 * agg[96], agg


def test_host_time_grows_with_running_sequences():
    cm = CostModel(LLAMA, "awq", "gb10")
    p = cm.params
    assert p.per_seq_overhead_s > 0
    one, many = (cm.breakdown(StepShape.decode(b, 512))["overhead_s"] for b in (1, 256))
    assert many - one == pytest.approx(255 * p.per_seq_overhead_s)


def test_token_budget_serves_decodes_first():
    """vLLM V1: running decodes are scheduled before new prefills, which get what remains of
    max_num_batched_tokens (chunked)."""
    llm = _sim(LLAMA, max_num_batched_tokens=600)
    e = llm.engine
    e.executor.step_log = []
    _run(llm, 4, 500, 8)
    shapes = [shape for _, _, shape in e.executor.step_log]
    assert all(s.num_tokens <= 600 for s in shapes)
    mixed = [s for s in shapes if any(n == 1 for n, _ in s.seqs) and any(n > 1 for n, _ in s.seqs)]
    assert mixed
    for s in mixed:  # decodes first; the prefill chunk takes the rest of the budget
        decodes = sum(1 for n, _ in s.seqs if n == 1)
        assert s.num_tokens == 600 or s.seqs[-1][1] + s.seqs[-1][0] == 500
        assert all(n == 1 for n, _ in s.seqs[:decodes])


def test_retime_equals_a_full_rerun_under_the_other_model():
    """Re-pricing a logged closed-loop run gives exactly what simulating it again gives."""
    central = _sim(QWEN)
    central.engine.executor.step_log = []
    r = _run(central, 8, 256, 32)
    variant = band_variants(central.engine.executor.cost_model)["pessimistic"]
    moved = retime(r, central.engine.executor.step_log, variant).metrics()
    rerun = _sim(QWEN)
    rerun.engine.executor.cost_model = variant
    again = _run(rerun, 8, 256, 32).metrics()
    for key in ("output_throughput", "median_ttft_ms", "median_tpot_ms", "p99_itl_ms"):
        assert moved[key] == pytest.approx(again[key], rel=1e-9), key
    slower = with_params(variant, bandwidth_efficiency=0.5)
    assert (
        retime(r, central.engine.executor.step_log, slower).metrics()["output_throughput"]
        < (moved["output_throughput"])
    )


def test_trace_summary_counts_recomputed_prefill_and_its_time():
    """Two prompts of 4 tokens, one preempted and recomputed: 12 prefill tokens of which 4
    recomputed; the steps carrying a chunk take 3 of the 6 seconds; 5 decode rows over 4 steps."""
    from research.perf.simulated import trace_summary

    log = [
        (0.0, 1.0, StepShape(((4, 0), (4, 0)))),
        (1.0, 1.0, StepShape(((1, 4), (1, 4)))),
        (2.0, 2.0, StepShape(((4, 0), (1, 5)))),  # the recompute beside a decode
        (4.0, 2.0, StepShape(((1, 6), (1, 4)))),
    ]
    got = trace_summary(log, prompt_tokens=8)
    assert got == {
        "prefill_tokens": 12,
        "recomputed_prefill_tokens": 4,
        "prefill_time_share": 0.5,
        "mean_decode_rows": 1.25,
    }
