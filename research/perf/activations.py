"""What vLLM's profile run charges besides the weights: the peak activations of one forward and of
the sampler, plus "other", under the batch ``vllm serve`` runs by default on a machine.

``estimate_activation_bytes`` is the "peak activations + other" term of ``kv_capacity``'s formula
(``research.perf.kv_capacity``); ``activation_elements_per_token`` is the forward's share, which
``research.perf.vllm_memory`` charges on its own. Also here, below both: resolving a preset name
to its ``ModelConfig`` and a dtype to its element size (``kv_capacity`` imports these and
``vllm_batch_defaults`` from here, so ``research.perf.kv_capacity`` still offers them).

Arithmetic on shapes: no parameter is allocated and JAX is not imported.
"""

from __future__ import annotations

from typing import Any

from research.config import ModelConfig
from research.perf.hardware import GiB, Hardware, get_hardware

DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
}

# vLLM's batch defaults for `vllm serve` (UsageContext.OPENAI_API_SERVER) in
# vllm/engine/arg_utils.py EngineArgs.get_batch_defaults: GPUs reporting >= 70 GiB (A100 excluded)
# get max_num_batched_tokens 8192 and max_num_seqs 1024, others 2048 and 256. The profile run that
# measures peak activations runs a batch of max_num_batched_tokens tokens and samples max_num_seqs
# rows, so these set the activation estimate when the caller does not.
VLLM_LARGE_GPU_BYTES = 70 * GiB
VLLM_BATCH_DEFAULTS_LARGE = (8192, 1024)
VLLM_BATCH_DEFAULTS_SMALL = (2048, 256)

# "Other" in vLLM's formula: memory outside PyTorch's activation peak that the profile run sees
# grow (cuBLAS / NCCL workspaces, allocator slack). An estimate, not a measurement. CUDA graphs
# are not charged here: before v0.21.0 vLLM captured them after allocating the KV pool, out of
# the (1 - gpu_memory_utilization) headroom; since v0.21.0 it subtracts an estimate of them
# from the pool (``vllm_available_kv_bytes``; docs/experiments/kv_capacity_gb10.md).
DEFAULT_OTHER_BYTES = 1 * GiB
# Bytes per [max_num_seqs, vocab] element alive at the sampler's peak in the profile run: float32
# logits and probabilities, and a top-k/top-p sort's float32 values and int64 indices.
SAMPLER_BYTES_PER_LOGIT = 4 + 4 + 4 + 8


def resolve_model(model: str | ModelConfig) -> ModelConfig:
    """A preset name or a ``ModelConfig`` -> the ``ModelConfig``."""
    if isinstance(model, ModelConfig):
        return model
    from research.models.presets import get_preset

    return get_preset(model)


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of ``dtype``: a name ("bfloat16", "float32", "bf16", ...) or anything
    numpy understands as a dtype (``jnp.bfloat16``, ``np.float32``)."""
    if isinstance(dtype, str):
        try:
            return DTYPE_BYTES[dtype.lower()]
        except KeyError:
            raise ValueError(
                f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}"
            ) from None
    itemsize = getattr(dtype, "itemsize", None)
    if itemsize is None:
        import numpy as np

        try:
            itemsize = np.dtype(dtype).itemsize
        except TypeError:
            raise ValueError(f"cannot tell the element size of dtype {dtype!r}") from None
    return int(itemsize)


def vllm_batch_defaults(hardware: str | Hardware) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) that ``vllm serve`` picks on ``hardware`` when not
    told: (8192, 1024) on GPUs reporting >= 70 GiB, (2048, 256) otherwise (vLLM's
    ``EngineArgs.get_batch_defaults``; its A100 exception does not concern our machines)."""
    hw = get_hardware(hardware)
    if hw.cuda_visible_bytes >= VLLM_LARGE_GPU_BYTES:
        return VLLM_BATCH_DEFAULTS_LARGE
    return VLLM_BATCH_DEFAULTS_SMALL


def activation_elements_per_token(model: str | ModelConfig) -> int:
    """Activation elements one token holds at the peak of a layer in vLLM's profile forward.

    Tensors are freed as soon as the next op has consumed them, so the peak is the hidden state
    and residual carried between layers (2D) plus the widest single stage, not the sum of all:

    - attention stage: normed input (D), fused q/k/v ((H + 2K) * E), q and k after RoPE
      ((H + K) * E), attention output (H * E);
    - dense MLP stage: normed input (D), fused gate/up (2F), SiLU(gate) * up (F);
    - MoE stage (vLLM's fused_moe): normed input (D), router logits (X), and the three
      intermediate caches per routed copy, ``top_k * (2F + F + D)``.
    """
    cfg = resolve_model(model)
    d, e = cfg.hidden_size, cfg.head_dim
    attention = d + (cfg.num_heads + 2 * cfg.num_kv_heads) * e
    attention += (cfg.num_heads + cfg.num_kv_heads) * e + cfg.num_heads * e
    if cfg.is_moe:
        f = cfg.moe_intermediate_size
        mlp = d + cfg.num_experts + cfg.num_experts_per_tok * (3 * f + d)
    else:
        mlp = d + 3 * cfg.intermediate_size
    return 2 * d + max(attention, mlp)


def estimate_activation_bytes(
    model: str | ModelConfig,
    *,
    max_num_batched_tokens: int = VLLM_BATCH_DEFAULTS_SMALL[0],
    max_num_seqs: int = VLLM_BATCH_DEFAULTS_SMALL[1],
    dtype: Any = "bfloat16",
    other_bytes: int = DEFAULT_OTHER_BYTES,
) -> int:
    """The "peak activations + other" of vLLM's formula, computed as its profile run incurs them:
    one forward of ``max_num_batched_tokens`` tokens, then the sampler over ``max_num_seqs``
    rows (the dummy sampler run uses top-k / top-p, so it sorts)::

        forward = max_num_batched_tokens * activation_elements_per_token(model) * dtype bytes
        sampler = max_num_batched_tokens * hidden * dtype bytes       (the kept hidden states)
                  + rows * vocab * SAMPLER_BYTES_PER_LOGIT             (rows = min(seqs, tokens))
        peak    = max(forward, sampler) + other_bytes

    The sampler's bytes per logit: float32 logits (4), probabilities (4), and a sort's float32
    values plus int64 indices (12). ``other_bytes`` (workspaces, allocator slack; DEFAULT 1 GiB)
    is the one term not derived from the shapes. A model of the measurement, not the
    measurement: pass the figure of a vLLM log ("PyTorch activation peak memory ...") as
    ``activation_bytes`` to ``kv_capacity`` when one is at hand.
    """
    cfg = resolve_model(model)
    if max_num_batched_tokens < 1 or max_num_seqs < 1:
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) and max_num_seqs "
            f"({max_num_seqs}) must be >= 1"
        )
    if other_bytes < 0:
        raise ValueError(f"other_bytes must be >= 0, got {other_bytes}")
    elem = dtype_bytes(dtype)
    forward = max_num_batched_tokens * activation_elements_per_token(cfg) * elem
    rows = min(max_num_seqs, max_num_batched_tokens)
    sampler = max_num_batched_tokens * cfg.hidden_size * elem
    sampler += rows * cfg.vocab_size * SAMPLER_BYTES_PER_LOGIT
    return max(forward, sampler) + other_bytes
