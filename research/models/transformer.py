"""The decoder stack shared by dense (Llama, Qwen3) and MoE (Qwen3-MoE) models.

Params are a plain dict pytree; per-layer weights are stacked on a leading layer axis L and the
stack runs under ``jax.lax.scan`` (one layer compiled once). Matrices are stored [in, out].

    params = {
      "embed": [V, D],
      "layers": {
        "attn_norm": [L, D], "mlp_norm": [L, D],
        "wq": [L, D, H*E], "wk": [L, D, K*E], "wv": [L, D, K*E], "wo": [L, H*E, D],
        "q_norm": [L, E], "k_norm": [L, E],                      # qk_norm models only
        "w_gate": [L, D, F], "w_up": [L, D, F], "w_down": [L, F, D],  # dense MLP
        "router": [L, D, X],                                     # MoE: X experts
        "w_gate": [L, X, D, F], "w_up": [L, X, D, F], "w_down": [L, X, F, D],
      },
      "final_norm": [D],
      "lm_head": [D, V],                                         # untied models only
    }

The KV cache is explicit state: ``forward(params, cfg, tokens, positions, cache) -> (hidden,
cache)``. The cache object decides how new K/V are written and how attention reads them (a
contiguous per-sequence cache here, a paged pool in the engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from research.config import ModelConfig
from research.models.layers import (
    apply_rope,
    grouped_query_attention,
    rms_norm,
    rope_cos_sin,
    swiglu,
)
from research.models.moe import moe_mlp

Params = dict[str, Any]


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """Shapes of every parameter as a nested dict of tuples (no allocation)."""
    d, L, e = cfg.hidden_size, cfg.num_layers, cfg.head_dim
    layers: dict[str, tuple[int, ...]] = {
        "attn_norm": (L, d),
        "mlp_norm": (L, d),
        "wq": (L, d, cfg.num_heads * e),
        "wk": (L, d, cfg.num_kv_heads * e),
        "wv": (L, d, cfg.num_kv_heads * e),
        "wo": (L, cfg.num_heads * e, d),
    }
    if cfg.qk_norm:
        layers |= {"q_norm": (L, e), "k_norm": (L, e)}
    if cfg.is_moe:
        x, f = cfg.num_experts, cfg.moe_intermediate_size
        layers |= {
            "router": (L, d, x),
            "w_gate": (L, x, d, f),
            "w_up": (L, x, d, f),
            "w_down": (L, x, f, d),
        }
    else:
        f = cfg.intermediate_size
        layers |= {"w_gate": (L, d, f), "w_up": (L, d, f), "w_down": (L, f, d)}
    shapes: dict[str, Any] = {
        "embed": (cfg.vocab_size, d),
        "layers": layers,
        "final_norm": (d,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
    return shapes


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Random parameters (normal, std 0.02; norms at 1) for tests and shape checks."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree_util.tree_flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda s: isinstance(s, tuple))[0]]
    keys = jax.random.split(key, len(leaves))
    out = []
    for path, shape, k in zip(paths, leaves, keys, strict=True):
        if "norm" in path:
            out.append(jnp.ones(shape, dtype))
        else:
            out.append((0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


@jax.tree_util.register_dataclass
@dataclass
class ContiguousKVCache:
    """Per-sequence contiguous KV cache: k, v [L, B, K, S, E].

    Tokens are written at their positions; a position < 0 marks padding and is not written.
    A query at position p attends to cached positions 0..p of its own row.
    """

    k: jax.Array
    v: jax.Array

    @classmethod
    def create(
        cls, cfg: ModelConfig, batch: int, max_len: int, dtype: Any = jnp.float32
    ) -> ContiguousKVCache:
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def update_and_attend(
        self,
        layer: jax.Array,
        q: jax.Array,
        k_new: jax.Array,
        v_new: jax.Array,
        positions: jax.Array,
        scale: float,
    ) -> tuple[jax.Array, ContiguousKVCache]:
        """q [B, T, H, E], k_new/v_new [B, T, K, E], positions [B, T] -> ([B, T, H, E], cache)."""
        b, t = positions.shape
        s = self.max_len
        # Padding (position < 0) is sent out of bounds and dropped by the scatter.
        write_pos = jnp.where(positions >= 0, positions, s)
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        k_all = self.k.at[layer, rows, :, write_pos].set(k_new.astype(self.k.dtype), mode="drop")
        v_all = self.v.at[layer, rows, :, write_pos].set(v_new.astype(self.v.dtype), mode="drop")
        k_layer = jax.lax.dynamic_index_in_dim(k_all, layer, axis=0, keepdims=False)
        v_layer = jax.lax.dynamic_index_in_dim(v_all, layer, axis=0, keepdims=False)
        key_pos = jnp.arange(s)
        mask = (key_pos[None, None, :] <= positions[:, :, None]) & (positions[:, :, None] >= 0)
        out = grouped_query_attention(q, k_layer, v_layer, mask, scale)
        return out, ContiguousKVCache(k_all, v_all)


def _layer(
    cfg: ModelConfig,
    lp: Params,
    x: jax.Array,
    layer: jax.Array,
    positions: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    cache: Any,
) -> tuple[jax.Array, Any]:
    """One pre-norm decoder layer on x [B, T, D]."""
    b, t, d = x.shape
    e, h, kvh = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

    hidden = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q = (hidden @ lp["wq"]).reshape(b, t, h, e)
    k = (hidden @ lp["wk"]).reshape(b, t, kvh, e)
    v = (hidden @ lp["wv"]).reshape(b, t, kvh, e)
    if cfg.qk_norm:  # Qwen3: RMSNorm over each head's vector, before RoPE
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    attn, cache = cache.update_and_attend(layer, q, k, v, positions, e**-0.5)
    x = x + attn.reshape(b, t, h * e) @ lp["wo"]

    hidden = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    if cfg.is_moe:
        mlp = moe_mlp(
            hidden.reshape(b * t, d),
            lp["router"],
            lp["w_gate"],
            lp["w_up"],
            lp["w_down"],
            top_k=cfg.num_experts_per_tok,
            norm_topk_prob=cfg.norm_topk_prob,
        ).reshape(b, t, d)
    else:
        mlp = swiglu(hidden, lp["w_gate"], lp["w_up"], lp["w_down"])
    return x + mlp, cache


def forward(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: Any,
) -> tuple[jax.Array, Any]:
    """Run the decoder on tokens [B, T] at positions [B, T] (-1 = padding).

    Returns the final-normed hidden states [B, T, D] and the updated cache. ``cfg`` is static.
    """
    if not cfg.runnable:
        raise ValueError(
            f"{cfg.name}: architecture {cfg.architecture!r} has shapes only (cost model); "
            "no forward pass is implemented for it"
        )
    x = params["embed"][tokens]  # [B, T, D]
    cos, sin = rope_cos_sin(jnp.maximum(positions, 0), cfg)  # [B, T, E]

    def body(carry, xs):
        x, cache = carry
        lp, layer = xs
        x, cache = _layer(cfg, lp, x, layer, positions, cos, sin, cache)
        return (x, cache), None

    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (x, cache), _ = jax.lax.scan(body, (x, cache), (params["layers"], layer_ids))
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), cache


def compute_logits(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """hidden [..., D] -> float32 logits [..., V] (tied embeddings reuse the embedding matrix)."""
    if cfg.tie_word_embeddings:
        logits = jnp.einsum("...D,VD->...V", hidden, params["embed"])
    else:
        logits = hidden @ params["lm_head"]
    return logits.astype(jnp.float32)
