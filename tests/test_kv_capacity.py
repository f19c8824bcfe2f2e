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
from research.perf.vllm_kv import (
    VLLM_TOKEN_REPORTS,
    vllm_available_kv_bytes,
    vllm_estimated_max_model_len,
    vllm_kv_bytes_needed,
    vllm_kv_cache_tokens,
    vllm_kv_groups,
    vllm_page_size_bytes,
    vllm_requested_bytes,
)
from research.perf.vllm_kv_logs import (
    check_vllm_log,
    format_kv_validation,
    load_gb10_vllm_logs,
    main,
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


# ------------------------------------------------------- vLLM's arithmetic vs GB10 log lines

GB10_LOGS = load_gb10_vllm_logs()


def _record(record_id):
    return next(r for r in GB10_LOGS if r["id"] == record_id)


def test_gb10_log_records_are_complete():
    assert len(GB10_LOGS) >= 3
    assert len({(r["preset"], r["gpu_memory_utilization"]) for r in GB10_LOGS}) == len(GB10_LOGS)
    for r in GB10_LOGS:
        assert r["source"]["url"].startswith("https://github.com/")
        assert r["verbatim"] and r["compare"] in r["logged"]
        assert "available_kv_cache_gib" in r["logged"]
        assert r["preset"] in PRESETS and r["token_report"] in VLLM_TOKEN_REPORTS


@pytest.mark.parametrize("record", GB10_LOGS, ids=[r["id"] for r in GB10_LOGS])
def test_vllm_arithmetic_reproduces_gb10_log_within_2_percent(record):
    # Only the logged available memory comes from the log; blocks and tokens are recomputed
    # from the model's shapes, the block size, the KV dtype and the tensor parallelism.
    check = check_vllm_log(record)
    assert check["logged"] == record["logged"][record["compare"]]
    assert abs(check["reproduced_error"]) <= 0.02, check


@pytest.mark.parametrize(
    "record",
    [r for r in GB10_LOGS if r["available_is_raw_log_line"]],
    ids=[r["id"] for r in GB10_LOGS if r["available_is_raw_log_line"]],
)
def test_raw_log_lines_fall_inside_the_printed_rounding(record):
    # vLLM prints the available memory to 0.01 GiB: the logged token count must lie between the
    # counts of the two ends of that interval, not merely within 2%.
    check = check_vllm_log(record)
    lo, hi = check["reproduced_range"]
    assert lo <= check["logged"] <= hi, check


@pytest.mark.parametrize(
    ("record_id", "perturbation"),
    [
        ("qwen3-0.6b-util0.60", {"kv_cache_dtype": "fp8"}),  # half the bytes: twice the tokens
        ("qwen3-0.6b-util0.60", {"preset": "qwen3-30b-a3b"}),  # 48 layers x 4 KV heads
        ("minimax-m2.7-awq-tp2-util0.85", {"tensor_parallel_size": 1}),  # all 8 KV heads
        ("minimax-m2.7-awq-tp2-util0.80", {"preset": "llama-3.3-70b"}),  # other shapes
    ],
)
def test_a_wrong_term_breaks_the_2_percent_band(record_id, perturbation):
    record = {**_record(record_id), **perturbation}
    assert abs(check_vllm_log(record)["reproduced_error"]) > 0.02


def test_vllm_arithmetic_by_hand_qwen3_0_6b():
    # Qwen3-0.6B: 28 layers of 8 KV heads x 128, bf16: a 16-token page is 2*16*8*128*2 bytes.
    assert vllm_page_size_bytes("qwen3-0.6b") == 65_536
    available = 69.4 * GiB  # "Current kv cache memory in use is 69.4 GiB"
    blocks = int(available) // 65_536 // 28
    assert blocks == 40_608
    cache = vllm_kv_cache_tokens("qwen3-0.6b", available, max_model_len=40_960)
    assert (cache.group_size, cache.num_groups, cache.num_blocks) == (28, 1, blocks)
    assert cache.blocks_per_request == 40_960 // 16
    assert cache.num_tokens == 649_728 == blocks * 16  # "GPU KV cache size: 649,728 tokens"
    # "Desired GPU memory utilization is (0.6, 73.01 GiB)" of 121.69 GiB.
    assert round(vllm_requested_bytes(121.69 * GiB, 0.6) / GiB, 2) == 73.01


def test_vllm_arithmetic_by_hand_minimax_tp2():
    # Per rank of two: 4 of the 8 KV heads, 62 layers, bf16 -> 126,976 bytes per token.
    page = vllm_page_size_bytes("minimax-m2", tensor_parallel_size=2)
    assert page == 2 * 16 * 4 * 128 * 2
    needed = vllm_kv_bytes_needed("minimax-m2", 196_608, tensor_parallel_size=2)
    assert needed == 62 * page * (196_608 // 16) and needed / GiB == 23.25  # logged 23.25 GiB
    est = vllm_estimated_max_model_len(
        "minimax-m2", 22.5 * GiB, max_model_len=196_608, tensor_parallel_size=2
    )
    assert est == int(22.5 * GiB) // (62 * page) * 16 == 190_256  # logged 190,272
    # More KV heads per rank than the model has: vLLM replicates one head per rank.
    assert vllm_page_size_bytes("minimax-m2", tensor_parallel_size=16) == 2 * 16 * 128 * 2


def test_vllm_pool_blocks_match_kv_capacity():
    # Same bytes, same blocks: vLLM's num_blocks equals our pool's for a dense model and for
    # gpt-oss's hybrid layout (18 sliding + 18 full layers, one group of each kind).
    for name, quant in (("qwen3-coder-30b-a3b", "awq"), ("gpt-oss-120b", "mxfp4")):
        cap = kv_capacity(name, quant, "gb10", 0.85)
        cache = vllm_kv_cache_tokens(name, cap.available_bytes)
        assert cache.num_blocks == cap.num_blocks, name
    assert vllm_kv_groups("gpt-oss-120b") == (18, {"full_attention": 1, "sliding_attention": 1})
    assert vllm_kv_groups("qwen3-0.6b") == (28, {"full_attention": 1})


def test_vllm_token_reports_differ_only_for_hybrid_models():
    dense = [
        vllm_kv_cache_tokens("qwen3-0.6b", 10 * GiB, token_report=t).num_tokens
        for t in VLLM_TOKEN_REPORTS
    ]
    assert dense[0] == dense[1]
    # gpt-oss, 131,072-token requests: a request holds 8,192 full-layer blocks and
    # cdiv(127 + 8,192, 16) + 1 = 521 sliding-layer ones (v0.2x); up to v0.19 the line halves
    # the blocks between the two groups.
    cache = vllm_kv_cache_tokens("gpt-oss-120b", 36 * GiB, max_model_len=131_072)
    assert cache.blocks_per_request == 8_192 + 521
    assert cache.num_tokens == int(cache.num_blocks / 8_713 * 131_072)
    old = vllm_kv_cache_tokens("gpt-oss-120b", 36 * GiB, token_report="blocks")
    assert old.num_tokens == cache.num_blocks // 2 * 16 < cache.num_tokens


def test_vllm_available_kv_bytes():
    total = 121.69 * GiB
    assert (
        vllm_available_kv_bytes(total, 0.6, 3 * GiB) == vllm_requested_bytes(total, 0.6) - 3 * GiB
    )
    with_graphs = vllm_available_kv_bytes(total, 0.6, 3 * GiB, cudagraph_bytes=GiB)
    assert with_graphs == vllm_available_kv_bytes(total, 0.6, 3 * GiB) - GiB
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        vllm_requested_bytes(total, 1.2)


def test_vllm_arithmetic_errors():
    with pytest.raises(ValueError, match="token_report"):
        vllm_kv_cache_tokens("qwen3-0.6b", GiB, token_report="pages")
    with pytest.raises(ValueError, match="available_bytes"):
        vllm_kv_cache_tokens("qwen3-0.6b", 0)
    with pytest.raises(ValueError, match="no 'int4' KV cache"):
        vllm_page_size_bytes("qwen3-0.6b", kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="block_size"):
        vllm_page_size_bytes("qwen3-0.6b", block_size=0)
    assert vllm_estimated_max_model_len("qwen3-0.6b", 1000) == 0


def test_new_presets_shapes():
    assert kv_bytes_per_token("qwen3-0.6b") == 2 * 28 * 8 * 128 * 2
    assert kv_bytes_per_token("minimax-m2") == 2 * 62 * 8 * 128 * 2
    count = sum(
        math.prod(s) for k, s in param_shapes(get_preset("minimax-m2")).items() if k != "layers"
    ) + sum(
        math.prod(s)
        for layer in param_shapes(get_preset("minimax-m2"))["layers"]
        for s in layer.values()
    )
    assert count / 1e9 == pytest.approx(230, rel=0.01)  # "230 billion total parameters"


def test_format_kv_validation_and_cli(capsys):
    text = format_kv_validation()
    for r in GB10_LOGS:
        assert r["id"] in text
    assert main(["--validate"]) == 0
    out = capsys.readouterr().out
    assert "reproduced" in out and "predicted" in out and "649,728" in out


# ------------------------------------------------------------ vLLM's memory profile (engine=vllm)


def test_vllm_memory_profile_terms_on_the_qwen3_record():
    """The budget is the driver's reported total, not docs/reference.md's 119.6 GiB: ceil(121.69
    GiB x 0.6) is the 73.01 GiB the log prints (unfitted). The forward peak at 8,192 tokens
    stays under the 0.26 GiB the log leaves for transient peak + graphs, and the terms add up
    to the pool the KV arithmetic turns into tokens."""
    from research.perf.vllm_memory import vllm_memory_profile

    p = vllm_memory_profile("qwen3-0.6b", None, "gb10", 0.6, max_model_len=40960)
    assert p.requested_bytes / GiB == pytest.approx(73.01, abs=0.005)
    assert 0 < p.forward_peak_bytes / GiB < 0.26
    assert p.available_bytes == (
        p.requested_bytes - p.weight_bytes - p.non_torch_bytes - p.forward_peak_bytes
    )
    # The non-torch term is read off this record, so it is close by construction; the check
    # is that nothing else (weights, forward peak, total) moves it.
    assert p.available_bytes / GiB == pytest.approx(69.40, rel=0.005)
    assert p.kv.num_tokens == pytest.approx(649_728, rel=0.005)
    assert check_vllm_log(_record("qwen3-0.6b-util0.60"))["predicted"] == p.kv.num_tokens


def test_vllm_engine_sizes_its_simulated_pool_by_the_memory_profile():
    """engine=vllm on a named machine gets the blocks vLLM's profile leaves, not kv_capacity's
    estimate (119.6 GiB total, a sampler term): for Qwen3-Coder AWQ at 0.9 that is 3% more."""
    from research.perf.engines.serving import resolve
    from research.perf.vllm_memory import vllm_memory_profile

    s = resolve("vllm", "gb10", model="qwen3-coder-30b-a3b", quantization="awq")
    mem = vllm_memory_profile("qwen3-coder-30b-a3b", "awq", "gb10", 0.9)
    assert s.num_kv_blocks == mem.kv.num_blocks
    assert s.llm_kwargs()["num_kv_blocks"] == mem.kv.num_blocks
    assert s.num_kv_blocks > kv_capacity("qwen3-coder-30b-a3b", "awq", "gb10", 0.9).num_blocks
    lower = resolve(
        "vllm", "gb10", model="qwen3-coder-30b-a3b", quantization="awq", gpu_memory_utilization=0.5
    )
    assert lower.num_kv_blocks < s.num_kv_blocks
    # SGLang sizes by its own fraction: not vLLM's profile.
    assert (
        resolve("sglang", "gb10", model="qwen3-coder-30b-a3b", quantization="awq").num_kv_blocks
        is None
    )


def test_a_users_pool_size_wins_over_the_memory_profile():
    from research.config import (
        CacheOptions,
        ExecutorConfig,
        HardwareConfig,
        LoadConfig,
        QuantConfig,
        RunConfig,
    )
    from research.perf.engines.serving import from_run

    run = RunConfig(
        model=LoadConfig(model="qwen3-coder-30b-a3b"),
        quantization=QuantConfig(quantization="awq"),
        executor=ExecutorConfig(kind="simulated"),
        hardware=HardwareConfig(name="gb10"),
        cache=CacheOptions(num_kv_blocks=123),
    )
    assert from_run(run).num_kv_blocks == 123


def test_vllm_memory_profile_refuses_a_budget_with_no_room():
    from research.perf.vllm_memory import vllm_memory_profile

    with pytest.raises(
        ValueError, match=r"leaves nothing for the KV cache.*gpu_memory_utilization"
    ):
        vllm_memory_profile("gpt-oss-120b", "mxfp4", "gb10", 0.5)
    with pytest.raises(ValueError, match="unknown GB10 driver"):
        vllm_memory_profile("qwen3-0.6b", None, "gb10", 0.6, driver="r999")
