"""gpt-oss from HF: its ``config.json`` as a ModelConfig and its safetensors as params.

The forward pass is the shared decoder (``research.models.transformer``) with gpt-oss's switches
on (see ``ModelConfig``): sliding-window and full layers, attention biases and sinks, YaRN RoPE,
a biased router with a softmax over the top-k logits, biased experts with a clamped SwiGLU.

Checkpoint layouts of the experts (X experts, D hidden, F expert width, O = out features):

- float (``save_pretrained`` of a float model): ``gate_up_proj`` [X, D, 2F] with gate and up
  interleaved along 2F (gate = even columns), ``down_proj`` [X, F, D]; biases
  ``gate_up_proj_bias`` [X, 2F] (interleaved the same way) and ``down_proj_bias`` [X, D].
- MXFP4 (``quant_method: "mxfp4"``, as openai/gpt-oss ships): ``{proj}_blocks`` uint8
  [X, O, I/32, 16], 32 E2M1 codes per block along the input axis, two per byte with the even
  element in the low nibble, and ``{proj}_scales`` uint8 E8M0 [X, O, I/32] (2^(code - 127)).
  That is the project's MXFP4 QTensor storage transposed: the bytes are reused as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from research.config import ModelConfig, RopeScaling
from research.quant.layout import GROUP_SIZES
from research.quant.qtensor import QTensor


def config_from_hf_gpt_oss(hf: dict[str, Any], name: str) -> ModelConfig:
    """ModelConfig from a gpt-oss ``config.json`` dict."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 150000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if rope_type == "yarn":
        scaling = RopeScaling(
            rope_type="yarn",
            factor=float(rope["factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            beta_fast=float(rope.get("beta_fast") or 32.0),
            beta_slow=float(rope.get("beta_slow") or 1.0),
            truncate=bool(rope.get("truncate", True)),
            attention_factor=rope.get("attention_factor"),
        )
    elif rope_type not in ("default", None):
        raise ValueError(f"gpt-oss rope_type {rope_type!r} is not supported (default, yarn)")
    if rope.get("mscale") or rope.get("mscale_all_dim") or rope.get("partial_rotary_factor"):
        raise ValueError("YaRN mscale / partial_rotary_factor are not supported")
    layers = hf["num_hidden_layers"]
    layer_types = tuple(
        hf.get("layer_types")
        or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    )
    heads = hf["num_attention_heads"]
    eos = hf.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ModelConfig(
        name=name,
        architecture="gpt_oss",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        num_experts=hf["num_local_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        norm_topk_prob=False,  # the softmax runs over the top-k logits instead
        moe_intermediate_size=hf["intermediate_size"],
        rope_theta=float(theta),
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 131072)),
        sliding_window=hf.get("sliding_window"),
        layer_types=layer_types if "sliding_attention" in layer_types else (),
        attention_bias=bool(hf.get("attention_bias", True)),
        attention_sinks=True,
        router_bias=True,
        softmax_after_topk=True,
        expert_bias=True,
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def mxfp4_from_blocks(blocks: np.ndarray, scales: np.ndarray, dtype: str) -> QTensor:
    """gpt-oss's ``*_blocks`` [X, O, G, 16] and ``*_scales`` [X, O, G] (uint8) -> an MXFP4
    QTensor [X, I, O], I = 32 G, by moving axes only: no value is decoded."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    x, o, g, half_block = blocks.shape
    group = GROUP_SIZES["mxfp4"]
    if blocks.dtype != np.uint8 or half_block != group // 2 or scales.shape != (x, o, g):
        raise ValueError(
            f"MXFP4 experts: blocks {blocks.dtype}{list(blocks.shape)} and scales "
            f"{list(scales.shape)}; expected uint8 [X, O, G, {group // 2}] and [X, O, G]"
        )
    codes = np.ascontiguousarray(blocks.reshape(x, o, g * half_block).transpose(0, 2, 1))
    return QTensor(
        codes,
        np.ascontiguousarray(scales.view(np.uint8).transpose(0, 2, 1)),
        fmt="mxfp4",
        shape=(x, g * group, o),
        group_size=group,
        dtype=dtype,
    )


def _columns(w: QTensor | np.ndarray, start: int) -> QTensor | np.ndarray:
    """Every other output column of w [..., I, O] from ``start`` (codes and scales alike: MXFP4
    packs and scales along I, so output columns are independent)."""
    if not isinstance(w, QTensor):
        return np.ascontiguousarray(w[..., start::2])
    codes = np.ascontiguousarray(np.asarray(w.codes)[..., start::2])
    scales = np.ascontiguousarray(np.asarray(w.scales)[..., start::2])
    shape = (*w.shape[:-1], w.shape[-1] // 2)
    return QTensor(codes, scales, fmt=w.fmt, shape=shape, group_size=w.group_size, dtype=w.dtype)


def read_gpt_oss_layer(
    get: Callable[[str], np.ndarray | None],
    float32: Callable[[str], np.ndarray],
    linear: Callable[[str], Any],
    prefix: str,
    dtype: str,
) -> dict[str, Any]:
    """One gpt-oss decoder layer ``prefix`` ("model.layers.{i}.") as params. ``get`` returns a
    tensor as stored (or None), ``float32`` a tensor as float32 (raising if absent), ``linear``
    an [in, out] matrix (dense or QTensor) of a linear module."""
    p = prefix
    layer: dict[str, Any] = {
        "attn_norm": float32(p + "input_layernorm.weight"),
        "mlp_norm": float32(p + "post_attention_layernorm.weight"),
        "sinks": float32(p + "self_attn.sinks"),
        "router": float32(p + "mlp.router.weight").T,
        "router_bias": float32(p + "mlp.router.bias"),
    }
    for which in "qkvo":
        layer[f"w{which}"] = linear(f"{p}self_attn.{which}_proj")
        layer[f"b{which}"] = float32(f"{p}self_attn.{which}_proj.bias")
    experts = p + "mlp.experts."
    if get(experts + "gate_up_proj_blocks") is not None:
        gate_up = mxfp4_from_blocks(
            get(experts + "gate_up_proj_blocks"), get(experts + "gate_up_proj_scales"), dtype
        )
        down = mxfp4_from_blocks(
            get(experts + "down_proj_blocks"), get(experts + "down_proj_scales"), dtype
        )
    else:
        gate_up = float32(experts + "gate_up_proj")  # [X, D, 2F]
        down = float32(experts + "down_proj")  # [X, F, D]
    gate_up_bias = float32(experts + "gate_up_proj_bias")  # [X, 2F]
    layer |= {
        "w_gate": _columns(gate_up, 0),
        "w_up": _columns(gate_up, 1),
        "w_down": down,
        "b_gate": np.ascontiguousarray(gate_up_bias[:, 0::2]),
        "b_up": np.ascontiguousarray(gate_up_bias[:, 1::2]),
        "b_down": float32(experts + "down_proj_bias"),
    }
    return layer
