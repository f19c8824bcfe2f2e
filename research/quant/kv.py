"""KV-cache quantization: FP8 E4M3 and symmetric int4 codes with one float32 scale per vector.

Every K or V vector (one token of one kv head, the last axis, E = head_dim) gets its own scale,
so a page of codes [..., S, E] comes with scales [..., S]. That is the per-token scale layout of
JAX's Pallas paged-attention kernel: pages [K, P, S, E], scales [K, P, S].

kv_dtype  codes                          scale s (1.0 where amax == 0)   element ≈
auto      the model dtype [..., E]       - (stored unquantized)          code
fp8       float8_e4m3fn [..., E]         float32 amax / 448              code * s
int4      uint8 [..., E/2] (split-half)  float32 amax / 7                q * s, q in [-8, 7]

fp8 codes are x / s clipped to ±448 and rounded to E4M3 by ``astype``; int4 codes are
q = clip(round(x / s), -8, 7) (|x / s| <= 7, so -8 never occurs; it still decodes).

int4 "split-half" packing: byte j holds element j in the low nibble and element j + E/2 in the
high nibble, each as a 4-bit two's-complement nibble (q & 0xF). A kernel then gets the two halves
of a tile with a mask and a shift and never interleaves: q·k = q[:E/2]·lo + q[E/2:]·hi, and p @ v
is two half-width dots whose results are the two halves of the output.

Like ``research.quant.formats``, the decoders are plain shifts, masks and compares, so a Pallas
kernel calls ``int4_unpack_halves`` on a loaded tile unchanged.

Axis legend: ... = leading axes (tokens, heads, pages), E = head_dim.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from research.quant.formats import E4M3_MAX

KV_DTYPES = ("auto", "fp8", "int4")
INT4_MAX = 7  # symmetric scale: amax maps to 7; -8 is representable but unused


def _check_kv_dtype(kv_dtype: str) -> None:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype {kv_dtype!r}; expected one of {KV_DTYPES}")


def kv_code_shape(head_dim: int, kv_dtype: str) -> tuple[int]:
    """Shape of one vector's codes: (E,), or (E/2,) for int4 (two elements per byte)."""
    _check_kv_dtype(kv_dtype)
    if kv_dtype != "int4":
        return (head_dim,)
    if head_dim % 2:
        raise ValueError(f"int4 KV packs two elements per byte; head_dim {head_dim} is odd")
    return (head_dim // 2,)


def kv_code_dtype(kv_dtype: str, model_dtype: Any) -> jnp.dtype:
    """Storage dtype of the codes; ``"auto"`` stores K/V unquantized in ``model_dtype``."""
    _check_kv_dtype(kv_dtype)
    return jnp.dtype({"auto": model_dtype, "fp8": jnp.float8_e4m3fn, "int4": jnp.uint8}[kv_dtype])


def kv_dtype_of(codes_dtype: Any) -> str:
    """The kv_dtype that stores codes of ``codes_dtype``: fp8, int4, or auto for plain floats."""
    dtype = jnp.dtype(codes_dtype)
    if dtype == jnp.float8_e4m3fn:
        return "fp8"
    if dtype == jnp.uint8:
        return "int4"
    if jnp.issubdtype(dtype, jnp.floating):
        return "auto"
    raise ValueError(f"no kv_dtype stores codes of dtype {dtype}")


def _scale(x: jax.Array, code_max: float) -> jax.Array:
    amax = jnp.max(jnp.abs(x), axis=-1)
    return jnp.where(amax > 0, amax / code_max, 1.0)


def quantize_kv(x: jax.Array, kv_dtype: str) -> tuple[jax.Array, jax.Array]:
    """K or V vectors [..., E] -> (codes, float32 scales [...]) in ``kv_dtype`` (fp8 or int4)."""
    _check_kv_dtype(kv_dtype)
    if kv_dtype == "auto":
        raise ValueError('kv_dtype "auto" stores K/V unquantized; there are no codes to make')
    x = jnp.asarray(x, jnp.float32)
    if kv_dtype == "fp8":
        scale = _scale(x, E4M3_MAX)
        codes = jnp.clip(x / scale[..., None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
        return codes, scale
    kv_code_shape(x.shape[-1], kv_dtype)  # validates an even head_dim
    scale = _scale(x, INT4_MAX)
    q = jnp.clip(jnp.round(x / scale[..., None]), -8, INT4_MAX).astype(jnp.int32)
    lo, hi = jnp.split(q, 2, axis=-1)
    return ((lo & 0xF) | ((hi & 0xF) << 4)).astype(jnp.uint8), scale


def int4_unpack_halves(codes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Split-half int4 codes uint8 [..., E/2] -> the signed halves (int32 [..., E/2] each):
    elements [:E/2] from the low nibbles, [E/2:] from the high ones."""
    c = codes.astype(jnp.int32)

    def signed(nibble: jax.Array) -> jax.Array:  # 4-bit two's complement: 8..15 -> -8..-1
        return nibble - ((nibble & 8) << 1)

    return signed(c & 0xF), signed((c >> 4) & 0xF)


def dequantize_kv(codes: jax.Array, scales: jax.Array, kv_dtype: str) -> jax.Array:
    """(codes, scales [...]) in ``kv_dtype`` (fp8 or int4) -> float32 [..., E]."""
    _check_kv_dtype(kv_dtype)
    if kv_dtype == "auto":
        raise ValueError('kv_dtype "auto" stores K/V unquantized; there is nothing to decode')
    scales = jnp.asarray(scales, jnp.float32)[..., None]
    if kv_dtype == "fp8":
        return codes.astype(jnp.float32) * scales
    lo, hi = int4_unpack_halves(codes)
    return jnp.concatenate([lo, hi], axis=-1).astype(jnp.float32) * scales
