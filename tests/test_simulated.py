"""The simulated executor under the real engine and scheduler: a virtual clock, the KV pool of a
named machine, and the shape of the published curves."""

from __future__ import annotations

import pytest

from research.bench import random_requests, run_benchmark
from research.llm import LLM
from research.perf import kv_capacity_blocks


def _sim(model: str = "qwen3-coder-30b-a3b", **kw) -> LLM:
    kw = (
        dict(
            executor="simulated",
            hardware="gb10",
            quantization="awq",
            dtype="bfloat16",
            max_model_len=4096,
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            gpu_memory_utilization=0.85,
        )
        | kw
    )
    return LLM(model, **kw)


def _sweep(llm: LLM, concurrencies, input_len=512, output_len=256):
    e = llm.engine
    out = []
    for c in concurrencies:
        reqs = random_requests(3 * c, input_len, output_len, vocab_size=1000, seed=c)
        r = run_benchmark(e, reqs, max_concurrency=c, clock=e.clock, sleep=e.executor.clock.sleep)
        out.append((c, r))
    return out


def test_pool_is_vllms_kv_capacity_and_no_weights_are_loaded():
    llm = _sim()
    assert llm.params is None
    assert llm.engine.block_manager.num_blocks == kv_capacity_blocks(
        "qwen3-coder-30b-a3b", "awq", "gb10", 0.85, 16, dtype="bfloat16"
    )


@pytest.mark.parametrize("model", ["qwen3-coder-30b-a3b", "llama-3.3-70b"])
def test_curves_have_the_published_shape(model):
    """Aggregate output tok/s does not fall as concurrency rises (the pool is not exhausted
    here), per-user tok/s does not rise, and every request gets exactly its tokens."""
    points = _sweep(_sim(model), (1, 8, 32, 64))
    agg, per_user = [], []
    for _c, r in points:
        assert all(rec.output_len == 256 for rec in r.records)
        m = r.metrics()
        agg.append(m["output_throughput"])
        per_user.append(m["per_user_tok_s"])
    assert agg == sorted(agg), agg
    assert per_user == sorted(per_user, reverse=True), per_user


def test_single_stream_matches_the_calibration_point():
    """128 in / 512 out at concurrency 1 through the engine: within 5% of 80.9 tok/s and 37 ms."""
    ((_, r),) = _sweep(_sim(), (1,), input_len=128, output_len=512)
    m = r.metrics()
    assert m["per_user_tok_s"] == pytest.approx(80.9, rel=0.05)
    assert m["median_ttft_ms"] == pytest.approx(37.0, rel=0.05)


def test_a_small_pool_preempts_and_loses_nothing():
    llm = _sim(num_kv_blocks=200)  # 3200 tokens for 16 requests of up to 768
    ((_, r),) = _sweep(llm, (16,))
    assert sum(rec.num_preemptions for rec in r.records) > 0
    assert all(rec.success and rec.output_len == 256 for rec in r.records)


def test_virtual_clock_advances_only_by_priced_steps():
    llm = _sim()
    e = llm.engine
    assert e.clock() == 0.0
    _sweep(llm, (1,), input_len=16, output_len=4)
    assert e.clock() == pytest.approx(e.executor.simulated_time)
    assert e.clock() > 0.0


def test_simulated_needs_a_named_machine():
    with pytest.raises(ValueError, match="hardware"):
        LLM("qwen3-coder-30b-a3b", executor="simulated")


def test_tensor_parallel_over_two_boxes_is_faster_but_not_twice():
    """TP=2 halves each box's weight and KV reads; two all-reduces per layer over ConnectX-7
    cost something, so single-stream speed rises by less than 2x and the pool grows."""
    one, two = _sim("llama-3.3-70b"), _sim("llama-3.3-70b", tensor_parallel_size=2)
    tps = []
    for llm in (one, two):
        ((_, r),) = _sweep(llm, (1,), input_len=128, output_len=64)
        tps.append(r.metrics()["per_user_tok_s"])
    assert 1.3 < tps[1] / tps[0] < 2.0, tps
    assert two.engine.block_manager.num_blocks > 2 * one.engine.block_manager.num_blocks


def test_two_replicas_behind_a_random_router():
    from research.perf.simulated import ReplicaRouter

    engines = [_sim("llama-3.3-70b").engine for _ in range(2)]
    router = ReplicaRouter(engines, seed=0)
    c = 16
    reqs = random_requests(3 * c, 256, 64, vocab_size=1000, seed=1)
    r = run_benchmark(router, reqs, max_concurrency=c, clock=router.clock, sleep=router.sleep)
    assert all(rec.success and rec.output_len == 64 for rec in r.records)
    assert all(e.stats()["num_steps"] > 0 for e in engines)  # both boxes served
    # The router's stats sum its boxes' prompt-token and prefix-cache counters (a results row's
    # hit rate over replicas comes from them).
    merged = router.stats()
    for key in ("prefix_cache_queries", "prefix_cache_hits", "kv_evictions"):
        assert merged[key] == sum(e.stats()[key] for e in engines)
    assert merged["prefix_cache_queries"] == 3 * c * 256
    for rec in r.records:  # causal, and the closed loop never exceeds its concurrency
        assert rec.send_time <= rec.first_token_time <= rec.finish_time
        in_flight = sum(o.send_time <= rec.send_time < o.finish_time for o in r.records)
        assert in_flight <= c
    ((_, single),) = _sweep(_sim("llama-3.3-70b"), (c,), input_len=256, output_len=64)
    # Two boxes beat one, by less than 2x: random routing leaves one box busier at times.
    assert r.metrics()["output_throughput"] > 1.1 * single.metrics()["output_throughput"]
