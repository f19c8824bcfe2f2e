"""GGUF loading on files this test writes itself with ``gguf.GGUFWriter``.

Three tiny random HF models (Llama, Qwen3 dense, Qwen3-MoE) are written to GGUF the way
llama.cpp's ``convert_hf_to_gguf.py`` writes them: the same metadata keys and tensor names,
MoE experts stacked [experts, out, in], and llama's q/k rows permuted for llama.cpp's
interleaved RoPE (qwen3 and qwen3moe are written unpermuted). ``load_gguf`` must give back the
right config, and our forward pass on the loaded params must reproduce HF's logits.
"""

from __future__ import annotations

import copy

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from research.models.transformer import ContiguousKVCache, compute_logits, forward
from research.models.weights import _unpermute_rope_rows, load_gguf

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: q and k are permuted with different head counts
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=512,
    initializer_range=0.08,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)
PROMPT_LEN = 24


def _llama():
    cfg = LlamaConfig(**COMMON, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def _qwen3():
    cfg = Qwen3Config(**COMMON, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg)


def _qwen3moe():
    cfg = Qwen3MoeConfig(
        **COMMON,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,  # llama.cpp's qwen3moe graph always renormalizes the top-k
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=False,
    )
    return Qwen3MoeForCausalLM(cfg)


# GGUF architecture name -> (builder, our architecture name)
MODELS = {
    "llama": (_llama, "llama"),
    "qwen3": (_qwen3, "qwen3"),
    "qwen3moe": (_qwen3moe, "qwen3_moe"),
}


# ----------------------------------------------------------------------------- writer


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """``LlamaModel.permute`` of convert_hf_to_gguf.py: HF half-split rows -> interleaved pairs."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_theta(hf_config) -> float:
    # transformers 5 nests it in rope_parameters; 4.x keeps a top-level attribute.
    rope = getattr(hf_config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def _hf_state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}


def _experts(sd: dict[str, np.ndarray], p: str, n_experts: int, f: int) -> dict[str, np.ndarray]:
    """Stacked [X, out, in] gate / up / down for one layer, from either transformers layout."""
    fused = p + "mlp.experts.gate_up_proj"
    if fused in sd:  # transformers 5: gate_up [X, 2F, D], down [X, D, F]
        return {
            "ffn_gate_exps": sd[fused][:, :f],
            "ffn_up_exps": sd[fused][:, f:],
            "ffn_down_exps": sd[p + "mlp.experts.down_proj"],
        }
    return {  # hub layout: one [out, in] matrix per expert
        f"ffn_{ours}_exps": np.stack(
            [sd[f"{p}mlp.experts.{e}.{ours}_proj.weight"] for e in range(n_experts)]
        )
        for ours in ("gate", "up", "down")
    }


def gguf_tensors(model, arch: str) -> dict[str, np.ndarray]:
    """HF weights renamed (and for llama, q/k permuted) as convert_hf_to_gguf.py does."""
    c = model.config
    sd = _hf_state(model)
    out = {"token_embd.weight": sd["model.embed_tokens.weight"]}
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        wq, wk = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if arch == "llama":
            wq = llama_cpp_permute(wq, c.num_attention_heads)
            wk = llama_cpp_permute(wk, c.num_key_value_heads)
        out |= {
            b + "attn_norm.weight": sd[p + "input_layernorm.weight"],
            b + "attn_q.weight": wq,
            b + "attn_k.weight": wk,
            b + "attn_v.weight": sd[p + "self_attn.v_proj.weight"],
            b + "attn_output.weight": sd[p + "self_attn.o_proj.weight"],
            b + "ffn_norm.weight": sd[p + "post_attention_layernorm.weight"],
        }
        if arch != "llama":
            out[b + "attn_q_norm.weight"] = sd[p + "self_attn.q_norm.weight"]
            out[b + "attn_k_norm.weight"] = sd[p + "self_attn.k_norm.weight"]
        if arch == "qwen3moe":
            out[b + "ffn_gate_inp.weight"] = sd[p + "mlp.gate.weight"]
            experts = _experts(sd, p, c.num_experts, c.moe_intermediate_size)
            out |= {b + k + ".weight": v for k, v in experts.items()}
        else:
            for proj in ("gate", "up", "down"):
                out[b + f"ffn_{proj}.weight"] = sd[p + f"mlp.{proj}_proj.weight"]
    out["output_norm.weight"] = sd["model.norm.weight"]
    if not c.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    return out


def _stays_f32(name: str, arr: np.ndarray) -> bool:
    # llama.cpp keeps 1-D tensors (norms) and the MoE router in F32 whatever the outtype.
    return arr.ndim < 2 or name.endswith("ffn_gate_inp.weight")


FILE_TYPES = {
    QT.F32: gguf.LlamaFileType.ALL_F32,
    QT.F16: gguf.LlamaFileType.MOSTLY_F16,
    QT.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
}


def write_gguf(path, model, arch: str, qtype: QT = QT.F32) -> None:
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)  # writes general.architecture
    w.add_name(f"tiny-{arch}")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(_rope_theta(c))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch == "llama":  # LlamaModel.set_gguf_parameters adds these two
        w.add_vocab_size(c.vocab_size)
        w.add_rope_dimension_count(c.head_dim)
    if arch == "qwen3moe":
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_file_type(FILE_TYPES[qtype])
    for name, arr in gguf_tensors(model, arch).items():
        if qtype == QT.F32 or _stays_f32(name, arr):
            w.add_tensor(name, arr.astype(np.float32))
        else:  # F16 comes back as float16, Q8_0 as uint8 blocks
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ----------------------------------------------------------------------------- helpers


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def our_logits(cfg, params, ids: np.ndarray) -> np.ndarray:
    b, t = ids.shape
    cache = ContiguousKVCache.create(cfg, b, t)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    hidden, _ = jax.jit(lambda p, tok, pos, c: forward(p, cfg, tok, pos, c))(
        params, jnp.asarray(ids), positions, cache
    )
    return np.asarray(compute_logits(params, cfg, hidden))


def quant_roundtrip_model(model, qtype: QT):
    """A copy of the HF model whose weights went through qtype and back, tensor by tensor.

    Quantization blocks run along the last (input) axis and rows are independent, so
    quantizing HF's [out, in] matrices gives the same values as quantizing the GGUF tensors
    (llama's q/k permutation only reorders whole rows; stacking experts adds a leading axis).
    """
    rt = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in rt.named_parameters():  # tied weights appear once
            arr = param.detach().numpy()
            if _stays_f32(name, arr) or name.endswith("mlp.gate.weight"):
                continue
            deq = gguf.quants.dequantize(gguf.quants.quantize(arr, qtype), qtype)
            param.copy_(torch.from_numpy(np.asarray(deq, np.float32).reshape(arr.shape)))
    return rt


@pytest.fixture(scope="module")
def prompt() -> np.ndarray:
    return np.random.RandomState(1).randint(0, COMMON["vocab_size"], size=(1, PROMPT_LEN))


@pytest.fixture(scope="module", params=sorted(MODELS))
def written(request, tmp_path_factory):
    """(gguf arch, torch model, path of its float32 GGUF)."""
    arch = request.param
    torch.manual_seed(0)
    model = MODELS[arch][0]().eval()
    path = tmp_path_factory.mktemp(arch) / f"{arch}.f32.gguf"
    write_gguf(path, model, arch)
    return arch, model, path


# ----------------------------------------------------------------------------- tests


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.RandomState(0)
    for n_head, head_dim, cols in ((4, 16, 64), (2, 16, 64), (8, 8, 24), (3, 4, 5)):
        w = rng.randn(n_head * head_dim, cols).astype(np.float32)
        permuted = llama_cpp_permute(w, n_head)
        assert not np.array_equal(permuted, w)  # the permutation is not a no-op
        np.testing.assert_array_equal(_unpermute_rope_rows(permuted, n_head), w)
        # And the layout: GGUF row (h, pair i, component c) is HF row (h, c, i).
        half = head_dim // 2
        for h in range(n_head):
            for i in range(half):
                for comp in range(2):
                    gguf_row = h * head_dim + 2 * i + comp
                    hf_row = h * head_dim + comp * half + i
                    np.testing.assert_array_equal(permuted[gguf_row], w[hf_row])
    bias = rng.randn(4 * 16).astype(np.float32)  # 1-D (bias) rows too
    np.testing.assert_array_equal(_unpermute_rope_rows(llama_cpp_permute(bias, 4), 4), bias)


def test_config_read_from_metadata(written):
    arch, model, path = written
    c = model.config
    cfg, params = load_gguf(path)
    assert cfg.architecture == MODELS[arch][1]
    assert cfg.name == f"tiny-{arch}"
    assert cfg.vocab_size == 256 and cfg.hidden_size == 64 and cfg.num_layers == 2
    assert cfg.num_heads == 4 and cfg.num_kv_heads == 2 and cfg.head_dim == 16
    assert cfg.intermediate_size == 128
    assert cfg.max_position_embeddings == 512
    assert cfg.rope_theta == _rope_theta(c)
    assert cfg.rope_scaling is None
    assert cfg.rms_norm_eps == pytest.approx(c.rms_norm_eps, rel=1e-6)  # stored as float32
    assert cfg.qk_norm == (arch != "llama")
    assert cfg.is_moe == (arch == "qwen3moe")
    assert cfg.tie_word_embeddings == (arch == "qwen3")
    assert ("lm_head" in params) == (arch != "qwen3")
    if arch == "qwen3moe":
        assert cfg.num_experts == 4 and cfg.num_experts_per_tok == 2
        assert cfg.moe_intermediate_size == 32 and cfg.norm_topk_prob
    else:
        assert cfg.num_experts == 0
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(params))


def test_logits_match_hf(written, prompt):
    _, model, path = written
    cfg, params = load_gguf(path)
    ref = hf_logits(model, prompt)
    ours = our_logits(cfg, params, prompt)
    diff = np.abs(ours - ref).max()
    assert diff < 1e-4, f"max abs logit diff {diff} (logit scale {np.abs(ref).max():.2f})"


@pytest.mark.parametrize(
    ("arch", "qtype"),
    [("llama", QT.Q8_0), ("qwen3moe", QT.Q8_0), ("qwen3", QT.F16)],
    ids=["llama-Q8_0", "qwen3moe-Q8_0", "qwen3-F16"],
)
def test_quantized_logits(arch, qtype, prompt, tmp_path):
    torch.manual_seed(0)
    model = MODELS[arch][0]().eval()
    path = tmp_path / f"{arch}.{qtype.name}.gguf"
    write_gguf(path, model, arch, qtype)
    cfg, params = load_gguf(path)
    ours = our_logits(cfg, params, prompt)

    # Exact dequantization: HF run on the same quantize->dequantize round trip of each weight
    # computes the same function in float32, so the float32 tolerance holds.
    ref_rt = hf_logits(quant_roundtrip_model(model, qtype), prompt)
    diff = np.abs(ours - ref_rt).max()
    assert diff < 1e-4, f"{qtype.name}: diff {diff} against HF on round-tripped weights"

    # Against the original float32 model the weights themselves differ: F16 keeps an 11-bit
    # significand (relative error <= 2^-11 per weight), Q8_0 stores 8-bit integers with one
    # scale per 32 weights (error <= absmax/254 per weight, ~1% of a typical weight here).
    # Measured on these models (logit scale ~2.5): F16 moves logits by ~2e-3 (0.07% of the
    # scale), Q8_0 by ~4e-2..6e-2 (~2%). The bounds leave a 4-7x margin; the exact check above
    # is the one that pins the dequantization down.
    ref = hf_logits(model, prompt)
    scale = np.abs(ref).max()
    tol = {QT.F16: 5e-3, QT.Q8_0: 0.1}[qtype] * scale
    diff = np.abs(ours - ref).max()
    assert diff < tol, f"{qtype.name}: diff {diff} vs original HF (tol {tol:.3g})"


def test_unsupported_architecture_raises(tmp_path):
    path = tmp_path / "gemma.gguf"
    w = gguf.GGUFWriter(str(path), "gemma")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="gemma"):
        load_gguf(path)
