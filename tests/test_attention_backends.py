"""One conformance suite for every attention backend that runs here, on the step's ragged inputs.

Each case is a random ragged step: decode rows, prefill chunks that start inside a block, a
fresh prompt, padded rows and padded tokens, in shuffled order, over a pool whose free blocks
hold NaN. Every backend's output must equal a dense oracle computed per query token from the
logical sequence (its context tokens and the step's new tokens, no pages, no tiles), with
sliding windows and attention sinks, on float32, bfloat16, fp8 and int4 pages. The oracle is
plain numpy; it shares nothing with the backends but the K/V quantizer.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.engine.attention import (
    ATTENTION_BACKENDS,
    BACKENDS,
    AttentionMetadata,
    choose_attention_backend,
    native_supports,
    num_tiles,
    query_tiles,
    tile_size,
)
from research.engine.kv_cache import init_kv_pool, write_kv
from research.models.presets import get_preset
from research.quant.kv import dequantize_kv, quantize_kv

# 4 query heads over 2 kv heads; head_dim 32, so int4's packed codes (16 wide) fill a Triton dot
CFG = dataclasses.replace(get_preset("tiny-qwen3"), head_dim=32, num_layers=1)
BS = 4  # tokens per block


def _step(rng: np.random.Generator, rows: list[tuple[int, int]], n_pad: int, r_pad: int):
    """Rows (context length, new tokens) -> the pool's contents, metadata and the oracle's
    logical K/V per row."""
    kvh, e, h = CFG.num_kv_heads, CFG.head_dim, CFG.num_heads
    m = max(-(-(c + t) // BS) for c, t in rows) + 1
    num_blocks = len(rows) * m + 3
    free = list(rng.permutation(num_blocks))
    tables = np.zeros((r_pad, m), np.int32)
    for i, (c, t) in enumerate(rows):
        need = -(-(c + t) // BS)
        tables[i, :need] = [free.pop() for _ in range(need)]
    counts = np.array([t for _, t in rows])
    n_real = int(counts.sum())
    n = n_real + n_pad
    qsl = np.full(r_pad + 1, n_real, np.int32)
    qsl[0] = 0
    qsl[1 : len(rows) + 1] = np.cumsum(counts)
    token_row = np.full(n, r_pad, np.int32)
    positions = np.full(n, -1, np.int32)
    seq_lens = np.zeros(r_pad, np.int32)
    ctx_k, ctx_v, ctx_slots = [], [], []
    logical = []
    for i, (c, t) in enumerate(rows):
        token_row[qsl[i] : qsl[i + 1]] = i
        positions[qsl[i] : qsl[i + 1]] = np.arange(c, c + t)
        seq_lens[i] = c + t
        kc = rng.standard_normal((c, kvh, e)).astype(np.float32)
        vc = rng.standard_normal((c, kvh, e)).astype(np.float32)
        ctx_k.append(kc)
        ctx_v.append(vc)
        ctx_slots += [tables[i, p // BS] * BS + p % BS for p in range(c)]
        logical.append((kc, vc))
    q = rng.standard_normal((n, h, e)).astype(np.float32)
    k_new = rng.standard_normal((n, kvh, e)).astype(np.float32)
    v_new = rng.standard_normal((n, kvh, e)).astype(np.float32)
    meta = AttentionMetadata(
        jnp.asarray(positions),
        jnp.asarray(token_row),
        jnp.asarray(qsl),
        jnp.asarray(seq_lens),
        jnp.asarray(tables),
    )
    ctx = (np.concatenate(ctx_k), np.concatenate(ctx_v), np.asarray(ctx_slots, np.int32))
    return q, k_new, v_new, meta, num_blocks, ctx, logical


def _oracle(q, k_new, v_new, meta, logical, scale, window, sinks):
    """Per query token, dense attention over its row's logical keys (context + new <= p)."""
    n, h, e = q.shape
    g = h // CFG.num_kv_heads
    positions, token_row = np.asarray(meta.positions), np.asarray(meta.token_row)
    qsl = np.asarray(meta.query_start_loc)
    out = np.zeros((n, h, e), np.float64)
    for j in range(n):
        if positions[j] < 0:
            continue
        r, p = token_row[j], positions[j]
        kc, vc = logical[r]
        first = qsl[r]
        keys = np.concatenate([kc, k_new[first : j + 1]]).astype(np.float64)
        vals = np.concatenate([vc, v_new[first : j + 1]]).astype(np.float64)
        key_pos = np.arange(len(keys))
        seen = key_pos > p - window if window is not None else np.ones(len(keys), bool)
        for head in range(h):
            kv = head // g
            s = keys[seen, kv] @ q[j, head].astype(np.float64) * scale
            top = s.max() if sinks is None else max(s.max(), sinks[head])
            w = np.exp(s - top)
            denom = w.sum() + (0.0 if sinks is None else np.exp(sinks[head] - top))
            out[j, head] = w @ vals[seen, kv] / denom
    return out


def _pool(num_blocks, ctx, page_dtype, kv_cache_dtype):
    fill = 0.0 if kv_cache_dtype == "int4" else float("nan")  # int4 codes carry no NaN
    pool = init_kv_pool(CFG, num_blocks, BS, page_dtype, fill, kv_cache_dtype)
    kc, vc, slots = ctx
    layers = CFG.num_layers
    k = [jnp.asarray(kc, page_dtype)] * layers
    v = [jnp.asarray(vc, page_dtype)] * layers
    return write_kv(pool, k, v, jnp.asarray(slots))


def _stored(x: np.ndarray, page_dtype, kv_cache_dtype) -> np.ndarray:
    """What the pool gives back for K/V ``x``: rounded to the page dtype or quantized."""
    x = np.asarray(jnp.asarray(x, page_dtype).astype(jnp.float32))
    if kv_cache_dtype == "auto":
        return x
    codes, scales = quantize_kv(jnp.asarray(x), kv_cache_dtype)
    return np.asarray(dequantize_kv(codes, scales, kv_cache_dtype))


CASES = {
    # (context, new) per row
    "decodes": [(9, 1), (3, 1), (17, 1), (0, 1)],
    # as many tokens as rows (N = R): the native backend's decode-kernel route
    "decode_sized": [(9, 1), (3, 2), (17, 1), (0, 1), (6, 1), (11, 1)],
    "mixed": [(6, 1), (5, 7), (0, 9), (13, 1), (2, 3)],
    "prefill_inside_block": [(5, 11), (7, 6)],
    "fresh_prompts": [(0, 5), (0, 12)],
}
FORMATS = {
    "float32": (jnp.float32, "auto", 2e-5),
    "bfloat16": (jnp.bfloat16, "auto", 3e-2),
    "fp8": (jnp.float32, "fp8", 2e-5),
    "int4": (jnp.float32, "int4", 2e-5),
}


def _runnable(backend: str, window, sinks, page_dtype, kv_cache_dtype) -> str | None:
    if backend == "pallas":
        return "the compiled Pallas kernel needs a GPU (pallas_interpret runs it here)"
    if backend == "native":
        if window is not None or sinks is not None:
            return "the native kernel has no sliding window or sinks (it refuses them)"
        return native_supports(page_dtype, kv_cache_dtype)
    return None


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("variant", ["plain", "window_sinks"])
def test_backend_matches_dense_oracle(backend, fmt, case, variant):
    page_dtype, kv_cache_dtype, tol = FORMATS[fmt]
    window, sinks = (
        (5, np.linspace(-1.0, 1.5, CFG.num_heads)) if variant != "plain" else (None,) * 2
    )
    if (why := _runnable(backend, window, sinks, page_dtype, kv_cache_dtype)) is not None:
        pytest.skip(why)
    if backend == "pallas_interpret" and fmt != "float32" and case != "mixed":
        pytest.skip("interpreted Pallas: page formats are checked on the mixed case (time)")
    rng = np.random.default_rng(zlib.crc32(f"{fmt}{case}{variant}".encode()))
    rows = CASES[case]
    n_pad = 8 - sum(t for _, t in rows) if case == "decode_sized" else 3
    q, k_new, v_new, meta, num_blocks, ctx, logical = _step(rng, rows, n_pad=n_pad, r_pad=8)
    assert (q.shape[0] == 8) == (case == "decode_sized")
    pool = _pool(num_blocks, ctx, page_dtype, kv_cache_dtype)
    logical = [
        (_stored(kc, page_dtype, kv_cache_dtype), _stored(vc, page_dtype, kv_cache_dtype))
        for kc, vc in logical
    ]
    qd, kd, vd = (jnp.asarray(x, page_dtype) for x in (q, k_new, v_new))
    scale = CFG.head_dim**-0.5
    sinks_j = None if sinks is None else jnp.asarray(sinks, jnp.float32)

    @jax.jit
    def run(qd, kd, vd, pool, meta):
        return BACKENDS[backend](
            qd, kd, vd, pool, 0, meta.block_tables, meta, scale, window=window, sinks=sinks_j
        )

    got = np.asarray(run(qd, kd, vd, pool, meta).astype(jnp.float32))
    as_f32 = [np.asarray(x.astype(jnp.float32)) for x in (qd, kd, vd)]
    want = _oracle(*as_f32, meta, logical, scale, window, sinks)
    assert np.isfinite(got).all()  # NaN in free blocks never leaks
    padded = np.asarray(meta.positions) < 0
    assert (got[padded] == 0).all()  # padded tokens attend to nothing
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def test_native_refuses_windows_by_name():
    rng = np.random.default_rng(0)
    q, k_new, v_new, meta, num_blocks, ctx, _ = _step(rng, [(3, 2)], 0, 1)
    pool = _pool(num_blocks, ctx, jnp.float32, "auto")
    with pytest.raises(ValueError, match="no sliding window"):
        BACKENDS["native"](q, k_new, v_new, pool, 0, meta.block_tables, meta, 0.5, window=4)


@pytest.mark.parametrize("rows", [[1] * 8, [1, 1, 5, 1, 9], [33], [2, 3, 1, 1, 1, 7, 1, 1]])
def test_query_tiles_cover_every_token_once(rows):
    """The reference's tiles: every real token in exactly one tile of its own row, within the
    static bound, whatever the mix."""
    r_pad, n_pad = 8, 4
    n = sum(rows) + n_pad
    qsl = np.full(r_pad + 1, sum(rows), np.int32)
    qsl[0] = 0
    qsl[1 : len(rows) + 1] = np.cumsum(rows)
    token_row = np.full(n, r_pad, np.int32)
    for i in range(len(rows)):
        token_row[qsl[i] : qsl[i + 1]] = i
    meta = AttentionMetadata(
        jnp.zeros(n, jnp.int32), jnp.asarray(token_row), jnp.asarray(qsl),
        jnp.zeros(r_pad, jnp.int32), jnp.zeros((r_pad, 1), jnp.int32),
    )  # fmt: skip
    for b in (1, 2, 4, 16):
        tile_row, token, valid = (np.asarray(x) for x in query_tiles(meta, n, b))
        assert len(tile_row) == num_tiles(n, r_pad, b)
        covered = token[valid]
        assert sorted(covered) == list(range(sum(rows)))
        assert (token_row[token[valid]] == np.repeat(tile_row, b).reshape(token.shape)[valid]).all()
    assert tile_size(64, 64) == 1  # decode-only steps score nothing twice


def test_auto_picks_pallas_on_a_gpu_native_on_a_cpu_else_xla():
    gpu = choose_attention_backend("auto", jnp.bfloat16, "auto", platform="gpu")
    assert gpu.name == "pallas" and "gpu" in gpu.reason
    # fp8 pages on a GPU Triton cannot compile fp8 for: the reference, saying why
    old = choose_attention_backend("auto", jnp.bfloat16, "fp8", platform="gpu", device_kind="A100")
    assert old.name == "xla" and "fp8" in old.reason
    h200 = choose_attention_backend("auto", jnp.bfloat16, "fp8", platform="gpu", device_kind="H200")
    assert h200.name == "pallas"
    cpu = choose_attention_backend("auto", jnp.float32, "auto", platform="cpu")
    if native_supports(jnp.float32, "auto") is None:
        assert cpu.name == "native"
    else:
        assert cpu.name == "xla" and "native" in cpu.reason
    fp8_cpu = choose_attention_backend("auto", jnp.float32, "fp8", platform="cpu")
    assert fp8_cpu.name == "xla" and "kv_cache_dtype='fp8'" in fp8_cpu.reason
    # A sharded plan runs the native kernel per device (research.parallel.ops.sharded_attention).
    sharded = choose_attention_backend("auto", jnp.float32, "auto", sharded=True, platform="cpu")
    assert sharded.name == cpu.name
    with pytest.raises(ValueError, match="one of"):
        choose_attention_backend("cuda", jnp.float32, "auto")
