"""A jitted step's parameters, passed with each distinct buffer once.

Dispatching a jitted call costs the host a few microseconds per argument buffer (flattening,
the signature check, the runtime's per-buffer bookkeeping): 3.7 us each on a Zen 4 core, where
SmolLM2's 183 parameter buffers took ~0.7 ms of a one-sequence decode step's ~12.
``compact`` passes each distinct buffer once (the per-layer views of one
``research.native.gemm.stack_layers`` stack share theirs) and stacks small vectors of one shape
and dtype (each layer's norms) into one array; ``CallParams.tree`` rebuilds the model's own
tree inside the trace, where a stacked vector's row is a slice XLA fuses into its reader.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# Vectors up to this size are stacked with the others of their shape and dtype (a layer's norm
# is 1-2 KB): a copy that costs nothing, made once.
SMALL_BYTES = 1 << 16


@jax.tree_util.register_pytree_node_class
class CallParams:
    """``buffers``: what the call passes; ``layout``: (the params' treedef, one (buffer,
    row) per leaf: the leaf is ``buffers[buffer]``, or its row ``row`` where ``row >= 0``).
    Static: two calls with the same layout share a compiled step."""

    def __init__(self, buffers: list[Any], layout: tuple[Any, tuple[tuple[int, int], ...]]):
        self.buffers = list(buffers)
        self.layout = layout

    def tree_flatten(self) -> tuple[list[Any], Any]:
        return self.buffers, self.layout

    @classmethod
    def tree_unflatten(cls, layout: Any, buffers: Any) -> CallParams:
        return cls(list(buffers), layout)

    def tree(self) -> Any:
        """The params as the model takes them."""
        treedef, sources = self.layout
        leaves = [self.buffers[b] if row < 0 else self.buffers[b][row] for b, row in sources]
        return jax.tree.unflatten(treedef, leaves)


def _stackable(leaf: Any) -> bool:
    return (
        isinstance(leaf, jax.Array)
        and leaf.ndim == 1
        and leaf.nbytes <= SMALL_BYTES
        and len(leaf.sharding.device_set) == 1
    )


def compact(params: Any) -> CallParams:
    """``params`` as a ``CallParams``: each distinct leaf once (by identity), and the small
    vectors that share a shape, dtype and device stacked into one array each."""
    leaves, treedef = jax.tree.flatten(params)
    unique: dict[int, int] = {}  # id(leaf) -> index into `distinct`
    distinct: list[Any] = []
    for leaf in leaves:
        if id(leaf) not in unique:
            unique[id(leaf)] = len(distinct)
            distinct.append(leaf)
    groups: dict[Any, list[int]] = {}
    for i, leaf in enumerate(distinct):
        if _stackable(leaf):
            groups.setdefault((leaf.shape, leaf.dtype, leaf.sharding), []).append(i)
    where: dict[int, tuple[int, int]] = {}  # distinct index -> (buffer, row)
    buffers: list[Any] = []
    for members in groups.values():
        if len(members) < 2:
            continue
        for row, i in enumerate(members):
            where[i] = (len(buffers), row)
        buffers.append(jnp.stack([distinct[i] for i in members]))
    for i, leaf in enumerate(distinct):
        if i not in where:
            where[i] = (len(buffers), -1)
            buffers.append(leaf)
    sources = tuple(where[unique[id(leaf)]] for leaf in leaves)
    return CallParams(buffers, (treedef, sources))
