"""The paged engine on real SmolLM2 weights: batch invariance, memory pressure with preemption,
prefix caching, and isolation (NaN-filled free blocks are never read)."""

from __future__ import annotations

import numpy as np
import pytest

from research import SamplingParams
from research.config import CacheConfig, SchedulerConfig
from research.engine.engine import Engine
from research.engine.request import RequestOutput

PASSAGE = (
    "The river wound through the valley, past farms and orchards, until it reached the old "
    "stone bridge where the village market was held every Saturday. Merchants came from the "
    "hills with cheese, wool and honey, and children ran between the stalls. In the spring the "
    "water rose high and the miller worried about his wheel; in the autumn it ran low and clear. "
    "Scientists measure the speed of light in a vacuum as about three hundred thousand "
    "kilometres per second, and the distance from the Earth to the Sun as about one hundred and "
    "fifty million kilometres, so sunlight takes a little over eight minutes to reach us. "
    "A good recipe for bread needs flour, water, salt and yeast, a warm room, patience and an "
    "oven hot enough to form a crust. Programming languages such as Python, Rust and C differ "
    "in how they manage memory: some use garbage collection, some ownership rules, and some "
    "leave it to the programmer. The history of the printing press begins with movable type in "
    "East Asia and continues with Gutenberg in Mainz around 1450, whose press spread across "
    "Europe within a few decades and changed how knowledge travelled. Mountains form where "
    "tectonic plates collide, volcanoes where magma finds a way to the surface, and deep ocean "
    "trenches where one plate slides beneath another. "
)


@pytest.fixture(scope="module")
def stream(smollm2_llm) -> list[int]:
    ids = smollm2_llm.tokenizer.encode(PASSAGE * 3)
    assert len(ids) > 700
    return ids


def _engine(llm, **kwargs) -> Engine:
    cache = CacheConfig(
        block_size=16,
        num_kv_blocks=kwargs.pop("num_kv_blocks", llm.engine.block_manager.num_blocks),
        enable_prefix_caching=kwargs.pop("enable_prefix_caching", True),
    )
    sched = SchedulerConfig(
        max_num_seqs=kwargs.pop("max_num_seqs", 32),
        max_num_batched_tokens=kwargs.pop("max_num_batched_tokens", 2048),
    )
    return Engine(
        llm.model_config,
        llm.params,
        llm.tokenizer,
        cache_config=cache,
        scheduler_config=sched,
        max_model_len=llm.max_model_len,
        **kwargs,
    )


def _count_ties(a: list[RequestOutput], b: list[RequestOutput], tol: float = 1e-4) -> int:
    """Outputs must agree token for token, except after a near-tie: at the first differing
    position both runs' top-2 logit gaps must be below ``tol``. Returns how many ties occurred."""
    ties = 0
    for x, y in zip(a, b, strict=True):
        assert len(x.token_ids) == len(y.token_ids)
        if x.token_ids == y.token_ids:
            continue
        i = next(i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids, strict=True)) if s != t)
        gap = max(x.top2_logit_gaps[i], y.top2_logit_gaps[i])
        assert gap < tol, f"outputs differ at token {i} where the top-2 logit gap is {gap:.3g}"
        ties += 1
    return ties


def test_batch_invariance_32_prompts(smollm2_llm, stream):
    lengths = np.linspace(8, 300, 32).astype(int)
    offsets = np.random.RandomState(0).randint(0, len(stream) - 300, size=32)
    prompts = [stream[o : o + n] for o, n in zip(offsets, lengths, strict=True)]
    sp = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)

    engine = _engine(smollm2_llm, max_num_seqs=32)
    together = engine.generate(prompts, [sp] * 32)
    alone = [engine.generate([p], [sp])[0] for p in prompts]

    ties = _count_ties(together, alone)
    print(f"\nbatch invariance: {32 - ties}/32 identical, {ties} near-ties (gap < 1e-4)")
    assert all(len(o.token_ids) == 48 for o in together + alone)
    assert engine.stats()["num_preemptions"] == 0
    # Compiled step shapes are bounded by the buckets, not by the number of steps.
    assert engine.num_compilations <= 24 < engine.num_steps


def test_memory_pressure_preempts_and_loses_nothing(smollm2_llm, stream):
    rng = np.random.RandomState(1)
    prompts = [
        stream[o : o + n]
        for o, n in zip(rng.randint(0, 400, 16), rng.randint(20, 80, 16), strict=True)
    ]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    demand = sum(-(-(len(p) + 24) // 16) for p in prompts)

    reference = smollm2_llm.engine.generate(prompts, [sp] * 16)
    # About 10x too small for the offered load; poisoned: pages start as NaN and every freed
    # block is refilled with NaN, so reading anything not written for this request shows up.
    small = _engine(
        smollm2_llm, num_kv_blocks=demand // 10, max_num_seqs=16, poison_freed_blocks=True
    )
    constrained = small.generate(prompts, [sp] * 16)

    preemptions = small.stats()["num_preemptions"]
    ties = _count_ties(reference, constrained)
    print(
        f"\nmemory pressure: pool {demand // 10} blocks for a demand of {demand}, "
        f"{preemptions} preemptions, {ties} near-ties"
    )
    assert preemptions > 0
    assert all(len(o.token_ids) == 24 and o.finish_reason == "length" for o in constrained)
    assert small.block_manager.num_free_blocks == small.block_manager.num_blocks


def test_prefix_caching_hits_and_matches_uncached(smollm2_llm, stream):
    prefix = stream[:256]
    suffixes = [stream[300 + 7 * i : 300 + 7 * i + 12] for i in range(6)]
    prompts = [prefix + s for s in suffixes]
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    outputs = {}
    for caching in (True, False):
        engine = _engine(smollm2_llm, enable_prefix_caching=caching)
        first = engine.generate(prompts[:1], [sp])  # computes and registers the prefix
        rest = engine.generate(prompts[1:], [sp] * 5)
        outputs[caching] = (first + rest, engine.block_manager.prefix_cache_hit_rate)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

    cached, hit_rate = outputs[True]
    uncached, no_hits = outputs[False]
    ties = _count_ties(cached, uncached)  # asserts equality up to near-ties
    print(f"\nprefix caching: hit rate {hit_rate:.3f} over {len(prompts)} requests, {ties} ties")
    # 5 of 6 requests reuse all 16 prefix blocks: 5*256 of 6*268 prompt tokens.
    assert hit_rate == pytest.approx(5 * 256 / (6 * 268))
    assert no_hits == 0.0


def test_isolation_nan_pool_matches_clean_run(smollm2_llm, stream):
    """Many requests finishing at different times in a NaN-poisoned pool: same outputs."""
    rng = np.random.RandomState(2)
    prompts = [
        stream[o : o + n]
        for o, n in zip(rng.randint(0, 400, 12), rng.randint(10, 60, 12), strict=True)
    ]
    sps = [
        SamplingParams(max_tokens=int(m), temperature=0.0, ignore_eos=True)
        for m in rng.randint(4, 30, 12)
    ]
    clean = smollm2_llm.engine.generate(prompts, sps)
    # The pool of the memory-pressure test (8 blocks, 16 seqs): its compiled shapes are reused.
    poisoned_engine = _engine(
        smollm2_llm,
        num_kv_blocks=8,
        max_num_seqs=16,
        poison_freed_blocks=True,
        enable_prefix_caching=False,
    )
    poisoned = poisoned_engine.generate(prompts, sps)
    ties = _count_ties(clean, poisoned)
    print(f"\nisolation: {len(prompts)} requests in a NaN-poisoned pool, {ties} near-ties")
    assert [len(o.token_ids) for o in poisoned] == [sp.max_tokens for sp in sps]


def test_a_vllm_users_snippet_runs_unchanged(smollm2_llm):
    """``LLM(model=...).generate(prompts, SamplingParams(...))[0].outputs[0].text``."""
    from research import CompletionOutput, SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0.0)
    out = smollm2_llm.generate(["The capital of France is"], sp)[0]
    (completion,) = out.outputs
    assert isinstance(completion, CompletionOutput) and completion.index == 0
    assert completion.text == out.text and "Paris" in completion.text
    assert completion.token_ids == out.token_ids and completion.finish_reason == out.finish_reason
