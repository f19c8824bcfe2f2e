"""A jitted step's parameters passed with each distinct buffer once (``call_params``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from research.engine.call_params import SMALL_BYTES, CallParams, compact


def test_compact_passes_each_buffer_once_and_rebuilds_the_tree():
    """A leaf held twice is passed once; small vectors of one shape and dtype share one
    stacked buffer (three norms), others stay apart (another dtype, a lone shape, a vector past
    ``SMALL_BYTES``, a matrix); ``tree()`` gives the same tree and values, inside a jit too."""
    shared = jnp.arange(12.0).reshape(3, 4)
    big = jnp.ones(SMALL_BYTES // 4 + 1, jnp.float32)
    params = {
        "embed": shared,
        "head": shared,
        "norms": [jnp.full(8, i, jnp.bfloat16) for i in range(3)],
        "odd": jnp.zeros(8, jnp.float32),
        "lone": jnp.ones(5, jnp.bfloat16),
        "big": big,
    }
    call = compact(params)
    assert len(call.buffers) == 5  # shared, the norm stack, odd, lone, big
    assert sum(b.shape == (3, 8) for b in call.buffers) == 1
    leaves = jax.tree.leaves(params)
    for got, want in zip(jax.tree.leaves(call.tree()), leaves, strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert jax.tree.structure(call.tree()) == jax.tree.structure(params)

    @jax.jit
    def total(p: CallParams) -> jax.Array:
        t = p.tree()
        return t["embed"].sum() + t["norms"][2].astype(jnp.float32).sum() + t["big"].sum()

    assert len(jax.tree.leaves(call)) == 5
    assert float(total(call)) == float(shared.sum() + 16 + big.sum())
