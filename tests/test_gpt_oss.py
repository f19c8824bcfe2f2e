"""gpt-oss against HF transformers on tiny random models saved with ``save_pretrained``:
sliding-window (8 tokens) and full layers, attention biases and sinks, YaRN RoPE, a biased
top-4-of-8 router and biased clamped-SwiGLU experts; float and MXFP4 (``*_blocks``/``*_scales``)
expert layouts."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from research import LLM, SamplingParams
from research.models.transformer import ContiguousKVCache, compute_logits, forward
from research.models.weights import load_hf_safetensors
from research.quant import QTensor, dequantize, quantize
from tests.hf_oracle import hf_greedy

WINDOW = 8


def _hf_config(**overrides) -> GptOssConfig:
    kwargs = dict(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,  # sliding, full
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=4,
        sliding_window=WINDOW,
        max_position_embeddings=1024,
        initializer_range=0.08,  # peaked enough that greedy decoding has no near-ties
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 32,  # prompts run past it: YaRN matters
        },
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return GptOssConfig(**(kwargs | overrides))


def _random_model(seed: int = 0) -> GptOssForCausalLM:
    """HF initializes biases to zero: give every bias, sink and norm random values too."""
    torch.manual_seed(seed)
    model = GptOssForCausalLM(_hf_config()).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or name.endswith("sinks"):
                param.normal_(0.0, 0.5)
            elif "norm" in name:
                param.uniform_(0.8, 1.2)
    return model


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    model = _random_model()
    path = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(path)
    return model, path


def _our_logits(path, ids: np.ndarray) -> np.ndarray:
    cfg, params = load_hf_safetensors(path)
    b, t = ids.shape
    cache = ContiguousKVCache.create(cfg, b, t)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    hidden, _ = jax.jit(lambda p, x, pos, c: forward(p, cfg, x, pos, c))(
        params, jnp.asarray(ids), positions, cache
    )
    return np.asarray(compute_logits(params, cfg, hidden))


def test_config_read_from_config_json(saved_model):
    _, path = saved_model
    cfg, params = load_hf_safetensors(path)
    assert cfg.architecture == "gpt_oss" and cfg.runnable
    assert cfg.layer_types == ("sliding_attention", "full_attention")
    assert [cfg.layer_window(i) for i in range(2)] == [WINDOW, None]
    assert cfg.rope_scaling.rope_type == "yarn" and not cfg.rope_scaling.truncate
    assert cfg.num_experts == 8 and cfg.num_experts_per_tok == 4
    assert params["layers"][0]["sinks"].shape == (8,)
    assert params["layers"][0]["b_gate"].shape == (8, 32)


def test_logits_match_hf_past_the_window(saved_model):
    model, path = saved_model
    ids = np.random.RandomState(1).randint(0, 512, size=(2, 48))  # 6 windows long
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    ours = _our_logits(path, ids)
    diff = np.abs(ours - ref).max()
    assert diff < 1e-4, f"max abs logit diff {diff} (logit scale {np.abs(ref).max():.2f})"
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_sinks_and_window_matter(saved_model):
    """The parity above is not vacuous: without the window or the sinks the logits move."""
    import dataclasses

    _, path = saved_model
    cfg, params = load_hf_safetensors(path)
    ids = jnp.asarray(np.random.RandomState(1).randint(0, 512, size=(1, 32)))
    positions = jnp.arange(32)[None]

    def logits(c, p):
        cache = ContiguousKVCache.create(c, 1, 32)
        hidden, _ = jax.jit(lambda p: forward(p, c, ids, positions, cache))(p)
        return np.asarray(compute_logits(p, c, hidden))

    base = logits(cfg, params)
    no_window = logits(dataclasses.replace(cfg, layer_types=()), params)
    assert np.abs(base - no_window).max() > 1e-2
    no_sink_params = {
        **params,
        "layers": [{**lp, "sinks": lp["sinks"] - 1e4} for lp in params["layers"]],
    }
    assert np.abs(base - logits(cfg, no_sink_params)).max() > 1e-2


@pytest.mark.parametrize("block_size", [WINDOW, 16])  # equal to, larger than the window
def test_greedy_generation_matches_hf(saved_model, block_size):
    """Through the paged engine (chunked prefill, continuous batching) with blocks as large as
    and larger than the window (smaller ones: ``test_sliding_layers_hold_only_the_window``)."""
    model, path = saved_model
    llm = LLM(str(path), dtype="float32", block_size=block_size, max_num_batched_tokens=16)
    rng = np.random.RandomState(2)
    prompts = [rng.randint(0, 512, size=n).tolist() for n in (5, 37)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(model, torch.tensor([prompt]), 10)


def test_sliding_layers_hold_only_the_window(saved_model):
    """A request 10x longer than the window, blocks of half the window: its sliding-window
    layers never hold more blocks than the window spans (blocks that slide out go back to the
    pool and are refilled with NaN), and its tokens are HF's."""
    from research.engine.engine import Engine
    from research.perf.kv_capacity import sliding_blocks_per_seq

    model, path = saved_model
    block_size = 4
    llm = LLM(  # pages start as NaN and freed blocks are refilled with NaN: never read
        str(path),
        dtype="float32",
        block_size=block_size,
        max_num_batched_tokens=16,
        poison_freed_blocks=True,
    )
    engine: Engine = llm.engine
    bm = engine.block_manager
    assert bm.sliding_window == WINDOW and not bm.enable_prefix_caching
    prompt = np.random.RandomState(4).randint(0, 512, size=60).tolist()
    steps = 10 * WINDOW - 60  # 80 tokens in all
    engine.add_request(prompt, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
    window_blocks = sliding_blocks_per_seq(llm.model_config, block_size)  # 3
    held, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        for seq in engine.scheduler.running:
            held.append((seq.num_computed_tokens, bm.sliding_blocks_held(seq), len(seq.block_ids)))
            bm.check_invariants(list(engine.scheduler.running))
    decode = [h for c, h, _ in held if c > len(prompt)]  # after decode steps
    assert decode and max(decode) <= window_blocks, held
    # While prefilling 16-token chunks the step also stores the window after its chunk.
    assert max(h for _, h, _ in held) <= 2 * window_blocks
    assert max(n for _, _, n in held) == -(-80 // block_size)  # full layers keep every block
    assert bm.num_free_blocks == bm.num_blocks  # everything returned
    assert tokens == hf_greedy(model, torch.tensor([prompt]), steps)


# ------------------------------------------------------------------ MXFP4 experts (*_blocks)


def _hf_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float experts [X, I, O] -> gpt-oss's (blocks [X, O, I/32, 16], scales [X, O, I/32]),
    packed here from the project's reference quantizer's E2M1 codes and E8M0 scales."""
    q = quantize(jnp.asarray(w), "mxfp4")
    codes = np.asarray(q.codes)  # [X, I/2, O]: byte k = inputs 2k (low nibble), 2k + 1
    x, half, o = codes.shape
    blocks = codes.transpose(0, 2, 1).reshape(x, o, half // 16, 16)
    scales = np.asarray(q.scales).transpose(0, 2, 1)
    return np.ascontiguousarray(blocks), np.ascontiguousarray(scales)  # save_file needs C order


@pytest.fixture(scope="module")
def mxfp4_model(saved_model, tmp_path_factory):
    """The float checkpoint rewritten with MXFP4 experts, and an HF model holding the experts'
    values as transformers' own MXFP4 dequantizer decodes them from those blocks."""
    model, path = saved_model
    out = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    tensors = load_file(path / "model.safetensors")
    for key in [k for k in tensors if k.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales = _hf_blocks(tensors.pop(key))
        tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
    save_file(tensors, out / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (out / "config.json").write_text(json.dumps(config))

    torch.manual_seed(0)
    ref = _random_model()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                prefix = f"model.layers.{i}.mlp.experts.{proj}"
                values = convert_moe_packed_tensors(
                    torch.tensor(tensors[prefix + "_blocks"]),
                    torch.tensor(tensors[prefix + "_scales"]),
                    dtype=torch.float32,
                )
                getattr(layer.mlp.experts, proj).copy_(values)
    return ref, out, tensors


def test_mxfp4_experts_load_bit_exact(saved_model, mxfp4_model):
    """Blocks and scales become QTensor storage untouched; decoded, they equal both the
    reference quantize/dequantize of the float experts and transformers' dequantizer."""
    _, path = saved_model
    _, out, tensors = mxfp4_model
    _, float_params = load_hf_safetensors(path)
    _, params = load_hf_safetensors(out)
    for i, lp in enumerate(params["layers"]):
        for key in ("w_gate", "w_up", "w_down"):
            w = lp[key]
            assert isinstance(w, QTensor) and w.fmt == "mxfp4"
            reference = quantize(float_params["layers"][i][key], "mxfp4")
            np.testing.assert_array_equal(np.asarray(w.codes), np.asarray(reference.codes))
            np.testing.assert_array_equal(np.asarray(w.scales), np.asarray(reference.scales))
            np.testing.assert_array_equal(
                np.asarray(dequantize(w)), np.asarray(dequantize(reference))
            )
        hf_values = convert_moe_packed_tensors(
            torch.tensor(tensors[f"model.layers.{i}.mlp.experts.gate_up_proj_blocks"]),
            torch.tensor(tensors[f"model.layers.{i}.mlp.experts.gate_up_proj_scales"]),
            dtype=torch.float32,
        ).numpy()  # [X, D, 2F], gate and up interleaved
        np.testing.assert_array_equal(np.asarray(dequantize(lp["w_gate"])), hf_values[..., 0::2])
        np.testing.assert_array_equal(np.asarray(dequantize(lp["w_up"])), hf_values[..., 1::2])


def test_mxfp4_checkpoint_matches_hf(mxfp4_model):
    ref, out, _ = mxfp4_model
    ids = np.random.RandomState(3).randint(0, 512, size=(1, 40))
    with torch.no_grad():
        expected = ref(torch.tensor(ids)).logits.numpy()
    diff = np.abs(_our_logits(out, ids) - expected).max()
    assert diff < 1e-4, f"max abs logit diff {diff}"
    assert LLM(str(out), dtype="float32").quantization == "mxfp4"  # served as stored


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_frequencies_match_hf_at_full_size(truncate):
    """gpt-oss-120b's YaRN (factor 32 over 4,096 positions, not truncated) and the truncated
    variant: inverse frequencies and the cos/sin gain as transformers computes them."""
    import dataclasses

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from research.models.layers import rope_attention_factor, rope_inv_freq
    from research.models.presets import get_preset

    cfg = get_preset("gpt-oss-120b")
    scaling = dataclasses.replace(cfg.rope_scaling, truncate=truncate)
    hf = GptOssConfig()  # the published defaults: yarn, factor 32, 4096, theta 150000
    hf.rope_parameters["truncate"] = truncate
    inv_freq, gain = ROPE_INIT_FUNCTIONS["yarn"](hf)
    ours = rope_inv_freq(cfg.head_dim, cfg.rope_theta, scaling)
    np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6)
    assert rope_attention_factor(scaling) == pytest.approx(gain)


def test_pallas_backend_serves_gpt_oss_like_xla(mxfp4_model):
    """The paged engine with attention_backend="pallas_interpret" on the MXFP4 checkpoint: the
    windowed Pallas paged-attention kernel on the sliding layers (a prompt 2.5 windows long in
    two prefill chunks, pages of half the window, then decodes) and the grouped-experts kernel
    decoding the MXFP4 experts in-kernel give the XLA backend's greedy tokens."""
    _, path, _ = mxfp4_model
    rng = np.random.RandomState(5)
    prompts = [rng.randint(0, 512, size=n).tolist() for n in (3, 20)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def tokens(backend: str) -> list[list[int]]:
        llm = LLM(
            str(path),
            dtype="float32",
            block_size=WINDOW // 2,
            max_num_batched_tokens=16,
            attention_backend=backend,
        )
        return [out.token_ids for out in llm.generate(prompts, params)]

    assert tokens("pallas_interpret") == tokens("xla")
