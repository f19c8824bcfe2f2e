"""The paged KV pool on device and attention that reads it through block tables.

Per layer, K and V pages are laid out [K, B, P, E] (kv heads, blocks in the pool, tokens per
block, head_dim), the layout of JAX's Pallas paged-attention kernel. A token's slot is
``block_id * P + offset``; its K/V are scattered there, then each sequence's context is gathered
through its block table. Models with sliding-window layers (gpt-oss) pair each sliding layer
with a full one on the same pages (``kv_layer_slots``): the sliding layers read and write
through their own block tables, whose blocks leave the window and return to the pool
(``research.engine.block_manager``).

Axis legend: N = packed tokens in the call, R = rows (sequences in the call), T = tokens per
row, M = blocks per row's table, K = kv heads, B = blocks in the pool, P = tokens per block,
E = head_dim, H = query heads.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from research.config import ModelConfig
from research.models.layers import KERNEL_BACKENDS, attention_with_lse, grouped_query_attention
from research.quant.kv import dequantize_kv, kv_code_dtype, kv_code_shape, quantize_kv

ATTENTION_BACKENDS = KERNEL_BACKENDS
NATIVE_MAX_T = 8  # tokens per row up to which "native" attention runs the kernel


@jax.tree_util.register_dataclass
@dataclass
class KVPool:
    """The paged K/V pool of every layer: pages [K, B, P, E'] plus, for quantized KV
    (``kv_cache_dtype`` fp8 or int4, see ``research.quant.kv``), float32 scales [K, B, P], one
    per token and kv head. E' = E, or E/2 for int4's packed codes; scales lists are empty for
    ``"auto"`` (pages hold K/V in the model dtype).

    ``page_dtype`` names the pages' dtype when they are stored as its raw bits (unsigned
    integers of the same width; "" = stored as values). XLA:CPU widens every bf16 / fp8 update of
    a buffer to float32 and back, i.e. rewrites a whole layer of the pool to store one token
    (measured 250 ms per decode step for a 755 MB bf16 pool); an integer update stays in place.
    ``view`` and ``stored`` convert between the two (bitcasts, free)."""

    k: list[jax.Array]
    v: list[jax.Array]
    k_scales: list[jax.Array] = field(default_factory=list)
    v_scales: list[jax.Array] = field(default_factory=list)
    kv_dtype: str = field(default="auto", metadata=dict(static=True))
    page_dtype: str = field(default="", metadata=dict(static=True))
    # Models with sliding-window layers (``kv_layer_slots``): the list entry each model layer's
    # pages are in, and which layers index them through the sliding-window block tables. Empty:
    # one entry per layer, one table.
    layer_slots: tuple[int, ...] = field(default=(), metadata=dict(static=True))
    sliding: tuple[bool, ...] = field(default=(), metadata=dict(static=True))

    def slot(self, layer: int) -> int:
        """The list entry (k[i], v[i], ...) that holds model layer ``layer``."""
        return self.layer_slots[layer] if self.layer_slots else layer

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding) and self.sliding[layer]

    @property
    def quantized(self) -> bool:
        return self.kv_dtype != "auto"

    def view(self, pages: jax.Array) -> jax.Array:
        """Pages (or any slice of them) as values of the pages' dtype."""
        return jax.lax.bitcast_convert_type(pages, self.page_dtype) if self.page_dtype else pages

    def stored(self, values: jax.Array) -> jax.Array:
        """Values of the pages' dtype as they are stored."""
        if not self.page_dtype:
            return values
        return jax.lax.bitcast_convert_type(values, _BITS[jnp.dtype(self.page_dtype).itemsize])

    def read(self, layer: int, which: str, block_tables: jax.Array, dtype: Any) -> jax.Array:
        """Pages of ``block_tables`` [R, M] for one layer, dequantized -> [K, R, M, P, E]."""
        pages = self.view((self.k if which == "k" else self.v)[layer][:, block_tables])
        if not self.quantized:
            return pages
        scales = (self.k_scales if which == "k" else self.v_scales)[layer][:, block_tables]
        return dequantize_kv(pages, scales, self.kv_dtype).astype(dtype)


def kv_layer_slots(cfg: ModelConfig) -> tuple[int, ...]:
    """The pool entry each layer's pages live in. A model with sliding-window layers pairs its
    i-th sliding layer with its i-th full layer on one entry: the two kinds take block ids from
    one pool under separate block tables (vLLM's hybrid allocator), so a block's pages serve
    one kind, and max(sliding, full) entries hold the whole model. Others: one per layer."""
    if not cfg.sliding_layers:
        return tuple(range(cfg.num_layers))
    seen = {True: 0, False: 0}
    slots = []
    for layer in range(cfg.num_layers):
        kind = cfg.layer_window(layer) is not None
        slots.append(seen[kind])
        seen[kind] += 1
    return tuple(slots)


def kv_pool_layers(cfg: ModelConfig) -> int:
    """Page arrays per K (and per V) in the pool: ``max(kv_layer_slots(cfg)) + 1``."""
    return max(kv_layer_slots(cfg)) + 1


def init_kv_pool(
    cfg: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: Any,
    fill: float = 0.0,
    kv_cache_dtype: str = "auto",
) -> KVPool:
    """Pages per layer [K, B, P, E'] filled with ``fill`` (NaN in isolation tests: for int4,
    whose codes have no NaN, the scales carry it)."""
    shape = (cfg.num_kv_heads, num_blocks, block_size)
    codes = (*shape, *kv_code_shape(cfg.head_dim, kv_cache_dtype))
    code_dtype = kv_code_dtype(kv_cache_dtype, dtype)
    code_fill = 0 if jnp.issubdtype(code_dtype, jnp.integer) else fill

    as_bits = stores_bits(code_dtype)
    page_dtype = jnp.dtype(code_dtype).name if as_bits else ""

    def page() -> jax.Array:
        values = jnp.full(codes, code_fill, code_dtype)
        return (
            jax.lax.bitcast_convert_type(values, _BITS[values.dtype.itemsize])
            if as_bits
            else values
        )

    entries = kv_pool_layers(cfg)

    def pages() -> list[jax.Array]:
        return [page() for _ in range(entries)]

    def scales() -> list[jax.Array]:
        if kv_cache_dtype == "auto":
            return []
        return [jnp.full(shape, fill, jnp.float32) for _ in range(entries)]

    hybrid = cfg.sliding_layers > 0
    return KVPool(
        pages(),
        pages(),
        scales(),
        scales(),
        kv_dtype=kv_cache_dtype,
        page_dtype=page_dtype,
        layer_slots=kv_layer_slots(cfg) if hybrid else (),
        sliding=tuple(cfg.layer_window(i) is not None for i in range(cfg.num_layers))
        if hybrid
        else (),
    )


_BITS = {1: jnp.uint8, 2: jnp.uint16}


def stores_bits(dtype: Any) -> bool:
    """Whether pages of ``dtype`` are kept as raw bits (``KVPool.page_dtype``): narrow floats on
    the CPU backend, where updating them in place needs an integer buffer."""
    dtype = jnp.dtype(dtype)
    return (
        jax.default_backend() == "cpu"
        and jnp.issubdtype(dtype, jnp.floating)
        and dtype.itemsize in _BITS
    )


def kv_pool_bytes_per_block(
    cfg: ModelConfig, block_size: int, dtype: Any, kv_cache_dtype: str = "auto"
) -> int:
    """Bytes one block takes across the pool's layers (``kv_pool_layers``: sliding-window and
    full layers share one), K and V, codes and scales."""
    code_bytes = kv_code_shape(cfg.head_dim, kv_cache_dtype)[0]
    code_bytes *= kv_code_dtype(kv_cache_dtype, dtype).itemsize
    scale_bytes = 0 if kv_cache_dtype == "auto" else 4
    layers = kv_pool_layers(cfg)
    return 2 * layers * cfg.num_kv_heads * block_size * (code_bytes + scale_bytes)


@jax.tree_util.register_dataclass
@dataclass
class PagedKVCache:
    """The pool (read-only here) plus this call's metadata; passed through ``forward``.

    The model runs on packed tokens: ``forward`` sees one row of N tokens from several
    sequences (no padding between them, so projections and MLPs cost what the real tokens
    cost). Attention unpacks them into [R, T] (one row per sequence, T = its longest chunk),
    reads each row's cached context through its block table plus the call's own new K/V, and
    packs the result back.

    The new K/V are collected in ``new_k``/``new_v`` and scattered into the donated pool by
    ``write_kv`` in a separate jitted call: reading and updating the pool in one XLA
    computation made XLA:CPU copy the whole pool every layer (1.2 vs 13 tok/s, 1 GiB pool).

    ``backend`` "xla" gathers the pages and runs masked attention in XLA; "pallas" and
    "pallas_interpret" read the cached context with the Pallas paged-attention kernel (one
    query per token, the row's cached length as its length) and merge it with attention over
    the call's new tokens by their log-sum-exps; "native" does the same with the C++ CPU kernel
    for calls of at most ``NATIVE_MAX_T`` tokens per row (decodes, verification) and runs
    prefill chunks through its packed kernel (context and new tokens in one causal pass over the
    packed tokens, no [R, T] grid).
    """

    pool: KVPool
    block_tables: jax.Array  # [R, M] int32
    token_row: jax.Array  # [N] int32: row of each packed token (R for padding)
    token_col: jax.Array  # [N] int32: its index within the row's chunk
    row_positions: jax.Array  # [R, T] int32: positions of each row's chunk, -1 = padding
    new_k: list[jax.Array] = field(default_factory=list)  # per layer [N, K, E]
    new_v: list[jax.Array] = field(default_factory=list)
    sliding_block_tables: jax.Array | None = None  # [R, M] int32: sliding-window layers
    backend: str = field(default="xla", metadata=dict(static=True))
    plan: Any = field(default=None, metadata=dict(static=True))  # research.parallel.ShardingPlan

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
        """q [1, N, H, E], k_new/v_new [1, N, K, E] packed; positions [1, N] (-1 = padding).
        ``window``: a query at p sees positions > p - window only (sliding-window layers);
        ``sinks`` [H]: per-head logits added to every softmax denominator (gpt-oss)."""
        if self.backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend {self.backend!r}; available: {ATTENTION_BACKENDS}")
        r, t = self.row_positions.shape

        def unpack(x: jax.Array) -> jax.Array:  # [N, heads, E] -> [R, T, heads, E]
            grid = jnp.zeros((r, t, *x.shape[1:]), x.dtype)
            return grid.at[self.token_row, self.token_col].set(x, mode="drop")

        tables = self.block_tables
        if self.pool.is_sliding(layer):
            tables = self.sliding_block_tables
        sharded = self.plan is not None and self.plan.size > 1
        packed = window is None and sinks is None and not sharded
        if self.backend == "native" and t > NATIVE_MAX_T and packed:
            # prefill chunks: one packed pass over context and new tokens, no [R, T] grid
            out = self._packed_attention(layer, q[0], k_new[0], v_new[0], tables, scale)
            return out.astype(q.dtype)[None], dataclasses.replace(
                self, new_k=[*self.new_k, k_new[0]], new_v=[*self.new_v, v_new[0]]
            )
        # The decode kernels read a row's context once per query: decode-sized chunks only.
        gather = self.backend == "xla" or (self.backend == "native" and t > NATIVE_MAX_T)
        attend = _gather_attention if gather else _kernel_attention
        if window is not None or sinks is not None:
            attend = functools.partial(attend, window=window, sinks=sinks)
        if sharded:
            if sinks is not None:
                raise ValueError("tensor parallelism does not split attention sinks (gpt-oss)")
            from research.parallel.ops import sharded_attention

            attend = functools.partial(sharded_attention, self.plan, attend)
        out = attend(
            unpack(q[0]),
            unpack(k_new[0]),
            unpack(v_new[0]),
            self.pool,
            self.pool.slot(layer),
            tables,
            self.row_positions,
            scale,
            self.backend,
        )
        return self._pack(out, k_new, v_new)

    def _packed_attention(
        self,
        layer: int,
        q: jax.Array,
        k_new: jax.Array,
        v_new: jax.Array,
        tables: jax.Array,
        scale: float,
    ) -> jax.Array:
        """Prefill chunks through the native packed kernel: q [N, H, E], k_new/v_new [N, K, E]
        -> [N, H, E] float32. Each row's tokens are contiguous in the call (``_pack``)."""
        from research import native

        r = self.row_positions.shape[0]
        n = q.shape[0]
        counts = jax.ops.segment_sum(jnp.ones(n, jnp.int32), self.token_row, num_segments=r)
        first = jax.ops.segment_min(jnp.arange(n, dtype=jnp.int32), self.token_row, r)
        start = jnp.maximum(self.row_positions[:, 0], 0)
        slot = self.pool.slot(layer)
        return native.packed_attention(
            q,
            k_new,
            v_new,
            self.pool.k[slot],
            self.pool.v[slot],
            tables,
            start,
            jnp.where(counts > 0, first, 0),
            counts,
            scale,
        )

    def _pack(
        self, out: jax.Array, k_new: jax.Array, v_new: jax.Array
    ) -> tuple[jax.Array, PagedKVCache]:
        """Rows [R, T, H, E] back to packed tokens [1, N, H, E], and this layer's new K/V kept."""
        out = out.at[self.token_row, self.token_col].get(mode="fill", fill_value=0)  # [N, H, E]
        return out[None], dataclasses.replace(
            self, new_k=[*self.new_k, k_new[0]], new_v=[*self.new_v, v_new[0]]
        )


def write_kv(
    pool: KVPool,
    new_k: list[jax.Array],
    new_v: list[jax.Array],
    slot_mapping: jax.Array,
    sliding_slot_mapping: jax.Array | None = None,
) -> KVPool:
    """Scatter new K/V [N, K, E] per layer into the pages at flat slots [N] (block * P +
    offset), quantizing them first for fp8/int4 pools; slots out of range (padding) are
    dropped. Sliding-window layers of a paired pool (``KVPool.layer_slots``) write at
    ``sliding_slot_mapping`` [N] instead. Jit with the pool donated."""
    if pool.layer_slots:
        return _write_paired(pool, new_k, new_v, slot_mapping, sliding_slot_mapping)
    slots = slot_mapping.reshape(-1)

    def write(pages: jax.Array, new: jax.Array, is_page: bool = True) -> jax.Array:
        """Scatter into pages [K, B, P, ...] (``is_page``: K/V codes, kept as the pool stores
        them; otherwise float32 scales)."""
        kvh, n, p = pages.shape[:3]
        flat = pages.reshape(kvh, n * p, *pages.shape[3:])
        if is_page and pool.page_dtype:
            new = pool.stored(new.astype(pool.page_dtype))
        new = jnp.moveaxis(new.astype(pages.dtype), 1, 0)  # [K, N, ...]
        return flat.at[:, slots].set(new, mode="drop").reshape(pages.shape)

    if not pool.quantized:
        k = [write(pages, new) for pages, new in zip(pool.k, new_k, strict=True)]
        v = [write(pages, new) for pages, new in zip(pool.v, new_v, strict=True)]
        return dataclasses.replace(pool, k=k, v=v)
    out: dict[str, list[jax.Array]] = {"k": [], "v": [], "k_scales": [], "v_scales": []}
    for which, news in (("k", new_k), ("v", new_v)):
        pages_list, scales_list = getattr(pool, which), getattr(pool, f"{which}_scales")
        for pages, scales, new in zip(pages_list, scales_list, news, strict=True):
            codes, new_scales = quantize_kv(new, pool.kv_dtype)  # [N, K, E'], [N, K]
            out[which].append(write(pages, codes))
            out[f"{which}_scales"].append(write(scales, new_scales, is_page=False))
    return dataclasses.replace(pool, **out)


def _write_paired(
    pool: KVPool,
    new_k: list[jax.Array],
    new_v: list[jax.Array],
    slot_mapping: jax.Array,
    sliding_slot_mapping: jax.Array,
) -> KVPool:
    """``write_kv`` for a pool whose entries hold one sliding and one full layer each: every
    layer goes to its entry, at the slots of its own block table."""
    lists = {name: list(getattr(pool, name)) for name in ("k", "v", "k_scales", "v_scales")}
    for layer, (k, v) in enumerate(zip(new_k, new_v, strict=True)):
        slot = pool.slot(layer)
        slots = sliding_slot_mapping if pool.is_sliding(layer) else slot_mapping
        one = dataclasses.replace(
            pool,
            k=[lists["k"][slot]],
            v=[lists["v"][slot]],
            k_scales=lists["k_scales"][slot : slot + 1],
            v_scales=lists["v_scales"][slot : slot + 1],
            layer_slots=(),
            sliding=(),
        )
        one = write_kv(one, [k], [v], slots)
        for name in lists:
            if lists[name]:
                lists[name][slot] = getattr(one, name)[0]
    return dataclasses.replace(pool, **lists)


def _gather_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    pool: KVPool,
    layer: int,
    block_tables: jax.Array,
    positions: jax.Array,
    scale: float,
    backend: str,
    window: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Pure-XLA paged attention: gather each row's blocks, append the new tokens, masked GQA.

    Rows hold contiguous positions start..start+T-1 (padding -1). A query at position p sees its
    row's cached positions < start and the new tokens at positions <= p, and with a ``window``
    only those > p - window; everything else (other rows' blocks, unused table entries,
    NaN-filled free blocks, blocks that slid out of the window) is masked out exactly."""
    del backend
    r, m = block_tables.shape
    kvh, _, p = pool.k[layer].shape[:3]
    e = q.shape[-1]

    def gather(which: str, new: jax.Array) -> jax.Array:
        g = pool.read(layer, which, block_tables, q.dtype)  # [K, R, M, P, E]
        g = g.transpose(1, 0, 2, 3, 4).reshape(r, kvh, m * p, e)  # [R, K, M*P, E]
        return jnp.concatenate([g, new.transpose(0, 2, 1, 3).astype(g.dtype)], axis=2)

    start = positions[:, 0]  # [R]; -1 for padding rows
    valid_q = (positions >= 0)[:, :, None]  # [R, T, 1]
    ctx_pos = jnp.arange(m * p)
    mask_ctx = (ctx_pos[None, None, :] < start[:, None, None]) & valid_q  # [R, T, M*P]
    if window is not None:
        mask_ctx &= ctx_pos[None, None, :] > positions[:, :, None] - window
    mask = jnp.concatenate([mask_ctx, _new_token_mask(positions, window)], axis=-1)
    return grouped_query_attention(q, gather("k", k_new), gather("v", v_new), mask, scale, sinks)


def _new_token_mask(positions: jax.Array, window: int | None = None) -> jax.Array:
    """[R, T, T]: a query at position p sees its row's new tokens at positions <= p (and
    > p - window)."""
    valid_q = (positions >= 0)[:, :, None]
    causal = (positions[:, None, :] <= positions[:, :, None]) & (positions[:, None, :] >= 0)
    if window is not None:
        causal &= positions[:, None, :] > positions[:, :, None] - window
    return causal & valid_q


def _kernel_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    pool: KVPool,
    layer: int,
    block_tables: jax.Array,
    positions: jax.Array,
    scale: float,
    backend: str,
    window: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """The cached context through a paged-attention kernel that reads the pages in place (the
    Pallas kernel, or the native CPU one for ``backend="native"``), merged with attention over
    the call's new tokens: out = (w_c * out_c + w_n * out_n) / (w_c + w_n + w_s),
    w = exp(lse - max), w_s = exp(sink - max) with attention sinks (0 without).

    Every query token becomes one kernel query with its row's block table and the row's cached
    length (its start position), so a prefill chunk of T tokens costs T decode queries. With a
    ``window`` each query passes its own position, and the Pallas kernel reads only the pages
    of its window; the native kernel has no window."""
    if window is not None and backend == "native":
        raise ValueError(
            f"attention_backend {backend!r}: the native paged-attention kernel has no sliding "
            "window; use attention_backend='xla' or a Pallas backend for sliding-window layers"
        )
    r, t, h, e = q.shape
    start = jnp.maximum(positions[:, 0], 0)  # cached tokens per row (0 for padding rows)
    tables, lengths = jnp.repeat(block_tables, t, axis=0), jnp.repeat(start, t)
    if block_tables.shape[1] == 0:  # a call of fresh prompts (M = 0): no cached context
        ctx_out = jnp.zeros((r * t, h, e), jnp.float32)
        ctx_lse = jnp.full((r * t, h), -jnp.inf, jnp.float32)
    elif backend == "native":
        from research import native

        ctx_out, ctx_lse = native.paged_attention(
            q.reshape(r * t, h, e), pool.k[layer], pool.v[layer], tables, lengths, scale
        )
    else:
        query_positions = None if window is None else positions.reshape(r * t)
        ctx_out, ctx_lse = _pallas_context(
            q.reshape(r * t, h, e),
            pool,
            layer,
            tables,
            lengths,
            scale,
            backend,
            window,
            query_positions,
        )
    new_out, new_lse = _new_token_attention(q, k_new, v_new, positions, scale, window)
    ctx_out = ctx_out.reshape(r, t, h, e).astype(jnp.float32)
    ctx_lse = ctx_lse.reshape(r, t, h)
    top = jnp.maximum(ctx_lse, new_lse)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32), top.shape)  # [R, T, H]
        top = jnp.maximum(top, sink)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w_ctx, w_new = jnp.exp(ctx_lse - top), jnp.exp(new_lse - top)  # 0 where a side is empty
    total = w_ctx + w_new
    if sinks is not None:
        total = total + jnp.exp(sink - top)
    denom = jnp.where(total > 0, total, 1.0)
    out = (w_ctx[..., None] * ctx_out + w_new[..., None] * new_out) / denom[..., None]
    return out.astype(q.dtype)


def _new_token_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    positions: jax.Array,
    scale: float,
    window: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Attention of the call's queries over the call's own new tokens (those within ``window``),
    in float32: (out, lse). A decode row (T = 1) sees exactly its own token, so its out is that
    token's V and its lse its one score: no batched dot (XLA:CPU runs small bf16 batched dots
    on a slow path)."""
    f32 = jnp.float32
    q, k_new, v_new = q.astype(f32), k_new.astype(f32), v_new.astype(f32)
    r, t, h, e = q.shape
    if t > 1:
        return attention_with_lse(q, k_new, v_new, _new_token_mask(positions, window), scale)
    kvh = k_new.shape[2]
    g = h // kvh
    valid = (positions[:, 0] >= 0)[:, None, None]  # [R, 1, 1]
    score = jnp.sum(q.reshape(r, kvh, g, e) * k_new.reshape(r, kvh, 1, e), axis=-1) * scale
    lse = jnp.where(valid, score, -jnp.inf).reshape(r, 1, h)
    out = jnp.broadcast_to(v_new.reshape(r, kvh, 1, e), (r, kvh, g, e))
    out = jnp.where(valid[..., None], out, 0.0).reshape(r, 1, h, e)
    return out, lse


def _pallas_context(
    q: jax.Array,
    pool: KVPool,
    layer: int,
    tables: jax.Array,
    lengths: jax.Array,
    scale: float,
    backend: str,
    window: int | None = None,
    query_positions: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The Pallas paged-attention kernel over the cached context: (out, lse) per query; with a
    ``window``, over the context tokens within it of each query's position."""
    from pallas_kernels.paged_attention import paged_attention
    from pallas_kernels.tuning import target_for_backend

    target = target_for_backend(backend)
    k_pages, v_pages = pool.view(pool.k[layer]), pool.view(pool.v[layer])
    if k_pages.dtype == jnp.float8_e4m3fn:
        target.require_fp8("the KV cache")
    e = q.shape[-1]
    return paged_attention(
        q,
        k_pages,
        v_pages,
        tables,
        lengths,
        sm_scale=scale,
        k_scales=pool.k_scales[layer] if pool.quantized else None,
        v_scales=pool.v_scales[layer] if pool.quantized else None,
        window=window,
        query_positions=query_positions,
        return_lse=True,
        **target.paged_attention.kwargs(
            page_size=k_pages.shape[2],
            head_dim=e,
            code_dim=k_pages.shape[3],
            q_dtype=q.dtype,
            page_dtype=k_pages.dtype,
        ),
        interpret=backend == "pallas_interpret",
    )


def native_supports(dtype: Any, kv_cache_dtype: str, cfg: ModelConfig | None = None) -> str | None:
    """Why the native CPU attention cannot serve a pool of ``dtype`` pages for ``cfg`` (None =
    it can)."""
    if cfg is not None and (cfg.attention_sinks or cfg.sliding_layers):
        return f"{cfg.name}'s sliding windows and attention sinks (the kernel has neither)"
    if kv_cache_dtype != "auto":
        return f"kv_cache_dtype={kv_cache_dtype!r} (native attention reads float32/bfloat16 pages)"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return f"{jnp.dtype(dtype).name} pages (native attention reads float32/bfloat16 pages)"
    if jax.default_backend() != "cpu":
        return f"the {jax.default_backend()} platform (native attention runs on CPU)"
    from research import native

    if not native.available():
        return f"the native library did not build: {native.build_error()}"
    return None


def resolve_attention_backend(
    backend: str,
    dtype: Any,
    kv_cache_dtype: str,
    sharded: bool = False,
    cfg: ModelConfig | None = None,
) -> str:
    """``"auto"``: the native CPU kernel where it serves this pool and model (CPU,
    float32/bfloat16 pages, one device, no sliding windows or sinks, the library built), else
    the XLA reference. An explicit ``"native"`` that cannot serve is an error naming why."""
    if backend == "auto":
        if sharded or native_supports(dtype, kv_cache_dtype, cfg) is not None:
            return "xla"
        return "native"
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend must be 'auto' or one of {ATTENTION_BACKENDS}, got {backend!r}"
        )
    if backend == "native":
        why = (
            "tensor/expert parallel plans"
            if sharded
            else native_supports(dtype, kv_cache_dtype, cfg)
        )
        if why is not None:
            raise ValueError(f'attention_backend="native" cannot serve {why}; use "xla"')
    return backend


def copy_blocks(pool: KVPool, src: jax.Array, dst: jax.Array) -> KVPool:
    """Copy-on-write: pages (and scales) ``src`` [C] to ``dst`` [C] in every layer."""
    return jax.tree_util.tree_map(lambda pages: pages.at[:, dst].set(pages[:, src]), pool)


def fill_blocks(pool: KVPool, blocks: jax.Array, value: float) -> KVPool:
    """Overwrite whole blocks with ``value`` (NaN poisoning of freed blocks in tests); integer
    codes (int4) keep their bits and the scales carry the value."""

    def fill(pages: jax.Array, bits: bool = False) -> jax.Array:
        if bits:
            value_bits = pool.stored(jnp.asarray(value, pool.page_dtype))
            return pages.at[:, blocks].set(value_bits)
        if jnp.issubdtype(pages.dtype, jnp.integer):
            return pages
        return pages.at[:, blocks].set(value)

    bits = bool(pool.page_dtype)
    return dataclasses.replace(
        pool,
        k=[fill(p, bits) for p in pool.k],
        v=[fill(p, bits) for p in pool.v],
        k_scales=[fill(p) for p in pool.k_scales],
        v_scales=[fill(p) for p in pool.v_scales],
    )
