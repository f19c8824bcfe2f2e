"""The paged KV pool on device and attention that reads it through block tables.

Per layer, K and V pages are laid out [K, B, P, E] (kv heads, blocks in the pool, tokens per
block, head_dim), the layout of JAX's Pallas paged-attention kernel. A token's slot is
``block_id * P + offset``; its K/V are scattered there, then each sequence's context is gathered
through its block table.

Axis legend: N = packed tokens in the call, R = rows (sequences in the call), T = tokens per
row, M = blocks per row's table, K = kv heads, B = blocks in the pool, P = tokens per block,
E = head_dim, H = query heads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from research.config import ModelConfig
from research.models.layers import grouped_query_attention

ATTENTION_BACKENDS = ("xla",)


def init_kv_pool(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: Any, fill: float = 0.0
) -> tuple[list[jax.Array], list[jax.Array]]:
    """K and V pages per layer, [K, B, P, E] each, filled with ``fill`` (NaN in isolation tests)."""
    shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
    k = [jnp.full(shape, fill, dtype) for _ in range(cfg.num_layers)]
    v = [jnp.full(shape, fill, dtype) for _ in range(cfg.num_layers)]
    return k, v


def kv_pool_bytes_per_block(cfg: ModelConfig, block_size: int, itemsize: int) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * block_size * cfg.head_dim * itemsize


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
    """

    k: list[jax.Array]  # per layer [K, B, P, E]
    v: list[jax.Array]
    block_tables: jax.Array  # [R, M] int32
    token_row: jax.Array  # [N] int32: row of each packed token (R for padding)
    token_col: jax.Array  # [N] int32: its index within the row's chunk
    row_positions: jax.Array  # [R, T] int32: positions of each row's chunk, -1 = padding
    new_k: list[jax.Array] = field(default_factory=list)  # per layer [N, K, E]
    new_v: list[jax.Array] = field(default_factory=list)
    backend: str = field(default="xla", metadata=dict(static=True))

    def update_and_attend(
        self,
        layer: int,
        q: jax.Array,
        k_new: jax.Array,
        v_new: jax.Array,
        positions: jax.Array,
        scale: float,
    ) -> tuple[jax.Array, PagedKVCache]:
        """q [1, N, H, E], k_new/v_new [1, N, K, E] packed; positions [1, N] (-1 = padding)."""
        if self.backend != "xla":
            raise ValueError(f"attention_backend {self.backend!r}; available: {ATTENTION_BACKENDS}")
        r, t = self.row_positions.shape

        def unpack(x: jax.Array) -> jax.Array:  # [N, heads, E] -> [R, T, heads, E]
            grid = jnp.zeros((r, t, *x.shape[1:]), x.dtype)
            return grid.at[self.token_row, self.token_col].set(x, mode="drop")

        out = _gather_attention(
            unpack(q[0]),
            unpack(k_new[0]),
            unpack(v_new[0]),
            self.k[layer],
            self.v[layer],
            self.block_tables,
            self.row_positions,
            scale,
        )
        out = out.at[self.token_row, self.token_col].get(mode="fill", fill_value=0)  # [N, H, E]
        return out[None], dataclasses.replace(
            self, new_k=[*self.new_k, k_new[0]], new_v=[*self.new_v, v_new[0]]
        )


def write_kv(
    k: list[jax.Array],
    v: list[jax.Array],
    new_k: list[jax.Array],
    new_v: list[jax.Array],
    slot_mapping: jax.Array,
) -> tuple[list[jax.Array], list[jax.Array]]:
    """Scatter new K/V [N, K, E] per layer into pages [K, B, P, E] at flat slots [N]
    (block * P + offset); slots out of range (padding) are dropped. Jit with k, v donated."""

    def write(pages: jax.Array, new: jax.Array) -> jax.Array:
        kvh, n, p, e = pages.shape
        flat = pages.reshape(kvh, n * p, e)
        new = new.reshape(-1, kvh, e).transpose(1, 0, 2).astype(pages.dtype)  # [K, R*T, E]
        return flat.at[:, slot_mapping.reshape(-1)].set(new, mode="drop").reshape(kvh, n, p, e)

    return (
        [write(pages, new) for pages, new in zip(k, new_k, strict=True)],
        [write(pages, new) for pages, new in zip(v, new_v, strict=True)],
    )


def _gather_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    positions: jax.Array,
    scale: float,
) -> jax.Array:
    """Pure-XLA paged attention: gather each row's blocks, append the new tokens, masked GQA.

    Rows hold contiguous positions start..start+T-1 (padding -1). A query at position p sees its
    row's cached positions < start and the new tokens at positions <= p; everything else (other
    rows' blocks, unused table entries, NaN-filled free blocks) is masked out exactly."""
    kvh, _, p, e = k_pages.shape
    r, m = block_tables.shape

    def gather(pages: jax.Array, new: jax.Array) -> jax.Array:
        g = pages[:, block_tables]  # [K, R, M, P, E]
        g = g.transpose(1, 0, 2, 3, 4).reshape(r, kvh, m * p, e)  # [R, K, M*P, E]
        return jnp.concatenate([g, new.transpose(0, 2, 1, 3).astype(g.dtype)], axis=2)

    start = positions[:, 0]  # [R]; -1 for padding rows
    valid_q = (positions >= 0)[:, :, None]  # [R, T, 1]
    ctx_pos = jnp.arange(m * p)
    mask_ctx = (ctx_pos[None, None, :] < start[:, None, None]) & valid_q  # [R, T, M*P]
    mask_new = (positions[:, None, :] <= positions[:, :, None]) & (positions[:, None, :] >= 0)
    mask = jnp.concatenate([mask_ctx, mask_new & valid_q], axis=-1)  # [R, T, M*P + T]
    return grouped_query_attention(q, gather(k_pages, k_new), gather(v_pages, v_new), mask, scale)


def copy_blocks(
    k: list[jax.Array], v: list[jax.Array], src: jax.Array, dst: jax.Array
) -> tuple[list[jax.Array], list[jax.Array]]:
    """Copy-on-write: pages ``src`` [C] to ``dst`` [C] in every layer."""
    k = [pages.at[:, dst].set(pages[:, src]) for pages in k]
    v = [pages.at[:, dst].set(pages[:, src]) for pages in v]
    return k, v


def fill_blocks(
    k: list[jax.Array], v: list[jax.Array], blocks: jax.Array, value: float
) -> tuple[list[jax.Array], list[jax.Array]]:
    """Overwrite whole blocks with ``value`` (NaN poisoning of freed blocks in tests)."""
    k = [pages.at[:, blocks].set(value) for pages in k]
    v = [pages.at[:, blocks].set(value) for pages in v]
    return k, v
