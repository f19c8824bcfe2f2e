"""Stateless building blocks shared by every architecture.

Axis legend used in einsums and shape comments:
  B = batch (sequences)     T = tokens per sequence in this call   S = cached positions
  D = hidden                H = query heads                         K = kv heads
  G = query heads per kv head (H = K * G)                           E = head_dim
  F = MLP width             V = vocabulary
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from research.config import ModelConfig, RopeScaling
from research.native.gemm import BlockWeight, NormWeight, PackedWeight, block_matmul
from research.native.gemm import add_rms_norm as native_add_rms_norm
from research.native.gemm import matmul as packed_matmul
from research.quant import QTensor, dequantize

# Where kernels run: "xla" = pure jnp reference, "native" = the C++ paged-attention kernel on CPU
# (``research.native``; matmuls as "xla"), "pallas" = Triton-backend Pallas kernels on GPU,
# "pallas_interpret" = the same kernels interpreted on CPU (for tests).
KERNEL_BACKENDS = ("xla", "native", "pallas", "pallas_interpret")


def rms_norm(x: jax.Array, weight: jax.Array | NormWeight, eps: float) -> jax.Array:
    """RMSNorm computed in float32, cast back to the input dtype before the weight (as HF)."""
    return add_rms_norm(x, None, weight, eps)[1]


def add_rms_norm(
    x: jax.Array, delta: jax.Array | None, weight: jax.Array | NormWeight, eps: float
) -> tuple[jax.Array, jax.Array]:
    """The residual stream after its add and its norm: (s, rms_norm(s)) for s = x + delta (x
    where ``delta`` is None). A ``NormWeight`` (``research.native.gemm.pack_params``) runs both
    in one native call where x, delta and the weight share a dtype; anything else in XLA."""
    if isinstance(weight, NormWeight):
        if x.dtype == weight.dtype and (delta is None or delta.dtype == x.dtype):
            return native_add_rms_norm(x, delta, weight, eps)
        weight = weight.own
    if delta is not None:
        x = x + delta
    return x, _rms_norm(x, weight, eps)


def _rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse frequencies [E/2] in float32, with Llama-3 or YaRN scaling if given."""
    inv_freq = 1.0 / (
        theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim)
    )
    inv_freq = inv_freq.astype(np.float32)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed down by `factor`, short ones kept, the band
    # in between interpolated smoothly.
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """YaRN (HF's ``_compute_yarn_parameters``): dimensions that rotate more than ``beta_fast``
    times over the original context keep their frequency, those under ``beta_slow`` are
    interpolated by ``factor``, with a linear ramp between (bounds rounded outward when
    ``truncate``)."""
    pos_freqs = theta ** (np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim))
    extrapolation = (1.0 / pos_freqs).astype(np.float32)
    interpolation = (1.0 / (np.float32(scaling.factor) * pos_freqs)).astype(np.float32)
    old_len = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as HF: no zero-width ramp
    ramp = (np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    keep = (1 - np.clip(ramp, 0, 1)).astype(np.float32)  # 1 = extrapolate (original frequency)
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """The gain YaRN puts on cos and sin (1 for every other RoPE)."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    return 1.0 if scaling.factor <= 1 else 0.1 * math.log(scaling.factor) + 1.0


def rope_cos_sin(positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables [..., E] for integer positions [...] (HF's half-split layout)."""
    inv_freq = jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., E/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [..., E]
    gain = rope_attention_factor(cfg.rope_scaling)
    if gain == 1.0:
        return jnp.cos(emb), jnp.sin(emb)
    return jnp.cos(emb) * gain, jnp.sin(emb) * gain


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B, T, heads, E] by cos/sin [B, T, E] (rotate-half convention of HF)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def matmul(x: jax.Array, w: jax.Array, transposed: bool = False) -> jax.Array:
    """x [..., I] @ w [I, O] (``transposed``: w is [O, I]), accumulated in float32 and returned
    in float32. Float32 operands are a plain dot. Narrower ones (bf16) are one 2-D dot with a
    float32 result: on XLA:CPU that is the fast path (AMX / AVX512-BF16 where the CPU has them;
    a bf16-output dot measured 2-3x slower at 4-64 rows), and a single row is padded to two,
    because the bf16 matrix-vector path is ~20x slower than the two-row matrix product."""
    if isinstance(w, PackedWeight):  # through the native kernels (``research.native.gemm``)
        return packed_matmul(x, w)
    if isinstance(w, BlockWeight):  # GGUF's blocks as stored, through the native kernel
        return block_matmul(x, w)
    contract = 1 if transposed else 0
    if x.dtype == jnp.float32 and w.dtype == jnp.float32:
        return jax.lax.dot_general(x, w, (((x.ndim - 1,), (contract,)), ((), ())))
    lead = x.shape[:-1]
    m = math.prod(lead)
    x2 = x.reshape(m, x.shape[-1])
    if m == 1:
        x2 = jnp.concatenate([x2, jnp.zeros_like(x2)])
    y = jax.lax.dot_general(
        x2, w, (((1,), (contract,)), ((), ())), preferred_element_type=jnp.float32
    )
    return y[:m].reshape(*lead, y.shape[-1])


def linear(x: jax.Array, w: jax.Array | QTensor, backend: str = "xla") -> jax.Array:
    """x [..., I] @ w [I, O] in x's dtype (accumulated in float32, see ``matmul``). A quantized
    weight is dequantized by XLA inside the step (``"xla"``) or tile by tile inside the Pallas
    quantized-matmul kernel (``"pallas*"``)."""
    if isinstance(w, PackedWeight):  # the native kernels write x's dtype themselves
        return packed_matmul(x, w, out_dtype=x.dtype)
    if isinstance(w, BlockWeight):
        return block_matmul(x, w, out_dtype=x.dtype)
    if not isinstance(w, QTensor):
        return matmul(x, w).astype(x.dtype)
    if not backend.startswith("pallas"):  # "xla", or "native" (attention only)
        return matmul(x, dequantize(w).astype(x.dtype)).astype(x.dtype)
    from pallas_kernels.grouped_experts import quantized_matmul
    from pallas_kernels.tuning import grouped_experts_config, target_for_backend

    target = target_for_backend(backend)
    if any(a.dtype == jnp.float8_e4m3fn for a in jax.tree_util.tree_leaves(w)):
        target.require_fp8(f"a {getattr(w, 'fmt', 'float')} weight")
    rows = math.prod(x.shape[:-1])
    blocks, _ = grouped_experts_config(
        target,
        x_dtype=x.dtype,
        fmt=getattr(w, "fmt", None),
        experts=1,
        k=w.shape[-2],
        n=w.shape[-1],
        m=rows,
    )
    return quantized_matmul(x, w, **blocks, interpret=backend == "pallas_interpret")


def swiglu(
    x: jax.Array,
    w_gate: jax.Array | QTensor,
    w_up: jax.Array | QTensor,
    w_down: jax.Array | QTensor,
    backend: str = "xla",
) -> jax.Array:
    """SwiGLU MLP: x [..., D] -> [..., D] with w_gate, w_up [D, F] and w_down [F, D]."""
    gate, up = linear(x, w_gate, backend), linear(x, w_up, backend)
    return linear(jax.nn.silu(gate) * up, w_down, backend)


def grouped_query_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    scale: float,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Masked softmax attention with grouped KV heads.

    q [B, T, H, E], k and v [B, K, S, E], mask [B, T, S] (True = attend) -> [B, T, H, E].
    Scores and softmax run in float32. Masked keys contribute exactly zero, even when the cache
    holds NaN or garbage there. ``sinks`` [H] (gpt-oss): one more logit per head in every
    softmax denominator, attached to no value.
    """
    b, t, h, e = q.shape
    kvh = k.shape[1]
    # Batch axes (B, K) lead every dot: XLA:CPU runs a batched dot whose output puts them
    # elsewhere ~9x slower (measured on SmolLM2 decode shapes).
    qg = q.reshape(b, t, kvh, h // kvh, e).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, E]
    scores = jnp.einsum("BKGTE,BKSE->BKGTS", qg, k, preferred_element_type=jnp.float32) * scale
    m = mask[:, None, None, :, :]
    scores = jnp.where(m, scores, -jnp.inf)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        sink = jnp.broadcast_to(
            sinks.astype(jnp.float32).reshape(1, kvh, h // kvh, 1, 1), (*scores.shape[:-1], 1)
        )
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    probs = jnp.where(m, probs, 0.0).astype(v.dtype)
    v = jnp.where(mask.any(axis=1)[:, None, :, None], v, jnp.zeros((), v.dtype))
    out = jnp.einsum("BKGTS,BKSE->BKGTE", probs, v, preferred_element_type=jnp.float32)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, e).astype(q.dtype)


def attention_with_lse(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float
) -> tuple[jax.Array, jax.Array]:
    """Masked GQA that also returns the log-sum-exp of the scores, for merging partial
    attentions (the paged kernel's cached context with a call's new tokens).

    q [B, T, H, E], k and v [B, S, K, E], mask [B, T, S] -> (float32 out [B, T, H, E],
    lse [B, T, H]); a query with no visible key gets out 0 and lse -inf.
    """
    b, t, h, e = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, e).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, E]
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, E]
    scores = jnp.einsum("BKGTE,BKSE->BKGTS", qg, kt, preferred_element_type=jnp.float32) * scale
    m = mask[:, None, None, :, :]
    scores = jnp.where(m, scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)  # [B, K, G, T]
    probs = jnp.where(m, jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    vt = jnp.where(mask.any(axis=1)[:, None, :, None], vt, jnp.zeros((), vt.dtype))
    out = jnp.einsum("BKGTS,BKSE->BKGTE", probs, vt.astype(jnp.float32))
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, e)
    return out, lse.transpose(0, 3, 1, 2).reshape(b, t, h)
