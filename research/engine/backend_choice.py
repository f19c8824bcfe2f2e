"""Which attention backend a run uses, and why (``research.engine.attention`` runs them).

``choose_attention_backend("auto", ...)`` picks Pallas on a GPU, the native kernel on a CPU
where it builds and serves the pool, else the XLA reference, and returns the reason with the
name (recorded in every results row). An explicit backend that cannot serve is an error
naming why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from research.config import ModelConfig

ATTENTION_BACKENDS = ("xla", "native", "pallas", "pallas_interpret")


@dataclass(frozen=True)
class AttentionChoice:
    """The backend a run uses and why (recorded in every results row's provenance)."""

    name: str
    reason: str


def native_supports(dtype: Any, kv_cache_dtype: str, cfg: ModelConfig | None = None) -> str | None:
    """Why the native CPU attention cannot serve a pool of ``dtype`` pages for ``cfg`` (None =
    it can)."""
    if cfg is not None and (cfg.attention_sinks or cfg.sliding_layers):
        return f"{cfg.name}'s sliding windows and attention sinks (the kernel has neither)"
    if kv_cache_dtype != "auto":
        return f"kv_cache_dtype={kv_cache_dtype!r} (native attention reads float32/bfloat16 pages)"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return f"{jnp.dtype(dtype).name} pages (native attention reads float32/bfloat16 pages)"
    if jax.default_backend() != "cpu":
        return f"the {jax.default_backend()} platform (native attention runs on CPU)"
    from research import native

    if not native.available():
        return f"the native attention library did not build: {native.build_error()}"
    return None


def pallas_supports(
    kv_cache_dtype: str, platform: str | None = None, device_kind: str | None = None
) -> str | None:
    """Why the compiled Pallas kernel cannot serve here (None = it can): it needs a GPU, and
    fp8 pages need one Triton compiles fp8 for (``device_kind``: the GPU's, else the local
    one's)."""
    platform = platform or jax.default_backend()
    if platform != "gpu":
        return f"the {platform} platform (the Pallas Triton kernels compile for GPUs)"
    if kv_cache_dtype == "fp8":
        from pallas_kernels.tuning import target_for_backend, target_for_kind

        target = target_for_kind(device_kind) if device_kind else target_for_backend("pallas")
        if not target.supports_fp8:
            return f"fp8 pages on sm_{target.compute_capability}"
    return None


def choose_attention_backend(
    backend: str,
    dtype: Any,
    kv_cache_dtype: str,
    sharded: bool = False,
    cfg: ModelConfig | None = None,
    platform: str | None = None,
    device_kind: str | None = None,
) -> AttentionChoice:
    """``"auto"``: Pallas on a GPU, the native kernel on a CPU where it serves this pool and model
    (float32/bfloat16 pages, no sliding windows or sinks, the library built; under a tensor or
    expert parallel plan each device runs it on its own heads, ``research.parallel.ops``), else
    the XLA reference. An explicit backend that cannot serve is an error naming why.
    ``platform`` / ``device_kind``: where the run is (default: this process's devices)."""
    platform = platform or jax.default_backend()
    if backend == "auto":
        if (why_not := pallas_supports(kv_cache_dtype, platform, device_kind)) is None:
            return AttentionChoice("pallas", f"auto: the {platform} platform")
        if platform == "gpu":
            return AttentionChoice("xla", f"auto: Pallas cannot serve {why_not}")
        if (why_not := native_supports(dtype, kv_cache_dtype, cfg)) is not None:
            return AttentionChoice("xla", f"auto: the native kernel cannot serve {why_not}")
        return AttentionChoice("native", "auto: the native kernel serves this CPU")
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend must be 'auto' or one of {ATTENTION_BACKENDS}, got {backend!r}"
        )
    if backend == "native" and (why := native_supports(dtype, kv_cache_dtype, cfg)) is not None:
        raise ValueError(f'attention_backend="native" cannot serve {why}; use "xla"')
    return AttentionChoice(backend, "asked for")


def resolve_attention_backend(
    backend: str,
    dtype: Any,
    kv_cache_dtype: str,
    sharded: bool = False,
    cfg: ModelConfig | None = None,
) -> str:
    """``choose_attention_backend``'s name."""
    return choose_attention_backend(backend, dtype, kv_cache_dtype, sharded, cfg).name
