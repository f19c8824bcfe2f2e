"""On-device sampling: greedy, temperature, top-k and top-p with per-request keys.

Each row samples with its own PRNG key, derived from the request's seed and the number of tokens
it has generated so far, so its result never depends on which other requests share the batch.

Axis legend: B = rows (sequences), V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from research.engine.request import SamplingParams


@jax.tree_util.register_dataclass
@dataclass
class SamplingTensors:
    """Per-row sampling settings, as device arrays of shape [B]."""

    temperature: jax.Array  # float32; 0 = greedy
    top_k: jax.Array  # int32; 0 = disabled
    top_p: jax.Array  # float32; 1 = disabled
    seed: jax.Array  # uint32 request seed
    step: jax.Array  # int32 tokens generated so far by the row (folded into the key)
    logprobs: jax.Array  # bool: the row wants its sample's log-probability and top alternatives

    @classmethod
    def from_params(
        cls, params: list[SamplingParams], seeds: list[int], steps: list[int]
    ) -> SamplingTensors:
        return cls(
            temperature=jnp.asarray(np.array([p.temperature for p in params], np.float32)),
            top_k=jnp.asarray(np.array([max(p.top_k, 0) for p in params], np.int32)),
            top_p=jnp.asarray(np.array([p.top_p for p in params], np.float32)),
            seed=jnp.asarray(np.array(seeds, np.uint32)),
            step=jnp.asarray(np.array(steps, np.int32)),
            logprobs=jnp.asarray(np.array([p.logprobs is not None for p in params], bool)),
        )


def _filtered_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Set logits outside each row's top-k and top-p nucleus to -inf. logits [B, V]."""
    vocab = logits.shape[-1]
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # descending [B, V]
    # top-k: the k-th largest value is the threshold (k = 0 keeps everything).
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)  # [B, 1]
    # top-p: keep the smallest prefix of the sorted distribution whose mass reaches p.
    probs = jax.nn.softmax(jnp.where(sorted_logits >= kth, sorted_logits, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep_sorted = keep_sorted.at[:, 0].set(True)
    n_keep = jnp.sum(keep_sorted & (sorted_logits >= kth), axis=-1)  # [B] >= 1
    threshold = jnp.take_along_axis(sorted_logits, (n_keep - 1)[:, None], axis=-1)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def greedy(logits: jax.Array, native: bool = False) -> tuple[jax.Array, jax.Array]:
    """Each row's argmax (the lowest index among ties, as ``jnp.argmax``) and the gap between its
    largest and second-largest logit, from three plain reductions over the vocabulary: XLA:CPU
    runs argmax's (value, index) reduction several times slower than a max, and ``lax.top_k``
    lowers to a full sort (275 ms for 32 x 49152). logits [B, V] -> ([B] int32, [B] float32).
    ``native``: the same values from the native CPU kernel (``research.native.gemm.greedy``) in
    one pass, where it is built: XLA's version writes two [B, V] selects, ~5% of a 64-row
    SmolLM2 decode step on two cores."""
    if native and logits.dtype == jnp.float32:
        from research import native as native_kernels

        if native_kernels.available("gemm"):
            from research.native.gemm import greedy as native_greedy

            return native_greedy(logits)
    vocab = logits.shape[-1]
    ids = jnp.arange(vocab, dtype=jnp.int32)
    first = jnp.max(logits, axis=-1, keepdims=True)
    # max propagates NaN: a row with one then matches its first NaN, as argmax does
    best = jnp.min(jnp.where((logits == first) | jnp.isnan(logits), ids, vocab), axis=-1)
    second = jnp.max(jnp.where(ids == best[:, None], -jnp.inf, logits), axis=-1)
    return best, first[:, 0] - second


def sample(
    logits: jax.Array, st: SamplingTensors, greedy_tokens: jax.Array | None = None
) -> jax.Array:
    """Next token per row: logits [B, V] float32 -> token ids [B] int32. Rows at temperature 0
    take ``greedy_tokens`` (their argmax; computed here when not given)."""
    if greedy_tokens is None:
        greedy_tokens = greedy(logits)[0]

    def draw(x: jax.Array) -> jax.Array:
        # Temperature first, then top-k / top-p on the tempered distribution (vLLM's order).
        temperature = jnp.where(st.temperature > 0, st.temperature, 1.0)
        scaled = x / temperature[:, None]
        row_filters = (st.top_k > 0) | (st.top_p < 1.0)  # [B]; rows without filters untouched
        scaled = jax.lax.cond(
            jnp.any(row_filters),
            lambda y: jnp.where(row_filters[:, None], _filtered_logits(y, st.top_k, st.top_p), y),
            lambda y: y,
            scaled,
        )
        keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(st.seed, st.step)
        return jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)

    # Random draws cost ~1 ms per row over a 49k vocabulary on CPU: skip them (and the tempered
    # copy of the logits) for greedy batches.
    sampled = jax.lax.cond(jnp.any(st.temperature > 0), draw, lambda x: greedy_tokens, logits)
    return jnp.where(st.temperature > 0, sampled, greedy_tokens)


def token_logprobs(
    logits: jax.Array, targets: jax.Array, k: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Log-softmax of raw ``logits`` [B, V]: each row's ``targets`` [B] log-probability and rank
    (how many tokens are at least as likely, vLLM's count), and its ``k`` most likely tokens
    (ids [B, k] and log-probabilities [B, k], most likely first; ties to the lower id).

    The top k come from k argmax passes: lax.top_k lowers to a full sort of the vocabulary on
    XLA:CPU, k passes over it cost less for the k <= 20 asked here."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    rows = jnp.arange(logp.shape[0])
    target = jnp.clip(targets, 0, logp.shape[-1] - 1)
    target_lp = logp[rows, target]
    rank = jnp.sum(logp >= target_lp[:, None], axis=-1).astype(jnp.int32)

    def pick(i, carry):
        x, ids, vals = carry
        j = jnp.argmax(x, axis=-1).astype(jnp.int32)
        ids = ids.at[:, i].set(j)
        vals = vals.at[:, i].set(x[rows, j])
        return x.at[rows, j].set(-jnp.inf), ids, vals

    init = (logp, jnp.zeros((logp.shape[0], k), jnp.int32), jnp.zeros((logp.shape[0], k)))
    _, top_ids, top_lp = jax.lax.fori_loop(0, k, pick, init)
    return target_lp, rank, top_ids, top_lp
