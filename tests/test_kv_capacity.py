"""research.perf: machines as data, stored weight bytes, KV bytes per token, vLLM's KV capacity."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest

from research.config import ModelConfig
from research.models.presets import PRESETS, get_preset
from research.models.shapes import param_shapes
from research.perf import (
    HARDWARE,
    Hardware,
    estimate_activation_bytes,
    get_hardware,
    kv_bytes_per_token,
    kv_capacity,
    kv_capacity_blocks,
    kv_capacity_tokens,
    quantized_bytes,
    register_hardware,
    vllm_batch_defaults,
    weight_bytes,
)

GiB = 2**30


def test_perf_does_not_import_jax():
    code = "import sys, research.perf, research.perf.sizing; assert 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------------- hardware


def test_hardware_figures_are_reference_section_2():
    gb10, h200 = get_hardware("gb10"), get_hardware("h200")
    assert gb10.memory_bytes == 128 * GiB
    assert gb10.cuda_visible_bytes == round(119.6 * GiB)
    assert gb10.peak_bandwidth == 273e9 and gb10.achievable_bandwidth == 232e9
    assert gb10.copy_bandwidth == 218e9
    assert dict(gb10.tensor_flops) == {"bf16": 125e12, "fp8": 250e12, "fp4": 500e12}
    assert gb10.flops("bf16", measured=True) == 91e12 and gb10.flops("fp8", measured=True) == 250e12
    assert gb10.interconnect_bandwidth == 200e9 / 8  # ConnectX-7, 200 Gb/s
    assert (gb10.sm_count, gb10.compute_capability) == (48, "121")
    assert h200.memory_bytes == 141 * GiB
    assert h200.peak_bandwidth == 4.8e12 and h200.achievable_bandwidth == 4.3e12
    assert dict(h200.tensor_flops) == {"bf16": 990e12, "fp8": 1980e12}
    assert h200.flops("bf16", measured=True) == 790e12
    assert h200.interconnect_bandwidth == 900e9 and "NVLink" in h200.interconnect_kind
    with pytest.raises(ValueError, match="no fp4"):
        h200.flops("fp4")


def test_hardware_is_frozen_and_lookup_errors_list_names():
    gb10 = get_hardware("gb10")
    assert get_hardware(gb10) is gb10
    with pytest.raises(dataclasses.FrozenInstanceError):
        gb10.peak_bandwidth = 1.0
    with pytest.raises(TypeError):
        gb10.tensor_flops["bf16"] = 1.0
    with pytest.raises(ValueError, match=r"unknown hardware 'b200'.*gb10, h200"):
        get_hardware("b200")


def test_register_hardware():
    hw = Hardware("test-box", GiB, GiB, 1e11, 5e10, {"bf16": 1e13})
    try:
        assert register_hardware(hw) is hw and get_hardware("test-box") is hw
        with pytest.raises(ValueError, match="already registered"):
            register_hardware(hw)
        assert vllm_batch_defaults(hw) == (2048, 256)  # < 70 GiB: vLLM's small-GPU defaults
    finally:
        HARDWARE.pop("test-box", None)
    with pytest.raises(ValueError, match="achievable_bandwidth"):
        Hardware("bad", GiB, GiB, 1e11, 2e11, {"bf16": 1e13})
    with pytest.raises(ValueError, match="unknown"):
        Hardware("bad", GiB, GiB, 1e11, 5e10, {"bf16": 1e13, "int8": 1e13})


# ------------------------------------------------------------------------------ weight bytes


def test_param_shapes_are_what_init_params_allocates():
    import jax

    from research.models.transformer import init_params

    cfg = PRESETS["tiny-qwen3-moe"]
    params = init_params(cfg, jax.random.key(0))
    allocated = jax.tree.map(lambda a: a.shape, params)
    assert allocated == param_shapes(cfg)


def test_weight_bytes_by_hand_qwen3_awq():
    # Per layer, AWQ (group 128) stores I*O/2 codes + (I/128)*O*2 scale + (I/128)*O/2 zero bytes
    # = I*O * (1/2 + 2.5/128) bytes for a weight [I, O].
    awq = 0.5 + 2.5 / 128
    attention = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048  # wq, wk, wv, wo
    experts = 128 * 3 * 2048 * 768  # gate, up [2048, 768] and down [768, 2048] per expert
    unquantized = 2 * 2048 + 2 * 128 + 2048 * 128  # norms, q/k norms, router (bf16)
    layer = (attention + experts) * awq + unquantized * 2
    embeddings = 2 * 151936 * 2048 * 2 + 2048 * 2  # embed + lm_head (untied) + final norm
    expected = 48 * layer + embeddings
    assert expected == 16_802_672_640
    assert weight_bytes("qwen3-coder-30b-a3b", "awq") == expected
    # bf16: 2 bytes per parameter (30.5B parameters).
    assert weight_bytes("qwen3-30b-a3b", None) == 2 * 30_532_122_624


@pytest.mark.parametrize(
    ("name", "formats", "dtype"),
    [
        ("tiny-llama", (None, "awq", "nvfp4", "mxfp4", "fp8"), "float32"),
        ("tiny-qwen3-moe", (None, "awq", "nvfp4", "mxfp4", "fp8"), "float32"),
        ("tiny-qwen3", (None, "awq", "nvfp4"), "bfloat16"),
    ],
)
def test_weight_bytes_matches_the_quantizer(name, formats, dtype):
    import jax
    import jax.numpy as jnp

    from research.models.transformer import init_params
    from research.quant import quantize_params
    from research.quant import weight_bytes as stored_bytes

    cfg = get_preset(name)
    params = init_params(cfg, jax.random.key(0), jnp.dtype(dtype))
    for fmt in formats:
        assert weight_bytes(cfg, fmt, dtype) == stored_bytes(quantize_params(params, fmt)), fmt
    assert weight_bytes(cfg, None, jnp.dtype(dtype)) == weight_bytes(cfg, None, dtype)


def test_quantized_bytes_errors():
    with pytest.raises(ValueError, match="multiple of 8"):
        quantized_bytes((128, 12), "awq")
    with pytest.raises(ValueError, match="not a multiple of any"):
        quantized_bytes((48, 64), "awq")
    with pytest.raises(ValueError, match="multiple of 32"):
        quantized_bytes((48, 64), "mxfp4")
    with pytest.raises(ValueError, match="unknown quantization"):
        quantized_bytes((128, 64), "int3")
    with pytest.raises(ValueError, match="quantization must be one of"):
        weight_bytes("tiny-llama", "gptq")
    with pytest.raises(ValueError, match="unknown dtype"):
        weight_bytes("tiny-llama", None, "float8")
    with pytest.raises(ValueError, match="unknown model preset"):
        weight_bytes("no-such-model", None)


# ---------------------------------------------------------------------------- KV per token


@pytest.mark.parametrize(
    ("name", "bf16"),
    [("qwen3-coder-30b-a3b", 98_304), ("llama-3.3-70b", 327_680), ("smollm2-135m", 23_040)],
)
def test_kv_bytes_per_token_reference(name, bf16):
    cfg = get_preset(name)
    assert kv_bytes_per_token(cfg) == bf16
    # fp8: 1 byte per element + a 4-byte scale per (token, kv head); int4: half a byte + 4.
    heads = 2 * cfg.num_layers * cfg.num_kv_heads
    assert kv_bytes_per_token(cfg, "fp8") == heads * (cfg.head_dim + 4)
    assert kv_bytes_per_token(cfg, "int4") == heads * (cfg.head_dim // 2 + 4)
    assert kv_bytes_per_token(cfg, "auto", "float32") == 2 * bf16


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int4"])
@pytest.mark.parametrize("name", ["qwen3-coder-30b-a3b", "gpt-oss-120b", "tiny-llama"])
def test_kv_bytes_per_token_matches_the_pool(name, kv_dtype):
    import jax.numpy as jnp

    from research.engine.kv_cache import kv_pool_bytes_per_block

    cfg = get_preset(name)
    for dtype in ("bfloat16", "float32"):
        per_block = kv_pool_bytes_per_block(cfg, 16, jnp.dtype(dtype), kv_dtype)
        # gpt-oss: a block holds one kind of layer (sliding or full), 18 of the 36
        assert kv_bytes_per_token(cfg, kv_dtype, dtype, "pool") * 16 == per_block


def test_kv_bytes_per_token_errors():
    odd = ModelConfig("odd", "llama", 64, 24, 1, 2, 1, 3, intermediate_size=32)
    with pytest.raises(ValueError, match="odd"):
        kv_bytes_per_token(odd, "int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_bytes_per_token("tiny-llama", "fp4")


# ------------------------------------------------------------------------------ KV capacity


def test_kv_capacity_by_hand_qwen3_coder_awq_gb10():
    total = round(119.6 * GiB)  # CUDA-visible bytes on GB10
    assert total == 128_419_522_150
    budget = total * 0.85  # 109,156,593,827.5
    weights = 16_802_672_640  # test_weight_bytes_by_hand_qwen3_awq
    activations = 3 * GiB  # given explicitly: the formula is under test, not the estimate
    available = budget - (weights + activations)  # 89,132,695,715.5
    block = 16 * 98_304  # block_size * kv_bytes_per_token = 1,572,864
    blocks = math.floor(available / block)  # 56,669.04...
    assert blocks == 56_669
    cap = kv_capacity("qwen3-coder-30b-a3b", "awq", "gb10", 0.85, 16, activation_bytes=3 * GiB)
    assert (cap.weight_bytes, cap.block_bytes, cap.available_bytes) == (weights, block, available)
    assert (cap.num_blocks, cap.num_tokens) == (56_669, 56_669 * 16)
    assert kv_capacity_tokens(activation_bytes=3 * GiB) == 906_704
    assert kv_capacity_blocks(activation_bytes=3 * GiB) == 56_669
    assert cap.max_sequences(512 + 256) == 56_669 // 48


def test_default_activation_estimate_by_hand():
    # GB10 reports >= 70 GiB, so `vllm serve` profiles 8192 tokens and 1024 sequences.
    assert vllm_batch_defaults("gb10") == (8192, 1024)
    # The profile forward's peak per token: hidden + residual (2*2048) plus the widest stage,
    # here the fused MoE: normed input (2048), router logits (128), 8 * (2*768 + 768 + 2048)
    # (attention's stage is 2048 + 40*128 + 36*128 + 32*128 = 15,872, narrower).
    moe_stage = 2048 + 128 + 8 * (3 * 768 + 2048)
    assert moe_stage > 2048 + 40 * 128 + 36 * 128 + 32 * 128
    forward = 8192 * (2 * 2048 + moe_stage) * 2  # bf16
    # The sampler run: kept hidden states + 20 bytes per [seqs, vocab] logit (fp32 logits and
    # probabilities, a sort's fp32 values and int64 indices).
    sampler = 8192 * 2048 * 2 + 1024 * 151_936 * 20
    expected = max(forward, sampler) + GiB  # + 1 GiB "other"
    assert (
        estimate_activation_bytes(
            "qwen3-coder-30b-a3b", max_num_batched_tokens=8192, max_num_seqs=1024
        )
        == expected
    )
    cap = kv_capacity("qwen3-coder-30b-a3b", "awq", "gb10", 0.85)
    assert cap.activation_bytes == expected
    assert cap.num_blocks == math.floor(
        (round(119.6 * GiB) * 0.85 - cap.weight_bytes - expected) / (16 * 98_304)
    )
    smaller = kv_capacity(
        "qwen3-coder-30b-a3b", "awq", "gb10", max_num_batched_tokens=2048, max_num_seqs=256
    )
    assert smaller.activation_bytes < cap.activation_bytes
    assert smaller.num_tokens > cap.num_tokens


@pytest.mark.parametrize("hardware", ["gb10", "h200"])
@pytest.mark.parametrize(
    ("name", "quant", "kv_dtype"),
    [
        ("qwen3-coder-30b-a3b", "awq", "auto"),
        ("llama-3.3-70b", "awq", "fp8"),
        ("gpt-oss-120b", "mxfp4", "auto"),
        ("smollm2-135m", None, "int4"),
    ],
)
def test_larger_blocks_never_hold_more_tokens(hardware, name, quant, kv_dtype):
    caps = [kv_capacity(name, quant, hardware, 0.85, b, kv_dtype) for b in (8, 16, 32, 64)]
    tokens = [c.num_tokens for c in caps]
    assert tokens == sorted(tokens, reverse=True), tokens
    for c in caps:
        assert c.num_tokens == c.num_blocks * c.block_size
        assert (
            c.num_blocks * c.block_bytes <= c.available_bytes < (c.num_blocks + 1) * c.block_bytes
        )


def test_quantized_kv_and_weights_hold_more_tokens():
    auto = kv_capacity_tokens("llama-3.3-70b", "awq", "gb10")
    assert kv_capacity_tokens("llama-3.3-70b", "awq", "gb10", kv_cache_dtype="fp8") > auto
    assert kv_capacity_tokens("llama-3.3-70b", "awq", "gb10", 0.95) > auto
    assert kv_capacity_tokens("llama-3.3-70b", "fp8", "h200") < kv_capacity_tokens(
        "llama-3.3-70b", "awq", "h200"
    )


def test_kv_capacity_errors():
    with pytest.raises(ValueError, match=r"weights 131\.\d+ GiB .* exceed the budget 101\.66 GiB"):
        kv_capacity("llama-3.3-70b", None, "gb10")  # 141 GB of bf16 weights
    with pytest.raises(ValueError, match="less than one KV block"):
        budget = round(119.6 * GiB) * 0.85
        weights = weight_bytes("llama-3.3-70b", "awq")
        kv_capacity("llama-3.3-70b", "awq", "gb10", activation_bytes=int(budget - weights) - 1000)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_capacity(gpu_memory_utilization=0.0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_capacity(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="block_size"):
        kv_capacity(block_size=0)
    with pytest.raises(ValueError, match="activation_bytes"):
        kv_capacity(activation_bytes=-1)
    with pytest.raises(ValueError, match="cannot be combined"):
        kv_capacity(activation_bytes=GiB, max_num_seqs=64)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        kv_capacity(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="unknown hardware"):
        kv_capacity(hardware="tpu")
