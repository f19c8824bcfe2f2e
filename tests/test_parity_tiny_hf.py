"""Golden parity on tiny random models built with transformers' own config classes, saved with
``save_pretrained`` and loaded through our safetensors path: Llama (with Llama-3 RoPE scaling),
Qwen3 dense (qk-norm, tied embeddings) and Qwen3-MoE (router, top-k, ragged_dot experts)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from research import LLM, SamplingParams
from research.models.transformer import ContiguousKVCache, compute_logits, forward
from research.models.weights import load_hf_safetensors
from tests.hf_oracle import hf_greedy

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    initializer_range=0.08,  # peaked enough that greedy decoding has no near-ties
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


def _llama():
    cfg = LlamaConfig(
        **COMMON,
        intermediate_size=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def _qwen3():
    cfg = Qwen3Config(**COMMON, intermediate_size=128, rope_theta=1e6, tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg)


def _qwen3_moe():
    cfg = Qwen3MoeConfig(
        **COMMON,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        rope_theta=1e6,
        tie_word_embeddings=False,
    )
    return Qwen3MoeForCausalLM(cfg)


BUILDERS = {"llama": _llama, "qwen3": _qwen3, "qwen3_moe": _qwen3_moe}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def saved_model(request, tmp_path_factory):
    torch.manual_seed(0)
    model = BUILDERS[request.param]().eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


def test_config_read_from_config_json(saved_model):
    arch, _model, path = saved_model
    cfg, _ = load_hf_safetensors(path)
    assert cfg.architecture == arch
    assert cfg.num_layers == 3 and cfg.num_kv_heads == 2 and cfg.head_dim == 16
    assert cfg.qk_norm == (arch != "llama")
    assert cfg.is_moe == (arch == "qwen3_moe")
    if arch == "llama":
        assert (
            cfg.rope_scaling is not None and cfg.rope_scaling.original_max_position_embeddings == 32
        )


def test_logits_match_hf(saved_model):
    _, model, path = saved_model
    cfg, params = load_hf_safetensors(path)
    # 96 positions: past the 32-token original context, so the Llama-3 RoPE scaling matters.
    ids = np.random.RandomState(1).randint(0, cfg.vocab_size, size=(2, 96))
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    cache = ContiguousKVCache.create(cfg, 2, 96)
    positions = jnp.broadcast_to(jnp.arange(96), (2, 96))
    hidden, _ = jax.jit(lambda p, t, pos, c: forward(p, cfg, t, pos, c))(
        params, jnp.asarray(ids), positions, cache
    )
    ours = np.asarray(compute_logits(params, cfg, hidden))
    diff = np.abs(ours - ref).max()
    assert diff < 1e-4, f"max abs logit diff {diff} (logit scale {np.abs(ref).max():.2f})"


def test_greedy_generation_matches_hf(saved_model):
    _, model, path = saved_model
    llm = LLM(str(path), dtype="float32")  # as the HF oracle ("auto" would serve bfloat16)
    rng = np.random.RandomState(2)
    prompts = [rng.randint(0, 512, size=n).tolist() for n in (5, 17, 33, 64)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_greedy(model, torch.tensor([prompt]), 32)
        assert out.token_ids == ref
