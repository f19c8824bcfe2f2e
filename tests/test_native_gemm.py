"""The AMX bfloat16 matrix product (``research.native.gemm``): packing, products against a
float64 reference on the same bf16 values, batch invariance, and the engine through it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.native import gemm

amx = pytest.mark.skipif(
    not gemm.available(), reason=f"AMX kernel unavailable: {gemm.unavailable_reason('bfloat16')}"
)


@pytest.mark.parametrize("transposed", [False, True])
def test_pack_round_trips_and_rejects_shapes_that_do_not_tile(transposed):
    w = jnp.asarray(np.random.default_rng(0).standard_normal((96, 64)), jnp.bfloat16)
    packed = gemm.pack(w.T if transposed else w, transposed=transposed)
    assert packed.shape == (96, 64) and packed.packed.shape == (2, 3, 2, 16, 32)
    np.testing.assert_array_equal(np.asarray(gemm.unpack(packed)), np.asarray(w))
    with pytest.raises(ValueError, match=r"\[96, 48\] weight does not tile"):
        gemm.pack(w[:, :48])


@amx
@pytest.mark.parametrize("m", [1, 2, 15, 16, 17, 31, 32, 33, 64, 130, 300])
def test_products_match_a_float64_reference(m):
    """Row counts across the kernel's 16-row tails, 32-row pairs and 128-row units."""
    rng = np.random.default_rng(m)
    k, n = 96, 160
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    y = np.asarray(jax.jit(gemm.matmul)(x, gemm.pack(w)))
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert y.dtype == np.float32 and y.shape == (m, n)
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@amx
@pytest.mark.parametrize("m", [1, 17, 40])
def test_bfloat16_output_and_the_swiglu_epilogue(m):
    """bfloat16 output is the float32 product rounded to nearest even; a gate/up pair gives
    silu(x W_gate) * (x W_up) in one product; q/k/v packed together give their concatenation."""
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, 64)), jnp.bfloat16)
    wg, wu = (jnp.asarray(rng.standard_normal((64, 64)) * 0.2, jnp.bfloat16) for _ in range(2))
    f32 = np.asarray(jax.jit(gemm.matmul)(x, gemm.pack(wg)))
    bf16 = jax.jit(lambda x, w: gemm.matmul(x, w, jnp.bfloat16))(x, gemm.pack(wg))
    assert bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(bf16), np.asarray(jnp.asarray(f32, jnp.bfloat16)))
    fused = gemm.pack_gate_up(wg, wu)
    assert fused.out_features == 64
    h = np.asarray(jax.jit(gemm.matmul)(x, fused))
    gate, up = (np.asarray(x, np.float64) @ np.asarray(w, np.float64) for w in (wg, wu))
    ref = gate / (1 + np.exp(-gate)) * up
    np.testing.assert_allclose(h, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    wk = jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16)
    qkv = np.asarray(jax.jit(gemm.matmul)(x, gemm.pack_qkv(wg, wk, wu)))
    np.testing.assert_array_equal(qkv[:, :64], f32)


@amx
def test_a_rows_product_does_not_depend_on_its_batch():
    """Each output is one dot product in a fixed order: a row gives the same bits alone, at
    another offset, or among 200 others (the engine's batch invariance rests on it)."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((200, 576)), jnp.bfloat16)
    w = gemm.pack(jnp.asarray(rng.standard_normal((576, 192)), jnp.bfloat16))
    f = jax.jit(gemm.matmul)
    full = np.asarray(f(x, w))
    for rows in (slice(7, 8), slice(0, 33), slice(150, 200)):
        np.testing.assert_array_equal(np.asarray(f(x[rows], w)), full[rows])


def test_resolve_picks_xla_where_the_kernel_cannot_serve():
    assert gemm.resolve("auto", jnp.float32) == "xla"
    assert gemm.resolve("xla", jnp.bfloat16) == "xla"
    assert gemm.resolve("auto", jnp.bfloat16, sharded=True) == "xla"
    with pytest.raises(ValueError, match=r'gemm_backend="native" cannot serve float32'):
        gemm.resolve("native", jnp.float32)
    with pytest.raises(ValueError, match="gemm_backend must be one of"):
        gemm.resolve("amx", jnp.bfloat16)
    if gemm.available():
        assert gemm.resolve("auto", jnp.bfloat16) == "native"


def test_pack_params_fuses_and_packs_projections_only():
    """q/k/v fuse into wqkv (q, then k, then v) and a dense MLP's gate/up into w_gate_up (per
    16-column panel: gate, then up) where they tile; wo and w_down are packed alone; norms, 3-D
    expert stacks, the router and the embedding stay; a tied embedding gains a packed lm_head
    (its transpose); a projection that does not tile stays unfused. Random weights and the
    exact inverse (``unpack``): a swapped q/k/v or gate/up order, or a wrong transpose, fails
    here, on any CPU (no AMX needed)."""
    bf = jnp.bfloat16
    rng = np.random.default_rng(0)

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape), bf)

    dense = {"attn_norm": w(64), "w_down": w(96, 64)}
    dense |= {key: w(64, 96) for key in ("wq", "wk", "wv", "wo", "w_gate", "w_up")}
    moe = {
        "wq": w(64, 96),
        "wk": w(64, 40),  # 40 outputs: does not tile, so no wqkv
        "wv": w(64, 96),
        "w_gate": w(4, 64, 32),  # experts: not 2-D projections
        "w_up": w(4, 64, 32),
        "router": w(64, 32),
    }
    params = {"embed": w(128, 64), "layers": [dense, moe]}
    packed = gemm.pack_params(params, tie_word_embeddings=True)
    d, m = packed["layers"]
    assert sorted(d) == ["attn_norm", "w_down", "w_gate_up", "wo", "wqkv"]
    assert d["wqkv"].shape == (64, 288) and d["w_gate_up"].out_features == 96

    def same(a, b):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    same(gemm.unpack(d["wqkv"]), jnp.concatenate([dense["wq"], dense["wk"], dense["wv"]], 1))
    panels = np.asarray(gemm.unpack(d["w_gate_up"]), np.float32).reshape(64, 6, 2, 16)
    same(panels[:, :, 0].reshape(64, 96), dense["w_gate"])
    same(panels[:, :, 1].reshape(64, 96), dense["w_up"])
    same(gemm.unpack(d["wo"]), dense["wo"])
    same(gemm.unpack(d["w_down"]), dense["w_down"])
    assert d["attn_norm"] is dense["attn_norm"]
    assert "wqkv" not in m and m["wk"] is moe["wk"]
    same(gemm.unpack(m["wq"]), moe["wq"])
    for key in ("w_gate", "w_up", "router"):
        assert m[key] is moe[key]
    assert packed["embed"] is params["embed"]
    same(gemm.unpack(packed["lm_head"]), params["embed"].T)
    assert "lm_head" not in gemm.pack_params(params, tie_word_embeddings=False)


@amx
def test_smollm2_bf16_through_the_kernel_matches_xla():
    """SmolLM2 in bfloat16 with packed weights: logits agree with XLA's bf16 products to bf16
    rounding, and greedy chat answers through the engine are XLA's, token for token."""
    from research import LLM, SamplingParams
    from research.models.transformer import compute_logits

    outs = {}
    for backend in ("native", "xla"):
        llm = LLM("smollm2-135m", dtype="bfloat16", max_model_len=256, gemm_backend=backend)
        ex = llm.engine.executor
        assert ex.gemm_backend == backend
        if backend == "native":
            assert isinstance(ex.params["layers"][0]["wqkv"], gemm.PackedWeight)
            hidden = jnp.asarray(np.random.default_rng(0).standard_normal((5, 576)), jnp.bfloat16)
            packed = compute_logits(ex.params, ex.cfg, hidden)
            plain = compute_logits(llm.params, ex.cfg, hidden)
            np.testing.assert_allclose(np.asarray(packed), np.asarray(plain), atol=0.05, rtol=0.02)
        tok = llm.tokenizer
        prompts = [
            tok.apply_chat_template([{"role": "user", "content": text}])
            for text in ("What is the capital of France?", "Name three prime numbers.")
        ]
        sp = SamplingParams(max_tokens=16, temperature=0.0)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert outs["native"] == outs["xla"]
