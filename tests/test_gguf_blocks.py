"""4-bit and 8-bit weights kept as stored: GGUF's Q4_1 and Q8_0 blocks (``quantization="gguf"``)
and AWQ int4 (``quantization="awq"`` on the native path): the panel packing against ``gguf``'s
and ``research.quant``'s own dequantization, the native kernel against an exact emulation of its
float32 arithmetic (any CPU), and the engine against the dequantized model."""

from __future__ import annotations

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research import native
from research.native import gemm

built = pytest.mark.skipif(
    not gemm.available(), reason=f"native gemm unavailable: {native.build_error('gemm')}"
)
fused = pytest.mark.skipif(
    gemm.available() and not gemm.fused_multiply_add(),
    reason="a build without FMA rounds each product before its sum (the emulation fuses them)",
)
TYPES = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}


def random_blocks(fmt: str, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF bytes of a random [N, K] weight quantized by ``gguf`` ([N, K/32 * block bytes]),
    and its dequantization W [K, N] float32."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    rows = gguf.quants.quantize(w, TYPES[fmt])
    return rows, gguf.quants.dequantize(rows, TYPES[fmt]).reshape(n, k).T.astype(np.float32)


def random_awq(n: int, k: int, seed: int, group: int = 64):
    """A random W [K, N] quantized to AWQ int4 (``research.quant``) and its dequantization."""
    from research.quant import dequantize, quantize

    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)
    qt = quantize(jnp.asarray(w), "awq", group_size=group)
    return qt, np.asarray(dequantize(qt), np.float32)


def blocks(fmt: str, n: int, k: int, seed: int) -> gemm.BlockWeight:
    if fmt == "awq":
        return gemm.pack_blocks(gemm.awq_rows(random_awq(n, k, seed)[0]), "awq")
    return gemm.pack_blocks(random_blocks(fmt, n, k, seed)[0], fmt)


def f32(v):
    return np.asarray(v, np.float64).astype(np.float32)


def block_sum(xb: np.ndarray) -> np.ndarray:
    """Each row's sum of its 32 x [rows, 32] in the kernel's order: lane l (of 8) adds x[l],
    x[8 + l], x[16 + l], x[24 + l] in turn, then lanes l and l + 4, l and l + 2, the last two."""
    s = ((xb[:, 0:8] + xb[:, 8:16]) + xb[:, 16:24]) + xb[:, 24:32]
    a = s[:, 0:4] + s[:, 4:8]
    return (a[:, 0] + a[:, 2]) + (a[:, 1] + a[:, 3])


def block_reference(x: np.ndarray, w: gemm.BlockWeight) -> np.ndarray:
    """The kernel's arithmetic, exactly: per column and 32-k block, two float32 sums of x times
    the codes (Q4_1: k < 16 and k >= 16; Q8_0: even and odd k), each a chain of fused
    multiply-adds (emulated in float64, exact for these products and sums, then rounded once),
    then y = fma(d, s0 + s1, y) and, for Q4_1, y = fma(m, sum of x over the block, y) (AWQ:
    m = -(d z), exact in float32; the sum in ``block_sum``'s order)."""
    n = w.shape[1]
    p = np.asarray(w.packed)
    g, kbs = p.shape[:2]
    x = np.asarray(x, np.float32)
    y = np.zeros((x.shape[0], n), np.float32)
    for kb in range(kbs):
        tile = p[:, kb]  # [g, bytes]
        d = tile[:, 0:64].copy().view(np.float16).astype(np.float64).reshape(-1)
        xb = x[:, kb * 32 : kb * 32 + 32]
        if w.fmt != "q8_0":
            m = tile[:, 64:128].copy().view(np.float16).astype(np.float64).reshape(-1)
            if w.fmt == "awq":  # the zero point: m = -(d z)
                m = -(d * m)
            pairs = tile[:, 128:].reshape(g, 4, 32, 4)  # [g, word, c, byte]
            q = np.stack([pairs & 15, pairs >> 4], -1).transpose(1, 3, 4, 0, 2).reshape(32, n)
            chains = [[(kk, q[kk]) for kk in range(16)], [(kk, q[kk]) for kk in range(16, 32)]]
        else:
            q = tile[:, 64:].reshape(g, 8, 32, 4).transpose(1, 3, 0, 2).reshape(32, n).view(np.int8)
            chains = [[(kk, q[kk]) for kk in range(0, 32, 2)],
                      [(kk, q[kk]) for kk in range(1, 32, 2)]]  # fmt: skip
        sums = []
        for chain in chains:
            s = np.zeros_like(y)
            for kk, q in chain:
                s = f32(np.outer(xb[:, kk], q.astype(np.float64)) + s)
            sums.append(s)
        y = f32(d * (sums[0] + sums[1]).astype(np.float64) + y)
        if w.fmt != "q8_0":
            y = f32(np.outer(block_sum(xb).astype(np.float64), m) + y)
    return y


def int8_reference(x: np.ndarray, w: gemm.BlockWeight, fused: bool = True) -> np.ndarray:
    """The kernel's arithmetic with int8 activations, exactly: each row's 32-k block quantized
    (a = max |x|, dx = a / 127, q = rint(x * (1 / dx)), ties to even, in float32), the block's
    integer sum of q times the codes, then y = fma(d, dx * sum, y) and, for Q4_1 and AWQ,
    y = fma(m, the block's float32 sum of x, y). ``fused=False``: a build without FMA rounds
    each product before its sum."""
    n = w.shape[1]
    p = np.asarray(w.packed)
    g, kbs = p.shape[:2]
    x = np.asarray(x, np.float32)
    y = np.zeros((x.shape[0], n), np.float32)

    def fma(a, b, c):  # a * b + c rounded once to float32 (or twice without FMA)
        prod = a.astype(np.float64) * b.astype(np.float64)
        return f32((prod if fused else f32(prod)).astype(np.float64) + c)

    for kb in range(kbs):
        tile = p[:, kb]
        d = tile[:, 0:64].copy().view(np.float16).astype(np.float32).reshape(-1)
        xb = x[:, kb * 32 : kb * 32 + 32]
        dx = np.abs(xb).max(1) / np.float32(127)
        inv = np.divide(np.float32(1), dx, out=np.zeros_like(dx), where=dx != 0)
        q = np.clip(np.rint(xb * inv[:, None]), -127, 127).astype(np.int64)
        if w.fmt != "q8_0":
            pairs = tile[:, 128:].reshape(g, 4, 32, 4)
            c = np.stack([pairs & 15, pairs >> 4], -1).transpose(1, 3, 4, 0, 2).reshape(32, n)
        else:
            c = tile[:, 64:].reshape(g, 8, 32, 4).transpose(1, 3, 0, 2).reshape(32, n)
            c = c.view(np.int8)
        t = f32(dx[:, None].astype(np.float64) * (q @ c.astype(np.int64)).astype(np.float32))
        y = fma(np.broadcast_to(d, y.shape), t, y)
        if w.fmt != "q8_0":
            m = tile[:, 64:128].copy().view(np.float16).astype(np.float32).reshape(-1)
            if w.fmt == "awq":  # the zero point: m = -(d z)
                m = f32(-(d.astype(np.float64) * m))
            y = fma(block_sum(xb)[:, None], np.broadcast_to(m, y.shape), y)
    return y


@pytest.fixture(scope="module")
def bundled():
    from research.models.weights import smollm2_gguf_path

    return {t.name: t for t in gguf.GGUFReader(str(smollm2_gguf_path())).tensors}


@pytest.mark.parametrize(
    "name", ["blk.0.attn_q.weight", "blk.3.ffn_down.weight", "token_embd.weight"]
)
def test_panels_hold_exactly_the_files_blocks(bundled, name):
    """The bundled GGUF's tensors (Q4_1 layers, the Q8_0 embedding): unpacking the panels gives
    what ``gguf`` dequantizes, for every weight."""
    t = bundled[name]
    fmt = t.tensor_type.name.lower()
    w = gemm.pack_blocks(np.asarray(t.data), fmt)
    ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(t.data.shape[0], -1).T
    assert w.shape == ref.shape and w.packed.dtype == jnp.uint8
    assert w.packed.nbytes == t.n_bytes  # as stored: no byte more than the file's
    np.testing.assert_array_equal(gemm.unpack_blocks(w), ref.astype(np.float32))


@built
@fused
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "awq"])
@pytest.mark.parametrize("m", [1, 2, 3, 65])
def test_block_kernel_is_its_exact_float32_arithmetic(fmt, m):
    w = blocks(fmt, 96, 128, seed=m)
    x = np.random.default_rng(100 + m).standard_normal((m, 128)).astype(np.float32)
    y = np.asarray(jax.jit(gemm.block_matmul)(jnp.asarray(x), w))
    np.testing.assert_array_equal(y, block_reference(x, w))
    xb = jnp.asarray(x, jnp.bfloat16)  # bfloat16 rows are widened first: the same sums
    yb = np.asarray(jax.jit(gemm.block_matmul)(xb, w))
    np.testing.assert_array_equal(yb, block_reference(np.asarray(xb, np.float32), w))


@built
@fused
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "awq"])
@pytest.mark.parametrize("m", [1, 2, 5, 65])
def test_int8_activations_are_their_exact_integer_arithmetic(fmt, m):
    """activations="int8" (llama.cpp's arithmetic): the kernel equals ``int8_reference`` bit
    for bit (a block of zeros, large and tiny blocks and a rounding tie included), and a
    row's result does not depend on the rows beside it (the same bits alone as in a batch of
    ``m``)."""
    w = dataclasses.replace(blocks(fmt, 96, 128, seed=m), activations="int8")
    rng = np.random.default_rng(200 + m)
    x = rng.standard_normal((m, 128)).astype(np.float32)
    x[0, :32] = 0.0  # dx = 0: the block adds nothing
    x[-1, 32:64] *= 1e3
    x[-1, 64:96] *= 1e-4
    # x * (1 / dx) is 113.5 in float32 but 113.4999995 exactly: a build that fused the product
    # into the rounding would give 113, the emulation (and the kernel) 114
    x[-1, 96:128] = np.clip(x[-1, 96:128], -0.5, 0.5)
    x[-1, 96], x[-1, 97] = np.float32(1.0045587), np.float32(0.8977749)
    run = jax.jit(gemm.block_matmul)
    y = np.asarray(run(jnp.asarray(x), w))
    np.testing.assert_array_equal(y, int8_reference(x, w))
    np.testing.assert_array_equal(np.asarray(run(jnp.asarray(x[-1:]), w))[0], y[-1])
    float_w = dataclasses.replace(w, activations="float")
    assert not np.array_equal(np.asarray(run(jnp.asarray(x), float_w)), y)  # the attribute acts


@pytest.mark.parametrize("group", [32, 64, 128])
def test_awq_blocks_hold_exactly_the_dequantized_weights(group):
    """AWQ codes, scales and zero points re-tiled (0.625 bytes per weight): every weight comes
    back as ``research.quant.dequantize`` gives it, whatever the group size (a block shares
    its group's scale and zero point)."""
    qt, ref = random_awq(96, 256, seed=group, group=group)
    w = gemm.pack_blocks(gemm.awq_rows(qt), "awq")
    assert w.shape == (256, 96) and w.packed.nbytes == 256 * 96 * 5 // 8
    np.testing.assert_array_equal(gemm.unpack_blocks(w), ref)


@built
def test_gate_up_blocks_give_silu_gate_times_up():
    gate, wg = random_blocks("q4_1", 64, 96, seed=1)
    up, wu = random_blocks("q4_1", 64, 96, seed=2)
    fused = gemm.pack_blocks(gemm.gate_up_rows(gate, up), "q4_1", epilogue="swiglu")
    assert fused.out_features == 64
    x = np.random.default_rng(3).standard_normal((5, 96)).astype(np.float32)
    h = np.asarray(jax.jit(gemm.block_matmul)(jnp.asarray(x), fused))
    g, u = (x.astype(np.float64) @ w.astype(np.float64) for w in (wg, wu))
    ref = g / (1 + np.exp(-g)) * u
    np.testing.assert_allclose(h, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_blocks_refuse_what_does_not_tile():
    rows, _ = random_blocks("q4_1", 48, 64, seed=0)
    with pytest.raises(ValueError, match="do not tile"):
        gemm.pack_blocks(rows, "q4_1")
    with pytest.raises(ValueError, match="not one of"):
        gemm.pack_blocks(rows, "q4_k")


def test_gguf_quantization_is_refused_where_it_cannot_run():
    from research import LLM

    with pytest.raises(ValueError, match=r"not a \.gguf file or a bundled GGUF preset"):
        LLM("tiny-llama", quantization="gguf")
    with pytest.raises(ValueError, match="simulator prices GGUF formats"):
        LLM("smollm2-135m", quantization="gguf", executor="simulated", hardware="gb10")
    with pytest.raises(ValueError, match='gemm_backend="xla" dequantizes'):
        LLM("smollm2-135m", quantization="gguf", gemm_backend="xla")


def greedy(llm, tokens: int) -> list[list[int]]:
    """``llm``'s greedy tokens on the parity prompts."""
    from research import SamplingParams
    from tests.test_parity_smollm2 import PROMPTS

    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]


@built
def test_smollm2_as_stored_blocks_decodes_as_its_dequantized_twin(smollm2_llm):
    """block_activations="float": the blocks hold exactly the dequantized model's weights, so logits
    differ by summation order only and greedy tokens on the parity prompts are identical."""
    from research import LLM
    from research.models.transformer import compute_logits

    llm = LLM(
        "smollm2-135m",
        max_model_len=1024,
        dtype="float32",
        quantization="gguf",
        block_activations="float",
    )
    params = llm.engine.executor.params
    assert isinstance(params["layers"][0]["wqkv"], gemm.BlockWeight)
    assert params["layers"][0]["w_gate_up"].fmt == "q4_1" and params["lm_head"].fmt == "q8_0"
    hidden = jnp.asarray(np.random.default_rng(0).standard_normal((3, 576)), jnp.float32)
    ours = np.asarray(compute_logits(params, llm.model_config, hidden))
    ref = np.asarray(compute_logits(smollm2_llm.params, llm.model_config, hidden))
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
    assert greedy(llm, 32) == greedy(smollm2_llm, 32)


@built
def test_smollm2_int8_activations_stay_within_a_kl_bound_of_float_activations():
    """quantization="gguf" takes int8 activations by default (llama.cpp's arithmetic): on the
    bundled blocks, the next-token distributions over ``TEXT`` stay within a bound of the same
    blocks' with float activations: measured 0.025 nats mean KL and 3 of 35 top tokens changed
    (float32), 0.026 / 2 (bfloat16), about what float8 weights cost this model
    (``WEIGHT_BOUNDS``); a wrong code order or scale moves the KL by nats."""
    from research import LLM
    from tests.test_quantized_smollm2 import TEXT, _distributions

    llm = LLM("smollm2-135m", max_model_len=1024, dtype="float32", quantization="gguf")
    params = llm.engine.executor.params
    assert params["layers"][0]["wqkv"].activations == "int8"
    assert params["lm_head"].activations == "int8"
    ids = llm.tokenizer.encode(TEXT)
    got = _distributions(llm, params, ids)
    ref = _distributions(llm, gemm.with_activations(params, "float"), ids)
    kl = float(jnp.mean(jnp.sum(jnp.exp(ref) * (ref - got), axis=-1)))
    flips = float(jnp.mean(jnp.argmax(ref, -1) != jnp.argmax(got, -1)))
    assert 0.0 < kl < 0.04, f"mean KL {kl:.4f} nats"
    assert flips <= 5 / 35, f"top token changed at {flips:.1%} of positions"


@built
def test_smollm2_awq_through_the_block_kernel_decodes_as_xla_dequantizing():
    """quantization="awq" on the native path: every projection a block weight of the AWQ
    codes as stored (q/k/v and gate/up fused), decoding the parity prompts to the same greedy
    tokens as XLA multiplying the dequantized weights (float32, so that path rounds no weight:
    the two differ by summation order only)."""
    from research import LLM

    kw = dict(max_model_len=1024, dtype="float32", quantization="awq")
    ours = LLM("smollm2-135m", **kw)
    xla = LLM("smollm2-135m", gemm_backend="xla", **kw)
    lp = ours.engine.executor.params["layers"][0]
    assert lp["wqkv"].fmt == "awq" and lp["w_gate_up"].epilogue == "swiglu"
    assert isinstance(lp["w_down"], gemm.BlockWeight) and "wq" not in lp
    assert greedy(ours, 24) == greedy(xla, 24)


@built
def test_awq_params_pack_into_fused_blocks_and_forward_as_dequantized():
    """The fast tier's check of the above on a random-weight model: ``pack_params`` turns each
    AWQ projection into blocks (q/k/v and gate/up fused), and the forward pass's hidden states
    agree with XLA's on the dequantized weights to float32 rounding."""
    from research.models.presets import get_preset
    from research.models.transformer import ContiguousKVCache, forward, init_params
    from research.quant import quantize_params

    cfg = get_preset("tiny-llama")
    params = quantize_params(init_params(cfg, jax.random.key(0)), "awq")
    packed = gemm.pack_params(params, cfg.tie_word_embeddings)
    assert {"wqkv", "wo", "w_gate_up", "w_down"} <= set(packed["layers"][0])
    assert all(isinstance(packed["layers"][0][key], gemm.BlockWeight) for key in ("wqkv", "wo"))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)))
    positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
    run = jax.jit(
        lambda p: forward(p, cfg, tokens, positions, ContiguousKVCache.create(cfg, 2, 9))[0]
    )
    ours, ref = np.asarray(run(packed)), np.asarray(run(params))
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
