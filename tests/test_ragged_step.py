"""One forward pass per engine step over a ragged token batch, fed by a persistent input batch."""

from __future__ import annotations

import random

import jax
import numpy as np
import pytest

from research import LLM, SamplingParams
from research.engine import step as step_module
from research.engine.input_batch import InputBatch


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _record_steps(llm: LLM) -> list[tuple[dict[str, int], int]]:
    """Per step: how many rows of each kind it ran, and its forward passes."""
    executor = llm.engine.executor
    execute, log = executor.execute, []

    def recorded(plan):
        result = execute(plan)
        kinds = {"decodes": len(plan.decodes), "prefills": len(plan.prefills)}
        kinds["verifies"] = len(plan.verifies)
        log.append((kinds, result.forward_passes))
        return result

    executor.execute = recorded
    return log


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_every_step_is_one_forward_pass_whatever_the_mix(spec):
    """Decodes, prefill chunks and verifications of one step share a single forward: the step
    result says 1 for every step (mixed ones included), the engine's count equals its steps,
    and the traced step calls the model's ``forward`` exactly once."""
    llm = LLM(
        "tiny-llama",
        max_model_len=256,
        max_num_seqs=6,
        max_num_batched_tokens=32,
        block_size=8,
        num_kv_blocks=20,  # a tenth of what six rows need: preemption too
        speculative_config=spec,
    )
    log = _record_steps(llm)
    jax.clear_caches()  # shapes traced by earlier tests would not be traced again
    forwards = step_module._FORWARDS_IN_TRACE[0]
    traces = step_module.STEP_TRACES[0]
    prompts = [p * 2 for p in _prompts(10, seed=3, hi=30)]  # repeats: n-gram drafts find them
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    assert [len(o.token_ids) for o in outs] == [20] * len(prompts)
    mixed = [k for k, _ in log if sum(bool(v) for v in k.values()) > 1]
    assert mixed, "the workload made no mixed step"
    assert all(fp == 1 for _, fp in log)
    stats = llm.engine.stats()
    assert stats["num_forward_passes"] == stats["num_steps"] == len(log)
    assert stats["num_preemptions"] > 0
    if spec is not None:
        assert any(k["verifies"] and (k["decodes"] or k["prefills"]) for k, _ in log)
    new_traces = step_module.STEP_TRACES[0] - traces
    assert new_traces > 0
    assert step_module._FORWARDS_IN_TRACE[0] - forwards == new_traces  # one forward per trace


def test_persistent_input_batch_equals_a_fresh_build_every_step():
    """The slots updated in place (tokens appended, blocks rewritten from the first changed one)
    give exactly the inputs a batch built from scratch gives, through chunked prefill, prefix
    caching, preemption and rejected drafts."""
    llm = LLM(
        "tiny-llama",
        max_model_len=256,
        max_num_seqs=5,
        max_num_batched_tokens=24,
        block_size=8,
        num_kv_blocks=24,
        enable_prefix_caching=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
    )
    executor = llm.engine.executor
    batch = executor.batch
    prepare, checked = batch.prepare, [0]

    def fresh() -> InputBatch:
        return InputBatch(
            max_slots=executor.max_num_seqs,
            max_model_len=executor.max_model_len,
            max_blocks_per_seq=executor.max_blocks_per_seq,
            block_size=executor.block_size,
            num_blocks=executor.num_blocks,
            num_scored=batch.num_scored,
        )

    def compared(rows, shape):
        got = prepare(rows, shape)
        want = fresh().prepare(rows, shape)
        leaves = jax.tree_util.tree_leaves
        for a, b in zip(leaves(got.inputs), leaves(want.inputs), strict=True):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(got.slot_mapping, want.slot_mapping)
        checked[0] += 1
        return got

    batch.prepare = compared
    shared = _prompts(1, seed=9, lo=40, hi=40)[0]
    prompts = [shared + p for p in _prompts(8, seed=4, hi=20)]  # a common prefix: cache hits
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert all(len(o.token_ids) == 24 for o in outs)
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0
    assert stats["spec_num_draft_tokens"] > stats["spec_num_accepted_tokens"]  # some rejected
    assert checked[0] == stats["num_steps"]


def test_greedy_tokens_do_not_depend_on_the_batch():
    """Each prompt's greedy tokens alone equal its tokens among others (other rows, other mixes
    of decodes and prefill chunks in its steps)."""
    prompts = _prompts(6, seed=5)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM("tiny-llama", max_model_len=256, max_num_batched_tokens=32)
    together = [o.token_ids for o in llm.generate(prompts, sp)]
    alone = [llm.generate([p], sp)[0].token_ids for p in prompts]
    assert together == alone
