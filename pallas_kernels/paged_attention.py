"""Paged decode attention (one query token per sequence) on Pallas' Triton backend, with float,
FP8 or int4 KV pages dequantized tile by tile inside the kernel.

Layout (JAX's Pallas paged attention): q [B, H, D]; K/V pages [K, P, S, Dk]; per-token scales
[K, P, S] for quantized KV; block_tables [B, M] (page ids of each sequence, in order) and lengths
[B]. Sequence b's token t lives at page ``block_tables[b, t // S]``, offset ``t % S``. KV codes
follow ``research.quant.kv``: Dk = D for float and fp8 pages, D/2 for int4 (split-half nibbles).

Grid (B, K, splits): one program reads the pages of one sequence and kv head, for all G query
heads of that kv head at once (padded to Gp >= 16 rows because Triton's dot needs every dim >=
16), so each K/V page is read once per kv head. A split covers a contiguous run of the
sequence's pages, walked in compute blocks of ``pages_per_compute_block`` pages (T = pages * S
tokens) with an online softmax in float32. Each split writes its unnormalized output, running
max and sum; a log-sum-exp reduction outside the kernel combines the splits.

Masking: token positions >= lengths[b] are loaded as 0 (masked loads, so a GPU never reads them)
and their scores set to -inf. Loading K, V and scales as 0 matters as much as masking the scores:
a NaN in an unused page (or the tail of the last page) would otherwise reach the output as
0 * NaN in p @ v. A sequence of length 0 gets zeros.

Sliding window (``window`` W, gpt-oss's sliding layers): a query at position p sees tokens t with
p - W < t <= p (and t < lengths[b]); p defaults to lengths[b] - 1, the sequence's last token.
The visible tokens span at most Mw = cdiv(W + S - 1, S) pages, so the wrapper narrows each
block table to the Mw columns from the window's first page (``_window_tables``) and the kernel
runs on [B, Mw] tables in token coordinates relative to that page: the grid, the loop and the
pages read scale with the window, not the context. Tokens of the first and last window page
outside [p - W + 1, min(p + 1, lengths[b])) are masked exactly like the tail of a page.

Attention sinks (``sinks`` [H], gpt-oss): one logit per head that joins every softmax
denominator and carries no value; added where the splits are combined, outside the kernel.

Differences from ``jax.experimental.pallas.ops.gpu.paged_attention``: q is not pre-scaled (we
take ``sm_scale``, default 1/sqrt(D), and apply it to the float32 scores); int4 pages; splits
and compute blocks adapt to the table width (it need not divide by ``k_splits``); the partial
results stay float32.

Precision: float32 operands multiply as IEEE float32 (``Precision.HIGHEST``; Triton would run
them as TF32 otherwise); bf16/f16 operands accumulate in float32. Checked on the Triton module by
``pallas_kernels.verify``, which also compiles every configuration offline for sm_90 and sm_121.

Axis legend: B = batch (sequences), H = query heads, K = kv heads, G = H / K query heads per kv
head, Gp = G padded to a power of two >= 16, P = pages in the pool, S = page size (tokens per
page), M = pages per sequence (block-table width), Mw = pages a window spans, D = head_dim,
Dk = stored code width, T = tokens per compute block.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from research.quant.kv import (
    dequantize_kv,
    int4_unpack_halves,
    kv_code_shape,
    kv_dtype_of,
)

MIN_DOT_DIM = 16  # Triton's tl.dot needs every operand dim >= 16


def _is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _split_plan(
    pages_per_seq: int, page_size: int, pages_per_compute_block: int, k_splits: int
) -> tuple[int, int, int]:
    """(pages per compute block, splits, compute blocks per split) for a table of M pages.

    The compute block is at most the table width (rounded up to a power of two) and at least 16
    tokens; the requested splits are capped at the number of compute blocks, and trailing splits
    that would get no block are dropped. The table is padded to splits * blocks * pages columns.
    """
    pages = min(pages_per_compute_block, pl.next_power_of_2(pages_per_seq))
    pages = max(pages, pl.cdiv(MIN_DOT_DIM, page_size))
    n_blocks = pl.cdiv(pages_per_seq, pages)
    blocks_per_split = pl.cdiv(n_blocks, min(k_splits, n_blocks))
    return pages, pl.cdiv(n_blocks, blocks_per_split), blocks_per_split


def _kernel(
    q_ref,  # [Gp, D]
    k_ref,  # [P, S, Dk] this kv head's pages
    ks_ref,  # [P, S] or None
    v_ref,  # [P, S, Dk]
    vs_ref,  # [P, S] or None
    table_ref,  # [blocks_per_split * pages] this split's page ids
    length_ref,  # [1] end of the visible tokens
    first_ref,  # [1] first visible token (a window), or None: token 0
    o_ref,  # [Gp, D] float32, unnormalized
    m_ref,  # [Gp] running max of the scores
    l_ref,  # [Gp] softmax denominator (relative to m)
    *,
    sm_scale: float,
    int4: bool,
    compute_dtype: Any,
    pages: int,
    blocks_per_split: int,
):
    gp, d = q_ref.shape
    page_size = k_ref.shape[1]
    block_t = pages * page_size
    length = length_ref[0]
    split_start = pl.program_id(2) * (blocks_per_split * block_t)
    n_blocks = jnp.clip(pl.cdiv(length - split_start, block_t), 0, blocks_per_split)
    if first_ref is not None:
        # The window's first token lies in the table's first page (``_window_tables``), so
        # every block up to the length holds a visible token, unless none is visible at all.
        first = first_ref[0]
        n_blocks = jnp.where(first < length, n_blocks, jnp.int32(0))

    if int4:  # q·k = q[:D/2]·lo + q[D/2:]·hi; the output halves accumulate separately
        half = d // 2
        qs = (q_ref[:, pl.ds(0, half)], q_ref[:, pl.ds(half, half)])
    else:
        qs = (q_ref[...],)
    qs = tuple(x.astype(compute_dtype) for x in qs)
    # float32 operands: IEEE float32 MMAs. Without a precision Triton runs them as TF32 (10-bit
    # mantissas); bf16/f16 operands ignore it and accumulate in float32 either way.
    precision = jax.lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None

    def body(i, carry):
        accs, m_prev, l_prev = carry
        ids = table_ref[pl.ds(i * pages, pages)]  # [pages]
        token = (
            split_start
            + i * block_t
            + jax.lax.broadcasted_iota(jnp.int32, (pages, page_size), 0) * page_size
            + jax.lax.broadcasted_iota(jnp.int32, (pages, page_size), 1)
        )
        # [pages, S]; n_blocks counts only blocks starting below the length, so each has a
        # valid token and the running max below is finite.
        valid = token < length
        if first_ref is not None:
            valid &= token >= first
        valid_t = valid.reshape(block_t)

        # Gathers index every axis with an array (interpret mode cannot mix arrays and slices).
        offset = jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)

        def load_codes(ref):  # -> parts of the tile, each [T, D or D/2], in compute_dtype
            lane = jax.lax.broadcasted_iota(jnp.int32, (1, 1, ref.shape[-1]), 2)
            idx = (ids[:, None, None], offset[:, :, None], lane)
            zero = jnp.zeros((), ref.dtype)  # Triton cannot cast an int `other` to fp8
            tile = pltriton.load(ref.at[idx], mask=valid[:, :, None], other=zero)
            tile = tile.reshape(block_t, ref.shape[-1])
            parts = int4_unpack_halves(tile) if int4 else (tile,)
            return tuple(x.astype(compute_dtype) for x in parts)

        def load_scales(ref):  # -> [T] float32, 0 where masked
            return pltriton.load(ref.at[ids[:, None], offset], mask=valid, other=0).reshape(block_t)

        scores = sum(
            pltriton.dot(q, k, trans_b=True, precision=precision)
            for q, k in zip(qs, load_codes(k_ref), strict=True)
        )
        if ks_ref is None:
            scores = scores * sm_scale
        else:
            scores = scores * (load_scales(ks_ref) * sm_scale)[None, :]
        scores = jnp.where(valid_t[None, :], scores, -jnp.inf)  # [Gp, T]

        m_next = jnp.maximum(m_prev, scores.max(axis=-1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.exp(scores - m_next[:, None])  # exactly 0 at masked tokens
        l_next = correction * l_prev + p.sum(axis=-1)
        if vs_ref is not None:  # per-token V scale: scale the probabilities, not the codes
            p = p * load_scales(vs_ref)[None, :]
        p = p.astype(compute_dtype)
        accs = tuple(
            correction[:, None] * acc + pltriton.dot(p, v, precision=precision)
            for acc, v in zip(accs, load_codes(v_ref), strict=True)
        )
        return accs, m_next, l_next

    accs = tuple(jnp.zeros((gp, q.shape[1]), jnp.float32) for q in qs)
    m = jnp.full((gp,), -jnp.inf, jnp.float32)
    total = jnp.zeros((gp,), jnp.float32)
    accs, m, total = jax.lax.fori_loop(0, n_blocks, body, (accs, m, total))

    if int4:
        o_ref[:, pl.ds(0, half)] = accs[0]
        o_ref[:, pl.ds(half, half)] = accs[1]
    else:
        o_ref[...] = accs[0]
    m_ref[...] = m
    l_ref[...] = total


def _validate(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    k_scales: jax.Array | None,
    v_scales: jax.Array | None,
    kv_dtype: str | None,
    window: int | None = None,
    query_positions: jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> str:
    """Shape/dtype checks shared by the kernel and the reference; returns the kv_dtype."""
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, heads, head_dim]; got shape {q.shape}")
    if k_pages.ndim != 4:
        raise ValueError(
            f"k_pages must be [kv_heads, pages, page_size, head_dim]; got shape {k_pages.shape}"
        )
    if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
        raise ValueError(
            f"k_pages and v_pages differ: {k_pages.shape} {k_pages.dtype} vs "
            f"{v_pages.shape} {v_pages.dtype}"
        )
    batch, heads, head_dim = q.shape
    kv_heads, num_pages, page_size, code_dim = k_pages.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [{batch}, pages_per_seq]; got {block_tables.shape}")
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must be [{batch}]; got shape {lengths.shape}")
    if block_tables.dtype != jnp.int32 or lengths.dtype != jnp.int32:
        raise ValueError(
            f"block_tables and lengths must be int32; got {block_tables.dtype}, {lengths.dtype}"
        )
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"q must be float32, bfloat16 or float16; got {q.dtype}")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int (tokens) or None; got {window!r}")
    if query_positions is not None:
        if window is None:
            raise ValueError("query_positions only apply with a window")
        if query_positions.shape != (batch,) or query_positions.dtype != jnp.int32:
            raise ValueError(
                f"query_positions must be int32[{batch}]; got "
                f"{query_positions.dtype}{list(query_positions.shape)}"
            )
    if sinks is not None and (
        sinks.shape != (heads,) or not jnp.issubdtype(sinks.dtype, jnp.floating)
    ):
        raise ValueError(f"sinks must be float[{heads}]; got {sinks.dtype}{list(sinks.shape)}")

    stored = kv_dtype_of(k_pages.dtype)
    if kv_dtype is not None and kv_dtype != stored:
        raise ValueError(f"kv_dtype {kv_dtype!r} but the pages are {k_pages.dtype} ({stored!r})")
    if kv_code_shape(head_dim, stored) != (code_dim,):
        raise ValueError(
            f"{stored} pages of head_dim {head_dim} store {kv_code_shape(head_dim, stored)} "
            f"codes per token; k_pages has {code_dim}"
        )
    scales_shape = (kv_heads, num_pages, page_size)
    if stored == "auto":
        if k_scales is not None or v_scales is not None:
            raise ValueError(f"k_scales/v_scales only apply to fp8/int4 pages, not {k_pages.dtype}")
    else:
        for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
            if s is None or s.shape != scales_shape or s.dtype != jnp.float32:
                got = None if s is None else f"{s.dtype}{list(s.shape)}"
                raise ValueError(
                    f"{stored} pages need {name} float32{list(scales_shape)}; got {got}"
                )
    return stored


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "kv_dtype",
        "window",
        "pages_per_compute_block",
        "k_splits",
        "num_warps",
        "num_stages",
        "interpret",
        "return_lse",
    ),
)
def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    sm_scale: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    kv_dtype: str | None = None,
    window: int | None = None,
    query_positions: jax.Array | None = None,
    sinks: jax.Array | None = None,
    pages_per_compute_block: int = 8,
    k_splits: int = 16,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Decode attention of q [B, H, D] over paged K/V; returns [B, H, D] in q.dtype (and, with
    ``return_lse``, the float32 log-sum-exp of the scaled scores [B, H], sinks included, -inf
    when no token is visible and there are no sinks).

    Args:
      q: one query token per sequence, [B, H, D], float32/bfloat16/float16. Not pre-scaled.
      k_pages, v_pages: [K, P, S, Dk]: float pages (Dk = D), float8_e4m3fn (fp8, Dk = D) or
        uint8 split-half int4 codes (Dk = D/2); see ``research.quant.kv``.
      block_tables: int32 [B, M], page ids in [0, P); entries past a sequence's last page may
        hold anything (-1, stale ids): their pages are never loaded.
      lengths: int32 [B], tokens per sequence (clipped to M * S). Length 0 gives zeros.
      sm_scale: softmax scale applied to q·k; default 1/sqrt(D).
      k_scales, v_scales: float32 [K, P, S] per-token scales, required for fp8/int4 pages.
      kv_dtype: "auto" (float), "fp8" or "int4"; inferred from the page dtype, checked if given.
      window: sliding window in tokens: the query at position p sees tokens p - window < t <= p
        (and t < length); only the pages holding those tokens are read. None: every token.
      query_positions: int32 [B], each query's position for the window; default lengths - 1
        (the query is the sequence's last token). Only with a window.
      sinks: float [H] attention-sink logits (one per query head): each joins its head's softmax
        denominator as exp(sink) and contributes no value.
      pages_per_compute_block: pages per inner-loop tile (a power of two); capped at the table
        width and raised so a tile holds >= 16 tokens.
      k_splits: splits of each sequence's pages into programs run in parallel (more for long
        contexts with few sequences); capped at the number of compute blocks.
      num_warps, num_stages: Triton compiler parameters.
      interpret: run the kernel in Pallas' interpreter (CPU).

    S, D, Dk and the compute block must be powers of two and Dk >= 16 (Triton). The dots run in
    q.dtype for quantized pages (fp8 and int4 codes are exact in bfloat16), else in the wider of
    q.dtype and the page dtype, accumulating in float32.
    """
    stored = _validate(
        q,
        k_pages,
        v_pages,
        block_tables,
        lengths,
        k_scales,
        v_scales,
        kv_dtype,
        window,
        query_positions,
        sinks,
    )
    batch, heads, head_dim = q.shape
    kv_heads, num_pages, page_size, code_dim = k_pages.shape
    if not all(map(_is_power_of_2, (page_size, head_dim, code_dim, pages_per_compute_block))):
        raise ValueError(
            "page size, head_dim, stored code width and pages_per_compute_block must be powers "
            f"of two (Triton); got {page_size}, {head_dim}, {code_dim}, {pages_per_compute_block}"
        )
    if code_dim < MIN_DOT_DIM:
        raise ValueError(f"stored code width {code_dim} < {MIN_DOT_DIM} (Triton dot operands)")
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    compute_dtype = q.dtype if stored != "auto" else jnp.promote_types(q.dtype, k_pages.dtype)

    lengths = jnp.minimum(lengths, block_tables.shape[1] * page_size)
    firsts = None
    if window is not None:
        positions = lengths - 1 if query_positions is None else query_positions
        block_tables, firsts, lengths = _window_tables(
            block_tables, lengths, positions, window, page_size
        )
    pages_per_seq = block_tables.shape[1]
    pages, splits, blocks_per_split = _split_plan(
        pages_per_seq, page_size, pages_per_compute_block, k_splits
    )
    pages_per_split = blocks_per_split * pages
    tables = jnp.pad(block_tables, ((0, 0), (0, splits * pages_per_split - pages_per_seq)))
    tables = tables.reshape(batch, splits, pages_per_split)

    group = heads // kv_heads
    block_h = max(MIN_DOT_DIM, pl.next_power_of_2(group))
    q_blocks = q.reshape(batch, kv_heads, group, head_dim)
    q_blocks = jnp.pad(q_blocks, ((0, 0), (0, 0), (0, block_h - group), (0, 0)))

    page_spec = pl.BlockSpec((None, num_pages, page_size, code_dim), lambda b, h, s: (h, 0, 0, 0))
    scale_spec = (
        None
        if stored == "auto"
        else pl.BlockSpec((None, num_pages, page_size), lambda b, h, s: (h, 0, 0))
    )
    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        int4=stored == "int4",
        compute_dtype=compute_dtype,
        pages=pages,
        blocks_per_split=blocks_per_split,
    )
    partial_shape = (splits, batch, kv_heads, block_h)
    acc, m, total = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, splits),
        in_specs=[
            pl.BlockSpec((None, None, block_h, head_dim), lambda b, h, s: (b, h, 0, 0)),
            page_spec,
            scale_spec,
            page_spec,
            scale_spec,
            pl.BlockSpec((None, None, pages_per_split), lambda b, h, s: (b, s, 0)),
            pl.BlockSpec((1,), lambda b, h, s: (b,)),
            None if firsts is None else pl.BlockSpec((1,), lambda b, h, s: (b,)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_h, head_dim), lambda b, h, s: (s, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (s, b, h, 0)),
            pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (s, b, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*partial_shape, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paged_attention_{stored}" + ("_window" if window is not None else ""),
    )(q_blocks, k_pages, k_scales, v_pages, v_scales, tables, lengths, firsts)

    # Log-sum-exp over splits (and the sink); an empty split has m = -inf, l = 0, acc = 0 and
    # weight 0.
    top = m.max(axis=0)  # [B, K, Gp]
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(kv_heads, group)
        sink = jnp.pad(sink, ((0, 0), (0, block_h - group)), constant_values=-jnp.inf)
        top = jnp.maximum(top, sink[None])
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weight = jnp.exp(m - top)  # [splits, B, K, Gp]
    denom = (weight * total).sum(axis=0)
    if sinks is not None:
        denom = denom + jnp.exp(sink[None] - top)
    out = (weight[..., None] * acc).sum(axis=0) / jnp.where(denom > 0, denom, 1.0)[..., None]
    out = out[:, :, :group].reshape(batch, heads, head_dim).astype(q.dtype)
    if not return_lse:
        return out
    # log sum_j exp(score_j): the weight of this partial attention when merging it with another.
    lse = jnp.where(denom > 0, top + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    return out, lse[:, :, :group].reshape(batch, heads)


def window_pages(window: int, page_size: int) -> int:
    """Pages that ``window`` consecutive tokens can touch: cdiv(window + S - 1, S)."""
    return pl.cdiv(window + page_size - 1, page_size)


def _window_tables(
    block_tables: jax.Array,
    lengths: jax.Array,
    positions: jax.Array,
    window: int,
    page_size: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Narrow [B, M] tables to the window: (tables [B, Mw], first [B], end [B]) with the visible
    tokens [first, end) counted from the first column's page, first in [0, S).

    The query at ``positions`` [B] sees tokens max(p - window + 1, 0) <= t < min(p + 1, length);
    column j of the narrowed table is page ``first // S + j`` of the sequence. Columns past M
    repeat the last page id and lie past ``end`` (never loaded)."""
    width = block_tables.shape[1]
    start = jnp.maximum(positions - window + 1, 0)  # [B] first visible token
    end = jnp.minimum(lengths, positions + 1)
    first_page = jnp.minimum(start // page_size, width - 1)
    cols = first_page[:, None] + jnp.arange(min(width, window_pages(window, page_size)))
    tables = jnp.take_along_axis(block_tables, jnp.minimum(cols, width - 1), axis=1)
    base = first_page * page_size
    return tables, start - base, jnp.maximum(end - base, 0)


@functools.partial(jax.jit, static_argnames=("sm_scale", "kv_dtype", "window", "return_lse"))
def paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    sm_scale: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    kv_dtype: str | None = None,
    window: int | None = None,
    query_positions: jax.Array | None = None,
    sinks: jax.Array | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``paged_attention`` in plain jnp, all in float32: gather each sequence's whole table,
    dequantize, masked softmax with the sinks as extra logits (masked K/V rows zeroed, so NaN
    pages stay out)."""
    stored = _validate(
        q,
        k_pages,
        v_pages,
        block_tables,
        lengths,
        k_scales,
        v_scales,
        kv_dtype,
        window,
        query_positions,
        sinks,
    )
    batch, heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    group = heads // kv_heads
    tokens = block_tables.shape[1] * page_size
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale

    def gather(pages: jax.Array, scales: jax.Array | None) -> jax.Array:  # -> [B, K, M*S, D]
        codes = pages[:, block_tables]  # [K, B, M, S, Dk]
        if stored == "auto":
            x = codes.astype(jnp.float32)
        else:
            x = dequantize_kv(codes, scales[:, block_tables], stored)
        return x.reshape(kv_heads, batch, tokens, head_dim).transpose(1, 0, 2, 3)

    t = jnp.arange(tokens)[None, :]
    valid = t < lengths[:, None]  # [B, M*S]
    if window is not None:
        p = (lengths - 1 if query_positions is None else query_positions)[:, None]
        valid &= (t > p - window) & (t <= p)
    k = jnp.where(valid[:, None, :, None], gather(k_pages, k_scales), 0.0)
    v = jnp.where(valid[:, None, :, None], gather(v_pages, v_scales), 0.0)
    qg = q.astype(jnp.float32).reshape(batch, kv_heads, group, head_dim)
    hi = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("bkgd,bktd->bkgt", qg, k, precision=hi) * sm_scale
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    if sinks is not None:  # one more logit per head, with a zero value
        sink = jnp.broadcast_to(
            sinks.astype(jnp.float32).reshape(1, kv_heads, group, 1), (batch, kv_heads, group, 1)
        )
        scores = jnp.concatenate([scores, sink], axis=-1)
        v = jnp.concatenate([v, jnp.zeros((batch, kv_heads, 1, head_dim))], axis=2)
    m = scores.max(axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m)  # 0 at masked tokens
    denom = p.sum(axis=-1, keepdims=True)
    out = jnp.einsum("bkgt,bktd->bkgd", p, v, precision=hi) / jnp.where(denom > 0, denom, 1.0)
    out = out.reshape(batch, heads, head_dim).astype(q.dtype)
    if not return_lse:
        return out
    lse = jnp.where(denom > 0, m + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    return out, lse.reshape(batch, heads)
