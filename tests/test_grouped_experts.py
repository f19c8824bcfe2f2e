"""Grouped-experts Pallas kernel (interpreted on CPU, compiled on a GPU) against ``ragged_dot`` on
dequantized weights (plus a per-group bias), gpt-oss's MXFP4 checkpoint layout, its tile
schedule, the dense ``quantized_matmul``, input validation and the GPU (Triton) lowering.

Tolerances: the kernel decodes each weight tile with the same float32 operations as
``research.quant.dequantize``, so kernel and reference multiply identical operands and differ only
in summation order. float32: max |kernel - reference| <= 1e-5 * max |reference| (observed ~5e-7).
bfloat16: the outputs are rounded to bfloat16, so a summation-order difference can flip the last
bit: |kernel - reference| <= 2^-7 * |reference| + 1e-3 * max |reference| elementwise.

Axis legend: M = routed rows, K = input channels, N = output channels, G = groups (experts).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.experimental import pallas as pl

from pallas_kernels.grouped_experts import (
    _tile_schedule,
    grouped_experts,
    grouped_experts_reference,
    quantized_matmul,
)
from research.quant import FORMATS, QTensor, dequantize, quantize

# Interpreted on CPU; compiled on a GPU (``python -m pallas_kernels.gpu_check`` runs this file there).
INTERPRET = jax.default_backend() != "gpu"
M, K, N, G = 48, 256, 96, 6  # N = 1.5 block_n: the last N tile is partial
BLOCKS = dict(block_m=16, block_n=64, block_k=64)  # 3 row tiles, 4 K steps
kernel = functools.partial(grouped_experts, **BLOCKS, interpret=INTERPRET)

# All share (M, G), so each rhs kind compiles once. Sums below M leave trailing rows (must be 0).
GROUP_SIZES = {
    # empty groups first and in the middle, sizes not multiples of block_m, group 2 spans two
    # row tiles, group 5 straddles a tile boundary, rows 35..47 trailing
    "mixed": [0, 5, 20, 0, 3, 7],
    "one_group": [0, 0, M, 0, 0, 0],  # all rows in one group spanning every row tile
    "tile_aligned": [16, 0, 16, 16, 0, 0],  # boundaries on tile edges
    # every tile straddles two or three groups: 8 visits, exactly the bound cdiv(M, bm) + G - 1
    "straddling": [9, 9, 9, 9, 9, 3],
    "trailing_tiles": [3, 0, 0, 0, 0, 2],  # row tiles 1 and 2 hold no group: zero-fill visits
    "all_empty": [0] * G,
}
# Rhs kinds: a plain array (float32 or bfloat16) or a QTensor; lhs dtype for each.
RHS_KINDS = {
    "float32": ("float32", jnp.float32),
    "bfloat16": ("bfloat16", jnp.bfloat16),
    **{fmt: (fmt, jnp.float32) for fmt in FORMATS},
    "nvfp4-bf16-lhs": ("nvfp4", jnp.bfloat16),
    "awq-bf16-lhs": ("awq", jnp.bfloat16),
}
# Target of the Triton custom call: jaxlib <= 0.10.2 hands XLA the Triton IR, newer jaxlib the
# compiled kernel (pallas_call_registration.py).
TRITON_CALL_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")


def _normal(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@functools.cache
def _rhs(kind: str) -> jax.Array | QTensor:
    w = jnp.asarray(_normal(1, (G, K, N)))
    fmt, _ = RHS_KINDS[kind]
    return quantize(w, fmt) if fmt in FORMATS else w.astype(fmt)


def _lhs(dtype) -> jax.Array:
    return jnp.asarray(_normal(0, (M, K)), dtype)


def _check(out: jax.Array, ref: jax.Array) -> None:
    """Kernel output vs reference with the tolerances of the module doc."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    o, r = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(o))
    scale = max(float(np.max(np.abs(r))), 1.0)
    if out.dtype == jnp.float32:
        np.testing.assert_allclose(o, r, rtol=0, atol=1e-5 * scale)
    else:
        np.testing.assert_allclose(o, r, rtol=2**-7, atol=1e-3 * scale)


@pytest.mark.parametrize("case", GROUP_SIZES)
@pytest.mark.parametrize("kind", RHS_KINDS)
def test_kernel_matches_reference(kind: str, case: str):
    lhs, rhs = _lhs(RHS_KINDS[kind][1]), _rhs(kind)
    group_sizes = jnp.asarray(GROUP_SIZES[case], jnp.int32)
    out = kernel(lhs, rhs, group_sizes)
    _check(out, grouped_experts_reference(lhs, rhs, group_sizes))
    total = sum(GROUP_SIZES[case])
    np.testing.assert_array_equal(np.asarray(out[total:], np.float32), 0.0)
    if total:  # the product is not trivially zero
        assert float(jnp.max(jnp.abs(out[:total]))) > 1.0


@pytest.mark.parametrize("case", GROUP_SIZES)
def test_float_rhs_matches_ragged_dot_and_numpy(case: str):
    """Plain float32 rhs: the kernel against jax.lax.ragged_dot and a per-group numpy loop."""
    lhs, rhs = _lhs(jnp.float32), _rhs("float32")
    group_sizes = jnp.asarray(GROUP_SIZES[case], jnp.int32)
    out = kernel(lhs, rhs, group_sizes)
    _check(out, jax.lax.ragged_dot(lhs, rhs, group_sizes))
    x, w = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    expected = np.zeros((M, N))
    ends = np.cumsum(GROUP_SIZES[case])
    for g, (start, end) in enumerate(zip(ends - GROUP_SIZES[case], ends, strict=True)):
        expected[start:end] = x[start:end] @ w[g]
    _check(out, jnp.asarray(expected, jnp.float32))


@pytest.mark.parametrize("case", GROUP_SIZES)
def test_tile_schedule_stores_every_row_once(case: str):
    """Each output row is stored by exactly one visit, which multiplies it by its own group."""
    sizes = np.array(GROUP_SIZES[case])
    block_m = BLOCKS["block_m"]
    schedule = jax.tree_util.tree_map(
        np.asarray,
        jax.jit(_tile_schedule, static_argnums=(1, 2))(jnp.asarray(sizes, jnp.int32), M, block_m),
    )
    assert schedule.row_tile.shape == (pl.cdiv(M, block_m) + G - 1,)
    group_of_row = np.repeat(np.arange(G), sizes)  # rows past the groups have none
    stores = np.zeros(M, int)
    for tile, g, lo, hi, write_hi in zip(*schedule, strict=True):
        assert tile * block_m <= lo <= hi <= write_hi <= min((tile + 1) * block_m, M)
        np.testing.assert_array_equal(group_of_row[lo:hi], g)
        assert write_hi == hi or hi >= len(group_of_row)  # zeros only past the grouped rows
        stores[lo:write_hi] += 1
    np.testing.assert_array_equal(stores, 1)


@pytest.mark.parametrize(
    ("fmt", "block_k"), [("awq", 128), ("awq", 256), ("nvfp4", 16), ("mxfp4", 16)]
)
def test_other_block_k(fmt: str, block_k: int):
    """block_k equal to or above the AWQ group, equal to the NVFP4 block, below the MXFP4 block
    (the other tests use 64: below the AWQ group, several NVFP4 / MXFP4 blocks per tile)."""
    lhs, rhs = _lhs(jnp.float32), _rhs(fmt)
    group_sizes = jnp.asarray(GROUP_SIZES["mixed"], jnp.int32)
    out = grouped_experts(
        lhs, rhs, group_sizes, block_m=16, block_n=32, block_k=block_k, interpret=INTERPRET
    )
    _check(out, grouped_experts_reference(lhs, rhs, group_sizes))


@pytest.mark.parametrize("fmt", [*FORMATS, "float32"])
def test_quantized_matmul(fmt: str):
    x = jnp.asarray(_normal(2, (2, 5, 128)))  # leading batch dims
    w = jnp.asarray(_normal(3, (128, 40)))  # N = 40: a partial block_n tile
    wq = quantize(w, fmt) if fmt in FORMATS else w
    out = quantized_matmul(x, wq, block_n=32, block_k=64, interpret=INTERPRET)
    dense = dequantize(wq) if fmt in FORMATS else w
    expected = jnp.einsum("abk,kn->abn", x, dense, precision=jax.lax.Precision.HIGHEST)
    _check(out, expected)


def _bias(dtype=jnp.float32) -> jax.Array:
    return jnp.asarray(_normal(4, (G, N)), dtype)


def _ragged_dot_plus_bias(lhs, rhs, group_sizes, bias) -> jax.Array:
    """ragged_dot on the dequantized weight (cast to lhs.dtype: the kernel's MMA operands), then
    each grouped row's bias in numpy; rows past the groups stay zero."""
    w = dequantize(rhs) if isinstance(rhs, QTensor) else rhs
    out = jax.lax.ragged_dot(
        lhs, w.astype(lhs.dtype), group_sizes, preferred_element_type=jnp.float32
    )
    out = np.array(out, np.float32)
    sizes = np.asarray(group_sizes)
    out[: sizes.sum()] += np.repeat(np.asarray(bias, np.float32), sizes, axis=0)
    return jnp.asarray(out).astype(lhs.dtype)


@pytest.mark.parametrize("case", ["mixed", "straddling", "trailing_tiles", "all_empty"])
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "mxfp4", "awq"])
def test_bias_matches_ragged_dot_plus_bias(kind: str, case: str):
    """Per-group bias [G, N] (gpt-oss's experts): added to each group's rows only; rows past the
    groups stay zero (a bias there would show up)."""
    lhs, rhs = _lhs(RHS_KINDS[kind][1]), _rhs(kind)
    group_sizes = jnp.asarray(GROUP_SIZES[case], jnp.int32)
    bias = _bias()
    out = kernel(lhs, rhs, group_sizes, bias)
    _check(out, _ragged_dot_plus_bias(lhs, rhs, group_sizes, bias))
    _check(out, grouped_experts_reference(lhs, rhs, group_sizes, bias))
    total = sum(GROUP_SIZES[case])
    np.testing.assert_array_equal(np.asarray(out[total:], np.float32), 0.0)


@pytest.mark.parametrize("case", ["mixed", "straddling", "trailing_tiles"])
@pytest.mark.parametrize("kind", ["bfloat16", "awq", "nvfp4"])
def test_router_weights_in_the_epilogue(kind: str, case: str):
    """``row_scale`` (each routed row's router weight) multiplies the row's float32 result
    before the rounding, after the bias: numpy's (lhs @ W + bias) * scale row by row."""
    lhs, rhs = _lhs(RHS_KINDS[kind][1]), _rhs(kind)
    sizes = GROUP_SIZES[case]
    group_sizes = jnp.asarray(sizes, jnp.int32)
    bias = _bias()
    scale = jnp.asarray(np.random.default_rng(3).uniform(0.1, 1.0, lhs.shape[0]), jnp.float32)
    out = kernel(lhs, rhs, group_sizes, bias, scale)
    unscaled = np.asarray(_ragged_dot_plus_bias(lhs, rhs, group_sizes, bias), np.float32)
    want = unscaled * np.asarray(scale)[:, None]
    assert not np.allclose(unscaled[: sum(sizes)], want[: sum(sizes)], rtol=1e-2)  # it matters
    _check(out, jnp.asarray(want).astype(out.dtype))
    _check(out, grouped_experts_reference(lhs, rhs, group_sizes, bias, scale))
    np.testing.assert_array_equal(np.asarray(out[sum(sizes) :], np.float32), 0.0)


E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _gpt_oss_mxfp4(seed: int) -> tuple[QTensor, np.ndarray]:
    """Random gpt-oss ``*_blocks`` [G, N, K/32, 16] / ``*_scales`` [G, N, K/32] through the
    checkpoint loader, and the weight [G, K, N] they encode, decoded here in numpy from the
    format's definition: byte j of a block holds elements 2j (low nibble) and 2j + 1 (high);
    E2M1 code = sign bit 3, magnitude index bits 0-2; E8M0 scale = 2^(code - 127)."""
    from research.models.gpt_oss import mxfp4_from_blocks

    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (G, N, K // 32, 16), dtype=np.uint8)
    scales = rng.integers(120, 131, (G, N, K // 32), dtype=np.uint8)
    nibbles = np.stack([blocks & 0xF, blocks >> 4], axis=-1).reshape(G, N, K)  # [G, N, K]
    values = np.asarray(E2M1_VALUES)[nibbles & 7] * np.where(nibbles & 8, -1.0, 1.0)
    values *= np.repeat(np.exp2(scales.astype(np.float64) - 127), 32, axis=-1)
    return mxfp4_from_blocks(blocks, scales, "float32"), values.transpose(0, 2, 1)


@pytest.mark.parametrize("lhs_dtype", [jnp.float32, jnp.bfloat16])
def test_gpt_oss_mxfp4_experts_with_bias(lhs_dtype):
    """gpt-oss's checkpoint layout (E2M1 codes, low nibble = even element, E8M0 scales per 32
    inputs) as the loader stores it, with a bias: the kernel against ragged_dot on the weight
    decoded independently in numpy, plus the bias."""
    rhs, dense = _gpt_oss_mxfp4(5)
    assert rhs.fmt == "mxfp4" and rhs.shape == (G, K, N)
    np.testing.assert_array_equal(np.asarray(dequantize(rhs), np.float64), dense)
    lhs, bias = _lhs(lhs_dtype), _bias()
    group_sizes = jnp.asarray(GROUP_SIZES["mixed"], jnp.int32)
    out = kernel(lhs, rhs, group_sizes, bias)
    _check(out, _ragged_dot_plus_bias(lhs, jnp.asarray(dense, jnp.float32), group_sizes, bias))


def _lowered_text(lhs, rhs, group_sizes) -> str:
    f = functools.partial(grouped_experts, **BLOCKS, interpret=False)
    return jax.jit(f).trace(lhs, rhs, group_sizes).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("kind", ["bfloat16", *FORMATS])
def test_gpu_lowering_emits_triton_call(kind: str):
    """interpret=False lowers for CUDA (no GPU needed) to one Triton custom call. This proves the
    Pallas -> Triton IR lowering, not that the IR compiles to PTX."""
    text = _lowered_text(_lhs(jnp.bfloat16), _rhs(kind), jnp.asarray(GROUP_SIZES["mixed"]))
    assert sum(text.count(target) for target in TRITON_CALL_TARGETS) == 1
    assert f"grouped_experts_{kind if kind in FORMATS else 'plain'}" in text
    if kind in FORMATS:  # the kernel gets the packed storage; no dense [G, K, N] weight exists
        assert not re.search(rf"tensor<{G}x{K}x{N}x(f32|bf16|f16)>", text)


def test_bad_inputs_raise():
    lhs, rhs = _lhs(jnp.float32), _rhs("awq")
    gs = jnp.asarray(GROUP_SIZES["mixed"], jnp.int32)
    cases = [
        ((lhs[None], rhs, gs), {}, "lhs must be"),
        ((lhs.astype(jnp.int32), rhs, gs), {}, "floating point"),
        ((lhs, _rhs("float32")[0], gs), {}, "rhs must be"),
        ((lhs[:, :128], rhs, gs), {}, "K mismatch"),
        ((lhs, rhs, gs[:-1]), {}, "groups"),
        ((lhs, rhs, gs.astype(jnp.float32)), {}, "group_sizes must be"),
        ((lhs, rhs, gs[None]), {}, "group_sizes must be"),
        ((lhs, rhs, gs), {"block_m": 8}, "block_m must be a power of two"),
        ((lhs, rhs, gs, _bias()[:, :-1]), {}, r"bias must be float\[6, 96\]"),
        ((lhs, rhs, gs, _bias().astype(jnp.int32)), {}, "bias must be float"),
        ((lhs, rhs, gs), {"block_n": 48}, "block_n must be a power of two"),
        ((lhs[:, :192], _rhs("float32")[:, :192], gs), {"block_k": 128}, "multiple of block_k"),
        # A hand-built QTensor whose K is not a whole number of AWQ groups.
        (
            (lhs[:, :192], dataclasses.replace(rhs, shape=(G, 192, N)), gs),
            {"block_k": 64},
            "group size 128",
        ),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            grouped_experts(*args, interpret=INTERPRET, **kwargs)
    with pytest.raises(ValueError, match="w must be"):
        quantized_matmul(lhs, rhs, interpret=INTERPRET)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", *FORMATS])
@settings(max_examples=6, derandomize=True, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 24), min_size=G, max_size=G).filter(lambda s: sum(s) <= M),
    seed=st.integers(0, 2**16),
    scaled=st.booleans(),
)
def test_property_generated_routings_match_reference(kind: str, sizes, seed, scaled):
    """Random routings (empty experts anywhere, groups straddling and spanning tiles, trailing
    rows) in every weight format, with and without router weights in the epilogue: the kernel
    equals its reference, and rows past the routed ones are zero."""
    lhs = jnp.asarray(np.random.default_rng(seed).standard_normal((M, K)), RHS_KINDS[kind][1])
    rhs = _rhs(kind)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    scale = None
    if scaled:
        scale = jnp.asarray(np.random.default_rng(seed + 1).uniform(0.1, 1.0, M), jnp.float32)
    out = kernel(lhs, rhs, group_sizes, None, scale)
    _check(out, grouped_experts_reference(lhs, rhs, group_sizes, None, scale))
    np.testing.assert_array_equal(np.asarray(out[sum(sizes) :], np.float32), 0.0)
