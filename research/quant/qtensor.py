"""Quantized weight matrices: ``QTensor`` plus reference ``quantize`` / ``dequantize``.

A weight is laid out [I, O] (the model computes x @ W), optionally with stacked experts in front,
[X, I, O]; each expert is quantized on its own. Groups (blocks) of ``group_size`` consecutive input
channels share a scale, separately for every output column, in every format:

- ``awq``: int4 W4A16. Per (group of 128 by default, column) an fp16 scale s and an int4 zero point z,
  asymmetric min-max: s = (max - min) / 15, z = round(-min / s), q = clamp(round(w / s) + z, 0, 15),
  w ≈ (q - z) * s, with [min, max] widened to include 0 and s rounded to fp16 (>= 2^-14) before
  q and z are computed. q and z are packed 8 per int32 along O in AutoAWQ's GEMM order.
- ``nvfp4``: E2M1 elements, blocks of 16, an E4M3 scale per block and one float32 scale per tensor
  (per expert), NVIDIA's recipe: g = amax / (448 * 6), block scale b = e4m3(block_amax / 6 / g),
  element = e2m1(w / (b * g)); w ≈ element * b * g.
- ``mxfp4`` (OCP Microscaling): E2M1 elements, blocks of 32, an E8M0 shared scale 2^e with
  e = floor(log2(block_amax)) - 2 (E2M1's largest exponent is 2); element = e2m1(w / 2^e),
  saturating at ±6 (block values in [6, 8) * 2^e clip to 6 * 2^e).
- ``fp8``: float8_e4m3fn elements and a float32 scale per output column: s = amax / 448.

Storage (P = O / 8 packed words; "-" = None):

fmt    codes                      scales                        zeros                  tensor_scale
awq    int32 [..., I, P]          float16 [..., I/128, O]       int32 [..., I/128, P]  -
nvfp4  uint8 [..., I/2, O]        float8_e4m3fn [..., I/16, O]  -                      float32 [...]
mxfp4  uint8 [..., I/2, O]        uint8 E8M0 [..., I/32, O]     -                      -
fp8    float8_e4m3fn [..., I, O]  float32 [..., O]              -                      -

4-bit codes are packed along I: byte [k, n] holds input channels 2k (low nibble) and 2k+1 (high).

Axis legend: X = stacked experts (optional), I = input channels, O = output channels,
G = groups along I, S = group size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from research.quant.formats import (
    AWQ_PACK,
    E2M1_MAX,
    E4M3_MAX,
    awq_pack,
    awq_unpack,
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    e8m0_encode,
    pack_nibbles,
    unpack_nibbles,
)
from research.quant.layout import FORMATS, GROUP_SIZES

AWQ_MAX_Q = 15
# Smallest normal fp16: a smaller AWQ scale would be an fp16 subnormal and lose relative precision.
FP16_MIN_NORMAL = 2.0**-14


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QTensor:
    """A quantized weight [..., I, O]: packed storage arrays (pytree children) + static metadata."""

    codes: jax.Array  # packed elements, see the module table
    scales: jax.Array  # per-group (per-column for fp8) scales in the format's own dtype
    zeros: jax.Array | None = None  # awq: packed int4 zero points, int32 [..., I/128, O/8]
    tensor_scale: jax.Array | None = None  # nvfp4: float32 per-tensor scale [...] (per expert)
    fmt: str = field(kw_only=True, metadata=dict(static=True))  # one of FORMATS
    shape: tuple[int, ...] = field(kw_only=True, metadata=dict(static=True))  # original [..., I, O]
    group_size: int = field(kw_only=True, metadata=dict(static=True))  # input channels per scale
    dtype: str = field(default="float32", kw_only=True, metadata=dict(static=True))  # original

    def __repr__(self) -> str:
        return (
            f"QTensor(fmt={self.fmt!r}, shape={self.shape}, group_size={self.group_size}, "
            f"dtype={self.dtype!r}, nbytes={self.nbytes})"
        )

    @property
    def nbytes(self) -> int:
        """Bytes of packed storage (codes, scales and zero points)."""
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(self))


def _divide(a: jax.Array | float, b: jax.Array | float) -> jax.Array:
    """a / b, correctly rounded like numpy and torch.

    XLA rewrites a division by a constant or by a broadcast into a multiplication by the
    reciprocal (up to 1 ulp off), which would move scales and codes across rounding boundaries.
    The optimization barrier hides the full-shape divisor from that rewrite.
    """
    shape = jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b))
    divisor = jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(b, jnp.float32), shape))
    return a / divisor


def _groups(w: jax.Array, group: int) -> jax.Array:
    """[..., I, O] -> [..., G, S, O]."""
    *lead, d_in, d_out = w.shape
    return w.reshape(*lead, d_in // group, group, d_out)


def _expand(per_group: jax.Array, group: int) -> jax.Array:
    """[..., G, O] -> [..., G * S, O]: one row per input channel."""
    return jnp.repeat(per_group, group, axis=-2)


@functools.partial(jax.jit, static_argnums=1)
def _quantize_awq(w: jax.Array, group: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    g = _groups(w, group)  # [..., G, S, O]
    # The range is widened to include 0 (as GPTQ does) so z lands in [0, 15] and every weight lies
    # in the representable range; groups that straddle 0 (practically all) are unaffected.
    w_min = jnp.minimum(jnp.min(g, axis=-2), 0.0)  # [..., G, O]
    w_max = jnp.maximum(jnp.max(g, axis=-2), 0.0)
    scale = jnp.maximum(_divide(w_max - w_min, AWQ_MAX_Q), FP16_MIN_NORMAL).astype(jnp.float16)
    s = scale.astype(jnp.float32)  # quantize with the scale that is stored
    zero = jnp.clip(jnp.round(_divide(-w_min, s)), 0, AWQ_MAX_Q)  # [..., G, O]
    q = jnp.clip(jnp.round(_divide(g, s[..., None, :])) + zero[..., None, :], 0, AWQ_MAX_Q)
    q = q.astype(jnp.uint8).reshape(w.shape)
    return awq_pack(q), scale, awq_pack(zero.astype(jnp.uint8))


@jax.jit
def _quantize_nvfp4(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    amax = jnp.max(jnp.abs(w), axis=(-2, -1))  # [...]
    tensor_scale = jnp.where(amax > 0, _divide(amax, E4M3_MAX * E2M1_MAX), 1.0)
    g = _groups(w, GROUP_SIZES["nvfp4"])  # [..., G, S, O]
    block_amax = jnp.max(jnp.abs(g), axis=-2)  # [..., G, O]
    # block_amax / 6 / g <= 448 up to float rounding; the clip keeps e4m3 (no inf) from NaN.
    block = _divide(_divide(block_amax, E2M1_MAX), tensor_scale[..., None, None])
    scales = jnp.minimum(block, E4M3_MAX).astype(jnp.float8_e4m3fn)
    unit = scales.astype(jnp.float32) * tensor_scale[..., None, None]  # [..., G, O]
    # A block scale that underflows e4m3 (block_amax < amax * 2^-9 / 448) zeroes its block.
    safe = jnp.where(unit > 0, unit, 1.0)[..., None, :]
    y = jnp.where(unit[..., None, :] > 0, _divide(g, safe), 0.0)
    codes = e2m1_encode(y).reshape(w.shape)
    return pack_nibbles(codes), scales, tensor_scale


@jax.jit
def _quantize_mxfp4(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    g = _groups(w, GROUP_SIZES["mxfp4"])  # [..., G, S, O]
    block_amax = jnp.max(jnp.abs(g), axis=-2)  # [..., G, O]
    # frexp: block_amax = m * 2^k with m in [0.5, 1), so floor(log2(block_amax)) = k - 1, exactly.
    _, k = jnp.frexp(block_amax)
    exponent = jnp.where(block_amax > 0, k - 1 - 2, -127)  # all-zero block: smallest scale
    scales = e8m0_encode(exponent)  # clamps to [-127, 127]
    shared = scales.astype(jnp.int32) - 127
    y = jnp.ldexp(g, -shared[..., None, :])  # exact division by a power of two
    codes = e2m1_encode(y).reshape(w.shape)  # |y| < 8; [6, 8) saturates to 6
    return pack_nibbles(codes), scales


@jax.jit
def _quantize_fp8(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    amax = jnp.max(jnp.abs(w), axis=-2)  # [..., O]
    scales = jnp.where(amax > 0, _divide(amax, E4M3_MAX), 1.0)
    # w / s may round a hair past 448; float8_e4m3fn has no inf and would turn it into NaN.
    y = jnp.clip(_divide(w, scales[..., None, :]), -E4M3_MAX, E4M3_MAX)
    return y.astype(jnp.float8_e4m3fn), scales


def quantize(w: jax.Array, fmt: str, group_size: int | None = None) -> QTensor:
    """Quantize a weight [I, O] (or stacked experts [X, I, O]) to ``fmt``; see the module doc.

    ``group_size`` may be set for ``awq`` only (AutoAWQ's ``q_group_size``: 128 by default, 64
    and 32 are common); the microscaling formats fix theirs and fp8 scales whole columns.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; expected one of {FORMATS}")
    if group_size is not None and fmt != "awq":
        raise ValueError(f"{fmt} has a fixed group size; only awq takes group_size")
    if group_size is not None and (group_size < 8 or group_size & (group_size - 1)):
        raise ValueError(f"awq group_size must be a power of two >= 8, got {group_size}")
    w = jnp.asarray(w)
    if w.ndim not in (2, 3):
        raise ValueError(
            f"{fmt} quantizes a weight [in, out] or stacked experts [X, in, out]; "
            f"got shape {w.shape} (rank {w.ndim})"
        )
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"{fmt} quantizes floating-point weights; got dtype {w.dtype}")
    d_in, d_out = w.shape[-2:]
    group = group_size or GROUP_SIZES.get(fmt, d_in)
    if d_in == 0 or d_in % group:
        raise ValueError(
            f"{fmt} groups {group} input channels per scale; the input dim (axis {w.ndim - 2} of "
            f"shape {w.shape}) is {d_in}, not a positive multiple of {group}"
        )
    if fmt == "awq" and d_out % AWQ_PACK:
        raise ValueError(
            f"awq packs {AWQ_PACK} output columns per int32; the output dim (last axis of shape "
            f"{w.shape}) is {d_out}, not a multiple of {AWQ_PACK}"
        )
    meta = dict(fmt=fmt, shape=tuple(w.shape), group_size=group, dtype=str(w.dtype))
    w32 = w.astype(jnp.float32)
    if fmt == "awq":
        codes, scales, zeros = _quantize_awq(w32, group)
        return QTensor(codes, scales, zeros=zeros, **meta)
    if fmt == "nvfp4":
        codes, scales, tensor_scale = _quantize_nvfp4(w32)
        return QTensor(codes, scales, tensor_scale=tensor_scale, **meta)
    if fmt == "mxfp4":
        codes, scales = _quantize_mxfp4(w32)
        return QTensor(codes, scales, **meta)
    codes, scales = _quantize_fp8(w32)
    return QTensor(codes, scales, **meta)


@jax.jit
def dequantize(qt: QTensor) -> jax.Array:
    """QTensor -> float32 weight of shape ``qt.shape`` (cast to ``qt.dtype`` yourself if wanted).

    Jitted: the format and shapes are static pytree metadata, so each (fmt, shape) compiles once.
    """
    group = qt.group_size
    if qt.fmt == "awq":
        q = awq_unpack(qt.codes).astype(jnp.float32)  # [..., I, O]
        zero = _expand(awq_unpack(qt.zeros).astype(jnp.float32), group)
        scale = _expand(qt.scales.astype(jnp.float32), group)
        w = (q - zero) * scale
    elif qt.fmt == "nvfp4":
        elements = e2m1_decode(unpack_nibbles(qt.codes))
        unit = qt.scales.astype(jnp.float32) * qt.tensor_scale[..., None, None]  # [..., G, O]
        w = elements * _expand(unit, group)
    elif qt.fmt == "mxfp4":
        elements = e2m1_decode(unpack_nibbles(qt.codes))
        w = elements * _expand(e8m0_decode(qt.scales), group)
    elif qt.fmt == "fp8":
        w = qt.codes.astype(jnp.float32) * qt.scales[..., None, :]
    else:
        raise ValueError(f"unknown quantization format {qt.fmt!r}; expected one of {FORMATS}")
    if w.shape != qt.shape:
        raise ValueError(f"{qt.fmt} storage decodes to shape {w.shape}; QTensor says {qt.shape}")
    return w
