"""The two places where the step runs per device under ``shard_map``: paged attention (each
device reads only its kv heads' pages, through the XLA path or the Pallas kernel) and the
expert-parallel MoE (each device runs its own experts; the outputs are summed)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from research.parallel.sharding import ShardingPlan
from research.quant.qtensor import QTensor


def sharded_attention(
    plan: ShardingPlan,
    attend: Callable[..., jax.Array],
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    pool: Any,
    layer: int,
    block_tables: jax.Array,
    meta: Any,
    scale: float,
    window: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """``attend`` (a ``research.engine.attention`` backend) per device: q [N, H, E] split by
    query head, the new K/V [N, K, E] and the layer's pages [K, ...] split by kv head; block
    tables and the step's attention metadata replicated."""
    if sinks is not None:
        raise ValueError("tensor parallelism does not split attention sinks (gpt-oss)")
    heads = plan.spec(("q_heads",))[0]
    kv = plan.spec(("kv_heads",))[0]
    scales = [pool.k_scales[layer], pool.v_scales[layer]] if pool.quantized else []

    def local(q, k_new, v_new, k_pages, v_pages, block_tables, meta, *scales):
        one = dataclasses.replace(
            pool,
            k=[k_pages],
            v=[v_pages],
            k_scales=list(scales[:1]),
            v_scales=list(scales[1:]),
        )
        return attend(q, k_new, v_new, one, 0, block_tables, meta, scale, window=window)

    return jax.shard_map(
        local,
        mesh=plan.mesh,
        in_specs=(
            P(None, heads, None),
            P(None, kv, None),
            P(None, kv, None),
            P(kv),
            P(kv),
            P(),
            jax.tree_util.tree_map(lambda _: P(), meta),
            *[P(kv)] * len(scales),
        ),
        out_specs=P(None, heads, None),
        check_vma=False,
    )(q, k_new, v_new, pool.k[layer], pool.v[layer], block_tables, meta, *scales)


def _local_experts(w: Any) -> Any:
    if isinstance(w, QTensor):
        return dataclasses.replace(w, shape=(w.codes.shape[0], *w.shape[1:]))
    return w


def expert_parallel(
    plan: ShardingPlan,
    experts_fn: Callable[..., jax.Array],
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    w_gate: Any,
    w_up: Any,
    w_down: Any,
    backend: str,
) -> jax.Array:
    """``experts_fn`` (``moe._experts``) on each device's E/n experts, ids shifted so that the
    experts held elsewhere fall outside its range; the partial outputs are summed."""
    axes = plan.spec(("experts",))[0]

    def local(x, weights, experts, w_gate, w_up, w_down):
        # A QTensor's static shape names the whole stack; here it holds its share of it.
        w_gate, w_up, w_down = (_local_experts(w) for w in (w_gate, w_up, w_down))
        first = jax.lax.axis_index(axes) * w_gate.shape[0]
        out = experts_fn(x, weights, experts - first, w_gate, w_up, w_down, backend)
        return jax.lax.psum(out, axes)

    return jax.shard_map(
        local,
        mesh=plan.mesh,
        in_specs=(P(), P(), P(), P(axes), P(axes), P(axes)),
        out_specs=P(),
        check_vma=False,
    )(x, weights, experts, w_gate, w_up, w_down)
