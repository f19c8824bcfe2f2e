"""Element codecs and bit packing for 4-bit and 8-bit weight formats, in plain jax.numpy.

Everything here is shifts, masks, compares and bitcasts on integer codes, so a Pallas kernel can
call the decoders on a loaded tile unchanged. ``ml_dtypes`` is the oracle the tests compare with.

Codes:
- E2M1 (FP4, the element of NVFP4 and MXFP4): 4 bits, sign bit 3, exponent bits 2..1 (bias 1),
  mantissa bit 0. Magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 for codes 0..7; code 8 is -0. No inf/NaN.
  Held one code per uint8 (the value in the low nibble), two per byte once packed.
- E8M0 (the MX block scale): a uint8 biased exponent, value 2^(code - 127); code 255 is NaN.
- E4M3 (FP8, ``float8_e4m3fn``): converted with ``astype``; max finite 448, no inf.
- AWQ int4: 8 nibbles per int32 in AutoAWQ's GEMM order (``AWQ_ORDER``).

Axis legend: I = input channels (the reduction axis of x @ W), O = output channels,
P = packed 32-bit words along O (O / 8). Leading axes (e.g. stacked experts) pass through.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from research.quant.layout import AWQ_PACK

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127  # code 255 is NaN

# Slot i (bits 4i..4i+3) of a packed int32 holds column AWQ_ORDER[i] of its group of 8 columns.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

# E2M1 round-to-nearest: magnitude codes are monotone in value, so the code of |x| is the number of
# midpoints between neighbouring grid values that |x| passes. At a tie the even code wins (ties to
# even, as ml_dtypes rounds): ``>`` where the lower neighbour has the even code, ``>=`` where the
# upper one does. Past the last midpoint (5) everything saturates to 6, including inf.
_E2M1_MIDPOINTS = (  # (midpoint, True if a tie rounds up)
    (0.25, False),  # 0 | 0.5
    (0.75, True),  # 0.5 | 1
    (1.25, False),  # 1 | 1.5
    (1.75, True),  # 1.5 | 2
    (2.5, False),  # 2 | 3
    (3.5, True),  # 3 | 4
    (5.0, False),  # 4 | 6
)


def e2m1_encode(x: jax.Array) -> jax.Array:
    """Floats -> E2M1 codes (uint8, 0..15): round to nearest, ties to even, saturate at ±6.

    The sign bit is copied from ``x`` (so -0.1 encodes as -0, code 8, as ml_dtypes does). NaN has
    no E2M1 code; it encodes as a signed zero.
    """
    x = jnp.asarray(x, jnp.float32)
    mag = jnp.abs(x)
    code = jnp.zeros(x.shape, jnp.uint8)
    for midpoint, tie_up in _E2M1_MIDPOINTS:
        passed = mag >= midpoint if tie_up else mag > midpoint
        code = code + passed.astype(jnp.uint8)
    return code | (jnp.signbit(x).astype(jnp.uint8) << 3)


def e2m1_decode(codes: jax.Array) -> jax.Array:
    """E2M1 codes (any integer dtype; only the low nibble is read) -> float32.

    Builds the float32 bit pattern directly: a normal code (exponent e > 0) is 2^(e-1) * 1.m, i.e.
    float32 exponent field e + 126 and mantissa top bit m; the subnormal codes (e = 0) are 0 and
    0.5 (bits 0x3F000000).
    """
    c = jnp.asarray(codes).astype(jnp.uint32)
    sign = (c >> 3) & 1
    exponent = (c >> 1) & 3
    mantissa = c & 1
    normal = ((exponent + 126) << 23) | (mantissa << 22)
    subnormal = mantissa * 0x3F000000
    bits = jnp.where(exponent == 0, subnormal, normal) | (sign << 31)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def e8m0_encode(exponent: jax.Array) -> jax.Array:
    """Power-of-two exponents (integers) -> E8M0 codes (uint8), clamped to [-127, 127]."""
    e = jnp.clip(jnp.asarray(exponent).astype(jnp.int32), E8M0_MIN_EXP, E8M0_MAX_EXP)
    return (e + E8M0_BIAS).astype(jnp.uint8)


def e8m0_decode(codes: jax.Array) -> jax.Array:
    """E8M0 codes (uint8) -> float32 2^(code - 127); code 255 -> NaN.

    Code c > 0 is the float32 with exponent field c and zero mantissa. Code 0 (2^-127) is a float32
    subnormal (bits 0x00400000); XLA:CPU flushes subnormals in arithmetic, so it then acts as 0.
    """
    c = jnp.asarray(codes).astype(jnp.uint32)
    bits = jnp.where(c == 0, 0x00400000, c << 23)
    bits = jnp.where(c == 255, 0x7FC00000, bits)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """4-bit codes [..., I, O] -> uint8 [..., I/2, O], two codes per byte along the input axis.

    byte [k, n] = codes[2k, n] | codes[2k+1, n] << 4: the low nibble holds the even input channel.
    """
    *lead, d_in, d_out = codes.shape
    if d_in % 2:
        raise ValueError(f"nibble packing needs an even input dim; got shape {codes.shape}")
    pairs = codes.astype(jnp.uint8).reshape(*lead, d_in // 2, 2, d_out)
    return (pairs[..., 0, :] & 0xF) | ((pairs[..., 1, :] & 0xF) << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """uint8 [..., I/2, O] -> 4-bit codes uint8 [..., I, O] (inverse of ``pack_nibbles``)."""
    *lead, half, d_out = packed.shape
    low = packed & 0xF
    high = (packed >> 4) & 0xF
    return jnp.stack([low, high], axis=-2).reshape(*lead, 2 * half, d_out)


def awq_pack(q: jax.Array) -> jax.Array:
    """uint4 values [..., I, O] (any integer dtype, 0..15) -> int32 [..., I, O/8] in AWQ GEMM order.

    Nibble slot i of each int32 holds column ``AWQ_ORDER[i]`` of its group of 8 columns
    (AutoAWQ's ``qweight[:, col] |= intweight[:, 8 * col + order[i]] << 4 * i``).
    """
    *lead, d_in, d_out = q.shape
    if d_out % AWQ_PACK:
        raise ValueError(f"AWQ packs 8 output columns per int32; got shape {q.shape}")
    cols = q.astype(jnp.uint32).reshape(*lead, d_in, d_out // AWQ_PACK, AWQ_PACK)
    slots = cols[..., list(AWQ_ORDER)] & 0xF  # [..., I, P, 8] in slot order
    shifts = jnp.arange(AWQ_PACK, dtype=jnp.uint32) * 4
    # The nibbles occupy disjoint bits, so the sum is their bitwise OR.
    words = jnp.sum(slots << shifts, axis=-1, dtype=jnp.uint32)
    return jax.lax.bitcast_convert_type(words, jnp.int32)


def awq_unpack(packed: jax.Array) -> jax.Array:
    """int32 [..., I, O/8] in AWQ GEMM order -> uint4 values as uint8 [..., I, O]."""
    *lead, d_in, words = packed.shape
    shifts = jnp.arange(AWQ_PACK, dtype=jnp.int32) * 4
    # int32 >> is arithmetic: mask after shifting so the sign bits of slot 7 do not leak in.
    slots = (packed[..., None] >> shifts) & 0xF  # [..., I, P, 8] in slot order
    inverse = np.argsort(AWQ_ORDER)  # column j sits in slot inverse[j]
    cols = slots[..., list(inverse)]
    return cols.reshape(*lead, d_in, words * AWQ_PACK).astype(jnp.uint8)
