"""Serving-engine profiles (research/perf/engines): each profile's mechanism does what it claims
in the simulator, bad options fail naming what is allowed, and the stored validation summary the
docs quote is what the validate_gb10 experiment computes today."""

from __future__ import annotations

import dataclasses
import json

import pytest

from research.bench import random_requests, run_benchmark
from research.llm import LLM
from research.perf.engines import PROFILES, resolve

QWEN = "qwen3-coder-30b-a3b"


def _sim(engine: str, quantization: str = "q8_0", model: str = QWEN, **overrides) -> LLM:
    serving = resolve(engine, "gb10", model=model, quantization=quantization, **overrides)
    return LLM(model, executor="simulated", hardware="gb10", **serving.llm_kwargs())


def _aggregate(llm: LLM, c: int, input_len: int = 128, output_len: int = 32) -> float:
    e = llm.engine
    reqs = random_requests(2 * c, input_len, output_len, vocab_size=1000, seed=c)
    res = run_benchmark(e, reqs, max_concurrency=c, clock=e.clock, sleep=e.executor.clock.sleep)
    return res.metrics()["output_throughput"]


def test_ollama_with_one_slot_serves_one_request_at_a_time():
    """OLLAMA_NUM_PARALLEL=1: the aggregate rate does not grow from 1 to 8 concurrent (the rest
    wait in its queue); vLLM's grows more than 3x over the same range."""
    ollama = [_aggregate(_sim("ollama"), c) for c in (1, 8)]
    vllm = [_aggregate(_sim("vllm", "awq"), c) for c in (1, 8)]
    assert ollama[1] == pytest.approx(ollama[0], rel=0.05)
    assert vllm[1] > 3 * vllm[0]


def test_llama_cpp_slots_cap_the_batch_and_split_the_context():
    """llama-server's automatic 4 slots share one pool (a request may use the whole context);
    an explicit --parallel N splits the context N ways, and a prompt beyond its slot's share is
    rejected, not truncated. The batch never holds more rows than slots."""
    auto = resolve("llama_cpp", "gb10", model=QWEN, quantization="q8_0")
    assert auto.max_num_seqs == 4 and auto.max_model_len == auto.num_kv_blocks
    split = resolve("llama_cpp", "gb10", model=QWEN, quantization="q8_0", parallel=8,
                    ctx_size=32768)  # fmt: skip
    assert (split.max_num_seqs, split.max_model_len, split.num_kv_blocks) == (8, 4096, 8)
    llm = _sim("llama_cpp", parallel=8, ctx_size=32768)
    rows = []
    execute = llm.engine.executor.execute

    def recorded(plan):
        rows.append(len(plan.scheduled))
        return execute(plan)

    llm.engine.executor.execute = recorded
    _aggregate(llm, 16)
    assert max(rows) == 8
    with pytest.raises(ValueError, match="4096"):
        llm.generate([[5] * 5000])


def test_sglang_radix_cache_hits_where_vllm_hash_cache_does_and_inside_a_block():
    """Two prompts sharing 100 tokens: vLLM's hash cache reuses whole 16-token blocks (96
    tokens), SGLang's radix tree every shared token (100)."""
    shared = list(range(1, 101))
    prompts = [
        dataclasses.replace(r, prompt_token_ids=shared + r.prompt_token_ids[100:])
        for r in random_requests(2, 160, 4, vocab_size=1000, seed=3)
    ]
    cached = {}
    for engine in ("vllm", "sglang"):
        llm = _sim(engine, "awq")
        e = llm.engine
        e.executor.step_log = []
        run_benchmark(e, prompts, max_concurrency=1, clock=e.clock, sleep=e.executor.clock.sleep)
        prefills = [shape for _, _, shape in e.executor.step_log if shape.num_tokens > 1]
        ((n, cached[engine]),) = prefills[-1].seqs
        assert n + cached[engine] == 160
    assert cached["vllm"] == 96
    assert cached["sglang"] == 100


@pytest.mark.parametrize(
    "engine, options, match",
    [
        ("vllx", {}, "expected one of .*llama_cpp.*ollama.*sglang.*static.*vllm"),
        ("llama_cpp", {"block_size": 16}, "does not page.*parallel, ctx_size"),
        ("ollama", {"max_num_seqs": 4}, "no option max_num_seqs.*parallel"),
        ("llama_cpp", {"quantization": "awq"}, "GGUF files.*q8_0"),
        ("llama_cpp", {"enable_prefix_caching": True}, "no prefix cache"),
    ],
)
def test_bad_engine_options_fail_naming_what_is_allowed(engine, options, match):
    options = {"quantization": "q8_0"} | options
    with pytest.raises(ValueError, match=match):
        resolve(engine, "gb10", model=QWEN, **options)


def test_every_profile_cites_a_source_for_what_it_claims():
    for prof in PROFILES.values():
        assert prof.sources, prof.name
        assert all(isinstance(v, str) and v for v in prof.sources.values())


def test_stored_validation_summary_is_what_validate_gb10_computes():
    """docs and README quote research/perf/data/validation_summary.json: recomputed here, it
    must match (python -m experiments.validate_gb10 --write refreshes it)."""
    from experiments.validate_gb10 import (
        SUMMARY_PATH,
        llama_cpp_rows,
        prefill_rows,
        summarize,
        vllm_rows,
    )

    stored = json.loads(SUMMARY_PATH.read_text())
    rows = llama_cpp_rows()[0] + vllm_rows()[0] + prefill_rows()[0]
    assert summarize(rows) == stored
    assert stored["llama_cpp"]["median_abs_error"] <= 0.04
    decode = {k: v for k, v in stored.items() if k.startswith("vllm") and "prefill" not in k}
    assert decode and all(v["median_abs_error"] <= 0.10 for v in decode.values())
    # prefill and TTFT are reported per engine, apart from decode
    assert {
        "vllm/prefill_ttft",
        "llama_cpp/prefill_ttft",
        "ollama/prefill_ttft_length_assumed",
    } <= set(stored)
