"""The native CPU paged-attention kernel (``research.native``) against a float64 reference on the
same pages, and the engine through it against the XLA gather path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research import native
from research.engine.attention import native_supports, resolve_attention_backend
from research.engine.request import SamplingParams

pytestmark = pytest.mark.skipif(
    not native.available(), reason=f"native library unavailable: {native.build_error()}"
)


def _reference(q, k_pages, v_pages, tables, lengths, scale):
    """float64 softmax attention of q [N, H, E] over each row's first lengths[n] tokens."""
    n, h, e = q.shape
    kvh, _, p, _ = k_pages.shape
    g = h // kvh
    out = np.zeros((n, h, e))
    lse = np.full((n, h), -np.inf)
    for i in range(n):
        if lengths[i] == 0:
            continue
        slots = [(tables[i, t // p], t % p) for t in range(lengths[i])]
        for head in range(h):
            kv = head // g
            keys = np.stack([k_pages[kv, b, o] for b, o in slots]).astype(np.float64)
            vals = np.stack([v_pages[kv, b, o] for b, o in slots]).astype(np.float64)
            s = keys @ q[i, head].astype(np.float64) * scale
            top = s.max()
            w = np.exp(s - top)
            out[i, head] = w @ vals / w.sum()
            lse[i, head] = top + np.log(w.sum())
    return out, lse


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_kernel_matches_reference_and_never_reads_past_a_length(dtype, head_dim):
    """Lengths of 0, 1, a page, a page + 1 and a whole table; GQA with 3 query heads per kv head;
    every slot the kernel must not read is NaN (free blocks, tails of last pages), so a single
    read past a length would poison the output."""
    rng = np.random.default_rng(0)
    kvh, h, blocks, p, m = 2, 6, 24, 8, 4
    lengths = np.array([0, 1, p, p + 1, m * p, 13], np.int32)
    n = len(lengths)
    tables = rng.permutation(blocks)[: n * m].reshape(n, m).astype(np.int32)
    k_pages = np.full((kvh, blocks, p, head_dim), np.nan, np.float32)
    v_pages = np.full((kvh, blocks, p, head_dim), np.nan, np.float32)
    for i, length in enumerate(lengths):
        for t in range(length):
            b, o = tables[i, t // p], t % p
            k_pages[:, b, o] = rng.standard_normal((kvh, head_dim))
            v_pages[:, b, o] = rng.standard_normal((kvh, head_dim))
    q = rng.standard_normal((n, h, head_dim)).astype(np.float32)
    if dtype == "bfloat16":  # pages as the pool stores them: raw bits
        k_dev = jax.lax.bitcast_convert_type(jnp.asarray(k_pages, jnp.bfloat16), jnp.uint16)
        v_dev = jax.lax.bitcast_convert_type(jnp.asarray(v_pages, jnp.bfloat16), jnp.uint16)
        k_pages = np.asarray(jnp.asarray(k_pages, jnp.bfloat16).astype(jnp.float32))
        v_pages = np.asarray(jnp.asarray(v_pages, jnp.bfloat16).astype(jnp.float32))
    else:
        k_dev, v_dev = jnp.asarray(k_pages), jnp.asarray(v_pages)
    scale = head_dim**-0.5
    call = jax.jit(lambda *a: native.paged_attention(*a, scale))
    out, lse = call(jnp.asarray(q), k_dev, v_dev, jnp.asarray(tables), jnp.asarray(lengths))
    ref_out, ref_lse = _reference(q, k_pages, v_pages, tables, lengths, scale)
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out)[0] == 0) and np.all(np.isneginf(np.asarray(lse)[0]))


def packed_case(dtype: str, head_dim: int, p: int) -> tuple[tuple, float, np.ndarray, int]:
    """A packed call's inputs (pages of ``p`` tokens), its scale, the float64 reference and the
    number of real tokens: rows with and without cached context (whole pages, a page + 1),
    chunks of 1, 16, 17 and 40 new tokens (several query blocks; rows of one token are decode
    rows, 3 query heads per kv head), an empty row and padding tokens; every page slot past a
    row's context is NaN."""
    rng = np.random.default_rng(1)
    kvh, h, m = 2, 6, 64 // p
    starts = np.array([0, 9, 16, 0, 3, 37], np.int32)
    blocks = len(starts) * m
    counts = np.array([17, 1, 40, 0, 16, 1], np.int32)
    firsts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
    n = int(counts.sum()) + 5  # padding tokens at the end
    tables = rng.permutation(blocks)[: len(starts) * m].reshape(-1, m).astype(np.int32)
    k_pages = np.full((kvh, blocks, p, head_dim), np.nan, np.float32)
    v_pages = np.full((kvh, blocks, p, head_dim), np.nan, np.float32)
    for i, start in enumerate(starts):
        for t in range(start):
            b, o = tables[i, t // p], t % p
            k_pages[:, b, o] = rng.standard_normal((kvh, head_dim))
            v_pages[:, b, o] = rng.standard_normal((kvh, head_dim))
    q = rng.standard_normal((n, h, head_dim)).astype(np.float32)
    k_new = rng.standard_normal((n, kvh, head_dim)).astype(np.float32)
    v_new = rng.standard_normal((n, kvh, head_dim)).astype(np.float32)
    if dtype == "bfloat16":
        k_dev, v_dev = jnp.asarray(k_pages, jnp.bfloat16), jnp.asarray(v_pages, jnp.bfloat16)
        k_pages = np.asarray(k_dev.astype(jnp.float32))
        v_pages = np.asarray(v_dev.astype(jnp.float32))
    else:
        k_dev, v_dev = jnp.asarray(k_pages), jnp.asarray(v_pages)
    scale = head_dim**-0.5
    ref = np.zeros((n, h, head_dim))
    g = h // kvh
    for i, (start, first, count) in enumerate(zip(starts, firsts, counts, strict=True)):
        ctx = [(tables[i, t // p], t % p) for t in range(start)]
        for t in range(count):
            tok = first + t
            for head in range(h):
                kv = head // g
                keys = [k_pages[kv, b, o] for b, o in ctx] + list(k_new[first : tok + 1, kv])
                vals = [v_pages[kv, b, o] for b, o in ctx] + list(v_new[first : tok + 1, kv])
                keys, vals = np.asarray(keys, np.float64), np.asarray(vals, np.float64)
                s = keys @ q[tok, head].astype(np.float64) * scale
                w = np.exp(s - s.max())
                ref[tok, head] = w @ vals / w.sum()
    inputs = (q, k_new, v_new, k_dev, v_dev, tables, starts, firsts, counts)
    return inputs, scale, ref, int(counts.sum())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 40])
@pytest.mark.parametrize("page", [8, 16])
def test_packed_kernel_matches_reference_over_context_and_new_tokens(dtype, head_dim, page):
    """Prefill chunks and decode rows in one packed call (``packed_case``), pages of 8 tokens
    (context in partial chunks of keys) and of 16 (whole chunks, the engine's default: keys
    transposed by shuffles). Each token sees its row's context and the row's new tokens up to
    itself."""
    inputs, scale, ref, real = packed_case(dtype, head_dim, page)
    call = jax.jit(lambda *a: native.packed_attention(*a, scale))
    out = np.asarray(call(*inputs))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert np.all(out[real:] == 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "uint16"])
def test_packed_kernel_that_writes_stores_the_new_kv_as_write_kv_and_in_place(dtype):
    """``write=True``: the same attention bit for bit, and the pages ``write_kv`` would leave
    (each row's new tokens at their table's slots, padding dropped, NaN slots elsewhere kept),
    bit for bit; with the pages donated, the outputs are the inputs' own buffers (no copy of
    the pool per layer). "uint16": bfloat16 pages stored as their bits, as the engine's pool."""
    from research.engine.kv_cache import KVPool, write_kv

    page = 16
    inputs, scale, _, _ = packed_case("float32" if dtype == "float32" else "bfloat16", 64, page)
    q, k_new, v_new, k_dev, v_dev, tables, starts, firsts, counts = inputs
    if dtype == "uint16":
        k_dev, v_dev = (jax.lax.bitcast_convert_type(x, jnp.uint16) for x in (k_dev, v_dev))
    # bfloat16 pages take the new K/V rounded (write_kv's astype): off-grid float32 values
    k_new, v_new = k_new * 1.001, v_new * 1.001
    ref_out = np.asarray(native.packed_attention(q, k_new, v_new, k_dev, v_dev, *inputs[5:], scale))
    slots = np.full(q.shape[0], -1, np.int64)  # padding: dropped
    for i, (start, first, count) in enumerate(zip(starts, firsts, counts, strict=True)):
        for t in range(count):
            pos = start + t
            slots[first + t] = tables[i, pos // page] * page + pos % page
    blocks = k_dev.shape[1]
    slots = np.where(slots < 0, blocks * page, slots).astype(np.int32)
    pool = KVPool([k_dev], [v_dev], page_dtype="bfloat16" if dtype == "uint16" else "")
    want = write_kv(pool, [jnp.asarray(k_new)], [jnp.asarray(v_new)], jnp.asarray(slots))
    want_k, want_v = np.asarray(want.k[0]), np.asarray(want.v[0])
    assert not np.array_equal(want_k, np.asarray(k_dev), equal_nan=True)  # the write shows

    call = jax.jit(
        lambda k, v, *a: native.packed_attention(q, k_new, v_new, k, v, *a, scale, write=True),
        donate_argnums=(0, 1),
    )
    k_in, v_in = jnp.array(k_dev, copy=True), jnp.array(v_dev, copy=True)
    ptrs = k_in.unsafe_buffer_pointer(), v_in.unsafe_buffer_pointer()
    out, k_out, v_out = call(k_in, v_in, *inputs[5:])
    np.testing.assert_array_equal(np.asarray(out), ref_out)
    assert k_out.dtype == k_dev.dtype
    np.testing.assert_array_equal(np.asarray(k_out), want_k)
    np.testing.assert_array_equal(np.asarray(v_out), want_v)
    assert (k_out.unsafe_buffer_pointer(), v_out.unsafe_buffer_pointer()) == ptrs


def test_only_the_native_kernel_over_plain_pages_writes_in_the_step(monkeypatch):
    """The step stores the new K/V itself only where the native kernel serves plain pages on
    one device; quantized or paired pools, other backends and the ablation switch keep the
    separate ``write_kv`` call, and the executor follows the choice."""
    from research.engine.attention import writes_in_step
    from research.engine.kv_cache import KVPool
    from research.llm import LLM

    pages = [jnp.zeros((1, 2, 4, 8))]
    plain = KVPool(pages, pages)
    assert writes_in_step("native", plain)
    assert not writes_in_step("xla", plain)
    assert not writes_in_step("pallas_interpret", plain)
    assert not writes_in_step("native", KVPool(pages, pages, kv_dtype="fp8"))
    assert not writes_in_step("native", KVPool(pages, pages, layer_slots=(0, 0)))
    llm = LLM("tiny-llama", attention_backend="native", max_model_len=64, num_kv_blocks=8)
    assert llm.engine.executor.writes_in_step
    monkeypatch.setenv("RESEARCH_NATIVE_KV_WRITE", "0")
    assert not writes_in_step("native", plain)


def test_auto_resolves_to_native_on_cpu_only_where_it_serves():
    assert resolve_attention_backend("auto", jnp.float32, "auto") == "native"
    assert resolve_attention_backend("auto", jnp.bfloat16, "auto") == "native"
    assert resolve_attention_backend("auto", jnp.float32, "fp8") == "xla"
    assert resolve_attention_backend("auto", jnp.float16, "auto") == "xla"
    assert resolve_attention_backend("auto", jnp.float32, "auto", sharded=True) == "native"
    assert "kv_cache_dtype='int4'" in native_supports(jnp.float32, "int4")
    with pytest.raises(ValueError, match=r"native.*kv_cache_dtype='fp8'"):
        resolve_attention_backend("native", jnp.float32, "fp8")
    with pytest.raises(ValueError, match="attention_backend must be"):
        resolve_attention_backend("cuda", jnp.float32, "auto")
    from research.models.presets import get_preset

    gpt_oss = get_preset("tiny-gpt-oss")  # sliding windows and sinks: the XLA path serves it
    assert resolve_attention_backend("auto", jnp.float32, "auto", cfg=gpt_oss) == "xla"
    with pytest.raises(ValueError, match="sliding windows and attention sinks"):
        resolve_attention_backend("native", jnp.float32, "auto", cfg=gpt_oss)


def test_engine_greedy_native_equals_xla_under_preemption():
    """tiny-llama in float32, prompts across page boundaries and a pool small enough to preempt:
    the same greedy tokens through the native kernel and the XLA gather path."""
    from research.llm import LLM

    prompts = [np.random.default_rng(n).integers(0, 256, size=n).tolist() for n in (3, 17, 40, 9)]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs, preempted = {}, {}
    for backend in ("xla", "native"):
        llm = LLM(
            "tiny-llama",
            attention_backend=backend,
            max_model_len=128,
            max_num_seqs=4,
            num_kv_blocks=12,
            block_size=8,
        )
        assert llm.engine.executor.backend == backend
        outs[backend] = [o.token_ids for o in llm.generate(prompts, sp)]
        preempted[backend] = llm.engine.stats()["num_preemptions"]
    assert preempted["native"] > 0
    assert outs["native"] == outs["xla"]


def test_smollm2_greedy_native_equals_xla(smollm2_llm):
    """Real weights (float32): the native kernel's tokens are the XLA path's, prompt and decode."""
    from research.config import CacheConfig, SchedulerConfig
    from research.engine.engine import Engine

    tok = smollm2_llm.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": text}])
        for text in ("What is the capital of France?", "Name three prime numbers.")
    ]
    sp = SamplingParams(max_tokens=16, temperature=0.0)
    outs = {}
    for backend in ("xla", "native"):
        engine = Engine(
            smollm2_llm.model_config,
            smollm2_llm.params,
            tok,
            cache_config=CacheConfig(num_kv_blocks=32),
            scheduler_config=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32),
            max_model_len=256,
            attention_backend=backend,
        )
        outs[backend] = [o.token_ids for o in engine.generate(prompts, [sp, sp])]
    assert outs["native"] == outs["xla"]
