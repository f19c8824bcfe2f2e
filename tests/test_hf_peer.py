"""The HF transformers peer run: static batches, per-step timestamps and the tokens, on a tiny
random Llama; a smoke run on the real SmolLM2 GGUF."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from research.bench import BenchRequest, random_requests, result_point
from research.bench.hf_peer import run_hf_benchmark
from tests.hf_oracle import hf_greedy

# Inputs 6..18 tokens, outputs 4..12 tokens; 6 requests in batches of 4 and 2.
REQUESTS = random_requests(
    6, input_len=12, output_len=8, range_ratio=0.5, vocab_size=256, seed=0, special_ids=(0, 1, 2)
)
VLLM_KEYS = {
    "date",
    "model_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "completed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
} | {
    f"{stat}_{metric}_ms"
    for stat in ("mean", "median", "std", "p99")
    for metric in ("ttft", "tpot", "itl", "e2el")
}


@pytest.fixture(scope="module")
def tiny_hf():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny_result(tiny_hf):
    return run_hf_benchmark(tiny_hf, None, REQUESTS, max_concurrency=4)


def test_workload_mixes_lengths():
    assert len({r.prompt_len for r in REQUESTS}) > 1
    assert len({r.output_len for r in REQUESTS}) > 1
    assert max(r.output_len for r in REQUESTS[:4]) > min(r.output_len for r in REQUESTS[:4])


def test_static_batches_and_timestamps(tiny_result):
    records = tiny_result.records
    assert [r.output_len for r in records] == [r.output_len for r in REQUESTS]
    assert [r.prompt_len for r in records] == [r.prompt_len for r in REQUESTS]
    for r in records:
        assert r.success
        assert len(r.token_times) == r.output_len
        assert all(a <= b for a, b in itertools.pairwise(r.token_times))
        assert r.first_token_time == r.token_times[0]
        assert r.finish_time == r.token_times[-1]
        assert r.ttft > 0
    first, second = records[:4], records[4:]
    assert len({r.send_time for r in first}) == 1 and len({r.send_time for r in second}) == 1
    assert second[0].send_time >= max(r.finish_time for r in first)
    # Rows of one batch share the step stamps: each row's are a prefix of the longest row's.
    longest = max(first, key=lambda r: r.output_len)
    assert all(r.token_times == longest.token_times[: r.output_len] for r in first)
    assert tiny_result.duration == max(r.finish_time for r in records) - first[0].send_time

    stats = tiny_result.engine_stats
    lens = [r.output_len for r in REQUESTS]
    assert stats["num_batches"] == 2
    assert stats["decode_steps"] == max(lens[:4]) + max(lens[4:])
    padded = 4 * max(lens[:4]) + 2 * max(lens[4:])  # rows x steps actually decoded
    assert stats["wasted_decode_tokens"] == padded - sum(lens)


def test_result_point_has_vllm_keys(tiny_result):
    point = result_point(tiny_result, model_id="tiny-llama-hf", extra={"backend": "hf"})
    assert not VLLM_KEYS - point.keys()
    assert point["completed"] == 6 and point["failed"] == 0
    assert point["max_concurrency"] == 4 and point["request_rate"] == "inf"
    assert point["total_output_tokens"] == sum(r.output_len for r in REQUESTS)
    assert point["output_throughput"] > 0 and point["backend"] == "hf"


def test_tokens_match_each_prompt_alone(tiny_hf, tiny_result):
    """Left padding is batch invariant here: every request's greedy tokens equal HF generate on
    its prompt alone, exactly; and HF's plain greedy oracle up to the first EOS (generate masks
    EOS out while min_new_tokens is unmet, the oracle does not)."""
    eos = tiny_hf.generation_config.eos_token_id
    for request, got in zip(REQUESTS, tiny_result.engine_stats["token_ids"], strict=True):
        ids = torch.tensor([request.prompt_token_ids])
        with torch.inference_mode():
            alone = tiny_hf.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=request.output_len,
                min_new_tokens=request.output_len,
                pad_token_id=0,
            )
        assert got == alone[0, ids.shape[1] :].tolist()
        oracle = hf_greedy(tiny_hf, ids, request.output_len)
        upto = oracle.index(eos) if eos in oracle else len(oracle)
        assert got[:upto] == oracle[:upto]


class CountingClock:
    """Every reading is the next integer, so the readings show the order of the stamps."""

    def __init__(self):
        self.now = -1

    def __call__(self):
        self.now += 1
        return float(self.now)


def test_stamp_order_on_a_counting_clock(tiny_hf):
    # Batch 1: start 0, prompt put 1, steps 2..4, end 5. Batch 2: start 6, prompt 7, steps 8..9.
    requests = [BenchRequest([5, 6, 7], 3), BenchRequest([8, 9], 1), BenchRequest([10], 2)]
    result = run_hf_benchmark(tiny_hf, None, requests, max_concurrency=2, clock=CountingClock())
    a, b, c = result.records
    assert (a.send_time, a.token_times, a.finish_time) == (0.0, [2.0, 3.0, 4.0], 4.0)
    assert (b.send_time, b.token_times, b.finish_time) == (0.0, [2.0], 2.0)
    assert (c.send_time, c.token_times, c.finish_time) == (5.0, [8.0, 9.0], 9.0)
    assert result.duration == 9.0

    # A client that sends as soon as its slot's request finished: c (row 0) waits from a's finish.
    late = run_hf_benchmark(
        tiny_hf, None, requests, max_concurrency=2, clock=CountingClock(), send_at="slot_free"
    )
    assert [r.send_time for r in late.records] == [0.0, 0.0, 4.0]
    assert late.records[2].ttft == 4.0


def test_rejects_bad_inputs(tiny_hf):
    with pytest.raises(ValueError, match="vocabulary"):
        run_hf_benchmark(tiny_hf, None, [BenchRequest([3, 256], 2)], max_concurrency=1)
    with pytest.raises(ValueError, match="max_concurrency"):
        run_hf_benchmark(tiny_hf, None, REQUESTS, max_concurrency=0)
    with pytest.raises(ValueError, match="no requests"):
        run_hf_benchmark(tiny_hf, None, [], max_concurrency=1)


@pytest.mark.slow
def test_smollm2_smoke(smollm2_hf):
    model, tokenizer = smollm2_hf
    requests = random_requests(
        2,
        input_len=8,
        output_len=4,
        vocab_size=model.config.vocab_size,
        seed=0,
        special_ids=tokenizer.all_special_ids,
    )
    result = run_hf_benchmark(model, tokenizer, requests, max_concurrency=2, num_threads=1)
    point = result_point(result, model_id="smollm2-135m-hf")
    assert point["completed"] == 2 and point["total_output_tokens"] == 8
    assert all(len(r.token_times) == 4 and r.ttft > 0 for r in result.records)
    assert all(len(ids) == 4 for ids in result.engine_stats["token_ids"])
