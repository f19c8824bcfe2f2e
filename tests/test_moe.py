"""The sorted/grouped MoE path against a dense loop over every expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.models.moe import moe_mlp, route


def _dense_reference(x, w_router, w_gate, w_up, w_down, top_k, norm):
    """Every expert on every token, weighted by the (renormalized) top-k router weights."""
    probs = jax.nn.softmax(x @ w_router, axis=-1)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-probs[t])[:top_k]
        w = probs[t, top] / (probs[t, top].sum() if norm else 1.0)
        for e, we in zip(top, w, strict=True):
            h = jax.nn.silu(x[t] @ w_gate[e]) * (x[t] @ w_up[e])
            out[t] += we * (h @ w_down[e])
    return out


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 7, 40])
def test_moe_matches_dense_loop(norm, num_tokens):
    d, f, e, k = 16, 8, 6, 2
    keys = jax.random.split(jax.random.key(num_tokens), 5)
    x = jax.random.normal(keys[0], (num_tokens, d))
    w_router = jax.random.normal(keys[1], (d, e))
    w_gate = jax.random.normal(keys[2], (e, d, f)) * 0.3
    w_up = jax.random.normal(keys[3], (e, d, f)) * 0.3
    w_down = jax.random.normal(keys[4], (e, f, d)) * 0.3
    got = jax.jit(lambda *a: moe_mlp(*a, top_k=k, norm_topk_prob=norm))(
        x, w_router, w_gate, w_up, w_down
    )
    ref = _dense_reference(
        np.asarray(x),
        np.asarray(w_router),
        np.asarray(w_gate),
        np.asarray(w_up),
        np.asarray(w_down),
        k,
        norm,
    )
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-4)


def test_experts_with_no_tokens_are_skipped():
    # Router that sends every token to experts 0 and 3 only: the other groups are empty.
    d, f, e = 8, 4, 5
    x = jnp.ones((6, d))
    w_router = jnp.zeros((d, e)).at[:, 0].set(1.0).at[:, 3].set(0.5)
    weights, experts = route(x, w_router, 2, True)
    assert set(np.asarray(experts).ravel().tolist()) == {0, 3}
    np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, rtol=1e-6)
    w = jax.random.normal(jax.random.key(0), (3, e, d, f))
    w_down = jax.random.normal(jax.random.key(1), (e, f, d))
    got = moe_mlp(x, w_router, w[0], w[1], w_down, top_k=2, norm_topk_prob=True)
    ref = _dense_reference(
        np.asarray(x),
        np.asarray(w_router),
        np.asarray(w[0]),
        np.asarray(w[1]),
        np.asarray(w_down),
        2,
        True,
    )
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-4)
