"""Paged decode attention (Pallas, Triton backend; interpreted on CPU, compiled on a GPU): the
kernel against its jnp reference and JAX's own Pallas op, sliding windows and attention sinks, KV
quantization round trips and layouts, the split over pages, GPU lowering without a GPU, and
argument validation.

Inputs are poisoned: every KV slot no valid token uses (whole unused pages, the tail of each
sequence's last page, spare pages the block tables point to past the length) holds NaN (NaN
scales too for quantized pages), so a read that escapes the mask shows up in the output.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

from pallas_kernels.paged_attention import (
    _split_plan,
    _window_tables,
    paged_attention,
    paged_attention_reference,
    window_pages,
)
from research.quant.kv import (
    dequantize_kv,
    int4_unpack_halves,
    kv_code_dtype,
    kv_code_shape,
    kv_dtype_of,
    quantize_kv,
)

# Interpreted on CPU; compiled on a GPU (``python -m pallas_kernels.gpu_check`` runs this file there).
INTERPRET = jax.default_backend() != "gpu"
# Jitted: one compile per shape instead of one per jnp op.
quantize = jax.jit(quantize_kv, static_argnums=1)
dequantize = jax.jit(dequantize_kv, static_argnums=2)

F32_TOL = 2e-5  # float32 everywhere: summation order and exp only
BF16_TOL = 2e-2  # bfloat16 dot operands, probabilities and output (each rounds by 2^-8 rel.)


def _make_case(
    seed: int,
    *,
    lengths: tuple[int, ...],
    group: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    pages_per_seq: int,
    kv: str,
    q_dtype=jnp.float32,
    poison: float = np.nan,
    window: int | None = None,
    query_positions: tuple[int, ...] | None = None,
):
    """q, pages, block tables, lengths and scales; unused KV slots hold ``poison``.

    Block tables are a random permutation of the pool, two spare pages stay unreferenced, and
    table entries past a sequence's length point at (poisoned) pages like any other. With a
    ``window``, tokens outside the window of each query's position (default length - 1) are
    unused too: whole pages before the window and the out-of-window part of its first page.
    kv: "f32" / "bf16" (float pages) or "fp8" / "int4" (quantized from float32).
    """
    rng = np.random.default_rng(seed)
    batch = len(lengths)
    num_pages = batch * pages_per_seq + 2
    shape = (kv_heads, num_pages, page_size, head_dim)
    q = jnp.asarray(rng.standard_normal((batch, kv_heads * group, head_dim)), q_dtype)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    tables = rng.permutation(num_pages)[: batch * pages_per_seq].reshape(batch, pages_per_seq)

    used = np.zeros(shape[:3], bool)  # [K, P, S]
    for b, n in enumerate(lengths):
        t = np.arange(n)
        if window is not None:
            p = n - 1 if query_positions is None else query_positions[b]
            t = t[(t > p - window) & (t <= p)]
        used[:, tables[b, t // page_size], t % page_size] = True

    args = dict(
        block_tables=jnp.asarray(tables, jnp.int32), lengths=jnp.asarray(lengths, jnp.int32)
    )
    if query_positions is not None:
        args["query_positions"] = jnp.asarray(query_positions, jnp.int32)
    if kv in ("f32", "bf16"):
        dtype = jnp.float32 if kv == "f32" else jnp.bfloat16
        k, v = (jnp.asarray(np.where(used[..., None], x, poison), dtype) for x in (k, v))
        return dict(q=q, k_pages=k, v_pages=v, **args)
    out = dict(q=q, **args)
    for name, x in (("k", k), ("v", v)):
        codes, scales = quantize(jnp.asarray(x), kv)
        if kv == "fp8":  # int4 codes have no NaN: the NaN scales poison them
            codes = jnp.where(used[..., None], codes, poison).astype(codes.dtype)
        out[f"{name}_pages"] = codes
        out[f"{name}_scales"] = jnp.where(used, scales, poison)
    return out


def _call(fn, case, **kwargs):
    if "query_positions" in case:
        kwargs["query_positions"] = case["query_positions"]
    return fn(
        case["q"],
        case["k_pages"],
        case["v_pages"],
        case["block_tables"],
        case["lengths"],
        k_scales=case.get("k_scales"),
        v_scales=case.get("v_scales"),
        **kwargs,
    )


kernel = functools.partial(paged_attention, interpret=INTERPRET)


def _assert_close(out: jax.Array, ref: jax.Array, tol: float) -> None:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), "NaN/inf reached the output"
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)


# Each GQA ratio, head_dim, page size and KV dtype appears in several rows (not a cross product).
# Lengths: 1, 0 (zeros out), non-multiples of the page size, a full table.
CASES = [
    # group, head_dim, page, kv,   q dtype,      pages/seq, lengths
    (1, 64, 8, "f32", jnp.float32, 4, (1, 13, 0, 32)),
    (4, 128, 16, "f32", jnp.float32, 3, (17, 1, 48)),
    (8, 64, 32, "bf16", jnp.bfloat16, 2, (33, 64, 1)),
    (4, 64, 8, "bf16", jnp.bfloat16, 4, (1, 30, 0)),
    (8, 128, 8, "fp8", jnp.float32, 4, (25, 1, 32)),
    (1, 64, 32, "fp8", jnp.float32, 2, (40, 0, 1)),
    (4, 64, 16, "fp8", jnp.bfloat16, 3, (1, 47)),
    (4, 64, 16, "int4", jnp.float32, 3, (23, 1, 48, 0)),
    (1, 128, 32, "int4", jnp.float32, 2, (1, 63)),
    (8, 64, 8, "int4", jnp.bfloat16, 4, (9, 1, 31)),
]


@pytest.mark.parametrize(("group", "head_dim", "page", "kv", "q_dtype", "pages", "lengths"), CASES)
def test_kernel_matches_reference(group, head_dim, page, kv, q_dtype, pages, lengths):
    case = _make_case(
        0,
        lengths=lengths,
        group=group,
        kv_heads=2,
        head_dim=head_dim,
        page_size=page,
        pages_per_seq=pages,
        kv=kv,
        q_dtype=q_dtype,
    )
    # pages_per_compute_block=2, k_splits=2: several compute blocks and a split boundary.
    out = _call(kernel, case, pages_per_compute_block=2, k_splits=2)
    ref = _call(paged_attention_reference, case)
    assert out.dtype == q_dtype and out.shape == case["q"].shape
    # The reference dequantizes to float32 too, so quantized pages with a float32 q match as
    # tightly as float32 pages; bfloat16 anywhere rounds the dot operands.
    tol = F32_TOL if q_dtype == jnp.float32 and kv != "bf16" else BF16_TOL
    _assert_close(out, ref, tol)
    for b, n in enumerate(lengths):
        if n == 0:
            assert not np.asarray(out[b], np.float32).any(), "length 0 must give zeros"


def test_reference_matches_dense_softmax():
    """The reference itself against attention written out per sequence in numpy (float64)."""
    case = _make_case(
        1, lengths=(5, 16), group=2, kv_heads=2, head_dim=64, page_size=8, pages_per_seq=2, kv="f32"
    )
    ref = np.asarray(_call(paged_attention_reference, case, sm_scale=0.3))
    q, k, v = (np.asarray(case[n], np.float64) for n in ("q", "k_pages", "v_pages"))
    for b, n in enumerate(np.asarray(case["lengths"])):
        pages = np.asarray(case["block_tables"][b])
        kb = k[:, pages].reshape(2, -1, 64)[:, :n]  # [K, n, D]
        vb = v[:, pages].reshape(2, -1, 64)[:, :n]
        for h in range(4):
            s = 0.3 * kb[h // 2] @ q[b, h]
            p = np.exp(s - s.max())
            np.testing.assert_allclose(ref[b, h], p @ vb[h // 2] / p.sum(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv", ["f32", "fp8"])
def test_matches_jax_pallas_op(kv):
    # JAX's op multiplies unmasked NaN rows of V by zero probabilities (NaN * 0 = NaN), so this
    # comparison fills unused slots with zeros instead of NaN. It wants q pre-scaled, a table
    # width divisible by k_splits, and takes the same per-token [K, P, S] scales.
    case = _make_case(
        2,
        lengths=(1, 29, 64, 0),
        group=4,
        kv_heads=2,
        head_dim=64,
        page_size=16,
        pages_per_seq=4,
        kv=kv,
        poison=0.0,
    )
    sm_scale = 0.125
    theirs = jax_paged.paged_attention(
        case["q"] * sm_scale,
        case["k_pages"],
        case["v_pages"],
        case["block_tables"],
        case["lengths"],
        case.get("k_scales"),
        case.get("v_scales"),
        pages_per_compute_block=2,
        k_splits=2,
        interpret=INTERPRET,
    )
    ours = _call(kernel, case, sm_scale=sm_scale, pages_per_compute_block=2, k_splits=2)
    _assert_close(ours, theirs, F32_TOL)


def test_split_over_pages_matches_reference():
    """16 pages of 8 tokens, compute blocks of 2 pages, 4 splits of 4 pages each; lengths that
    leave whole splits empty (and one sequence of length 0). Table entries past each sequence's
    last page are -1, as an engine may leave them."""
    assert _split_plan(16, 8, pages_per_compute_block=2, k_splits=4) == (2, 4, 2)
    case = _make_case(
        3,
        lengths=(128, 35, 1, 100, 0),
        group=4,
        kv_heads=2,
        head_dim=64,
        page_size=8,
        pages_per_seq=16,
        kv="f32",
    )
    tables = np.asarray(case["block_tables"]).copy()
    for row, n in zip(tables, np.asarray(case["lengths"]), strict=True):
        row[-(-n // 8) :] = -1
    case["block_tables"] = jnp.asarray(tables)
    ref = _call(paged_attention_reference, case)
    split = _call(kernel, case, pages_per_compute_block=2, k_splits=4)
    _assert_close(split, ref, F32_TOL)


def test_split_plan():
    # (pages per compute block, splits, compute blocks per split)
    assert _split_plan(128, 16, 8, 16) == (8, 16, 1)
    assert _split_plan(128, 16, 8, 4) == (8, 4, 4)
    assert _split_plan(3, 16, 8, 16) == (4, 1, 1)  # block capped at the table width (pow2)
    assert _split_plan(1, 8, 1, 16) == (2, 1, 1)  # >= 16 tokens per block for Triton's dot
    assert _split_plan(5, 16, 1, 4) == (1, 3, 2)  # 5 blocks in 4 splits: 2 per split, 3 splits


# ---- sliding window and sinks --------------------------------------------------------------------

# Windows smaller than, equal to and larger than the page; lengths on both sides of the window
# (below it, at it, one past it, many pages past it) and of page boundaries. Every slot outside
# a query's window is NaN: a read of an out-of-window page or slot shows up in the output.
WINDOW_CASES = [
    # page, window, kv,   q dtype,      lengths,                         query positions
    (8, 5, "f32", jnp.float32, (0, 1, 4, 5, 6, 13, 40, 64), None),
    (8, 8, "f32", jnp.float32, (7, 8, 9, 16, 17, 63), None),
    (8, 20, "f32", jnp.float32, (19, 20, 21, 27, 47, 64), None),
    (16, 16, "f32", jnp.float32, (1, 15, 16, 17, 33, 64), None),
    (4, 16, "f32", jnp.float32, (3, 16, 17, 30, 32), None),
    (16, 5, "bf16", jnp.bfloat16, (4, 5, 6, 20, 50), None),
    (8, 12, "fp8", jnp.float32, (11, 12, 13, 40), None),
    (16, 24, "int4", jnp.float32, (23, 24, 25, 64), None),
    # The engine's prefill chunks: queries at or past the cached length (positions of new tokens
    # that are not in the pages); a window that ends before the context does sees nothing.
    (8, 10, "f32", jnp.float32, (0, 5, 20, 20, 20, 30), (0, 7, 20, 25, 29, 45)),
]


@pytest.mark.parametrize(("page", "window", "kv", "q_dtype", "lengths", "positions"), WINDOW_CASES)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_window_matches_reference(page, window, kv, q_dtype, lengths, positions, with_sinks):
    pages_per_seq = 64 // page
    case = _make_case(
        6,
        lengths=lengths,
        group=4,
        kv_heads=2,
        head_dim=64,
        page_size=page,
        pages_per_seq=pages_per_seq,
        kv=kv,
        q_dtype=q_dtype,
        window=window,
        query_positions=positions,
    )
    sinks = jnp.asarray(np.random.default_rng(7).standard_normal(8), jnp.float32)
    kwargs = dict(window=window, return_lse=True, sinks=sinks if with_sinks else None)
    out, lse = _call(kernel, case, pages_per_compute_block=2, k_splits=2, **kwargs)
    ref, ref_lse = _call(paged_attention_reference, case, **kwargs)
    tol = F32_TOL if q_dtype == jnp.float32 and kv != "bf16" else BF16_TOL
    _assert_close(out, ref, tol)
    ref_lse = np.asarray(ref_lse)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-5, atol=1e-5)
    if with_sinks:  # the sink keeps every denominator positive
        assert np.isfinite(ref_lse).all()
    elif positions is not None:  # windows that end before the context: nothing visible
        assert not np.isfinite(ref_lse).all()


def test_window_reads_only_the_window():
    """The window is what the kernel reads: a window of 128 over a 1,024-token table narrows it
    to the 9 pages of 16 tokens the window can touch, starting at the window's first page, and
    the split plan (the grid) follows the narrowed table."""
    page, width = 16, 64
    tables = jnp.asarray(np.arange(3 * width).reshape(3, width), jnp.int32)
    lengths = jnp.asarray([1024, 200, 100], jnp.int32)
    positions = jnp.asarray([1023, 200, 99], jnp.int32)  # row 1 queries the token after its last
    narrowed, first, end = jax.jit(_window_tables, static_argnums=(3, 4))(
        tables, lengths, positions, 128, page
    )
    assert window_pages(128, page) == 9 and narrowed.shape == (3, 9)
    starts = np.maximum(np.asarray(positions) - 127, 0)  # first visible token
    np.testing.assert_array_equal(
        np.asarray(narrowed[:, 0]), starts // page + [0, width, 2 * width]
    )
    np.testing.assert_array_equal(np.asarray(first), starts % page)
    np.testing.assert_array_equal(np.asarray(end), [128, 136, 100])
    assert _split_plan(9, page, 8, 16)[1] == 2 < _split_plan(width, page, 8, 16)[1] == 8


def test_sinks_without_window_and_empty_sequences():
    """Sinks join the denominator with no value: a sequence with no tokens gets zeros and the
    sink as its log-sum-exp; a sink of -inf changes nothing."""
    case = _make_case(
        8,
        lengths=(0, 9, 32),
        group=2,
        kv_heads=2,
        head_dim=64,
        page_size=8,
        pages_per_seq=4,
        kv="f32",
    )
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    out, lse = _call(kernel, case, sinks=sinks, return_lse=True)
    ref, ref_lse = _call(paged_attention_reference, case, sinks=sinks, return_lse=True)
    _assert_close(out, ref, F32_TOL)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-5, atol=1e-5)
    assert not np.asarray(out[0]).any() and np.array_equal(np.asarray(lse[0]), np.asarray(sinks))
    plain = _call(kernel, case)
    no_sinks = _call(kernel, case, sinks=jnp.full((4,), -jnp.inf, jnp.float32))
    _assert_close(no_sinks, plain, F32_TOL)
    assert np.abs(np.asarray(out[1:] - plain[1:])).max() > 1e-2


# ---- KV quantization -----------------------------------------------------------------------------


def _kv_vectors(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3, 5, 64)).astype(np.float32)
    x *= np.exp2(rng.integers(-8, 8, (3, 5, 1)))  # per-vector magnitudes over 16 octaves
    x[0, 0] = 0.0  # all-zero vector: scale 1, zero codes
    x[1, 1, 7] = 50.0  # an outlier sets its vector's scale
    return x


def test_fp8_round_trip():
    x = _kv_vectors(0)
    codes, scales = quantize(jnp.asarray(x), "fp8")
    assert codes.dtype == jnp.float8_e4m3fn and codes.shape == x.shape
    assert scales.dtype == jnp.float32 and scales.shape == x.shape[:-1]
    amax = np.abs(x).max(-1)
    np.testing.assert_allclose(np.asarray(scales), np.where(amax > 0, amax / 448, 1.0), rtol=1e-6)
    err = np.abs(np.asarray(dequantize(codes, scales, "fp8")) - x)
    # E4M3 keeps 3 mantissa bits: half a step is 2^-4 relative; subnormal steps are 2^-9 * s.
    s = np.asarray(scales)[..., None]
    assert (err <= 2.0**-4 * np.abs(x) + 2.0**-10 * s + 1e-30).all()
    assert (err.max(-1) <= 2.0**-4 * amax).all()
    assert not np.asarray(codes[0, 0], np.float32).any() and scales[0, 0] == 1.0


def test_int4_round_trip():
    x = _kv_vectors(1)
    codes, scales = quantize(jnp.asarray(x), "int4")
    assert codes.dtype == jnp.uint8 and codes.shape == (*x.shape[:-1], 32)
    amax = np.abs(x).max(-1)
    np.testing.assert_allclose(np.asarray(scales), np.where(amax > 0, amax / 7, 1.0), rtol=1e-6)
    err = np.abs(np.asarray(dequantize(codes, scales, "int4")) - x)
    assert (err <= np.asarray(scales)[..., None] * (0.5 + 1e-5)).all()
    assert not np.asarray(codes[0, 0]).any() and scales[0, 0] == 1.0


def test_int4_split_half_layout():
    # amax 7 -> scale 1, so the codes are the values; halves [7, -1, 0, 3] and [1, -7, 5, -4].
    x = jnp.asarray([7.0, -1, 0, 3, 1, -7, 5, -4])
    codes, scales = quantize(x, "int4")
    assert float(scales) == 1.0
    # byte j = (x[j] & 0xF) | (x[j + 4] & 0xF) << 4 in two's-complement nibbles
    np.testing.assert_array_equal(np.asarray(codes), [0x17, 0x9F, 0x50, 0xC3])
    lo, hi = int4_unpack_halves(jnp.asarray([0x17, 0x9F, 0x50, 0xC3, 0x88], jnp.uint8))
    np.testing.assert_array_equal(np.asarray(lo), [7, -1, 0, 3, -8])
    np.testing.assert_array_equal(np.asarray(hi), [1, -7, 5, -4, -8])
    np.testing.assert_array_equal(np.asarray(dequantize(codes, scales, "int4")), np.asarray(x))


def test_kv_dtype_helpers():
    assert kv_code_shape(128, "auto") == kv_code_shape(128, "fp8") == (128,)
    assert kv_code_shape(128, "int4") == (64,)
    assert kv_code_dtype("auto", jnp.bfloat16) == jnp.bfloat16
    assert kv_code_dtype("fp8", jnp.bfloat16) == jnp.float8_e4m3fn
    assert kv_code_dtype("int4", jnp.bfloat16) == jnp.uint8
    assert [kv_dtype_of(d) for d in (jnp.bfloat16, jnp.float8_e4m3fn, jnp.uint8)] == [
        "auto",
        "fp8",
        "int4",
    ]
    with pytest.raises(ValueError, match="kv_dtype 'int8'"):
        kv_code_shape(128, "int8")
    with pytest.raises(ValueError, match="odd"):
        quantize(jnp.ones((3, 5)), "int4")
    with pytest.raises(ValueError, match="unquantized"):
        quantize(jnp.ones((3, 4)), "auto")


# ---- GPU lowering without a GPU ------------------------------------------------------------------


@pytest.mark.parametrize("kv", ["bf16", "fp8", "int4"])
def test_lowers_to_triton_for_cuda(kv):
    case = _make_case(
        4,
        lengths=(20, 7),
        group=4,
        kv_heads=2,
        head_dim=128,
        page_size=16,
        pages_per_seq=4,
        kv=kv,
        q_dtype=jnp.bfloat16,
    )
    fn = functools.partial(_call, paged_attention, pages_per_compute_block=2, k_splits=2)
    text = jax.jit(fn).trace(case).lower(lowering_platforms=("cuda",)).as_text()
    # jaxlib <= 0.10.2 emits XLA's Triton custom call, newer ones triton_kernel_call_ffi.
    calls = text.count("__gpu$xla.gpu.triton") + text.count("triton_kernel_call_ffi")
    assert calls == 1  # one kernel launch, nothing split into several calls
    assert f"paged_attention_{'auto' if kv == 'bf16' else kv}" in text
    # The kernel reads the pool as stored: fp8 / int4 pages reach it as their codes, and no
    # dequantized copy of the whole pool [K, pages, P, E] exists in the program.
    pool = "2x10x16x128"  # kv_heads, batch * pages_per_seq + 2, page_size, head_dim
    stored = {"bf16": f"{pool}xbf16", "fp8": f"{pool}xf8E4M3FN", "int4": "2x10x16x64xui8"}[kv]
    assert f"tensor<{stored}>" in text, kv  # int4: two codes per byte
    if kv != "bf16":
        assert not re.search(rf"tensor<{pool}x(f32|bf16|f16)>", text), kv


# ---- validation ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_case():
    return _make_case(
        5, lengths=(3,), group=2, kv_heads=2, head_dim=64, page_size=16, pages_per_seq=2, kv="f32"
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda c: {**c, "q": c["q"][0]}, r"q must be \[batch, heads, head_dim\]"),
        (lambda c: {**c, "q": c["q"][:, :3]}, "3 query heads are not a multiple of 2 kv heads"),
        (lambda c: {**c, "q": c["q"][..., :32]}, "head_dim 32 store"),
        (lambda c: {**c, "k_pages": c["k_pages"][0]}, "k_pages must be"),
        (lambda c: {**c, "v_pages": c["v_pages"][:1]}, "k_pages and v_pages differ"),
        (lambda c: {**c, "block_tables": c["block_tables"][0]}, "block_tables must be"),
        (lambda c: {**c, "lengths": c["lengths"][:, None]}, "lengths must be"),
        (lambda c: {**c, "lengths": c["lengths"].astype(jnp.uint32)}, "must be int32"),
        (lambda c: {**c, "k_scales": c["k_pages"][..., 0]}, "only apply to fp8/int4"),
        (lambda c: {**c, "k_pages": c["k_pages"].astype(jnp.float8_e4m3fn)}, "k_pages and v_"),
        (
            lambda c: {
                **c,
                "k_pages": c["k_pages"].astype(jnp.float8_e4m3fn),
                "v_pages": c["v_pages"].astype(jnp.float8_e4m3fn),
            },
            r"fp8 pages need k_scales float32\[2, 4, 16\]; got None",
        ),
    ],
)
def test_validation_errors(small_case, change, match):
    with pytest.raises(ValueError, match=match):
        _call(kernel, change(small_case))


def test_validation_window_positions_and_sinks(small_case):
    with pytest.raises(ValueError, match="window must be a positive int"):
        _call(kernel, small_case, window=0)
    with pytest.raises(ValueError, match="query_positions only apply with a window"):
        _call(kernel, small_case, query_positions=jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match=r"query_positions must be int32\[1\]"):
        _call(kernel, small_case, window=4, query_positions=jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match=r"sinks must be float\[4\]"):
        _call(kernel, small_case, sinks=jnp.zeros((2,), jnp.float32))
    with pytest.raises(ValueError, match=r"sinks must be float\[4\]"):  # the reference too
        _call(paged_attention_reference, small_case, sinks=jnp.zeros((4,), jnp.int32))


def test_validation_kv_dtype_and_powers_of_two(small_case):
    with pytest.raises(ValueError, match="kv_dtype 'fp8' but the pages are float32"):
        _call(kernel, small_case, kv_dtype="fp8")
    with pytest.raises(ValueError, match="powers of two"):
        _call(kernel, small_case, pages_per_compute_block=3)
    with pytest.raises(ValueError, match="powers of two"):  # page size 12
        c = small_case
        _call(kernel, {**c, "k_pages": c["k_pages"][:, :, :12], "v_pages": c["v_pages"][:, :, :12]})
    # The reference shares the checks.
    with pytest.raises(ValueError, match="query heads are not a multiple"):
        _call(paged_attention_reference, {**small_case, "q": small_case["q"][:, :3]})


def test_default_sm_scale_is_inverse_sqrt_head_dim(small_case):
    out = _call(kernel, small_case)
    _assert_close(out, _call(paged_attention_reference, small_case, sm_scale=0.125), F32_TOL)
    unscaled = _call(paged_attention_reference, small_case, sm_scale=1.0)
    assert not np.allclose(np.asarray(out), np.asarray(unscaled), atol=1e-3)
