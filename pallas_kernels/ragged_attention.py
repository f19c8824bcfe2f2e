"""Ragged paged attention: one launch for a step's decodes, prefill chunks and verifications.

A Pallas kernel for the Triton backend over the engine's step inputs (``research.engine.step``):
N packed query tokens from R rows, row r's tokens at ``query_start_loc[r] : query_start_loc[r+1]``
with ``context_lens[r]`` tokens already in the paged pool. A query token at position p of row r
attends over the row's cached context (pool positions < context_lens[r], read through its block
table) and over the row's new tokens up to itself (``k_new``/``v_new``, the step's packed K/V,
written to the pool after the forward), inside a sliding ``window`` where the layer has one,
with attention ``sinks`` (gpt-oss) in the softmax denominator.

Grid ``(N // Bq + R, K, splits)``, fixed by the shape, so one compile serves every mix of rows.
A row of n tokens needs ceil(n / Bq) query blocks; their sum is at most N / Bq + R (vLLM's
bound). Program ``b`` finds its row from ``query_start_loc`` (the last r with
``query_start_loc[r] // Bq + r <= b``, a vectorized count over the row starts: no serial
search) and its first token; programs past their row's tokens run no loop and store nothing.
Padded tokens (at or past ``query_start_loc[R]``) are never written: the output starts as zeros.

Tile rows: the G query heads of a kv head are packed with Bq tokens into Bq x Gp rows (Gp = G
padded to a power of two), so a decode (one token) still fills a 16-row matrix tile and each
K/V tile is loaded once for the whole group. Two loops, both online softmax in float32:

1. the context: T-token tiles of the row's pages (``pages_per_compute_block`` pages each),
   dequantized in registers (bf16/f16/f32 pages as stored, fp8 with per-token scales, int4
   split-half nibbles: the dots run on the two halves of q and accumulate two output halves);
2. the new tokens: ``new_block`` tokens at a time from the packed K/V, causal by token index.

Loads are masked: a page past the row's context, outside the window or past the table is never
read (K/V and scales load as 0, scores -inf), so stale or NaN pages cannot reach the output.
The running max starts at a finite floor, so a row that sees no key in a tile stays finite.

Split-KV (``kv_splits`` > 1, for long decodes with few rows): split s reads a contiguous run
of the row's context tiles, split 0 also the new tokens; each writes its unnormalized output,
running max and sum, and a log-sum-exp reduction outside the kernel combines them (with the
sinks). With one split the kernel normalizes and writes the output itself, sinks included.

Axis legend: N = packed tokens, R = rows, M = table width (pages per row), K = kv heads,
H = K G query heads, Gp = G padded to a power of two, D = head_dim, Dk = stored code width,
P = pages in the pool, S = page size, Bq = query tokens per program, T = context tile tokens.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from research.quant.kv import dequantize_kv, int4_unpack_halves, kv_code_shape, kv_dtype_of

MIN_DOT_DIM = 16  # Triton's tl.dot needs every operand dim >= 16
M_FLOOR = -1e30  # the running max's start: finite, so exp(m_prev - m_next) never sees inf - inf
_FAR = 1 << 30  # a block index no program reaches (rows past R)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _kernel(
    starts_ref,  # [Rp] first token of each row (rows past R: _FAR)
    ends_ref,  # [Rp] end of each row's tokens
    ctx_ref,  # [Rp] cached tokens of each row
    table_ref,  # [R * M] block tables, row-major
    q_ref,  # [N, Gp, D] this kv head's query heads
    kn_ref,  # [N, D] this kv head's new keys
    vn_ref,  # [N, D]
    k_ref,  # [P, S, Dk] this kv head's pages
    ks_ref,  # [P, S] or None
    v_ref,
    vs_ref,
    sink_ref,  # [Gp] or None
    _o_in,  # the zero-initialized outputs (aliased)
    _m_in,
    _l_in,
    o_ref,  # [N, Gp, D]: the output (one split) or the split's unnormalized output
    m_ref,  # [N, Gp] or None (one split)
    l_ref,
    *,
    block_q: int,
    num_rows: int,
    width: int,
    pages: int,
    new_block: int,
    splits: int,
    sm_scale: float,
    int4: bool,
    compute_dtype: Any,
    window: int | None,
):
    n, gp, d = q_ref.shape
    page_size = k_ref.shape[1]
    block_t = pages * page_size
    bm = block_q * gp
    b = pl.program_id(0)
    split = pl.program_id(2)
    i32 = jnp.int32

    # -- which row, which tokens
    rp = starts_ref.shape[0]
    ridx = jax.lax.broadcasted_iota(i32, (rp,), 0)
    starts = starts_ref[...]
    first_blocks = jnp.where(ridx < num_rows, starts // block_q + ridx, _FAR)
    row = jnp.sum((first_blocks <= b).astype(i32)) - 1  # >= 0: row 0 starts at block 0

    def pick(vec):
        return jnp.sum(jnp.where(ridx == row, vec, 0))

    start, end, ctx = pick(starts), pick(ends_ref[...]), pick(ctx_ref[...])
    q0 = start + (b - pick(first_blocks)) * block_q  # this program's first token
    tok = q0 + jax.lax.broadcasted_iota(i32, (block_q,), 0)  # [Bq]
    qvalid = tok < end
    # In range and distinct (N >= Bq): a masked store never aliases a stored token (the
    # interpreter writes masked lanes back with the value they hold).
    tok_c = tok % n

    def per_row(x):  # [Bq] -> [Bq * Gp], token-major like the tile's rows
        return jnp.broadcast_to(x[:, None], (block_q, gp)).reshape(bm)

    row_tok = per_row(tok)
    row_pos = per_row(ctx + tok - start)  # each tile row's query position

    # -- the queries: [Bq, Gp, D] -> [Bq Gp, D] (in halves for int4 pages)
    half = d // 2
    lanes = ((0, half), (half, half)) if int4 else ((0, d),)
    g_idx = jax.lax.broadcasted_iota(i32, (1, gp, 1), 1)

    def load_q(lo, size):
        lane = lo + jax.lax.broadcasted_iota(i32, (1, 1, size), 2)
        x = pltriton.load(
            q_ref.at[tok_c[:, None, None], g_idx, lane], mask=qvalid[:, None, None], other=0
        )
        return x.reshape(bm, size).astype(compute_dtype)

    qs = tuple(load_q(lo, size) for lo, size in lanes)
    precision = jax.lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None

    def update(carry, scores, see, values, v_scale=None):
        """One online-softmax step: scores [bm, t] (scaled), see [bm, t], values: parts [t, *]."""
        accs, m_prev, l_prev = carry
        scores = jnp.where(see, scores, -jnp.inf)
        m_next = jnp.maximum(m_prev, scores.max(axis=-1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.exp(scores - m_next[:, None])  # exactly 0 where unseen
        l_next = correction * l_prev + p.sum(axis=-1)
        if v_scale is not None:  # per-token V scales: scale the probabilities, not the codes
            p = p * v_scale[None, :]
        p = p.astype(compute_dtype)
        accs = tuple(
            correction[:, None] * acc + pltriton.dot(p, v, precision=precision)
            for acc, v in zip(accs, values, strict=True)
        )
        return accs, m_next, l_next

    def window_ok(key_pos):  # [t] -> [bm, t]
        if window is None:
            return True
        return key_pos[None, :] > row_pos[:, None] - window

    # -- 1. the cached context, tile by tile
    lo_key = jnp.int32(0)
    if window is not None:  # the block's first query sees nothing before this
        lo_key = jnp.maximum(ctx + q0 - start - window + 1, 0)
    hi_key = jnp.where(q0 < end, ctx, 0)
    first_tile = lo_key // block_t
    n_tiles = jnp.maximum(pl.cdiv(hi_key, block_t) - first_tile, 0)
    per_split = pl.cdiv(n_tiles, splits)
    tile_lo = first_tile + split * per_split
    tile_hi = jnp.minimum(tile_lo + per_split, first_tile + n_tiles)
    offset = jax.lax.broadcasted_iota(i32, (1, page_size), 1)

    def ctx_body(i, carry):
        col = i * pages + jax.lax.broadcasted_iota(i32, (pages,), 0)
        ids = pltriton.load(
            table_ref.at[row * width + jnp.minimum(col, width - 1)], mask=col < width, other=0
        )
        key = i * block_t + jax.lax.broadcasted_iota(i32, (pages, page_size), 0) * page_size
        key = key + jax.lax.broadcasted_iota(i32, (pages, page_size), 1)
        kvalid = (key < hi_key) & (key >= lo_key)  # [pages, S]: what may be loaded
        key_t, kvalid_t = key.reshape(block_t), kvalid.reshape(block_t)

        def codes(ref):
            lane = jax.lax.broadcasted_iota(i32, (1, 1, ref.shape[-1]), 2)
            zero = jnp.zeros((), ref.dtype)  # Triton cannot cast an int `other` to fp8
            tile = pltriton.load(
                ref.at[ids[:, None, None], offset[:, :, None], lane],
                mask=kvalid[:, :, None],
                other=zero,
            ).reshape(block_t, ref.shape[-1])
            parts = int4_unpack_halves(tile) if int4 else (tile,)
            return tuple(x.astype(compute_dtype) for x in parts)

        def scales(ref):
            return pltriton.load(ref.at[ids[:, None], offset], mask=kvalid, other=0).reshape(
                block_t
            )

        s = sum(
            pltriton.dot(q, k, trans_b=True, precision=precision)
            for q, k in zip(qs, codes(k_ref), strict=True)
        )
        s = s * (sm_scale if ks_ref is None else (scales(ks_ref) * sm_scale)[None, :])
        see = kvalid_t[None, :] & window_ok(key_t)
        v_scale = None if vs_ref is None else scales(vs_ref)
        return update(carry, s, see, codes(v_ref), v_scale)

    if sink_ref is not None and splits == 1:  # the sink joins the denominator with no value
        sink = jnp.broadcast_to(sink_ref[...][None, :], (block_q, gp)).reshape(bm)
        m0 = jnp.maximum(sink, M_FLOOR)
        l0 = jnp.exp(sink - m0)
    else:
        m0 = jnp.full((bm,), M_FLOOR, jnp.float32)
        l0 = jnp.zeros((bm,), jnp.float32)
    accs0 = tuple(jnp.zeros((bm, size), jnp.float32) for _, size in lanes)
    carry = jax.lax.fori_loop(tile_lo, tile_hi, ctx_body, (accs0, m0, l0))

    # -- 2. the row's new tokens up to each query (split 0 only)
    new_lo = start
    if window is not None:
        new_lo = jnp.maximum(start, q0 - window + 1)
    new_hi = jnp.minimum(end, q0 + block_q)
    first_new = new_lo // new_block
    n_new = jnp.where((split == 0) & (q0 < end), pl.cdiv(new_hi, new_block) - first_new, 0)

    def new_body(i, carry):
        j = i * new_block + jax.lax.broadcasted_iota(i32, (new_block,), 0)
        jvalid = (j >= new_lo) & (j < new_hi)
        j_c = jnp.clip(j, 0, n - 1)

        def load(ref, lo, size):
            lane = lo + jax.lax.broadcasted_iota(i32, (1, size), 1)
            x = pltriton.load(ref.at[j_c[:, None], lane], mask=jvalid[:, None], other=0)
            return x.astype(compute_dtype)

        s = sum(
            pltriton.dot(q, load(kn_ref, lo, size), trans_b=True, precision=precision)
            for q, (lo, size) in zip(qs, lanes, strict=True)
        )
        see = jvalid[None, :] & (j[None, :] <= row_tok[:, None])
        if window is not None:
            see &= j[None, :] > row_tok[:, None] - window
        values = tuple(load(vn_ref, lo, size) for lo, size in lanes)
        return update(carry, s * sm_scale, see, values)

    accs, m, total = jax.lax.fori_loop(first_new, first_new + n_new, new_body, carry)

    # -- store this block's tokens
    if m_ref is None:
        inv = 1.0 / jnp.where(total > 0, total, 1.0)
        accs = tuple(acc * inv[:, None] for acc in accs)
    for acc, (lo, size) in zip(accs, lanes, strict=True):
        lane = lo + jax.lax.broadcasted_iota(i32, (1, 1, size), 2)
        pltriton.store(
            o_ref.at[tok_c[:, None, None], g_idx, lane],
            acc.reshape(block_q, gp, size).astype(o_ref.dtype),
            mask=qvalid[:, None, None],
        )
    if m_ref is not None:
        g2 = jax.lax.broadcasted_iota(i32, (1, gp), 1)
        for ref, x in ((m_ref, m), (l_ref, total)):
            pltriton.store(ref.at[tok_c[:, None], g2], x.reshape(block_q, gp), mask=qvalid[:, None])


def _validate(q, k_new, v_new, k_pages, v_pages, block_tables, query_start_loc, context_lens,
              k_scales, v_scales, kv_dtype, window, sinks) -> str:  # fmt: skip
    """Shape and dtype checks shared by the kernel and the reference; returns the kv_dtype."""
    if q.ndim != 3:
        raise ValueError(f"q must be [tokens, heads, head_dim]; got shape {q.shape}")
    n, heads, head_dim = q.shape
    if k_pages.ndim != 4 or v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
        raise ValueError(
            "k_pages and v_pages must be equal-shaped [kv_heads, pages, page_size, code_dim]; "
            f"got {k_pages.dtype}{list(k_pages.shape)}, {v_pages.dtype}{list(v_pages.shape)}"
        )
    kv_heads, num_pages, page_size, code_dim = k_pages.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if x.shape != (n, kv_heads, head_dim):
            raise ValueError(f"{name} must be [{n}, {kv_heads}, {head_dim}]; got {x.shape}")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [rows, pages_per_row]; got {block_tables.shape}")
    rows = block_tables.shape[0]
    if query_start_loc.shape != (rows + 1,) or context_lens.shape != (rows,):
        raise ValueError(
            f"query_start_loc must be [{rows + 1}] and context_lens [{rows}]; got "
            f"{query_start_loc.shape}, {context_lens.shape}"
        )
    for name, x in (("block_tables", block_tables), ("query_start_loc", query_start_loc),
                    ("context_lens", context_lens)):  # fmt: skip
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32; got {x.dtype}")
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"q must be float32, bfloat16 or float16; got {q.dtype}")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int (tokens) or None; got {window!r}")
    if sinks is not None and sinks.shape != (heads,):
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


def num_query_blocks(num_tokens: int, num_rows: int, block_q: int) -> int:
    """The grid's query-block axis: an upper bound on sum_r ceil(n_r / Bq) for any split of
    ``num_tokens`` into ``num_rows`` rows."""
    return num_tokens // block_q + num_rows


def query_block_tokens(group: int, block_rows: int) -> tuple[int, int]:
    """(Bq, Gp): query tokens per program and padded group so that Bq x Gp = ``block_rows``
    (at least one token; Gp a power of two)."""
    gp = pl.next_power_of_2(group)
    return max(1, block_rows // gp), gp


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "kv_dtype",
        "window",
        "block_rows",
        "pages_per_compute_block",
        "new_block",
        "kv_splits",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
def ragged_paged_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    context_lens: jax.Array,
    *,
    sm_scale: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    kv_dtype: str | None = None,
    window: int | None = None,
    sinks: jax.Array | None = None,
    block_rows: int = 16,
    pages_per_compute_block: int = 8,
    new_block: int = 16,
    kv_splits: int = 1,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """Attention of a step's N packed query tokens q [N, H, D] -> [N, H, D] in q.dtype.

    Args:
      q: the step's query tokens, row by row; not pre-scaled.
      k_new, v_new: [N, K, D] the same tokens' keys and values (not yet in the pool).
      k_pages, v_pages: [K, P, S, Dk] the pool: float pages (Dk = D), float8_e4m3fn (Dk = D)
        or uint8 split-half int4 codes (Dk = D/2), see ``research.quant.kv``.
      block_tables: int32 [R, M], each row's page ids in order; entries past a row's context
        are never read.
      query_start_loc: int32 [R+1], row r's tokens are q[query_start_loc[r]:query_start_loc[r+1]]
        (non-decreasing; padded rows repeat the last value). Tokens past the last row get 0.
      context_lens: int32 [R], tokens of each row already in the pool (positions 0..c-1); the
        row's new tokens are at positions c, c+1, ...
      sm_scale: softmax scale, default 1/sqrt(D).
      k_scales, v_scales: float32 [K, P, S] per-token scales (fp8 and int4 pages).
      window: sliding window: the query at position p sees keys at positions > p - window.
      sinks: float [H] attention-sink logits, one per query head.
      block_rows: tile rows per program, Bq tokens x Gp heads (>= 16 for Triton's dot).
      pages_per_compute_block: pages per context tile (T = pages x S tokens, at least 16).
      new_block: new tokens per tile of the second loop (a power of two >= 16).
      kv_splits: programs per query block and kv head splitting the context (long decodes).
      num_warps, num_stages: Triton compiler parameters.
      interpret: run in Pallas' interpreter (CPU).
    """
    stored = _validate(q, k_new, v_new, k_pages, v_pages, block_tables, query_start_loc,
                       context_lens, k_scales, v_scales, kv_dtype, window, sinks)  # fmt: skip
    num_tokens, heads, head_dim = q.shape
    kv_heads, num_pages, page_size, code_dim = k_pages.shape
    rows, width = block_tables.shape
    group = heads // kv_heads
    block_q, gp = query_block_tokens(group, block_rows)
    n = max(num_tokens, block_q)  # at least one block of tokens (the extra ones are padding)
    if n > num_tokens:
        q, k_new, v_new = (
            jnp.pad(x, ((0, n - num_tokens), (0, 0), (0, 0))) for x in (q, k_new, v_new)
        )
    pages = max(min(pages_per_compute_block, pl.next_power_of_2(max(width, 1))),
                pl.cdiv(MIN_DOT_DIM, page_size))  # fmt: skip
    if not all(map(_pow2, (page_size, head_dim, code_dim, pages, new_block, block_q * gp))):
        raise ValueError(
            "page size, head_dim, code width, pages per tile, new_block and block_rows must be "
            f"powers of two (Triton); got {page_size}, {head_dim}, {code_dim}, {pages}, "
            f"{new_block}, {block_q * gp}"
        )
    if block_q * gp < MIN_DOT_DIM or new_block < MIN_DOT_DIM or code_dim < MIN_DOT_DIM:
        raise ValueError(
            f"block_rows ({block_q * gp}), new_block ({new_block}) and the code width "
            f"({code_dim}) must be >= {MIN_DOT_DIM} (Triton's dot)"
        )
    if kv_splits < 1:
        raise ValueError(f"kv_splits must be >= 1; got {kv_splits}")
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    compute_dtype = q.dtype if stored != "auto" else jnp.promote_types(q.dtype, k_pages.dtype)

    # row metadata, padded to a power of two with rows no program reaches
    rp = max(MIN_DOT_DIM, pl.next_power_of_2(max(rows, 1)))
    starts = jnp.pad(query_start_loc[:-1], (0, rp - rows), constant_values=_FAR)
    ends = jnp.pad(query_start_loc[1:], (0, rp - rows))
    ctx = jnp.pad(context_lens, (0, rp - rows))
    table = block_tables.reshape(rows * width) if width else jnp.zeros((1,), jnp.int32)

    qg = q.reshape(n, kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - group), (0, 0)))
    sink = None
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(kv_heads, group)
        sink = jnp.pad(sink, ((0, 0), (0, gp - group)), constant_values=-jnp.inf)

    grid = (num_query_blocks(n, rows, block_q), kv_heads, kv_splits)
    whole = lambda shape: pl.BlockSpec(shape, lambda b, h, s: (0,) * len(shape))  # noqa: E731
    page_spec = pl.BlockSpec((None, num_pages, page_size, code_dim), lambda b, h, s: (h, 0, 0, 0))
    scale_spec = pl.BlockSpec((None, num_pages, page_size), lambda b, h, s: (h, 0, 0))
    quantized = stored != "auto"
    split = kv_splits > 1
    out_dtype = jnp.float32 if split else q.dtype
    if split:
        o_spec = pl.BlockSpec((None, n, None, gp, head_dim), lambda b, h, s: (s, 0, h, 0, 0))
        ml_spec = pl.BlockSpec((None, n, None, gp), lambda b, h, s: (s, 0, h, 0))
        zeros = [
            jnp.zeros((kv_splits, n, kv_heads, gp, head_dim), out_dtype),
            jnp.zeros((kv_splits, n, kv_heads, gp), jnp.float32),
            jnp.zeros((kv_splits, n, kv_heads, gp), jnp.float32),
        ]
        out_specs = [o_spec, ml_spec, ml_spec]
    else:
        o_spec = pl.BlockSpec((n, None, gp, head_dim), lambda b, h, s: (0, h, 0, 0))
        zeros = [jnp.zeros((n, kv_heads, gp, head_dim), out_dtype)]
        out_specs = [o_spec]
    inputs = [starts, ends, ctx, table, qg, k_new, v_new, k_pages, k_scales, v_pages, v_scales,
              sink, *zeros]  # fmt: skip
    in_specs = [
        whole((rp,)),
        whole((rp,)),
        whole((rp,)),
        whole(table.shape),
        pl.BlockSpec((n, None, gp, head_dim), lambda b, h, s: (0, h, 0, 0)),
        pl.BlockSpec((n, None, head_dim), lambda b, h, s: (0, h, 0)),
        pl.BlockSpec((n, None, head_dim), lambda b, h, s: (0, h, 0)),
        page_spec,
        scale_spec if quantized else None,
        page_spec,
        scale_spec if quantized else None,
        None if sink is None else pl.BlockSpec((None, gp), lambda b, h, s: (h, 0)),
        *out_specs,
    ]
    first_out = len(inputs) - len(zeros)

    def kernel(*refs):
        ins, outs = refs[: first_out + len(zeros)], refs[first_out + len(zeros) :]
        aliased = list(ins[first_out:]) + [None] * (3 - len(zeros))
        o, m, total = (*outs, None, None) if not split else outs
        _kernel(*ins[:first_out], *aliased, o, m, total,
                block_q=block_q, num_rows=rows, width=max(width, 1), pages=pages,
                new_block=new_block, splits=kv_splits, sm_scale=sm_scale,
                int4=stored == "int4", compute_dtype=compute_dtype,
                window=window)  # fmt: skip

    outs = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=[jax.ShapeDtypeStruct(z.shape, z.dtype) for z in zeros],
        # None inputs (no scales, no sinks) are not operands: count the ones that are
        input_output_aliases={
            sum(x is not None for x in inputs[:first_out]) + i: i for i in range(len(zeros))
        },
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_{stored}"
        + ("_window" if window is not None else "")
        + ("_split" if split else ""),
    )(*inputs)
    if not split:
        out = outs[0]
    else:  # log-sum-exp over the splits, with the sinks
        acc, m, total = outs
        top = m.max(axis=0)  # [N, K, Gp]
        if sink is not None:
            top = jnp.maximum(top, sink[None])
        weight = jnp.exp(m - top)
        denom = (weight * total).sum(axis=0)
        if sink is not None:
            denom = denom + jnp.exp(sink[None] - top)
        out = (weight[..., None] * acc).sum(axis=0) / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out[:num_tokens, :, :group].reshape(num_tokens, heads, head_dim).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "kv_dtype", "window"))
def ragged_paged_attention_reference(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    context_lens: jax.Array,
    *,
    sm_scale: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    kv_dtype: str | None = None,
    window: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """``ragged_paged_attention`` in plain jnp and float32: each token gathers its row's whole
    table and all N new tokens, masks, and takes a softmax with the sinks as extra logits."""
    stored = _validate(q, k_new, v_new, k_pages, v_pages, block_tables, query_start_loc,
                       context_lens, k_scales, v_scales, kv_dtype, window, sinks)  # fmt: skip
    n, heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    rows, width = block_tables.shape
    group = heads // kv_heads
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    f32, hi = jnp.float32, jax.lax.Precision.HIGHEST

    idx = jnp.arange(n, dtype=jnp.int32)
    row = jnp.searchsorted(query_start_loc[1:], idx, side="right").astype(jnp.int32)  # R = none
    real = row < rows
    row_c = jnp.minimum(row, rows - 1)
    start = query_start_loc[row_c]
    pos = context_lens[row_c] + idx - start  # [N]

    def gather(pages, scales):  # -> [N, K, M S, D]
        tables = block_tables[row_c]  # [N, M]
        codes = pages[:, tables]  # [K, N, M, S, Dk]
        x = (
            codes.astype(f32)
            if stored == "auto"
            else dequantize_kv(codes, scales[:, tables], stored)
        )
        return x.reshape(kv_heads, n, width * page_size, head_dim).transpose(1, 0, 2, 3)

    cpos = jnp.arange(width * page_size, dtype=jnp.int32)
    see_ctx = real[:, None] & (cpos[None, :] < context_lens[row_c][:, None])
    see_new = real[:, None] & (row[None, :] == row[:, None]) & (idx[None, :] <= idx[:, None])
    if window is not None:
        see_ctx &= cpos[None, :] > pos[:, None] - window
        see_new &= pos[None, :] > pos[:, None] - window
    kc = jnp.where(see_ctx[:, None, :, None], gather(k_pages, k_scales), 0.0)
    vc = jnp.where(see_ctx[:, None, :, None], gather(v_pages, v_scales), 0.0)
    qg = q.astype(f32).reshape(n, kv_heads, group, head_dim)
    s_ctx = jnp.einsum("nkgd,nktd->nkgt", qg, kc, precision=hi) * sm_scale
    s_new = jnp.einsum("nkgd,jkd->nkgj", qg, k_new.astype(f32), precision=hi) * sm_scale
    scores = jnp.concatenate(
        [
            jnp.where(see_ctx[:, None, None, :], s_ctx, -jnp.inf),
            jnp.where(see_new[:, None, None, :], s_new, -jnp.inf),
        ],
        axis=-1,
    )
    if sinks is not None:
        sink = jnp.broadcast_to(
            sinks.astype(f32).reshape(1, kv_heads, group, 1), (n, kv_heads, group, 1)
        )
        scores = jnp.concatenate([scores, sink], axis=-1)
    m = scores.max(axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m)
    denom = p.sum(axis=-1, keepdims=True)
    t = width * page_size
    out = jnp.einsum("nkgt,nktd->nkgd", p[..., :t], vc, precision=hi)
    out += jnp.einsum("nkgj,jkd->nkgd", p[..., t : t + n], v_new.astype(f32), precision=hi)
    out = out / jnp.where(denom > 0, denom, 1.0)
    return out.reshape(n, heads, head_dim).astype(q.dtype)
