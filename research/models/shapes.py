"""Parameter shapes of the decoder stack, without JAX: the cost model, the KV-capacity formula
and ``init_params`` all read them from here."""

from __future__ import annotations

from typing import Any

from research.config import ModelConfig


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """Shapes of every parameter as a nested dict / list of tuples (no allocation)."""
    d, e = cfg.hidden_size, cfg.head_dim
    layer: dict[str, tuple[int, ...]] = {
        "attn_norm": (d,),
        "mlp_norm": (d,),
        "wq": (d, cfg.num_heads * e),
        "wk": (d, cfg.num_kv_heads * e),
        "wv": (d, cfg.num_kv_heads * e),
        "wo": (cfg.num_heads * e, d),
    }
    if cfg.qk_norm:
        layer |= {"q_norm": (e,), "k_norm": (e,)}
    if cfg.attention_bias:
        layer |= {
            "bq": (cfg.num_heads * e,),
            "bk": (cfg.num_kv_heads * e,),
            "bv": (cfg.num_kv_heads * e,),
            "bo": (d,),
        }
    if cfg.attention_sinks:
        layer["sinks"] = (cfg.num_heads,)
    if cfg.is_moe:
        x, f = cfg.num_experts, cfg.moe_intermediate_size
        layer |= {
            "router": (d, x),
            "w_gate": (x, d, f),
            "w_up": (x, d, f),
            "w_down": (x, f, d),
        }
        if cfg.router_bias:
            layer["router_bias"] = (x,)
        if cfg.expert_bias:
            layer |= {"b_gate": (x, f), "b_up": (x, f), "b_down": (x, d)}
    else:
        f = cfg.intermediate_size
        layer |= {"w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
    shapes: dict[str, Any] = {
        "embed": (cfg.vocab_size, d),
        "layers": [dict(layer) for _ in range(cfg.num_layers)],
        "final_norm": (d,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
    return shapes
