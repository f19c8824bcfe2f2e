"""Grouped expert GEMM (``jax.lax.ragged_dot``) with weights dequantized tile by tile in-kernel.

A Pallas kernel for the Triton backend. Rows of ``lhs`` are sorted by expert (group); group g owns
rows [offset_g, offset_g + group_sizes[g]) and is multiplied by expert g's weight [K, N]. The
weight is a plain array or a ``research.quant.QTensor`` in any format, read from its packed storage
exactly as ``research.quant.quantize`` writes it: every [block_k, block_n] weight tile is decoded
in registers (float32) right before the MMA, so the dequantized weight never exists in memory.

Axis legend: M = routed rows (tokens x top-k, sorted by group), K = input channels (the reduction
axis), N = output channels, G = groups (experts), T = scheduled row-tile visits.

Tile schedule (``_tile_schedule``, computed outside the kernel from ``group_sizes``): the grid is
(T, cdiv(N, block_n)) with T = cdiv(M, block_m) + G - 1, a static bound. Visit t covers row tile
``row_tile[t]`` for group ``group[t]``: it multiplies rows [lo, hi) (the group's rows inside the
tile) and stores rows [lo, write_hi). A tile straddling a group boundary is visited once per group
it touches, each visit masking the other rows. Rows past sum(group_sizes) are written as zeros:
the visit that ends at the last grouped row stretches ``write_hi`` to the end of its tile, and
each later row tile gets one visit with lo = hi (no K loop, stores zeros). Leftover visits up to T
have an empty row range and store nothing. So every output row is stored exactly once, and the
interpreter (which runs grid points serially on CPU) runs at most T visits per N tile instead of
G * cdiv(M, block_m) mostly-empty ones.

Weight tiles, per format (see the storage table in ``research.quant.qtensor``); b = block:
- plain [G, K, N]: one [bk, bn] block load.
- awq: int32 words [bk, bn/8] of codes; each word is repeated 8 times along N (broadcast +
  reshape) and shifted by 4 * (its column's AWQ nibble slot), masked to 4 bits. Zero points (same
  packing) and fp16 scales are loaded per group of 128 rows and repeated along K.
- nvfp4 / mxfp4: uint8 [bk/2, bn]; each byte row is repeated twice along K, the even row keeps the
  low nibble and the odd row the high nibble; E2M1 decoded with ``e2m1_decode`` (shifts, masks,
  bitcast). nvfp4 block scales (E4M3, one row per 16 K) times the expert's float32 tensor scale;
  mxfp4 E8M0 scales (one row per 32 K) decoded with ``e8m0_decode``; repeated along K.
- fp8: float8_e4m3fn [bk, bn] block, converted to float32 and times the per-column scale.
The decoded tile is computed with the same float32 operations as ``research.quant.dequantize``
(bit-identical values), cast to lhs.dtype and fed to the MMA with float32 accumulation (IEEE
float32 MMA, not TF32, for float32 lhs). An optional per-group ``bias`` [G, N] (gpt-oss's
experts) is added to the float32 accumulator of the group's rows before the store. The output is
lhs.dtype.

gpt-oss's MXFP4 experts (``research.models.gpt_oss.mxfp4_from_blocks``) are MXFP4 QTensors of
exactly this storage (the checkpoint's bytes, axes moved), so they run here as they load.

Status: checked in interpret mode on CPU; its Triton modules pass the MLIR verifier and compile
offline to cubin for sm_90 and sm_121 (``pallas_kernels.verify``); not yet run on a GPU, and the
per-GPU blocks (``pallas_kernels.tuning``) fit shared memory but are untuned for speed. E4M3 loads (nvfp4 scales, fp8 codes)
need sm_89 or newer (H200: sm_90, GB10: sm_121).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from research.quant import QTensor, dequantize
from research.quant.formats import AWQ_ORDER, AWQ_PACK, e2m1_decode, e8m0_decode

MIN_BLOCK = 16  # Triton's dot needs every operand dim >= 16
NIBBLE_MASK = 0xF


class TileSchedule(NamedTuple):
    """Row-tile visits, each int32 [T]; see the module doc."""

    row_tile: jax.Array  # row tile index: rows [row_tile * block_m, (row_tile + 1) * block_m)
    group: jax.Array  # group (expert) whose weight the visit multiplies by
    lo: jax.Array  # first row multiplied and stored
    hi: jax.Array  # end of the rows multiplied (rows [lo, hi) belong to `group`)
    write_hi: jax.Array  # end of the rows stored; rows [hi, write_hi) are stored as zeros


def _tile_schedule(group_sizes: jax.Array, num_rows: int, block_m: int) -> TileSchedule:
    """group_sizes [G] -> the row-tile visits for M = ``num_rows``, T = cdiv(M, bm) + G - 1.

    Group ends are clamped to M (rows past M do not exist), so a schedule never leaves the array.
    """
    num_groups = group_sizes.shape[0]
    num_row_tiles = pl.cdiv(num_rows, block_m)
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), num_rows)  # [G]
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    total = ends[-1]  # rows that belong to some group
    first_tile = starts // block_m
    tiles = jnp.where(ends > starts, (ends - 1) // block_m - first_tile + 1, 0)  # [G] visits
    visits_end = jnp.cumsum(tiles)  # [G] visits of groups 0..g
    num_group_visits = visits_end[-1]

    visit = jnp.arange(num_row_tiles + num_groups - 1, dtype=jnp.int32)  # [T]
    # Empty groups add no visits, so `side="right"` skips them.
    group = jnp.minimum(jnp.searchsorted(visits_end, visit, side="right"), num_groups - 1)
    group_tile = first_tile[group] + visit - (visits_end[group] - tiles[group])
    tile_start = group_tile * block_m
    lo = jnp.maximum(starts[group], tile_start)
    hi = jnp.minimum(ends[group], tile_start + block_m)
    tile_end = jnp.minimum(tile_start + block_m, num_rows)
    write_hi = jnp.where(hi == total, tile_end, hi)  # the last grouped row's tile: zero the rest

    zero_tile = pl.cdiv(total, block_m) + visit - num_group_visits  # row tiles past the groups
    is_group = visit < num_group_visits
    is_zero = ~is_group & (zero_tile < num_row_tiles)
    row_tile = jnp.where(is_group, group_tile, jnp.where(is_zero, zero_tile, 0))
    zero_start = zero_tile * block_m
    zero_end = jnp.minimum(zero_start + block_m, num_rows)
    return TileSchedule(
        row_tile=row_tile.astype(jnp.int32),
        group=group.astype(jnp.int32),
        lo=jnp.where(is_group, lo, jnp.where(is_zero, zero_start, 0)).astype(jnp.int32),
        hi=jnp.where(is_group, hi, jnp.where(is_zero, zero_start, 0)).astype(jnp.int32),
        write_hi=jnp.where(is_group, write_hi, jnp.where(is_zero, zero_end, 0)).astype(jnp.int32),
    )


def _repeat_rows(x: jax.Array, times: int) -> jax.Array:
    """[r, c] -> [r * times, c], each row repeated ``times`` times in a row (broadcast + reshape)."""
    r, c = x.shape
    return jnp.broadcast_to(x[:, None, :], (r, times, c)).reshape(r * times, c)


def _repeat_cols(x: jax.Array, times: int) -> jax.Array:
    """[r, c] -> [r, c * times], each column repeated ``times`` times in a row."""
    r, c = x.shape
    return jnp.broadcast_to(x[:, :, None], (r, c, times)).reshape(r, c * times)


def _awq_shifts(block_n: int) -> jax.Array:
    """int32 [bn]: bit offset of column j's nibble in its packed word (4 * its AWQ slot).

    Built from iota and ``AWQ_ORDER`` (Python ints): a kernel may not capture array constants.
    """
    col = jnp.arange(block_n, dtype=jnp.int32) % AWQ_PACK
    shift = jnp.zeros((block_n,), jnp.int32)
    for slot, column in enumerate(AWQ_ORDER):
        shift = jnp.where(col == column, 4 * slot, shift)
    return shift


def _awq_nibbles(words: jax.Array, shifts: jax.Array) -> jax.Array:
    """Packed AWQ words int32 [r, bn/8] -> 4-bit values as float32 [r, bn]."""
    # int32 >> is arithmetic: mask after shifting so slot 7's sign bits do not leak in.
    return ((_repeat_cols(words, AWQ_PACK) >> shifts[None, :]) & NIBBLE_MASK).astype(jnp.float32)


def _weight_tile(
    fmt: str | None,
    w_refs: tuple,
    g: jax.Array,
    k0: jax.Array,
    n0: jax.Array,
    col_ok: jax.Array,
    *,
    block_k: int,
    block_n: int,
    group_size: int,
) -> jax.Array:
    """Expert g's weight rows [k0, k0 + bk), columns [n0, n0 + bn) -> [bk, bn], float32 (a plain
    weight: its own dtype).

    ``col_ok`` [bn] masks columns past N (their values are unspecified and never stored).
    """
    cols = pl.ds(n0, block_n)

    def col_mask(rows: int) -> jax.Array:  # [rows, bn]
        return jnp.broadcast_to(col_ok[None, :], (rows, block_n))

    if fmt is None:
        (w_ref,) = w_refs
        return pltriton.load(w_ref.at[g, pl.ds(k0, block_k), cols], mask=col_mask(block_k))
    if fmt == "fp8":
        codes_ref, scales_ref = w_refs
        codes = pltriton.load(codes_ref.at[g, pl.ds(k0, block_k), cols], mask=col_mask(block_k))
        scales = pltriton.load(scales_ref.at[g, cols], mask=col_ok)
        return codes.astype(jnp.float32) * scales[None, :]

    # Grouped formats: one scale row per `group_size` rows of K; a tile holds `scale_rows` of them.
    scale_rows = max(block_k // group_size, 1)
    repeats = block_k // scale_rows
    scale_index = pl.ds(k0 // group_size, scale_rows)
    if fmt == "awq":
        codes_ref, scales_ref, zeros_ref = w_refs
        words = block_n // AWQ_PACK
        word_cols = pl.ds(n0 // AWQ_PACK, words)
        word_ok = (n0 // AWQ_PACK + jnp.arange(words, dtype=jnp.int32)) < codes_ref.shape[-1]

        def word_mask(rows: int) -> jax.Array:  # [rows, bn / 8]
            return jnp.broadcast_to(word_ok[None, :], (rows, words))

        shifts = _awq_shifts(block_n)
        q_words = pltriton.load(
            codes_ref.at[g, pl.ds(k0, block_k), word_cols], mask=word_mask(block_k)
        )
        zero_words = pltriton.load(
            zeros_ref.at[g, scale_index, word_cols], mask=word_mask(scale_rows)
        )
        q, zero = _awq_nibbles(q_words, shifts), _awq_nibbles(zero_words, shifts)
        scale = pltriton.load(scales_ref.at[g, scale_index, cols], mask=col_mask(scale_rows))
        return (q - _repeat_rows(zero, repeats)) * _repeat_rows(scale.astype(jnp.float32), repeats)

    # nvfp4 / mxfp4: byte [k, n] holds K rows 2k (low nibble) and 2k + 1 (high nibble).
    codes_ref, scales_ref, *tensor_scale_ref = w_refs
    packed = pltriton.load(
        codes_ref.at[g, pl.ds(k0 // 2, block_k // 2), cols], mask=col_mask(block_k // 2)
    )
    nibble_shift = 4 * (jnp.arange(block_k, dtype=jnp.int32) % 2)  # [bk]: odd rows: high nibble
    codes = (_repeat_rows(packed.astype(jnp.int32), 2) >> nibble_shift[:, None]) & NIBBLE_MASK
    scale_codes = pltriton.load(scales_ref.at[g, scale_index, cols], mask=col_mask(scale_rows))
    if fmt == "nvfp4":
        unit = scale_codes.astype(jnp.float32) * tensor_scale_ref[0][g]
    else:
        unit = e8m0_decode(scale_codes)
    return e2m1_decode(codes) * _repeat_rows(unit, repeats)


def _kernel(
    row_tile_ref,
    group_ref,
    lo_ref,
    hi_ref,
    write_hi_ref,
    lhs_ref,
    *refs,
    fmt: str | None,
    group_size: int,
    block_m: int,
    block_n: int,
    block_k: int,
    has_bias: bool,
    has_row_scale: bool,
):
    """One (visit, N tile): out[rows, cols] = (lhs[rows, :] @ dequant(W[group])[:, cols]
    (+ bias[group, cols])) (* row_scale[rows])."""
    *w_refs, out_ref = refs
    scale_ref = w_refs.pop() if has_row_scale else None
    bias_ref = w_refs.pop() if has_bias else None
    k = lhs_ref.shape[1]
    n = out_ref.shape[1]
    visit = pl.program_id(0)
    g = group_ref[visit]
    lo, hi, write_hi = lo_ref[visit], hi_ref[visit], write_hi_ref[visit]
    row0 = pl.multiple_of(row_tile_ref[visit] * block_m, block_m)
    n0 = pl.multiple_of(pl.program_id(1) * block_n, block_n)
    rows = row0 + jnp.arange(block_m, dtype=jnp.int32)  # [bm]
    col_ok = n0 + jnp.arange(block_n, dtype=jnp.int32) < n  # [bn]
    # Rows of the tile before lo (another group's) are multiplied but never stored; rows from hi
    # on are loaded as zeros, so those in [hi, write_hi) store zeros.
    lhs_mask = jnp.broadcast_to((rows < hi)[:, None], (block_m, block_k))
    precision = jax.lax.Precision.HIGHEST if lhs_ref.dtype == jnp.float32 else None

    def k_step(i, acc):
        k0 = pl.multiple_of(i * block_k, block_k)
        x = pltriton.load(
            lhs_ref.at[pl.ds(row0, block_m), pl.ds(k0, block_k)], mask=lhs_mask, other=0
        )
        w = _weight_tile(
            fmt,
            tuple(w_refs),
            g,
            k0,
            n0,
            col_ok,
            block_k=block_k,
            block_n=block_n,
            group_size=group_size,
        )
        return acc + pltriton.dot(x, w.astype(x.dtype), precision=precision)

    # A visit with no rows to multiply (zero-fill or padding) skips the K loop. Both branches are
    # int32 arrays: with Python ints, Pallas' Triton lowering gives the constants the predicate's
    # i1 type and the loop bound no longer matches the loop variable (an invalid scf.for).
    num_k_steps = jnp.where(hi > lo, jnp.int32(k // block_k), jnp.int32(0))
    acc = jax.lax.fori_loop(0, num_k_steps, k_step, jnp.zeros((block_m, block_n), jnp.float32))
    if bias_ref is not None:  # the group's rows only: rows from hi on store zeros
        bias = pltriton.load(bias_ref.at[g, pl.ds(n0, block_n)], mask=col_ok, other=0)
        acc = acc + jnp.where((rows < hi)[:, None], bias.astype(jnp.float32)[None, :], 0.0)
    if scale_ref is not None:  # the router weight of each routed row, in the epilogue
        row_scale = pltriton.load(scale_ref.at[pl.ds(row0, block_m)], mask=rows < hi, other=0)
        acc = acc * row_scale.astype(jnp.float32)[:, None]
    store_mask = ((rows >= lo) & (rows < write_hi))[:, None] & col_ok[None, :]
    pltriton.store(
        out_ref.at[pl.ds(row0, block_m), pl.ds(n0, block_n)],
        acc.astype(out_ref.dtype),
        mask=store_mask,
    )


def _weight_operands(rhs: jax.Array | QTensor) -> tuple[str | None, int, tuple[jax.Array, ...]]:
    """rhs -> (format or None for a plain array, K rows per scale, storage arrays in kernel order)."""
    if not isinstance(rhs, QTensor):
        return None, rhs.shape[1], (rhs,)
    if rhs.fmt == "awq":
        return rhs.fmt, rhs.group_size, (rhs.codes, rhs.scales, rhs.zeros)
    if rhs.fmt == "nvfp4":
        return rhs.fmt, rhs.group_size, (rhs.codes, rhs.scales, rhs.tensor_scale)
    return rhs.fmt, rhs.group_size, (rhs.codes, rhs.scales)


def _validate(
    lhs: jax.Array,
    rhs: jax.Array | QTensor,
    group_sizes: jax.Array,
    blocks: dict[str, int],
    bias: jax.Array | None = None,
) -> None:
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be [M, K]; got shape {lhs.shape}")
    if not jnp.issubdtype(lhs.dtype, jnp.floating):
        raise ValueError(f"lhs must be floating point; got dtype {lhs.dtype}")
    rhs_shape = tuple(rhs.shape)
    if len(rhs_shape) != 3:
        raise ValueError(f"rhs must be [G, K, N] (plain array or QTensor); got shape {rhs_shape}")
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(
            f"group_sizes must be a 1-D integer array [G]; got {group_sizes.dtype}"
            f"{list(group_sizes.shape)}"
        )
    num_groups, k, _ = rhs_shape
    if group_sizes.shape[0] != num_groups:
        raise ValueError(
            f"group_sizes has {group_sizes.shape[0]} groups; rhs {rhs_shape} has {num_groups}"
        )
    if lhs.shape[1] != k:
        raise ValueError(f"K mismatch: lhs {lhs.shape} has K={lhs.shape[1]}, rhs {rhs_shape} K={k}")
    for name, size in blocks.items():
        if size < MIN_BLOCK or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= {MIN_BLOCK}; got {size}")
    if k % blocks["block_k"]:
        raise ValueError(f"K={k} is not a multiple of block_k={blocks['block_k']}")
    if isinstance(rhs, QTensor) and rhs.fmt != "fp8" and k % rhs.group_size:
        raise ValueError(f"K={k} is not a multiple of the {rhs.fmt} group size {rhs.group_size}")
    if bias is not None and (
        bias.shape != (num_groups, rhs_shape[2]) or not jnp.issubdtype(bias.dtype, jnp.floating)
    ):
        raise ValueError(
            f"bias must be float[{num_groups}, {rhs_shape[2]}] (one row per group); got "
            f"{bias.dtype}{list(bias.shape)}"
        )


_STATIC = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "interpret")


def fitting_block_k(k: int, largest: int = 128) -> int:
    """The largest power-of-two block_k <= ``largest`` that divides K (at least MIN_BLOCK), e.g.
    64 for SmolLM2's hidden width 576."""
    return max(MIN_BLOCK, min(largest, k & -k))


@functools.partial(jax.jit, static_argnames=_STATIC)
def grouped_experts(
    lhs: jax.Array,
    rhs: jax.Array | QTensor,
    group_sizes: jax.Array,
    bias: jax.Array | None = None,
    row_scale: jax.Array | None = None,
    *,
    block_m: int = 16,
    block_n: int = 128,
    block_k: int = 128,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> jax.Array:
    """``jax.lax.ragged_dot(lhs, dequantize(rhs), group_sizes)`` (+ each row's group's bias)
    (x ``row_scale``) with in-kernel dequantization.

    ``row_scale`` float [M]: each row's factor (an MoE's router weight of the routed row),
    applied to the float32 accumulator in the epilogue, after the bias, before the rounding.

    lhs [M, K] (rows sorted by group), rhs [G, K, N] plain array or QTensor of shape (G, K, N),
    group_sizes int [G] (non-negative; rows past M are ignored), bias float [G, N] or None ->
    [M, N] in lhs.dtype. The bias is added in float32 before the output's rounding. Rows past
    sum(group_sizes) are zero. K must be a multiple of block_k; N need not be a multiple of
    block_n. Blocks are powers of two >= 16. ``interpret=True`` runs the kernel on CPU.
    """
    blocks = dict(block_m=block_m, block_n=block_n, block_k=block_k)
    _validate(lhs, rhs, group_sizes, blocks, bias)
    num_rows = lhs.shape[0]
    if row_scale is not None and row_scale.shape != (num_rows,):
        raise ValueError(f"row_scale must be [{num_rows}] (one per row); got {row_scale.shape}")
    n = rhs.shape[2]
    if num_rows == 0:
        return jnp.zeros((0, n), lhs.dtype)
    fmt, group_size, weights = _weight_operands(rhs)
    schedule = _tile_schedule(group_sizes, num_rows, block_m)
    kernel = functools.partial(
        _kernel,
        fmt=fmt,
        group_size=group_size,
        has_bias=bias is not None,
        has_row_scale=row_scale is not None,
        **blocks,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows, n), lhs.dtype),
        grid=(schedule.row_tile.shape[0], pl.cdiv(n, block_n)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"grouped_experts_{fmt or 'plain'}"
        + ("_bias" if bias is not None else "")
        + ("_scaled" if row_scale is not None else ""),
    )(
        *schedule,
        lhs,
        *weights,
        *(() if bias is None else (bias,)),
        *(() if row_scale is None else (row_scale.astype(jnp.float32),)),
    )


@functools.partial(jax.jit, static_argnames=_STATIC)
def quantized_matmul(
    x: jax.Array,
    w: jax.Array | QTensor,
    *,
    block_m: int = 16,
    block_n: int = 128,
    block_k: int = 128,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> jax.Array:
    """x [..., K] @ w [K, N] (plain array or QTensor) -> [..., N] in x.dtype.

    The dense models' (4-bit) matmul: ``grouped_experts`` with a single group holding every row.
    """
    if len(w.shape) != 2:
        raise ValueError(f"w must be [K, N] (plain array or QTensor); got shape {tuple(w.shape)}")
    if x.ndim < 1:
        raise ValueError("x must be [..., K]; got a scalar")
    if isinstance(w, QTensor):
        # One expert: storage arrays get a leading axis of 1 (free reshapes), metadata follows.
        stacked = jax.tree_util.tree_map(lambda a: a[None], w)
        w = dataclasses.replace(stacked, shape=(1, *w.shape))
    else:
        w = w[None]
    rows = x.reshape(-1, x.shape[-1])
    group_sizes = jnp.full((1,), rows.shape[0], jnp.int32)
    out = grouped_experts(
        rows,
        w,
        group_sizes,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
    )
    return out.reshape(*x.shape[:-1], w.shape[2])


@jax.jit
def grouped_experts_reference(
    lhs: jax.Array,
    rhs: jax.Array | QTensor,
    group_sizes: jax.Array,
    bias: jax.Array | None = None,
    row_scale: jax.Array | None = None,
) -> jax.Array:
    """XLA oracle: ``ragged_dot`` on the dequantized weight cast to lhs.dtype (the kernel's MMA
    operands), float32 accumulation, plus each grouped row's bias in float32, times each row's
    ``row_scale`` in float32, output in lhs.dtype."""
    if bias is not None and bias.shape != (rhs.shape[0], rhs.shape[2]):
        raise ValueError(f"bias must be [{rhs.shape[0]}, {rhs.shape[2]}]; got {bias.shape}")
    w = dequantize(rhs) if isinstance(rhs, QTensor) else rhs
    out = jax.lax.ragged_dot(
        lhs, w.astype(lhs.dtype), group_sizes, preferred_element_type=jnp.float32
    )
    if bias is not None:
        ends = jnp.cumsum(group_sizes)  # [G]
        row = jnp.arange(lhs.shape[0])
        group = jnp.searchsorted(ends, row, side="right")  # [M]; G past the grouped rows
        row_bias = bias.astype(jnp.float32)[jnp.minimum(group, bias.shape[0] - 1)]
        out = out + jnp.where((group < bias.shape[0])[:, None], row_bias, 0.0)
    if row_scale is not None:
        out = out * row_scale.astype(jnp.float32)[:, None]
    return out.astype(lhs.dtype)
