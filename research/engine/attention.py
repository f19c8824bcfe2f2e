"""Paged attention over one step's ragged token batch, behind one interface.

A step is one forward pass over N packed tokens from R rows (sequences): decodes (one token),
prefill chunks and speculative verifications (a row's last token and its drafts) in any mix.
Attention reads them as vLLM v1's attention metadata describes them (``AttentionMetadata``):
each token's position and row, ``query_start_loc`` [R+1] (row r's tokens are
``query_start_loc[r] : query_start_loc[r+1]``), ``seq_lens`` [R] (cached context + new tokens)
and the block tables [R, M]. Padded rows have no tokens and length 0; padded tokens (row R,
position -1) attend to nothing and are written nowhere.

The new tokens' K/V are not in the pool yet: the step collects them and ``write_kv`` scatters
them into the donated pool after the forward (reading and updating the pool in one XLA
computation copies it on XLA:CPU). The native kernel is the exception (``writes_in_step``): it
stores them itself, into pages the step is given donated, and XLA sees one in-place update per
layer. So every backend computes, per query token at position p
of row r, attention over row r's cached context (positions < context length) and over row r's
new tokens at positions <= p, within a sliding ``window`` where the layer has one, with
attention ``sinks`` (gpt-oss) in the softmax denominator.

Backends (``ATTENTION_BACKENDS``):

- ``xla``: the reference. Query tiles: each row's tokens are cut into tiles of ``b`` tokens
  (``tile_size``: 1 for decode-only steps, larger for prefill chunks); the tile count has a
  static upper bound ``(N + R (b - 1)) / b``, so one compile serves every mix. Each tile
  gathers its row's pages and attends over them and the step's new tokens (masked to its row).
- ``native``: the C++ CPU kernel (``research.native.packed_attention``): the whole step's rows
  in one causal pass (context pages + each row's new tokens), no tiles, no padding.
- ``pallas`` / ``pallas_interpret``: the ragged paged-attention kernel
  (``pallas_kernels.ragged_attention``, compiled for the GPU / interpreted on CPU): the whole
  step in one launch per layer, cached context from the pages, new tokens from the step's K/V.

``resolve_attention_backend("auto", ...)`` picks Pallas on a GPU, the native kernel on a CPU
where it builds and serves the pool, else XLA, and says why (``AttentionChoice``).

Axis legend: N = packed tokens, R = rows, M = blocks per row, K = kv heads, G = query heads per
kv head, H = K G query heads, E = head_dim, P = tokens per block, Q = query tiles, b = tile size.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from research.engine.backend_choice import (  # noqa: F401 (the choice of a backend)
    ATTENTION_BACKENDS,
    AttentionChoice,
    choose_attention_backend,
    native_supports,
    pallas_supports,
    resolve_attention_backend,
)
from research.engine.kv_cache import KVPool


@jax.tree_util.register_dataclass
@dataclass
class AttentionMetadata:
    """A step's ragged batch as attention reads it (device arrays)."""

    positions: jax.Array  # [N] int32, -1 = padding
    token_row: jax.Array  # [N] int32: each token's row, R = padding
    query_start_loc: jax.Array  # [R+1] int32
    seq_lens: jax.Array  # [R] int32: cached context + this step's tokens; 0 = padded row
    block_tables: jax.Array  # [R, M] int32
    sliding_block_tables: jax.Array | None = None  # [R, M]: sliding-window layers' tables

    @property
    def num_new(self) -> jax.Array:
        """[R]: each row's tokens in this step."""
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @property
    def context_lens(self) -> jax.Array:
        """[R]: each row's cached tokens before this step."""
        return jnp.maximum(self.seq_lens - self.num_new, 0)


# ------------------------------------------------------------------ the XLA reference


TILE_SIZES = (1, 2, 4, 8, 16, 32, 64)


def num_tiles(n: int, r: int, b: int) -> int:
    """Upper bound on the query tiles of ``b`` tokens that N tokens in R rows need: a row of n_r
    tokens takes ceil(n_r / b) <= (n_r + b - 1) / b."""
    return max(1, min(n, (n + r * (b - 1)) // b))


def tile_size(n: int, r: int) -> int:
    """The tile size (static, from the step's shape) that minimizes tiles x (tile + 8): each
    tile gathers its row's pages once (the 8) and scores its b queries. A decode-only step
    (N = R) gets b = 1: one tile per row, nothing scored twice."""
    return min(TILE_SIZES, key=lambda b: (num_tiles(n, r, b) * (b + 8), b))


def query_tiles(meta: AttentionMetadata, n: int, b: int) -> tuple[jax.Array, ...]:
    """Tiles of ``b`` consecutive tokens of one row: (tile_row [Q] (R = empty tile), token
    index [Q, b] (N = none), valid [Q, b])."""
    r = meta.block_tables.shape[0]
    q = num_tiles(n, r, b)
    num_new = meta.num_new
    per_row = (num_new + b - 1) // b
    ends = jnp.cumsum(per_row)
    idx = jnp.arange(q, dtype=jnp.int32)
    tile_row = jnp.searchsorted(ends, idx, side="right").astype(jnp.int32)  # R past the last
    row = jnp.minimum(tile_row, r - 1)
    local = idx - (ends[row] - per_row[row])
    count = jnp.where(tile_row < r, jnp.clip(num_new[row] - local * b, 0, b), 0)
    offs = jnp.arange(b, dtype=jnp.int32)
    valid = offs[None, :] < count[:, None]
    token = jnp.where(valid, (meta.query_start_loc[row] + local * b)[:, None] + offs, n)
    return tile_row, token, valid


def _xla_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    pool: KVPool,
    slot: int,
    tables: jax.Array,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    sinks: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Reference attention of every query token: q [N, H, E], k_new / v_new [N, K, E] ->
    (out [N, H, E] float32, lse [N, H] float32; lse excludes ``sinks``).

    Masked keys contribute exactly zero, even where the pages hold NaN (freed blocks)."""
    n, h, e = q.shape
    kvh = k_new.shape[1]
    g = h // kvh
    r = tables.shape[0]
    b = tile_size(n, r)
    tile_row, token, valid = query_tiles(meta, n, b)
    nq = token.shape[0]
    row = jnp.minimum(tile_row, r - 1)
    qt = q.at[token].get(mode="fill", fill_value=0)  # [Q, b, H, E]
    qt = qt.reshape(nq, b, kvh, g, e).transpose(0, 2, 3, 1, 4)  # [Q, K, G, b, E]
    pos = jnp.where(valid, meta.positions.at[token].get(mode="fill", fill_value=-1), -1)
    f32 = jnp.float32

    # the step's new tokens, masked to the tile's row, causal
    key_pos = meta.positions
    see_new = (meta.token_row[None, None, :] == tile_row[:, None, None]) & valid[..., None]
    see_new &= (key_pos[None, None, :] <= pos[..., None]) & (key_pos >= 0)[None, None, :]
    if window is not None:
        see_new &= key_pos[None, None, :] > pos[..., None] - window
    s_new = jnp.einsum("QKGBE,NKE->QKGBN", qt, k_new.astype(q.dtype), preferred_element_type=f32)
    s_new = jnp.where(see_new[:, None, None], s_new * scale, -jnp.inf)
    parts = [(s_new, see_new, v_new.astype(q.dtype), "QKGBN,NKE->QKGBE")]

    if tables.shape[1] > 0:
        m, p = tables.shape[1], pool.k[slot].shape[2]
        rt = tables[row]  # [Q, M]

        def gather(which: str) -> jax.Array:
            pages = pool.read(slot, which, rt, q.dtype)  # [K, Q, M, P, E]
            return pages.transpose(1, 0, 2, 3, 4).reshape(nq, kvh, m * p, e)

        ctx_len = jnp.where(tile_row < r, meta.context_lens[row], 0)  # [Q]
        cpos = jnp.arange(m * p, dtype=jnp.int32)
        see_ctx = (cpos[None, None, :] < ctx_len[:, None, None]) & valid[..., None]
        if window is not None:
            see_ctx &= cpos[None, None, :] > pos[..., None] - window
        kc, vc = gather("k"), gather("v")
        s_ctx = jnp.einsum("QKGBE,QKSE->QKGBS", qt, kc, preferred_element_type=f32)
        s_ctx = jnp.where(see_ctx[:, None, None], s_ctx * scale, -jnp.inf)
        # a NaN page times a zero probability is NaN: zero the values no query sees
        vc = jnp.where(see_ctx.any(axis=1)[:, None, :, None], vc, jnp.zeros((), vc.dtype))
        parts.append((s_ctx, see_ctx, vc, "QKGBS,QKSE->QKGBE"))

    top = functools.reduce(jnp.maximum, [jnp.max(s, axis=-1) for s, *_ in parts])  # [Q,K,G,b]
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(f32).reshape(1, kvh, g, 1), top.shape)
        top = jnp.maximum(top, sink)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = [jnp.where(m[:, None, None], jnp.exp(s - top[..., None]), 0.0) for s, m, *_ in parts]
    total = sum(jnp.sum(w, axis=-1) for w in weights)
    lse = jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1.0)) + top, -jnp.inf)
    if sinks is not None:
        total = total + jnp.exp(sink - top)
    denom = jnp.where(total > 0, total, 1.0)[..., None]
    out = sum(
        jnp.einsum(eq, (w / denom).astype(vals.dtype), vals, preferred_element_type=f32)
        for w, (_, _, vals, eq) in zip(weights, parts, strict=True)
    )  # [Q, K, G, b, E]
    out = out.transpose(0, 3, 1, 2, 4).reshape(nq * b, h, e)
    lse = lse.transpose(0, 3, 1, 2).reshape(nq * b, h)
    flat = token.reshape(-1)
    full = jnp.zeros((n, h, e), f32).at[flat].set(out, mode="drop")
    full_lse = jnp.full((n, h), -jnp.inf, f32).at[flat].set(lse, mode="drop")
    return full, full_lse


def xla_attention(q, k_new, v_new, pool, slot, tables, meta, scale, window=None, sinks=None):
    """``_xla_attention``'s output [N, H, E] in q's dtype."""
    out, _ = _xla_attention(q, k_new, v_new, pool, slot, tables, meta, scale, window, sinks)
    return out.astype(q.dtype)


# ------------------------------------------------------------------ kernels


def writes_in_step(backend: str, pool: KVPool, plan: Any = None) -> bool:
    """Whether a step's attention stores the new K/V itself (``PagedKVCache.writes``): the
    native kernel on one device, over a pool of plain pages (no quantized KV, no paired
    sliding-window entries). A step of these then needs no second call: a one-sequence bf16
    decode step of SmolLM2 spent ~1.5 ms of its ~13 (AMD EPYC, two cores) dispatching and
    running ``write_kv``, most of it in jaxlib's per-array work for 60 pages and 60 new K/V.
    ``$RESEARCH_NATIVE_KV_WRITE=0`` keeps the separate write (an ablation)."""
    if os.environ.get("RESEARCH_NATIVE_KV_WRITE", "1") == "0":
        return False
    sharded = plan is not None and plan.size > 1
    return backend == "native" and not sharded and not pool.quantized and not pool.layer_slots


def native_attention(
    q, k_new, v_new, pool, slot, tables, meta, scale, window=None, sinks=None, write=False
):
    """The native CPU kernel: the whole step's rows in one packed causal pass over their cached
    pages and their own new tokens, decodes included. (Decode-sized steps used to read each
    token's context with the per-token decode kernel and merge the new tokens in by
    log-sum-exp in XLA; with the kernels' own thread pool the one pass took 0.76 of that at
    one row and 0.57-0.67 at 4-16 rows, 30 layers of SmolLM2's heads at 192-2000 positions.)
    ``write``: the kernel also stores the new K/V in the layer's pages (``writes_in_step``);
    returns (out, k pages, v pages)."""
    if window is not None or sinks is not None:
        raise ValueError(
            "attention_backend 'native': the native kernel has no sliding window or sinks; use "
            "attention_backend='xla' or a Pallas backend for this model"
        )
    from research import native

    count = meta.num_new
    out = native.packed_attention(
        q,
        k_new,
        v_new,
        pool.k[slot],
        pool.v[slot],
        tables,
        meta.context_lens,
        jnp.where(count > 0, meta.query_start_loc[:-1], 0),
        count,
        scale,
        write=write,
    )
    if write:
        return out[0].astype(q.dtype), out[1], out[2]
    return out.astype(q.dtype)


def pallas_attention(
    q, k_new, v_new, pool, slot, tables, meta, scale, window=None, sinks=None, interpret=False
):
    """The ragged paged-attention kernel (``pallas_kernels.ragged_attention``): the whole step,
    decodes, prefill chunks and verification rows, in one launch per layer, reading the cached
    context from the pages and the new tokens from the step's K/V. Blocks come from the tuning
    table for this GPU (``pallas_kernels.tuning.ragged_attention_config``); decode-sized steps
    (N = R) get the split-KV variant where the table or the rules give one."""
    from pallas_kernels.ragged_attention import ragged_paged_attention
    from pallas_kernels.tuning import ragged_attention_config, target_for_backend

    target = target_for_backend("pallas_interpret" if interpret else "pallas")
    k_pages, v_pages = pool.view(pool.k[slot]), pool.view(pool.v[slot])
    if k_pages.dtype == jnp.float8_e4m3fn:
        target.require_fp8("the KV cache")
    n, h, e = q.shape
    r = tables.shape[0]
    config, _ = ragged_attention_config(
        target,
        q_dtype=q.dtype,
        kv=pool.kv_dtype,
        head_dim=e,
        group=h // k_new.shape[1],
        decode=n == r,
        num_rows=r,
    )
    return ragged_paged_attention(
        q,
        k_new.astype(q.dtype),
        v_new.astype(q.dtype),
        k_pages,
        v_pages,
        tables,
        meta.query_start_loc,
        meta.context_lens,
        sm_scale=scale,
        k_scales=pool.k_scales[slot] if pool.quantized else None,
        v_scales=pool.v_scales[slot] if pool.quantized else None,
        window=window,
        sinks=sinks,
        interpret=interpret,
        **config.kwargs(page_size=k_pages.shape[2], group=h // k_new.shape[1]),
    )


Attend = Callable[..., jax.Array]

BACKENDS: dict[str, Attend] = {
    "xla": xla_attention,
    "native": native_attention,
    "pallas": pallas_attention,
    "pallas_interpret": functools.partial(pallas_attention, interpret=True),
}
assert tuple(BACKENDS) == ATTENTION_BACKENDS


# ------------------------------------------------------------------ the cache the model sees


@jax.tree_util.register_dataclass
@dataclass
class PagedKVCache:
    """The pool, this step's attention metadata and the new K/V collected per layer ([N, K, E],
    scattered into the pool by ``write_kv`` after the forward); passed through
    ``research.models.transformer.forward``, which runs on one row of N packed tokens.

    ``writes`` (the native backend only, ``writes_in_step``): the attention kernel stores each
    layer's new K/V in the layer's pages itself, in place where the step donates the pool, and
    ``pool`` ends the forward updated (nothing is collected, no ``write_kv`` call follows)."""

    pool: KVPool
    meta: AttentionMetadata
    new_k: list[jax.Array] = field(default_factory=list)
    new_v: list[jax.Array] = field(default_factory=list)
    backend: str = field(default="xla", metadata=dict(static=True))
    plan: Any = field(default=None, metadata=dict(static=True))  # research.parallel.ShardingPlan
    writes: bool = field(default=False, metadata=dict(static=True))

    def update_and_attend(
        self,
        layer: int,
        q: jax.Array,
        k_new: jax.Array,
        v_new: jax.Array,
        positions: jax.Array,
        scale: float,
        window: int | None = None,
        sinks: jax.Array | None = None,
    ) -> tuple[jax.Array, PagedKVCache]:
        """q [1, N, H, E], k_new/v_new [1, N, K, E] packed; positions [1, N] (the metadata's).
        ``window``: a query at p sees positions > p - window only (sliding-window layers);
        ``sinks`` [H]: per-head logits added to every softmax denominator (gpt-oss)."""
        del positions  # the metadata carries them
        if self.backend not in BACKENDS:
            raise ValueError(f"attention_backend {self.backend!r}; available: {ATTENTION_BACKENDS}")
        attend = BACKENDS[self.backend]
        tables = self.meta.block_tables
        if self.writes:
            if not writes_in_step(self.backend, self.pool, self.plan):
                raise ValueError(f"attention backend {self.backend!r} does not write the pool")
            slot = self.pool.slot(layer)
            out, k_pages, v_pages = native_attention(
                q[0], k_new[0], v_new[0], self.pool, slot, tables, self.meta, scale,
                window=window, sinks=sinks, write=True,
            )  # fmt: skip
            k, v = list(self.pool.k), list(self.pool.v)
            k[slot], v[slot] = k_pages, v_pages
            return out[None], dataclasses.replace(
                self, pool=dataclasses.replace(self.pool, k=k, v=v)
            )
        if self.pool.is_sliding(layer):
            tables = self.meta.sliding_block_tables
        if self.plan is not None and self.plan.size > 1:
            if sinks is not None:
                raise ValueError("tensor parallelism does not split attention sinks (gpt-oss)")
            from research.parallel.ops import sharded_attention

            attend = functools.partial(sharded_attention, self.plan, attend)
        out = attend(
            q[0], k_new[0], v_new[0], self.pool, self.pool.slot(layer), tables, self.meta, scale,
            window=window, sinks=sinks,
        )  # fmt: skip
        return out[None], dataclasses.replace(
            self, new_k=[*self.new_k, k_new[0]], new_v=[*self.new_v, v_new[0]]
        )
