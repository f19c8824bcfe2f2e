"""Tests for research.engine.sampler: greedy, temperature, top-k, top-p and per-row keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.engine.request import SamplingParams
from research.engine.sampler import SamplingTensors, sample

sample_jit = jax.jit(sample)


def _tensors(
    n: int,
    *,
    temperature: float | list[float] = 1.0,
    top_k: int | list[int] = 0,
    top_p: float | list[float] = 1.0,
    seed: int | list[int] | np.ndarray = 0,
    step: int | list[int] | np.ndarray = 0,
) -> SamplingTensors:
    """SamplingTensors for ``n`` rows; scalars are broadcast to every row."""

    def col(value, dtype):
        return jnp.asarray(np.broadcast_to(np.asarray(value, dtype), (n,)).copy())

    return SamplingTensors(
        temperature=col(temperature, np.float32),
        top_k=col(top_k, np.int32),
        top_p=col(top_p, np.float32),
        seed=col(seed, np.uint32),
        step=col(step, np.int32),
        logprobs=col(False, bool),
    )


def _log_probs(probs: list[float], rows: int) -> jax.Array:
    """Logits [rows, V] whose softmax is ``probs`` in every row."""
    return jnp.tile(jnp.log(jnp.asarray(probs, jnp.float32)), (rows, 1))


def _random_logits(rows: int, vocab: int, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=(rows, vocab)) * 2, jnp.float32)


def test_greedy_rows_return_argmax():
    logits = _random_logits(32, 16)
    # Greedy rows ignore top-k/top-p and seeds: they are always the argmax.
    st = _tensors(32, temperature=0.0, top_k=[0, 3] * 16, top_p=0.5, seed=np.arange(32))
    tokens = np.asarray(sample_jit(logits, st))
    assert tokens.dtype == np.int32
    np.testing.assert_array_equal(tokens, np.argmax(np.asarray(logits), axis=-1))


def test_greedy_and_sampled_rows_mixed_in_one_batch():
    logits = _random_logits(16, 16, seed=1)
    temperature = [0.0, 1.0] * 8
    st = _tensors(16, temperature=temperature, seed=np.arange(16))
    tokens = np.asarray(sample_jit(logits, st))
    argmax = np.argmax(np.asarray(logits), axis=-1)
    np.testing.assert_array_equal(tokens[::2], argmax[::2])
    assert ((tokens >= 0) & (tokens < 16)).all()


def test_top_k_1_with_temperature_always_returns_argmax():
    rows = 256
    logits = _random_logits(rows, 16, seed=2)
    st = _tensors(rows, temperature=2.0, top_k=1, seed=np.arange(rows), step=np.arange(rows) % 7)
    tokens = np.asarray(sample_jit(logits, st))
    np.testing.assert_array_equal(tokens, np.argmax(np.asarray(logits), axis=-1))


@pytest.mark.parametrize("k", [2, 3, 5])
def test_top_k_never_samples_outside_the_top_k(k):
    rows, vocab = 2000, 16
    # The same logits in every row, many different seeds; a high temperature spreads the mass.
    row_logits = _random_logits(1, vocab, seed=3)
    logits = jnp.tile(row_logits, (rows, 1))
    st = _tensors(rows, temperature=3.0, top_k=k, seed=np.arange(rows))
    tokens = np.asarray(sample_jit(logits, st))
    top_k_ids = set(np.argsort(-np.asarray(row_logits[0]))[:k].tolist())
    seen = set(tokens.tolist())
    assert seen <= top_k_ids, f"sampled {sorted(seen - top_k_ids)} outside the top {k}"
    assert seen == top_k_ids  # and every one of the top k does get sampled


@pytest.mark.parametrize(
    ("top_p", "allowed"),
    [(0.6, {0, 1}), (0.5, {0}), (0.85, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})],
)
def test_top_p_samples_only_from_the_nucleus(top_p, allowed):
    # Tokens 2 and 3 tie, so a nucleus that reaches into them keeps both.
    rows = 2000
    logits = _log_probs([0.5, 0.3, 0.1, 0.1], rows)
    st = _tensors(rows, temperature=1.0, top_p=top_p, seed=np.arange(rows))
    seen = set(np.asarray(sample_jit(logits, st)).tolist())
    assert seen == allowed


def test_top_p_renormalizes_over_the_nucleus():
    rows = 4000
    logits = _log_probs([0.5, 0.3, 0.1, 0.1], rows)
    st = _tensors(rows, temperature=1.0, top_p=0.6, seed=np.arange(rows))
    tokens = np.asarray(sample_jit(logits, st))
    freq = np.bincount(tokens, minlength=4) / rows
    np.testing.assert_allclose(freq, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0], atol=0.05)


def test_row_result_does_not_depend_on_the_rest_of_the_batch():
    vocab = 16
    logits = _random_logits(8, vocab, seed=4)
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=2, top_p=0.9),
        SamplingParams(temperature=2.0, top_k=-1),
        SamplingParams(temperature=0.5, top_p=0.3),
        SamplingParams(temperature=1.0, top_k=8),
    ]
    for trial in range(5):
        seeds = [1000 * trial + 17 * i for i in range(8)]
        steps = [trial + i for i in range(8)]
        batched = np.asarray(sample_jit(logits, SamplingTensors.from_params(params, seeds, steps)))
        for i in range(8):
            alone_st = SamplingTensors.from_params([params[i]], [seeds[i]], [steps[i]])
            alone = int(sample_jit(logits[i : i + 1], alone_st)[0])
            assert alone == batched[i], f"row {i} ({params[i]}) differs alone vs. batched"
        # The same row at a different position of the batch also gives the same token.
        perm = np.roll(np.arange(8), 3)
        rolled = sample_jit(
            logits[perm],
            SamplingTensors.from_params(
                [params[j] for j in perm], [seeds[j] for j in perm], [steps[j] for j in perm]
            ),
        )
        np.testing.assert_array_equal(np.asarray(rolled), batched[perm])


def test_same_seed_and_step_is_reproducible():
    logits = _random_logits(64, 16, seed=5)
    st = _tensors(64, temperature=1.0, seed=np.arange(64) * 3, step=np.arange(64))
    first = np.asarray(sample_jit(logits, st))
    second = np.asarray(sample_jit(logits, st))
    np.testing.assert_array_equal(first, second)


def test_different_steps_give_different_samples():
    rows, vocab = 200, 16
    logits = jnp.zeros((rows, vocab), jnp.float32)  # uniform
    st = _tensors(rows, temperature=1.0, seed=1234, step=np.arange(rows))
    tokens = np.asarray(sample_jit(logits, st))
    # 200 uniform draws over 16 tokens: all 16 appear with overwhelming probability.
    assert len(set(tokens.tolist())) > 1
    assert len(set(tokens.tolist())) >= 12


def test_different_seeds_give_different_samples():
    rows, vocab = 200, 16
    logits = jnp.zeros((rows, vocab), jnp.float32)
    st = _tensors(rows, temperature=1.0, seed=np.arange(rows), step=5)
    assert len(set(np.asarray(sample_jit(logits, st)).tolist())) >= 12


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_empirical_frequencies_match_softmax(temperature):
    rows = 2000
    logits = _log_probs([0.4, 0.3, 0.2, 0.1], rows)
    st = _tensors(rows, temperature=temperature, seed=np.arange(rows) + 99)
    tokens = np.asarray(sample_jit(logits, st))
    freq = np.bincount(tokens, minlength=4) / rows
    expected = np.asarray(jax.nn.softmax(logits[0] / temperature))
    np.testing.assert_allclose(freq, expected, atol=0.05)


def test_from_params_maps_disabled_filters():
    params = [
        SamplingParams(temperature=0.0, top_k=-1),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9),
    ]
    st = SamplingTensors.from_params(params, seeds=[2**32 - 1, 7], steps=[0, 3])
    np.testing.assert_array_equal(np.asarray(st.top_k), [0, 5])  # -1 means disabled, like 0
    np.testing.assert_allclose(np.asarray(st.temperature), [0.0, 0.8])
    np.testing.assert_allclose(np.asarray(st.top_p), [1.0, 0.9])
    np.testing.assert_array_equal(np.asarray(st.seed), np.array([2**32 - 1, 7], np.uint32))
    np.testing.assert_array_equal(np.asarray(st.step), [0, 3])
    assert st.seed.dtype == jnp.uint32 and st.top_k.dtype == jnp.int32
