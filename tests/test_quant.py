"""Reference quantization: codecs against ml_dtypes, packing layouts, error bounds, pytrees."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from research.quant import (
    FORMATS,
    QTensor,
    awq_pack,
    awq_unpack,
    dequantize,
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    e8m0_encode,
    pack_nibbles,
    quantize,
    unpack_nibbles,
)

F4 = ml_dtypes.float4_e2m1fn
F8 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu
E2M1_GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def _normal(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32)
    w.reshape(-1)[rng.choice(w.size, 4, replace=False)] *= 10  # outliers stress the scales
    return w


def _bytes(x) -> np.ndarray:
    return np.atleast_1d(np.asarray(x)).view(np.uint8)


def _e2m1_error_bound(y: np.ndarray) -> np.ndarray:
    """Largest |y - e2m1(y)|: half the grid step where |y| <= 6 (steps 0.5 up to 2, 1 up to 4,
    2 up to 6), and the saturation distance |y| - 6 beyond."""
    a = np.abs(y)
    half_step = np.where(a <= 2, 0.25, np.where(a <= 4, 0.5, 1.0))
    return np.where(a <= 6, half_step, a - 6)


def _unit_scales(qt: QTensor) -> np.ndarray:
    """Effective per-group multiplier of an nvfp4 / mxfp4 QTensor, decoded with ml_dtypes,
    expanded to one row per input channel: [..., I, O] float32."""
    if qt.fmt == "nvfp4":
        unit = (
            np.asarray(qt.scales).astype(np.float32) * np.asarray(qt.tensor_scale)[..., None, None]
        )
    else:
        unit = _bytes(qt.scales).view(E8M0).astype(np.float32)
    return np.repeat(unit, qt.group_size, axis=-2)


def _codes(qt: QTensor) -> np.ndarray:
    return np.asarray(unpack_nibbles(qt.codes))


# ---- element codecs against ml_dtypes ------------------------------------------------------------


def test_e2m1_decode_all_codes_matches_ml_dtypes():
    # ml_dtypes keeps one float4 per byte, the code in the low nibble (astype leaves the rest 0).
    codes = np.arange(16, dtype=np.uint8)
    expected = codes.view(F4).astype(np.float32)
    got = np.asarray(e2m1_decode(jnp.asarray(codes)))
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(expected))  # code 8 is -0
    np.testing.assert_array_equal(np.abs(got[:8]), E2M1_GRID)


def test_e2m1_encode_matches_ml_dtypes():
    rng = np.random.default_rng(0)
    grid = np.concatenate([E2M1_GRID, -E2M1_GRID])
    midpoints = (E2M1_GRID[1:] + E2M1_GRID[:-1]) / 2  # ties: must round to the even code
    special = np.concatenate([midpoints, [6.5, 7.0, 8.0, 1e6, np.inf, 1e-30, 0.0]])
    special = np.concatenate([special, -special]).astype(np.float32)
    near = np.concatenate(
        [np.nextafter(special, np.float32(np.inf)), np.nextafter(special, np.float32(-np.inf))]
    )
    x = np.concatenate(
        [grid, special, near, rng.standard_normal(4000) * 3, rng.uniform(-8, 8, 4000)]
    ).astype(np.float32)
    got = _bytes(e2m1_encode(jnp.asarray(x)))
    np.testing.assert_array_equal(got, _bytes(x.astype(F4)))
    codes = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(_bytes(e2m1_encode(e2m1_decode(jnp.asarray(codes)))), codes)


def test_e4m3_conversion_matches_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    got = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(codes), jnp.float8_e4m3fn))
    np.testing.assert_array_equal(got.astype(np.float32), codes.view(F8).astype(np.float32))
    # Encoding: every finite value, the midpoints between neighbours (ties to even) and random
    # values from the subnormal range (2^-9 steps) up to 448.
    finite = codes[:127].view(F8).astype(np.float32)  # 0 .. 448 ascending (0x7F is NaN)
    midpoints = (finite[1:] + finite[:-1]) / 2
    rng = np.random.default_rng(1)
    x = np.concatenate([finite, midpoints, np.exp2(rng.uniform(-11, np.log2(448), 4000))])
    x = np.concatenate([x, -x]).astype(np.float32)
    got = _bytes(jnp.asarray(x).astype(jnp.float8_e4m3fn))
    np.testing.assert_array_equal(got, _bytes(x.astype(F8)))


def test_e8m0_matches_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    got = np.asarray(e8m0_decode(jnp.asarray(codes)))
    expected = codes.view(E8M0).astype(np.float32)  # 2^-127 .. 2^127, code 255 NaN
    np.testing.assert_array_equal(_bytes(got[:255].view(np.float32)), _bytes(expected[:255]))
    assert np.isnan(got[255]) and np.isnan(expected[255])
    exponents = np.arange(-127, 128)
    powers = np.ldexp(np.float32(1), exponents).astype(np.float32)
    np.testing.assert_array_equal(
        _bytes(e8m0_encode(jnp.asarray(exponents))), _bytes(powers.astype(E8M0))
    )


# ---- packing layouts -----------------------------------------------------------------------------


def test_awq_pack_order_by_hand():
    # Slot i (bits 4i..4i+3) holds column [0, 2, 4, 6, 1, 3, 5, 7][i]. Columns 0..7 = 0..7 give
    # slots (low to high) 0, 2, 4, 6, 1, 3, 5, 7, read from the top nibble: 0x75316420.
    q = np.zeros((4, 16), np.uint8)
    q[0, :8] = np.arange(8)
    q[1, 7] = 15  # column 7 -> slot 7: 0xF0000000, negative as int32
    q[2, 1] = 1  # column 1 -> slot 4: 0x00010000
    q[3, 8:] = [1, 0, 0, 0, 0, 0, 0, 0]  # second word of the row, column 8 -> slot 0
    packed = np.asarray(awq_pack(jnp.asarray(q)))
    assert packed.dtype == np.int32 and packed.shape == (4, 2)
    expected = np.array(
        [[0x75316420, 0], [0xF0000000 - (1 << 32), 0], [0x00010000, 0], [0, 1]], np.int64
    )
    np.testing.assert_array_equal(packed, expected)
    np.testing.assert_array_equal(np.asarray(awq_unpack(jnp.asarray(packed))), q)
    rand = np.random.default_rng(2).integers(0, 16, (3, 5, 24)).astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(awq_unpack(awq_pack(jnp.asarray(rand)))), rand)


def test_nibble_packing_low_nibble_is_even_input_channel():
    codes = np.array([[1, 9], [2, 10], [3, 15], [4, 0]], np.uint8)  # [I=4, O=2]
    packed = np.asarray(pack_nibbles(jnp.asarray(codes)))
    np.testing.assert_array_equal(packed, [[0x21, 0xA9], [0x43, 0x0F]])
    np.testing.assert_array_equal(np.asarray(unpack_nibbles(jnp.asarray(packed))), codes)


# Storage per format for w [..., I, O]: (dtype, shape) of codes, scales, zeros, tensor_scale.
def _expected_layout(fmt: str, lead: tuple[int, ...], d_in: int, d_out: int):
    if fmt == "awq":
        return [
            (np.int32, (*lead, d_in, d_out // 8)),
            (np.float16, (*lead, d_in // 128, d_out)),
            (np.int32, (*lead, d_in // 128, d_out // 8)),
        ]
    if fmt == "nvfp4":
        return [
            (np.uint8, (*lead, d_in // 2, d_out)),
            (F8, (*lead, d_in // 16, d_out)),
            (np.float32, lead),
        ]
    if fmt == "mxfp4":
        return [(np.uint8, (*lead, d_in // 2, d_out)), (np.uint8, (*lead, d_in // 32, d_out))]
    return [(F8, (*lead, d_in, d_out)), (np.float32, (*lead, d_out))]


@pytest.mark.parametrize("lead", [(), (3,)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_storage_layout(fmt, lead):
    d_in, d_out = 256, 32
    qt = quantize(jnp.asarray(_normal(3, (*lead, d_in, d_out))).astype(jnp.bfloat16), fmt)
    leaves = jax.tree_util.tree_leaves(qt)
    assert [(leaf.dtype, leaf.shape) for leaf in leaves] == [
        (np.dtype(dt), shape) for dt, shape in _expected_layout(fmt, lead, d_in, d_out)
    ]
    if fmt in ("nvfp4", "mxfp4"):
        assert qt.codes.size == int(np.prod(lead, dtype=int)) * d_in * d_out // 2
    assert (qt.fmt, qt.shape, qt.dtype) == (fmt, (*lead, d_in, d_out), "bfloat16")
    assert qt.nbytes == sum(leaf.nbytes for leaf in leaves)


# ---- quantize -> dequantize ----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_error_within_format_bound(fmt):
    w = _normal(4, (256, 32))
    qt = quantize(jnp.asarray(w), fmt)
    deq = np.asarray(dequantize(qt))
    assert deq.dtype == np.float32 and deq.shape == w.shape
    err = np.abs(deq - w)
    if fmt == "awq":
        # The stored scale s is fp16(range / 15), at most 2^-11 relative below range / 15, so
        # w / s + z spans [-0.5, 15 * (1 + 2^-11) + 0.5]: rounding costs <= s / 2 and clipping the
        # top at 15 adds <= 15 * 2^-11 * s.
        s = np.repeat(np.asarray(qt.scales).astype(np.float32), 128, axis=0)
        bound = s * (0.5 + 15 * 2.0**-11)
    elif fmt == "fp8":
        # y = w / s lies in [-448, 448]. E4M3 keeps 3 mantissa bits: rounding a normal y
        # (|y| >= 2^-6) errs by <= half an ulp <= 2^-4 |y|; subnormals step by 2^-9 (half: 2^-10).
        s = np.asarray(qt.scales)[None, :]
        bound = s * np.maximum(2.0**-4 * np.abs(w / s), 2.0**-10)
    else:
        # Elements are e2m1(y) with y = w / u, u the block's (decoded) scale: |err| <= u times
        # half the E2M1 step at |y|, or u * (|y| - 6) where y saturates. MXFP4: u = 2^e with
        # e = floor(log2(block_amax)) - 2, so |y| < 8. NVFP4: u = e4m3(block_amax / 6 / g) * g;
        # rounding the scale (normal e4m3: <= 2^-4 relative) leaves |y| <= 6 / (1 - 2^-4) = 6.4.
        u = _unit_scales(qt)
        y = w / u
        assert np.abs(y).max() < (6.4 if fmt == "nvfp4" else 8.0)
        if fmt == "nvfp4":
            assert np.asarray(qt.scales).astype(np.float32).min() >= 2.0**-6  # normal scales
        bound = u * _e2m1_error_bound(y)
    # Slack: float32 rounding of w / u, of the product and of deq - w, a few ulps of |w|.
    np.testing.assert_array_less(err, bound + 4 * np.spacing(np.abs(w)))


def _on_grid_weight(fmt: str, rng: np.random.Generator, d_in: int, d_out: int) -> np.ndarray:
    """A weight every format represents exactly: grid values times representable scales, with
    each group's extreme values present so the recomputed scales equal the ones used."""
    if fmt == "awq":
        groups = d_in // 128
        s = np.exp2(rng.uniform(-10, -4, (groups, 1, d_out))).astype(np.float16).astype(np.float32)
        z = rng.integers(0, 16, (groups, 1, d_out))
        q = rng.integers(0, 16, (groups, 128, d_out))
        q[:, 0], q[:, 1] = 0, 15  # min = -z s and max = (15 - z) s give back s and z
        return ((q - z) * s).astype(np.float32).reshape(d_in, d_out)
    if fmt == "fp8":
        s = np.exp2(rng.integers(-8, 2, (1, d_out))).astype(np.float32)  # w / s stays exact
        e = rng.integers(0, 127, (d_in, d_out)).astype(np.uint8).view(F8).astype(np.float32)
        e[0] = 448  # column amax = 448 s
        return e * np.where(rng.random((d_in, d_out)) < 0.5, -1, 1) * s
    block = 16 if fmt == "nvfp4" else 32
    e = E2M1_GRID[rng.integers(0, 8, (d_in // block, block, d_out))]
    e[:, 0] = 6 if fmt == "nvfp4" else rng.choice([4, 6], (d_in // block, d_out))
    e = e * np.where(rng.random(e.shape) < 0.5, -1, 1)
    if fmt == "mxfp4":
        scale = np.exp2(rng.integers(-10, 6, (d_in // block, 1, d_out)))
    else:
        # g = 2^-10 and normal e4m3 block scales b, one of them 448: amax = 6 * 448 * g, so
        # g = amax / 2688 and b = block_amax / 6 / g are recomputed exactly.
        b = rng.integers(8, 127, (d_in // block, 1, d_out)).astype(np.uint8).view(F8)
        b = b.astype(np.float32)
        b[0, 0, 0] = 448
        scale = b * 2.0**-10
    return (e * scale).astype(np.float32).reshape(d_in, d_out)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_exact_on_grid(fmt):
    w = _on_grid_weight(fmt, np.random.default_rng(5), 256, 32)
    np.testing.assert_array_equal(np.asarray(dequantize(quantize(jnp.asarray(w), fmt))), w)


def test_scales_follow_the_recipes():
    w = _normal(6, (256, 32))
    blocks16 = np.abs(w).reshape(16, 16, 32).max(axis=1)
    blocks32 = np.abs(w).reshape(8, 32, 32).max(axis=1)

    nv = quantize(jnp.asarray(w), "nvfp4")
    g = np.float32(np.abs(w).max()) / np.float32(448 * 6)
    assert np.asarray(nv.tensor_scale) == g
    np.testing.assert_array_equal(_bytes(nv.scales), _bytes((blocks16 / 6 / g).astype(F8)))
    np.testing.assert_array_equal(_codes(nv), _bytes((w / _unit_scales(nv)).astype(F4)))

    mx = quantize(jnp.asarray(w), "mxfp4")
    exponent = np.floor(np.log2(blocks32)).astype(np.int32) - 2
    np.testing.assert_array_equal(_bytes(mx.scales), exponent + 127)
    # e2m1 saturates at ±6 like ml_dtypes, so the codes are ml_dtypes' cast of w / 2^e.
    np.testing.assert_array_equal(_codes(mx), _bytes((w / _unit_scales(mx)).astype(F4)))

    fp8 = quantize(jnp.asarray(w), "fp8")
    np.testing.assert_array_equal(np.asarray(fp8.scales), np.abs(w).max(axis=0) / np.float32(448))

    awq = quantize(jnp.asarray(w), "awq")
    groups = w.reshape(2, 128, 32)
    s = ((groups.max(axis=1) - groups.min(axis=1)) / 15).astype(np.float16)
    np.testing.assert_array_equal(np.asarray(awq.scales), s)
    zeros = np.asarray(awq_unpack(awq.zeros))
    np.testing.assert_array_equal(zeros, np.round(-groups.min(axis=1) / s.astype(np.float32)))


def test_all_zero_weight_round_trips():
    for fmt in FORMATS:
        w = jnp.zeros((256, 32), jnp.float32)
        np.testing.assert_array_equal(np.asarray(dequantize(quantize(w, fmt))), 0.0)


# ---- pytree, jit, stacked experts ----------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_qtensor_is_a_pytree_that_survives_jit(fmt):
    qt = quantize(jnp.asarray(_normal(7, (256, 32))), fmt)
    leaves, treedef = jax.tree_util.tree_flatten(qt)
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert (rebuilt.fmt, rebuilt.shape, rebuilt.group_size) == (qt.fmt, qt.shape, qt.group_size)
    jitted = jax.jit(lambda q: dequantize(q))(qt)
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(dequantize(qt)))
    passed = jax.jit(lambda q: q)(qt)  # QTensor in and out of a jitted function
    assert isinstance(passed, QTensor) and passed.fmt == fmt


@pytest.mark.parametrize("fmt", FORMATS)
def test_stacked_experts_equal_per_expert_quantization(fmt):
    w = _normal(8, (3, 256, 32)) * np.array([0.5, 1.0, 4.0], np.float32)[:, None, None]
    stacked = quantize(jnp.asarray(w), fmt)
    deq = np.asarray(dequantize(stacked))
    for x in range(3):
        single = quantize(jnp.asarray(w[x]), fmt)
        for a, b in zip(
            jax.tree_util.tree_leaves(stacked), jax.tree_util.tree_leaves(single), strict=True
        ):
            np.testing.assert_array_equal(_bytes(np.asarray(a)[x]), _bytes(b))
        np.testing.assert_array_equal(deq[x], np.asarray(dequantize(single)))


# ---- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "fmt", "match"),
    [
        ((128, 16), "int3", "unknown quantization format 'int3'"),
        ((128,), "fp8", "rank 1"),
        ((2, 2, 128, 16), "mxfp4", "rank 4"),
        ((100, 16), "awq", "not a positive multiple of 128"),
        ((24, 16), "nvfp4", "not a positive multiple of 16"),
        ((2, 48, 16), "mxfp4", "not a positive multiple of 32"),
        ((128, 12), "awq", "not a multiple of 8"),
    ],
)
def test_bad_input_raises(shape, fmt, match):
    with pytest.raises(ValueError, match=match):
        quantize(jnp.zeros(shape, jnp.float32), fmt)


def test_bad_dtype_and_unknown_stored_format_raise():
    with pytest.raises(ValueError, match="floating-point"):
        quantize(jnp.zeros((128, 16), jnp.int32), "awq")
    qt = quantize(jnp.zeros((128, 16), jnp.float32), "fp8")
    bogus = QTensor(qt.codes, qt.scales, fmt="int3", shape=qt.shape, group_size=128)
    with pytest.raises(ValueError, match="unknown quantization format"):
        dequantize(bogus)
