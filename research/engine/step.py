"""The jitted engine step: one forward pass over every token scheduled in a step.

Whatever the mix of decodes, prefill chunks and speculative verifications, a step is one call
of ``model_step`` over a flat token axis (``StepInputs``, vLLM v1's model-runner inputs): token
ids and positions [N], ``query_start_loc`` [R+1], sequence lengths [R], block tables [R, M],
and the indices of the tokens whose logits are sampled or scored, ``logits_indices`` [R, S].
S is 1, or 1 + the configured drafts with speculative decoding: a verification row scores its
last token and each draft; other rows use their first column (their last token). Every
weight is read once per step.

The step then samples one token per row from its first scored position (``sample``) and, with
speculation, accepts or rejects each verification row's drafts (``rejection_sample``) on
device. The new K/V of every layer are returned and scattered into the donated pool by a second
jitted call (``write_kv``) at the step's slot mapping [N].

The jitted functions live at module level with the model config static, so every executor of
the same model in a process shares compiled code. ``STEP_TRACES`` counts the step's traces
(= compilations) in this process.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from research.engine.attention import AttentionMetadata, PagedKVCache
from research.engine.call_params import CallParams
from research.engine.kv_cache import KVPool, copy_blocks, fill_blocks, write_kv
from research.engine.request import MAX_LOGPROBS
from research.engine.sampler import SamplingTensors, greedy, sample, token_logprobs
from research.engine.spec.rejection import rejection_sample
from research.models.transformer import Params, compute_logits, forward

STEP_TRACES = [0]
# ``forward`` calls in the step's traced body: one per trace, over all its tokens (tests check
# it; the executor counts the step's calls per engine step).
_FORWARDS_IN_TRACE = [0]


@jax.tree_util.register_dataclass
@dataclass
class StepInputs:
    """One step's inputs on the flat token axis (N tokens, R rows, S scored positions per row)."""

    token_ids: jax.Array  # [N] int32
    meta: AttentionMetadata  # positions, rows, query_start_loc, seq_lens, block tables
    logits_indices: jax.Array  # [R, S] int32: packed index of each scored position
    draft_tokens: jax.Array  # [R, S - 1] int32, -1 = none
    num_drafts: jax.Array  # [R] int32
    verify: jax.Array  # [R] bool: the row's tokens come from rejection sampling
    sampling: SamplingTensors  # [R] each
    # [N] int32: the next prompt token after each packed token, for requests that want their
    # prompt's log-probabilities; -1 elsewhere
    prompt_targets: jax.Array


def _when(pred: jax.Array, fn: Any, rows: int) -> dict[str, jax.Array]:
    """``token_logprobs``-shaped results of ``fn()`` if ``pred``, else zeros (lax.cond)."""
    names = ("logprob", "rank", "top_ids", "top_logprobs")

    def zeros() -> tuple[jax.Array, ...]:
        k = MAX_LOGPROBS
        return (
            jnp.zeros(rows),
            jnp.zeros(rows, jnp.int32),
            jnp.zeros((rows, k), jnp.int32),
            jnp.zeros((rows, k)),
        )

    return dict(zip(names, jax.lax.cond(pred, fn, zeros), strict=True))


def _prompt_logprobs(
    params: Params, cfg: Any, hidden: jax.Array, targets: jax.Array
) -> tuple[jax.Array, ...]:
    """``token_logprobs`` of every packed token's next prompt token: hidden [N, D], targets [N].
    The head runs over chunks of at most 64 tokens, so the logits never take N x V at once."""
    n = hidden.shape[0]
    chunk = min(n & -n, 64)  # a power of two that divides N

    def one(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        h, t = args
        return token_logprobs(compute_logits(params, cfg, h), t, MAX_LOGPROBS)

    out = jax.lax.map(one, (hidden.reshape(n // chunk, chunk, -1), targets.reshape(-1, chunk)))
    return tuple(x.reshape(n, *x.shape[2:]) for x in out)


def _forward(params: Params, cfg: Any, inputs: StepInputs, cache: PagedKVCache, backend: str):
    _FORWARDS_IN_TRACE[0] += 1
    meta = inputs.meta
    return forward(params, cfg, inputs.token_ids[None], meta.positions[None], cache, backend)


def _model_step(
    params: Params | CallParams,
    pool: KVPool,
    inputs: StepInputs,
    *,
    cfg: Any,
    backend: str,
    plan: Any = None,
    writes: bool = False,
) -> dict[str, Any]:
    """One forward over the step's tokens, then sampling (and verification). Returns:

    - ``new_k`` / ``new_v``: per layer [N, K, E] (for ``write_kv``); with ``writes``
      (``model_step_writing``, ``research.engine.attention.writes_in_step``) ``pool`` instead,
      the donated pool with the new K/V stored by the attention kernel;
    - ``tokens`` [R, S]: a row's accepted drafts then its sampled token (-1 after); rows that
      do not verify have their sample in column 0; ``num_accepted`` [R];
    - ``gaps`` [R, S]: the top-2 logit gap at every scored position;
    - log-probabilities of each row's sample (``sample_*``, [R] and [R, MAX_LOGPROBS]) and of
      each packed token's next prompt token (``prompt_*``, [N] ...), each branch computed only
      when a row (or token) of the step asks for it, else zeros."""
    STEP_TRACES[0] += 1  # runs only while tracing
    if isinstance(params, CallParams):
        params = params.tree()
    cache = PagedKVCache(pool, inputs.meta, backend=backend, plan=plan, writes=writes)
    hidden, cache = _forward(params, cfg, inputs, cache, backend)
    r, s = inputs.logits_indices.shape
    logits = compute_logits(params, cfg, hidden[0, inputs.logits_indices.reshape(-1)])
    logits = logits.reshape(r, s, -1)  # [R, S, V]
    # On CPU with the native kernels (one device), the argmax and gap in one native pass.
    native = backend == "native" and plan is None
    greedy_tokens, gaps = greedy(logits.reshape(r * s, -1), native=native)
    gaps = gaps.reshape(r, s)
    first = logits[:, 0]
    sampled = sample(first, inputs.sampling, greedy_tokens.reshape(r, s)[:, 0])
    tokens = jnp.full((r, s), -1, jnp.int32).at[:, 0].set(sampled)
    num_accepted = jnp.zeros(r, jnp.int32)
    if s > 1:  # speculative decoding: verification rows take rejection sampling's tokens
        verified, accepted = rejection_sample(
            logits, inputs.draft_tokens, inputs.num_drafts, inputs.sampling
        )
        tokens = jnp.where(inputs.verify[:, None], verified, tokens)
        num_accepted = jnp.where(inputs.verify, accepted, 0)
    kv = {"pool": cache.pool} if writes else {"new_k": cache.new_k, "new_v": cache.new_v}
    out: dict[str, Any] = {
        **kv,
        "tokens": tokens,
        "num_accepted": num_accepted,
        "gaps": gaps,
    }
    out |= {
        f"sample_{k}": v
        for k, v in _when(
            jnp.any(inputs.sampling.logprobs),
            lambda: token_logprobs(first, sampled, MAX_LOGPROBS),
            r,
        ).items()
    }
    out |= {
        f"prompt_{k}": v
        for k, v in _when(
            jnp.any(inputs.prompt_targets >= 0),
            lambda: _prompt_logprobs(params, cfg, hidden[0], inputs.prompt_targets),
            inputs.token_ids.shape[0],
        ).items()
    }
    return out


def advance(inputs: StepInputs, tokens: jax.Array, block_size: int, pad_slot: int):
    """A decode step's inputs one token on: each row's next token is ``tokens`` [R] (its
    sample), at the next position, over one more cached token; sampling keys move on with the
    row's token count. Returns the inputs and the new tokens' KV slots [N] (``pad_slot`` for
    padding) from the rows' block tables, which must already hold the new positions."""
    meta = inputs.meta
    r = meta.seq_lens.shape[0]
    real = meta.positions >= 0
    row = jnp.minimum(meta.token_row, r - 1)
    positions = jnp.where(real, meta.positions + 1, -1)
    pos = jnp.maximum(positions, 0)
    slots = meta.block_tables[row, pos // block_size] * block_size + pos % block_size
    meta = dataclasses.replace(
        meta, positions=positions, seq_lens=jnp.where(meta.seq_lens > 0, meta.seq_lens + 1, 0)
    )
    sampling = dataclasses.replace(inputs.sampling, step=inputs.sampling.step + 1)
    token_ids = jnp.where(real, tokens[row], 0)
    inputs = dataclasses.replace(inputs, token_ids=token_ids, meta=meta, sampling=sampling)
    return inputs, jnp.where(real, slots, pad_slot).astype(jnp.int32)


def _multi_step(
    params: Params | CallParams,
    pool: KVPool,
    inputs: StepInputs,
    slot_mapping: jax.Array,
    num_steps: jax.Array,
    *,
    cfg: Any,
    backend: str,
    plan: Any = None,
    writes: bool = False,
    max_steps: int,
    block_size: int,
    pad_slot: int,
) -> dict[str, Any]:
    """``num_steps`` (<= ``max_steps``) decode steps in one call (vLLM's multi-step
    scheduling): every row has one token, and each step's sample is the row's next input.
    Each step is ``_model_step`` over the same rows (sampling, K/V stored as one step stores
    them); the host checks stops afterwards and drops what a finished row sampled past its
    stop. Returns the pool, ``tokens`` and ``gaps`` [max_steps, R] (steps past num_steps: -1
    and 0)."""
    r = inputs.meta.seq_lens.shape[0]
    tokens = jnp.full((max_steps, r), -1, jnp.int32)
    gaps = jnp.zeros((max_steps, r), jnp.float32)

    def body(i, carry):
        pool, inputs, slots, tokens, gaps = carry
        out = _model_step(params, pool, inputs, cfg=cfg, backend=backend, plan=plan, writes=writes)
        pool = out["pool"] if writes else write_kv(pool, out["new_k"], out["new_v"], slots)
        sampled = out["tokens"][:, 0]
        tokens = tokens.at[i].set(sampled)
        gaps = gaps.at[i].set(out["gaps"][:, 0].astype(jnp.float32))
        inputs, slots = advance(inputs, sampled, block_size, pad_slot)
        return pool, inputs, slots, tokens, gaps

    carry = (pool, inputs, slot_mapping, tokens, gaps)
    pool, _, _, tokens, gaps = jax.lax.fori_loop(0, num_steps, body, carry)
    return {"pool": pool, "tokens": tokens, "gaps": gaps}


_STATIC = ("cfg", "backend", "plan")
model_step = jax.jit(_model_step, static_argnames=_STATIC)
# The step whose attention stores the new K/V itself, into the pool it is given (donated).
model_step_writing = jax.jit(
    functools.partial(_model_step, writes=True), static_argnames=_STATIC, donate_argnums=1
)
# Several decode steps in one call (``num_scheduler_steps``), the pool donated.
model_multi_step = jax.jit(
    _multi_step,
    static_argnames=(*_STATIC, "writes", "max_steps", "block_size", "pad_slot"),
    donate_argnums=1,
)
write_kv_jit = jax.jit(write_kv, donate_argnums=0)
copy_blocks_jit = jax.jit(copy_blocks, donate_argnums=0)
fill_blocks_jit = jax.jit(fill_blocks, donate_argnums=0, static_argnums=2)


def to_host(x: jax.Array) -> np.ndarray:
    """A step output on the host. Across processes (``jax.distributed``) the outputs are
    replicated on every device, so this process's own copy is the whole value."""
    if x.is_fully_addressable:
        return np.asarray(x)
    if not x.is_fully_replicated:
        raise ValueError(f"a step output is split across processes: {x.sharding}")
    return np.asarray(x.addressable_data(0))
