"""Sparse MoE MLP: Qwen3-MoE (A3B: softmax router over all experts, top-k, SwiGLU experts) and
gpt-oss (router with a bias, softmax over the top-k logits, experts with biases and a clamped
SwiGLU).

Tokens are sorted by expert and each expert's contiguous slice is multiplied by that expert's
weights with one grouped GEMM (``grouped_matmul``, ``jax.lax.ragged_dot`` semantics); the Pallas
grouped-experts kernel plugs in behind the same function.

Axis legend: N = tokens, D = hidden, E = experts, A = activated experts per token (top-k),
F = expert MLP width, R = routed rows (N * A).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from research.quant import QTensor, dequantize


def route(
    x: jax.Array,
    w_router: jax.Array,
    top_k: int,
    norm_topk_prob: bool,
    bias: jax.Array | None = None,
    softmax_after_topk: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Router: x [N, D], w_router [D, E] (bias [E]) -> (weights [N, A] float32, expert ids
    [N, A] int32). ``softmax_after_topk`` (gpt-oss): the top-k logits, then a softmax over them."""
    logits = x @ w_router
    if bias is not None:
        logits = logits + bias.astype(logits.dtype)
    logits = logits.astype(jnp.float32)  # [N, E]
    if softmax_after_topk:
        top, experts = jax.lax.top_k(logits, top_k)
        return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array | QTensor,
    group_sizes: jax.Array,
    backend: str = "xla",
    bias: jax.Array | None = None,
    row_scale: jax.Array | None = None,
) -> jax.Array:
    """lhs [R, Din] sorted by group, rhs [E, Din, Dout], group_sizes [E] (+ bias [E, Dout] per
    group, gpt-oss) (x ``row_scale`` [R], the router weights) -> [R, Dout]; rows past the groups
    are rows of no expert here. The Pallas kernel applies ``row_scale`` in its epilogue.

    ``"xla"``: ``ragged_dot`` (on the dequantized experts when rhs is a QTensor); ``"pallas*"``:
    the Pallas grouped-experts kernel, which dequantizes 4/8-bit experts tile by tile and adds
    the bias to its float32 accumulator."""
    if not backend.startswith("pallas"):  # "xla", or "native" (attention only)
        if isinstance(rhs, QTensor):
            rhs = dequantize(rhs).astype(lhs.dtype)
        y = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=lhs.dtype)
        if bias is not None:
            row_group = jnp.repeat(
                jnp.arange(group_sizes.shape[0]), group_sizes, total_repeat_length=lhs.shape[0]
            )
            y = y + bias[row_group].astype(y.dtype)
        return y if row_scale is None else y * row_scale[:, None].astype(y.dtype)
    from pallas_kernels.grouped_experts import grouped_experts
    from pallas_kernels.tuning import grouped_experts_config, target_for_backend

    target = target_for_backend(backend)
    if any(a.dtype == jnp.float8_e4m3fn for a in jax.tree_util.tree_leaves(rhs)):
        target.require_fp8(f"a {getattr(rhs, 'fmt', 'float')} weight")
    blocks, _ = grouped_experts_config(
        target,
        x_dtype=lhs.dtype,
        fmt=getattr(rhs, "fmt", None),
        experts=rhs.shape[0],
        k=rhs.shape[-2],
        n=rhs.shape[-1],
        m=lhs.shape[0],
    )
    interpret = backend == "pallas_interpret"
    return grouped_experts(
        lhs, rhs, group_sizes, bias=bias, row_scale=row_scale, **blocks, interpret=interpret
    )


def moe_mlp(
    x: jax.Array,
    w_router: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    top_k: int,
    norm_topk_prob: bool,
    backend: str = "xla",
    plan: Any = None,
    router_bias: jax.Array | None = None,
    softmax_after_topk: bool = False,
    biases: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.702,
) -> jax.Array:
    """x [N, D] -> [N, D]. Expert weights: w_gate, w_up [E, D, F]; w_down [E, F, D]; optional
    ``biases`` (b_gate, b_up [E, F], b_down [E, D]) and ``swiglu_limit`` (see ``clamped_swiglu``).

    With an expert-parallel ``plan`` (``research.parallel.ShardingPlan``) each device holds E/n
    experts and runs the rows routed to them; the partial outputs are summed over the devices
    (the tokens are replicated there, as after tensor-parallel attention)."""
    weights, experts = route(
        x, w_router, top_k, norm_topk_prob, router_bias, softmax_after_topk
    )  # [N, A]
    if plan is not None and plan.expert_parallel and plan.size > 1:
        if biases is not None or swiglu_limit is not None:
            raise ValueError("expert parallelism does not support experts with biases (gpt-oss)")
        from research.parallel.ops import expert_parallel

        return expert_parallel(plan, _experts, x, weights, experts, w_gate, w_up, w_down, backend)
    return _experts(
        x, weights, experts, w_gate, w_up, w_down, backend, biases, swiglu_limit, swiglu_alpha
    )


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float, alpha: float) -> jax.Array:
    """gpt-oss's expert activation: gate clamped to <= limit, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def _experts(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    w_gate: jax.Array | QTensor,
    w_up: jax.Array | QTensor,
    w_down: jax.Array | QTensor,
    backend: str,
    biases: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.702,
) -> jax.Array:
    """The routed rows through the experts held here: ``experts`` [N, A] index ``w_*``'s
    leading axis; an id outside [0, E) (an expert held elsewhere) skips its row."""
    num_experts, top_k = w_gate.shape[0], experts.shape[-1]
    flat_experts = experts.reshape(-1)  # [R]
    here = (flat_experts >= 0) & (flat_experts < num_experts)
    flat_experts = jnp.where(here, flat_experts, num_experts)  # rows held elsewhere sort last
    order = jnp.argsort(flat_experts, stable=True)  # rows grouped by expert
    token_of_row = order // top_k  # [R] which token each sorted row came from
    # [E]: rows of the experts held here; the rows sorted after them get no group (zeros)
    group_sizes = jnp.bincount(flat_experts, length=num_experts + 1)[:num_experts]
    group_sizes = group_sizes.astype(jnp.int32)

    xs = x[token_of_row]  # [R, D]
    b_gate, b_up, b_down = biases if biases is not None else (None, None, None)
    gate = grouped_matmul(xs, w_gate, group_sizes, backend, b_gate)  # [R, F]
    up = grouped_matmul(xs, w_up, group_sizes, backend, b_up)
    if swiglu_limit is None:
        h = jax.nn.silu(gate) * up
    else:
        h = clamped_swiglu(gate, up, swiglu_limit, swiglu_alpha)
    row_weight = jnp.where(here, weights.reshape(-1), 0.0)[order]  # [R] router weights
    # [R, D], each routed row times its router weight (the kernel's epilogue on Pallas)
    ys = grouped_matmul(h, w_down, group_sizes, backend, b_down, row_scale=row_weight)
    return jnp.zeros_like(x).at[token_of_row].add(ys)
