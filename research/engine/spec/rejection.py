"""Speculative decoding's rejection sampler, on device (Leviathan et al. 2023; vLLM's).

A row proposes drafts x_0 .. x_{d-1} (from a proposal distribution q; for n-gram lookup q is a
point mass on each draft). The target's distribution p_j at each of the d + 1 verified positions
is the one the plain sampler draws from (temperature, then top-k and top-p; greedy rows are a
point mass on the argmax). Draft j is accepted with probability min(1, p_j(x_j) / q_j(x_j)),
left to right; at the first rejection the row's next token is drawn from
norm(max(0, p_j - q_j)) and the rest is dropped; if all d are accepted a bonus token is drawn
from p_d. Each emitted token is then distributed exactly as p: speculation changes the cost,
never the output distribution. Greedy rows accept while the draft equals the argmax.

Random draws use the request's own key folded with its position in the output (as ``sample``),
so a row's result does not depend on the rest of the batch.

Axis legend: R = rows, T = verified positions per row (drafts + 1), S = T - 1 draft slots,
V = vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from research.engine.sampler import SamplingTensors, _filtered_logits


def target_probs(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """The distribution ``sample`` draws from, per row: logits [B, V] -> probabilities [B, V]
    (one-hot on the argmax for greedy rows)."""
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    temperature = jnp.where(st.temperature > 0, st.temperature, 1.0)
    scaled = logits.astype(jnp.float32) / temperature[:, None]
    row_filters = (st.top_k > 0) | (st.top_p < 1.0)
    scaled = jax.lax.cond(
        jnp.any(row_filters),
        lambda x: jnp.where(row_filters[:, None], _filtered_logits(x, st.top_k, st.top_p), x),
        lambda x: x,
        scaled,
    )
    return jnp.where((st.temperature > 0)[:, None], jax.nn.softmax(scaled, axis=-1), greedy)


def rejection_sample(
    logits: jax.Array,
    draft_tokens: jax.Array,
    num_drafts: jax.Array,
    st: SamplingTensors,
    draft_probs: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Verify each row's drafts against the target.

    logits [R, T, V]: the target's logits after the row's last accepted token (t = 0) and after
    each draft (t = 1 .. S); draft_tokens [R, S] int32; num_drafts [R] (0 .. S; slots past it are
    padding); st: the rows' sampling settings [R] (``step`` = tokens the row has generated);
    draft_probs [R, S, V]: the proposal distribution q, or None for a point mass on each draft.

    Returns tokens [R, T] int32 (the accepted drafts, then the one sampled token, then -1) and
    num_accepted [R] int32: the row emits num_accepted + 1 tokens."""
    r, t, v = logits.shape
    s = t - 1
    flat = SamplingTensors(
        temperature=jnp.repeat(st.temperature, t),
        top_k=jnp.repeat(st.top_k, t),
        top_p=jnp.repeat(st.top_p, t),
        seed=jnp.repeat(st.seed, t),
        step=jnp.repeat(st.step, t),
        logprobs=jnp.repeat(st.logprobs, t),
    )
    p = target_probs(logits.reshape(r * t, v), flat).reshape(r, t, v)
    drafts = jnp.clip(draft_tokens, 0, v - 1)
    positions = jnp.arange(s)
    valid = positions[None, :] < num_drafts[:, None]  # [R, S]
    p_draft = jnp.take_along_axis(p[:, :s], drafts[..., None], axis=-1)[..., 0]  # [R, S]
    is_draft = jnp.arange(v)[None, None, :] == drafts[..., None]  # [R, S, V]
    if draft_probs is None:
        q_draft = jnp.ones_like(p_draft)
        residual = jnp.where(is_draft, 0.0, p[:, :s])
    else:
        q_draft = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
        residual = jnp.maximum(p[:, :s] - draft_probs, 0.0)

    # One key per (row, output position): the plain sampler's key for that position, split in
    # two (the acceptance test's uniform and the token draw).
    def position_keys(seed: jax.Array, step: jax.Array) -> jax.Array:
        return jax.vmap(lambda j: jax.random.split(jax.random.fold_in(jax.random.key(seed), j)))(
            step + jnp.arange(t)
        )

    keys = jax.vmap(position_keys)(st.seed, st.step)  # [R, T, 2]
    u = jax.vmap(jax.vmap(jax.random.uniform))(keys[:, :s, 0])  # [R, S] in [0, 1)
    accept = (u * q_draft < p_draft) & valid  # u < p / q without dividing by q = 0
    num_accepted = jnp.sum(jnp.cumprod(accept, axis=1), axis=1).astype(jnp.int32)  # [R]

    # The token after the accepted drafts: from the residual where a draft was rejected, from
    # p itself after the last draft (the bonus token).
    total = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0), p[:, :s])
    dist = jnp.concatenate([jnp.where(valid[..., None], residual, p[:, :s]), p[:, s:]], axis=1)
    rows = jnp.arange(r)
    final_dist = dist[rows, num_accepted]  # [R, V]
    final_keys = keys[rows, num_accepted, 1]
    drawn = jax.vmap(jax.random.categorical)(final_keys, jnp.log(final_dist))
    final = jnp.where(st.temperature > 0, drawn, jnp.argmax(final_dist, axis=-1)).astype(jnp.int32)
    cols = jnp.arange(t)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros((r, 1), drafts.dtype)], axis=1)
    tokens = jnp.where(
        cols < num_accepted[:, None],
        padded,
        jnp.where(cols == num_accepted[:, None], final[:, None], -1),
    )
    return tokens.astype(jnp.int32), num_accepted
