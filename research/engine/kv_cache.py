"""The paged KV pool on device: pages, their formats, and the writes into them.

Per layer, K and V pages are laid out [K, B, P, E] (kv heads, blocks in the pool, tokens per
block, head_dim), the layout of JAX's Pallas paged-attention kernel. A token's slot is
``block_id * P + offset``; its K/V are scattered there, then each sequence's context is gathered
through its block table. Models with sliding-window layers (gpt-oss) pair each sliding layer
with a full one on the same pages (``kv_layer_slots``): the sliding layers read and write
through their own block tables, whose blocks leave the window and return to the pool
(``research.engine.block_manager``). Attention reads the pool in ``research.engine.attention``.

Axis legend: N = packed tokens in the step, R = rows (sequences in the step), M = blocks per
row's table, K = kv heads, B = blocks in the pool, P = tokens per block, E = head_dim.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from research.config import ModelConfig
from research.quant.kv import dequantize_kv, kv_code_dtype, kv_code_shape, quantize_kv


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
