"""Engine behaviour on a tiny random model: bad requests refused mid-run, abort, timestamps,
bounded compilation, stop conditions, copy-on-write block copies."""

from __future__ import annotations

import dataclasses
import math

import pytest

from research import SamplingParams
from research.config import CacheConfig, SchedulerConfig
from research.engine.engine import Engine
from research.models.presets import get_preset
from research.models.transformer import init_params

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 60)), [3] * 17]


@pytest.fixture(scope="module")
def model():
    import jax

    cfg = get_preset("tiny-llama")
    return cfg, init_params(cfg, jax.random.key(0))


def _engine(model, **sched) -> Engine:
    cfg, params = model
    return Engine(
        cfg,
        params,
        cache_config=CacheConfig(block_size=4, num_kv_blocks=64),
        scheduler_config=SchedulerConfig(**({"max_num_seqs": 8} | sched)),
        max_model_len=128,
    )


def _drain(engine: Engine) -> dict[str, object]:
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def test_bad_requests_are_refused_while_running_ones_continue(model):
    reference = _engine(model).generate(PROMPTS, [GREEDY] * len(PROMPTS))
    engine = _engine(model)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    engine.step()
    engine.step()
    bad = [
        ([], "prompt is empty"),
        ([1, 2, 10_000], "outside the vocabulary"),
        (list(range(1, 130)), "max_model_len"),
    ]
    for prompt, reason in bad:
        with pytest.raises(ValueError, match=reason):
            engine.add_request(prompt, GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1, 2], GREEDY, request_id=ids[0])
    final = _drain(engine)
    assert [final[i].token_ids for i in ids] == [o.token_ids for o in reference]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_abort_returns_blocks_and_others_finish(model):
    engine = _engine(model, max_num_seqs=4)
    reference = _engine(model).generate(PROMPTS, [GREEDY] * len(PROMPTS))
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    engine.step()
    used_before = engine.block_manager.num_used_blocks
    seq_blocks = len(engine.requests[ids[2]].block_ids)
    assert seq_blocks > 0
    assert engine.abort(ids[2])
    assert engine.block_manager.num_used_blocks == used_before - seq_blocks
    assert not engine.abort(ids[2])  # already gone
    assert not engine.abort("no-such-request")
    final = _drain(engine)
    assert ids[2] not in final
    for i in (0, 1, 3):
        assert final[ids[i]].token_ids == reference[i].token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # A waiting request can be aborted too.
    rid = engine.add_request(PROMPTS[0], GREEDY)
    assert engine.abort(rid)
    assert not engine.has_unfinished_requests()


def test_outputs_carry_ordered_timestamps(model):
    engine = _engine(model)
    out = engine.generate(PROMPTS[:2], [GREEDY] * 2)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert len(m.token_times) == len(out.token_ids) == 12
    assert m.token_times == sorted(m.token_times)
    assert m.token_times[0] == m.first_token_time


def test_compilations_bounded_by_buckets_not_steps(model):
    cfg, params = model
    engine = Engine(
        cfg,
        params,
        cache_config=CacheConfig(block_size=4, num_kv_blocks=64, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        max_model_len=128,
    )
    engine.generate(PROMPTS, [GREEDY] * len(PROMPTS))
    shapes, steps = engine.num_compilations, engine.num_steps
    for _ in range(3):
        engine.generate(PROMPTS, [GREEDY] * len(PROMPTS))
    assert engine.num_steps == 4 * steps
    assert engine.num_compilations == shapes  # more steps, no new shapes
    # The bound itself: buckets of rows (1..8), tokens (decode, or 16..64), blocks (32 = 128/4).
    assert shapes <= 4 * (1 + 3) * 1


def test_stop_token_and_eos(model):
    engine = _engine(model)
    base = engine.generate([PROMPTS[0]], [GREEDY])[0].token_ids
    stop = base[4]
    out = engine.generate(
        [PROMPTS[0]], [SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop])]
    )[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop
    assert out.token_ids == base[: base.index(stop) + 1]
    # tiny-llama's EOS is token 2: a model that emits it stops unless ignore_eos is set.
    cfg, _ = model
    assert 2 in cfg.eos_token_ids


def test_sampling_is_batch_invariant_with_seeds(model):
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=7)
    engine = _engine(model)
    alone = engine.generate([PROMPTS[1]], [sp])[0].token_ids
    together = engine.generate(PROMPTS, [GREEDY, sp, GREEDY, GREEDY])[1].token_ids
    assert alone == together


def test_fork_copy_on_write_reaches_the_device(model):
    """A forked sequence diverging inside a shared partial block gets a private copy."""
    import numpy as np

    engine = _engine(model)
    rid = engine.add_request([7, 8, 9, 10, 11, 12], GREEDY)  # 1.5 blocks of 4
    engine.step()  # prefill
    parent = engine.requests[rid]
    bm = engine.block_manager
    from research.engine.sequence import Sequence

    child = Sequence("child", list(parent.prompt_token_ids), GREEDY, 0, parent.metrics)
    child.output_token_ids = list(parent.output_token_ids)
    bm.fork(parent, child)
    shared_last = parent.block_ids[-1]
    assert bm.blocks[shared_last].ref_count == 2
    assert bm.allocate_slots(child, 1)
    ((src, dst),) = bm.pending_copies
    assert src == shared_last and child.block_ids[-1] == dst
    from research.engine.scheduler import StepPlan

    engine.executor.execute(StepPlan(block_copies=bm.take_pending_copies()))
    k = engine.executor.pool.k[0]
    np.testing.assert_array_equal(np.asarray(k[:, dst, :2]), np.asarray(k[:, src, :2]))
    bm.free(child)
    engine.abort(rid)
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_narrow_kv_pages_are_written_in_place_and_never_read_unwritten(model, kv):
    """bf16 (and fp8) pages live as raw bits on CPU, where XLA rewrites a whole float16-wide
    layer to update one token: the pool's buffers are reused step after step (in place), and a
    poisoned pool (NaN in every page, refilled when freed) under preemption gives the tokens of
    a roomy, clean one, with no NaN read (every top-2 gap finite). bf16 pages: token for token.
    fp8 pages: token for token up to a near-tie, because recomputing a preempted request reads
    its generated tokens' K/V unquantized (new tokens of the prefill chunk) where its decode
    steps read them from fp8 pages (its top-2 gaps moved by up to 0.0015 even where its tokens
    held), so the first differing token must have both runs' gaps below 0.005."""
    import jax
    import jax.numpy as jnp

    cfg, params = model
    params = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), params)

    def engine(blocks: int, poison: bool) -> Engine:
        return Engine(
            cfg,
            params,
            cache_config=CacheConfig(block_size=4, num_kv_blocks=blocks),
            scheduler_config=SchedulerConfig(max_num_seqs=8),
            max_model_len=128,
            dtype=jnp.bfloat16,
            kv_cache_dtype=kv,
            poison_freed_blocks=poison,
        )

    roomy = engine(64, False)
    pool = roomy.executor.pool
    assert pool.page_dtype == ("bfloat16" if kv == "auto" else "float8_e4m3fn")
    assert pool.k[0].dtype == (jnp.uint16 if kv == "auto" else jnp.uint8)
    roomy.add_request(PROMPTS[2], GREEDY)
    roomy.step()
    pointer = roomy.executor.pool.k[-1].unsafe_buffer_pointer()
    roomy.step()
    roomy.step()
    assert roomy.executor.pool.k[-1].unsafe_buffer_pointer() == pointer
    _drain(roomy)

    reference = engine(64, False).generate(PROMPTS, [GREEDY] * len(PROMPTS))
    tight = engine(16, True)
    out = tight.generate(PROMPTS, [GREEDY] * len(PROMPTS))
    assert tight.stats()["num_preemptions"] > 0
    assert all(math.isfinite(g) for o in out for g in o.top2_logit_gaps)
    if kv == "auto":
        assert [o.token_ids for o in out] == [o.token_ids for o in reference]
        return
    for x, y in zip(out, reference, strict=True):
        assert len(x.token_ids) == len(y.token_ids)
        if x.token_ids != y.token_ids:
            i = next(
                i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids, strict=True)) if s != t
            )
            gap = max(x.top2_logit_gaps[i], y.top2_logit_gaps[i])
            assert gap < 0.005, f"tokens differ at {i} where the top-2 logit gap is {gap:.3g}"


def test_llm_logs_its_kv_pool_at_start(caplog):
    """vLLM's start-up line: KV blocks and the maximum concurrency at max_model_len."""
    import logging

    from research import LLM

    with caplog.at_level(logging.INFO, logger="research.llm"):
        LLM("tiny-llama", max_model_len=128, block_size=4, num_kv_blocks=64)
    # 64 blocks of 4 tokens; a 128-token request needs 32 of them
    assert "# KV cache blocks: 64 (256 tokens of 4)" in caplog.text
    assert "maximum concurrency for 128 tokens per request: 2.00x" in caplog.text


def test_prefix_cache_hits_give_the_tokens_an_uncached_engine_gives(model):
    """Four prompts sharing a 32-token prefix, the first alone: the other three reuse its eight
    blocks (the hit rate counts exactly those tokens) and generate the tokens an engine without
    the cache computes from scratch."""
    cfg, params = model
    prefix = list(range(100, 132))
    prompts = [[*prefix, 200 + i, 210 + i, 220 + i] for i in range(4)]
    got = {}
    for caching in (True, False):
        engine = Engine(
            cfg,
            params,
            cache_config=CacheConfig(block_size=4, num_kv_blocks=64, enable_prefix_caching=caching),
            scheduler_config=SchedulerConfig(max_num_seqs=8),
            max_model_len=128,
        )
        first = engine.generate(prompts[:1], [GREEDY])
        rest = engine.generate(prompts[1:], [GREEDY] * 3)
        got[caching] = ([o.token_ids for o in first + rest], engine.block_manager)
    (cached, bm), (uncached, plain) = got[True], got[False]
    assert cached == uncached
    assert bm.prefix_cache_hit_rate == pytest.approx(3 * 32 / (4 * 35))
    assert plain.prefix_cache_hit_rate == 0.0
    assert bm.num_free_blocks == bm.num_blocks


def test_prompt_logprobs_survive_chunking_prefix_caching_and_preemption(model):
    """Prompt log-probabilities do not depend on how the prompt was computed: whole, in 8-token
    chunks, after an identical prompt filled the prefix cache (such a request recomputes its
    prompt, as vLLM), or recomputed after preemption."""
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    whole = _engine(model).generate(PROMPTS[2:], [sp, sp])
    assert len(whole[0].prompt_logprobs) == len(PROMPTS[2]) and whole[0].prompt_logprobs[0] is None
    chunked_engine = _engine(model, max_num_batched_tokens=8)
    chunked_engine.generate([PROMPTS[2]], [GREEDY])  # fills the prefix cache
    chunked = chunked_engine.generate([PROMPTS[2]], [sp])[0]
    # 18 blocks of 4 admit both prompts (10 + 5 blocks); growing, one preempts the other.
    cfg, params = model
    tight = Engine(
        cfg,
        params,
        cache_config=CacheConfig(block_size=4, num_kv_blocks=18),
        scheduler_config=SchedulerConfig(max_num_seqs=8),
        max_model_len=128,
    )
    long_sp = dataclasses.replace(sp, max_tokens=16)
    preempted = tight.generate(PROMPTS[2:], [long_sp, long_sp])
    assert tight.scheduler.num_preemptions > 0
    for ref, other in [(whole[0], chunked), *zip(whole, preempted, strict=True)]:
        assert other.token_ids[:6] == ref.token_ids
        for a, b in zip(ref.prompt_logprobs[1:], other.prompt_logprobs[1:], strict=True):
            assert a.keys() == b.keys()
            for t in a:
                assert a[t].rank == b[t].rank
                assert abs(a[t].logprob - b[t].logprob) < 1e-4


def test_logprobs_are_refused_where_no_logits_exist():
    from research import LLM

    llm = LLM("tiny-llama", executor="simulated", hardware="gb10", num_kv_blocks=64)
    with pytest.raises(ValueError, match="logprobs need the model's logits"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=1))
