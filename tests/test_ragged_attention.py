"""The ragged paged-attention kernel (interpreted on CPU) against its jnp reference on
property-generated steps: ragged mixes of decodes and prefill chunks, chunks starting inside a
page, padded rows and tokens, sliding-window edges, sinks, the split-KV variant, and every page
format. Every page slot no row may read (unused pages, the tail of each row's context, pages
the tables point to past the context) holds NaN, so a read that escapes the masks shows up.
"""

from __future__ import annotations

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from pallas_kernels.ragged_attention import (
    num_query_blocks,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from research.config import CacheConfig, SchedulerConfig
from research.quant.kv import quantize_kv

INTERPRET = jax.default_backend() != "gpu"
N, R, M, S, P = 32, 6, 8, 4, 64  # tokens, rows, table width, page size, pages in the pool
HEADS, KV_HEADS, D = 6, 2, 32  # a group of 3 (padded to 4 in the tile)
FORMATS = {  # q dtype, kv format, tolerance
    "float32": (jnp.float32, "auto", 2e-5),
    "bfloat16": (jnp.bfloat16, "auto", 3e-2),
    "fp8": (jnp.float32, "fp8", 2e-5),
    "int4": (jnp.float32, "int4", 2e-5),
}
VARIANTS = {  # window, sinks, kv_splits
    "plain": (None, False, 1),
    "window_sinks": (7, True, 1),
    "split": (None, False, 3),
    "split_window_sinks": (5, True, 3),
}


@st.composite
def steps(draw):
    """(context, new tokens) per row: R rows, at most N tokens in all, contexts up to M S - new
    tokens; some rows padded (0 new tokens, context 0)."""
    rows = []
    budget = N
    for _ in range(R):
        new = draw(st.integers(0, min(budget, 12)))
        ctx = draw(st.integers(0, M * S - new)) if new else 0
        budget -= new
        rows.append((ctx, new))
    return rows


def _build(rows, fmt, seed, sinks):
    q_dtype, kv, _ = FORMATS[fmt]
    rng = np.random.default_rng(seed)
    qsl = np.concatenate([[0], np.cumsum([n for _, n in rows])]).astype(np.int32)
    ctx = np.array([c for c, _ in rows], np.int32)
    tables = rng.permutation(P)[: R * M].reshape(R, M).astype(np.int32)
    k = rng.standard_normal((KV_HEADS, P, S, D)).astype(np.float32)
    v = rng.standard_normal((KV_HEADS, P, S, D)).astype(np.float32)
    used = np.zeros((P, S), bool)
    for r, (c, _) in enumerate(rows):
        for t in range(c):
            used[tables[r, t // S], t % S] = True
    k[:, ~used], v[:, ~used] = np.nan, np.nan  # everything no row may read
    q = jnp.asarray(rng.standard_normal((N, HEADS, D)), q_dtype)
    k_new = jnp.asarray(rng.standard_normal((N, KV_HEADS, D)), q_dtype)
    v_new = jnp.asarray(rng.standard_normal((N, KV_HEADS, D)), q_dtype)
    extra = {}
    if kv == "auto":
        kp, vp = jnp.asarray(k, q_dtype), jnp.asarray(v, q_dtype)
    else:
        kp, ks = quantize_kv(jnp.asarray(k), kv)
        vp, vs = quantize_kv(jnp.asarray(v), kv)
        extra = dict(k_scales=ks, v_scales=vs)
    if sinks:
        extra["sinks"] = jnp.asarray(rng.standard_normal(HEADS), jnp.float32)
    args = (q, k_new, v_new, kp, vp, jnp.asarray(tables), jnp.asarray(qsl), jnp.asarray(ctx))
    return args, extra, qsl


@functools.cache
def _kernel(window, splits):
    return jax.jit(
        functools.partial(
            ragged_paged_attention,
            window=window,
            kv_splits=splits,
            block_rows=16,
            pages_per_compute_block=4,
            new_block=16,
            interpret=INTERPRET,
        )
    )


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", FORMATS)
@settings(
    max_examples=5,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(rows=steps(), seed=st.integers(0, 2**16))
def test_kernel_matches_reference(fmt, variant, rows, seed):
    window, sinks, splits = VARIANTS[variant]
    args, extra, qsl = _build(rows, fmt, seed, sinks)
    got = np.asarray(_kernel(window, splits)(*args, **extra).astype(jnp.float32))
    want = np.asarray(
        ragged_paged_attention_reference(*args, window=window, **extra).astype(jnp.float32)
    )
    assert np.isfinite(got).all()  # no NaN page was read
    assert (got[qsl[-1] :] == 0).all()  # padded tokens are never written
    tol = FORMATS[fmt][2]
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def test_one_compile_serves_every_mix():
    """Grid and shapes depend on (N, R, M) only: three different mixes, one compile."""
    kernel = _kernel(None, 1)
    mixes = [
        [(0, 12), (3, 1), (0, 0), (9, 7), (30, 1), (0, 0)],  # prefill chunks and decodes
        [(5, 1)] * R,  # decodes only
        [(0, 32), (0, 0), (0, 0), (0, 0), (0, 0), (0, 0)],  # one prompt fills the step
    ]
    before = kernel._cache_size()
    for i, rows in enumerate(mixes):
        args, extra, _ = _build(rows, "float32", i, sinks=False)
        want = ragged_paged_attention_reference(*args, **extra)
        np.testing.assert_allclose(kernel(*args, **extra), want, atol=2e-5, rtol=2e-5)
    assert kernel._cache_size() - before <= 1


def test_grid_bound_covers_every_split_of_tokens():
    """sum_r ceil(n_r / Bq) <= N // Bq + R for every way to cut N tokens into R rows."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        n, r, bq = (
            int(rng.integers(1, 200)),
            int(rng.integers(1, 20)),
            int(rng.choice([1, 2, 4, 8])),
        )
        cuts = np.sort(rng.integers(0, n + 1, r - 1))
        sizes = np.diff(np.concatenate([[0], cuts, [n]]))
        assert sum(-(-s // bq) for s in sizes) <= num_query_blocks(n, r, bq)


def test_refuses_inconsistent_inputs():
    args, _, _ = _build([(0, 1)] * R, "float32", 0, sinks=False)
    q, k_new, v_new, kp, vp, tables, qsl, ctx = args
    with pytest.raises(ValueError, match="query_start_loc must be"):
        ragged_paged_attention(q, k_new, v_new, kp, vp, tables, qsl[:-1], ctx, interpret=True)
    with pytest.raises(ValueError, match="k_new must be"):
        ragged_paged_attention(q, k_new[:, :1], v_new, kp, vp, tables, qsl, ctx, interpret=True)
    with pytest.raises(ValueError, match="block_rows"):
        ragged_paged_attention(*args, block_rows=8, interpret=True)


@pytest.mark.parametrize("tokens,rows", [(64, 8), (8, 8)])  # a mixed step; a decode-sized one
def test_engine_step_launches_one_attention_kernel_per_layer(tokens, rows):
    """The engine's step lowered for CUDA with the Pallas backends (no GPU needed): one
    attention launch per layer whatever the mix (the decode-sized step takes the split-KV
    variant, still one launch), and the experts' three GEMMs per layer."""
    from pallas_kernels.launches import step_launches

    got = step_launches("tiny-qwen3-moe", "h200", tokens=tokens, rows=rows)
    layers = got["layers"]
    attention = {k: v for k, v in got["kernels"].items() if "attention" in k}
    assert attention == {
        "ragged_paged_attention_auto" + ("_split" if tokens == rows else ""): layers
    }
    # gate and up, then down with the router weights in its epilogue
    assert got["kernels"]["grouped_experts_plain"] == 2 * layers
    assert got["kernels"]["grouped_experts_plain_scaled"] == layers


def test_tuning_table_entries_and_the_stated_fallback():
    """The engine's blocks come from the table where it has the shape, else from the rules,
    and the source says which; the split-KV variant only for decode-sized steps of few rows."""
    from pallas_kernels.tuning import (
        TARGETS,
        RaggedAttentionConfig,
        ragged_attention_config,
        table_key,
        tuning_table,
    )

    h200 = TARGETS["h200"]
    shape = dict(q_dtype=jnp.bfloat16, kv="int4", head_dim=128, group=8)
    config, source = ragged_attention_config(h200, **shape, decode=False)
    key = table_key("h200", "ragged_attention", q="bfloat16", kv="int4", d=128, g=8, step="mixed")
    assert source == f"table: {tuning_table()[key]['source']}"
    assert "sm_90" in source
    assert config == RaggedAttentionConfig(**tuning_table()[key]["config"])
    few, _ = ragged_attention_config(h200, **shape, decode=True, num_rows=4)
    many, _ = ragged_attention_config(h200, **shape, decode=True, num_rows=64)
    assert few.kv_splits > 1 and many.kv_splits == 1
    _, source = ragged_attention_config(h200, **{**shape, "head_dim": 256}, decode=False)
    assert source.startswith("rule: no table entry for h200|ragged_attention|d=256")


def test_engine_greedy_tokens_with_pallas_equal_xla_on_mixed_steps(smollm2_llm):
    """SmolLM2-135M (real weights) on the parity prompts, with an 8-token budget so prompts
    arrive as prefill chunks beside other rows' decodes: the Pallas backends (the ragged kernel,
    interpreted) give the XLA reference's greedy tokens, and the mixed steps ran as one
    forward pass each."""
    from research.engine.engine import Engine
    from research.engine.request import SamplingParams
    from tests.test_parity_smollm2 import PROMPTS

    tok = smollm2_llm.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * len(prompts)
    tokens, mixed = {}, {}
    for backend in ("xla", "pallas_interpret"):
        engine = Engine(
            smollm2_llm.model_config,
            smollm2_llm.params,
            tok,
            cache_config=CacheConfig(num_kv_blocks=64, block_size=8),
            scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8),
            max_model_len=128,
            attention_backend=backend,
        )
        execute = engine.executor.execute
        steps = []

        def recording(plan, execute=execute, steps=steps):
            result = execute(plan)
            steps.append((bool(plan.decodes), bool(plan.prefills), result.forward_passes))
            return result

        engine.executor.execute = recording
        tokens[backend] = [o.token_ids for o in engine.generate(prompts, params)]
        mixed[backend] = [s for s in steps if s[0] and s[1]]
        assert all(passes == 1 for *_, passes in steps)
    assert tokens["pallas_interpret"] == tokens["xla"]
    assert len(mixed["pallas_interpret"]) >= 2  # decodes and prefill chunks shared steps


def test_grouped_experts_blocks_from_the_table_by_m_bucket():
    """Expert GEMMs take the table's blocks for their M bucket (decode-sized calls 16 rows per
    tile, long prefills more), the block_k fitted to K; unknown shapes get the stated rules."""
    from pallas_kernels.tuning import TARGETS, grouped_experts_config

    gb10 = TARGETS["gb10"]
    shape = dict(x_dtype=jnp.bfloat16, fmt="awq", experts=128, k=2048, n=768)
    decode, source = grouped_experts_config(gb10, **shape, m=8 * 8)
    assert source.startswith("table: offline for sm_121")
    prefill, _ = grouped_experts_config(gb10, **shape, m=8192)
    assert decode["block_m"] == 16 and prefill["block_m"] > decode["block_m"]
    assert 2048 % decode["block_k"] == 0
    _, source = grouped_experts_config(gb10, **{**shape, "n": 1000}, m=64)
    assert source.startswith("rule: no table entry for gb10|grouped_experts")
