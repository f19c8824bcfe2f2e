"""The decoder stack shared by dense (Llama, Qwen3) and MoE (Qwen3-MoE, gpt-oss) models.

Params are a plain dict pytree with one dict per layer. Matrices are stored [in, out].

    params = {
      "embed": [V, D],
      "layers": [  # one per layer
        {
          "attn_norm": [D], "mlp_norm": [D],
          "wq": [D, H*E], "wk": [D, K*E], "wv": [D, K*E], "wo": [H*E, D],
          "q_norm": [E], "k_norm": [E],                          # qk_norm models only
          "bq": [H*E], "bk": [K*E], "bv": [K*E], "bo": [D],      # attention_bias (gpt-oss)
          "sinks": [H],                                          # attention_sinks (gpt-oss)
          "w_gate": [D, F], "w_up": [D, F], "w_down": [F, D],    # dense MLP
          "router": [D, X],                                      # MoE: X experts
          "w_gate": [X, D, F], "w_up": [X, D, F], "w_down": [X, F, D],
          "router_bias": [X], "b_gate": [X, F], "b_up": [X, F], "b_down": [X, D],  # gpt-oss
        },
      ],
      "final_norm": [D],
      "lm_head": [D, V],                                         # untied models only
    }

Layers are unrolled in Python rather than stacked under ``lax.scan``: on XLA:CPU, slicing one
layer out of stacked weights copies it every step (measured 2.3x slower decode for SmolLM2).

The KV cache is explicit state: ``forward(params, cfg, tokens, positions, cache) -> (hidden,
cache)``. The cache object decides how new K/V are written and how attention reads them (a
contiguous per-sequence cache here, a paged pool in the engine); a sliding-window layer passes
its ``window`` and a model with attention sinks its per-head ``sinks`` to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from research.config import ModelConfig
from research.models.layers import (
    add_rms_norm,
    apply_rope,
    grouped_query_attention,
    linear,
    matmul,
    rms_norm,
    rope_cos_sin,
    swiglu,
)
from research.models.moe import moe_mlp
from research.models.shapes import param_shapes

Params = dict[str, Any]


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Random parameters (normal, std 0.02; norms at 1) for tests and shape checks."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree_util.tree_flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
    paths = [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(
            shapes, is_leaf=lambda s: isinstance(s, tuple)
        )[0]
    ]
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
    """Per-sequence contiguous KV cache: one k and one v array [B, K, S, E] per layer.

    Tokens are written at their positions; a position < 0 marks padding and is not written.
    A query at position p attends to cached positions 0..p of its own row.
    """

    k: list[jax.Array]
    v: list[jax.Array]

    @classmethod
    def create(
        cls, cfg: ModelConfig, batch: int, max_len: int, dtype: Any = jnp.float32
    ) -> ContiguousKVCache:
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        return cls(
            [jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
            [jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
        )

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def update_and_attend(
        self,
        layer: int,
        q: jax.Array,
        k_new: jax.Array,
        v_new: jax.Array,
        positions: jax.Array,
        scale: float,
        window: int | None = None,
        sinks: jax.Array | None = None,
    ) -> tuple[jax.Array, ContiguousKVCache]:
        """q [B, T, H, E], k_new/v_new [B, T, K, E], positions [B, T] -> ([B, T, H, E], cache).
        ``window``: a query at p sees positions p - window + 1 .. p only; ``sinks`` [H]: see
        ``grouped_query_attention``."""
        b, t = positions.shape
        s = self.max_len
        # Padding (position < 0) is sent out of bounds and dropped by the scatter.
        write_pos = jnp.where(positions >= 0, positions, s)
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        k_layer = (
            self.k[layer].at[rows, :, write_pos].set(k_new.astype(self.k[layer].dtype), mode="drop")
        )
        v_layer = (
            self.v[layer].at[rows, :, write_pos].set(v_new.astype(self.v[layer].dtype), mode="drop")
        )
        key_pos = jnp.arange(s)
        mask = (key_pos[None, None, :] <= positions[:, :, None]) & (positions[:, :, None] >= 0)
        if window is not None:
            mask &= key_pos[None, None, :] > positions[:, :, None] - window
        out = grouped_query_attention(q, k_layer, v_layer, mask, scale, sinks)
        k, v = list(self.k), list(self.v)
        k[layer], v[layer] = k_layer, v_layer
        return out, ContiguousKVCache(k, v)


def _project(x: jax.Array, lp: Params, which: str, backend: str) -> jax.Array:
    """Attention projection ``w{which}`` (q, k, v or o), plus its bias if the layer has one."""
    return _bias(linear(x, lp[f"w{which}"], backend), lp.get(f"b{which}"))


def _bias(y: jax.Array, bias: jax.Array | None) -> jax.Array:
    return y if bias is None else y + bias.astype(y.dtype)


def _layer(
    cfg: ModelConfig,
    lp: Params,
    x: jax.Array,
    delta: jax.Array | None,
    layer: int,
    positions: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    cache: Any,
    backend: str,
) -> tuple[jax.Array, jax.Array, Any]:
    """One pre-norm decoder layer on the residual stream x + delta [B, T, D] (delta: the last
    layer's MLP output, or None); returns the stream before this layer's MLP output is added,
    that output, and the cache (each add goes with the norm after it: ``add_rms_norm``)."""
    b, t, d = x.shape
    e, h, kvh = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

    x, hidden = add_rms_norm(x, delta, lp["attn_norm"], cfg.rms_norm_eps)
    if "wqkv" in lp:  # q, k and v in one product (``research.native.gemm.pack_params``)
        qkv = linear(hidden, lp["wqkv"], backend)
        parts = jnp.split(qkv, [h * e, (h + kvh) * e], axis=-1)
        q, k, v = (_bias(y, lp.get(f"b{w}")) for y, w in zip(parts, "qkv", strict=True))
    else:
        q, k, v = (_project(hidden, lp, w, backend) for w in "qkv")
    q, k, v = q.reshape(b, t, h, e), k.reshape(b, t, kvh, e), v.reshape(b, t, kvh, e)
    if cfg.qk_norm:  # Qwen3: RMSNorm over each head's vector, before RoPE
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    extra: dict[str, Any] = {}  # only models that have them pass window / sinks
    if cfg.layer_window(layer) is not None:
        extra["window"] = cfg.layer_window(layer)
    if cfg.attention_sinks:
        extra["sinks"] = lp["sinks"]
    attn, cache = cache.update_and_attend(layer, q, k, v, positions, e**-0.5, **extra)
    attn = _project(attn.reshape(b, t, h * e), lp, "o", backend)
    x, hidden = add_rms_norm(x, attn, lp["mlp_norm"], cfg.rms_norm_eps)
    if cfg.is_moe:
        mlp = moe_mlp(
            hidden.reshape(b * t, d),
            lp["router"],
            lp["w_gate"],
            lp["w_up"],
            lp["w_down"],
            top_k=cfg.num_experts_per_tok,
            norm_topk_prob=cfg.norm_topk_prob,
            backend=backend,
            plan=getattr(cache, "plan", None),  # expert parallelism rides on the paged cache
            router_bias=lp.get("router_bias"),
            softmax_after_topk=cfg.softmax_after_topk,
            biases=(lp["b_gate"], lp["b_up"], lp["b_down"]) if cfg.expert_bias else None,
            swiglu_limit=cfg.swiglu_limit,
            swiglu_alpha=cfg.swiglu_alpha,
        ).reshape(b, t, d)
    elif "w_gate_up" in lp:  # silu(gate) * up in the product's epilogue (packed weights)
        mlp = linear(linear(hidden, lp["w_gate_up"], backend), lp["w_down"], backend)
    else:
        mlp = swiglu(hidden, lp["w_gate"], lp["w_up"], lp["w_down"], backend)
    return x, mlp, cache


def forward(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: Any,
    backend: str = "xla",
) -> tuple[jax.Array, Any]:
    """Run the decoder on tokens [B, T] at positions [B, T] (-1 = padding).

    Returns the final-normed hidden states [B, T, D] and the updated cache. ``cfg`` and
    ``backend`` (where quantized matmuls run, see ``layers.KERNEL_BACKENDS``) are static.
    """
    if not cfg.runnable:
        raise ValueError(
            f"{cfg.name}: architecture {cfg.architecture!r} has shapes only (cost model); "
            "no forward pass is implemented for it"
        )
    x = params["embed"][tokens]  # [B, T, D]
    if x.dtype == jnp.uint16:  # a bfloat16 table kept as its codes (native.gemm.pack_params)
        x = jax.lax.bitcast_convert_type(x, jnp.bfloat16)
    cos, sin = rope_cos_sin(jnp.maximum(positions, 0), cfg)  # [B, T, E]

    delta = None
    for layer, lp in enumerate(params["layers"]):
        x, delta, cache = _layer(cfg, lp, x, delta, layer, positions, cos, sin, cache, backend)
    return add_rms_norm(x, delta, params["final_norm"], cfg.rms_norm_eps)[1], cache


def compute_logits(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """hidden [..., D] -> float32 logits [..., V] (tied embeddings reuse the embedding matrix,
    unless the params carry a packed copy as ``lm_head``, see ``research.native.gemm``)."""
    if cfg.tie_word_embeddings and "lm_head" not in params:
        return matmul(hidden, params["embed"], transposed=True)
    return matmul(hidden, params["lm_head"])
