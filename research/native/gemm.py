"""bfloat16 matrix products on Intel AMX (``gemm.cc``), with weights packed once at load time.

XLA:CPU's bfloat16 dot reaches 0.3-0.5 TFLOP/s on a core pair whose AMX tile units do several
(``experiments.bench_gemm`` measures both side by side), so a bf16 step spends most of its time
in the projections. ``pack_params`` rewrites a model's 2-D projection weights into
``PackedWeight`` leaves, each holding the weight in AMX's B-tile layout; ``layers.matmul`` sends
a product with one to the native kernel. Everything else (norms, RoPE, attention, sampling)
stays in XLA.

Where the library did not build, the CPU has no AMX-BF16, the model is not bfloat16, or a
weight's shape does not tile (in and out features multiples of 32), weights stay
as they are and XLA multiplies them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from research import native

# Per-layer projection weights the packed path serves ([in, out] matrices multiplied by
# ``layers.linear``); anything else in a layer (norms, biases, sinks, MoE expert stacks, the
# router) stays as it is.
PACKED_KEYS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
GEMM_BACKENDS = ("auto", "xla", "native")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A weight W [K, N] stored as [N/32, K/32, 2, 16, 32] bfloat16 in AMX's B-tile layout,
    each 32-column panel contiguous: packed[g, kb, t, r, 2c + j] = W[32 kb + 2 r + j,
    32 g + 16 t + c]."""

    packed: jax.Array
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))

    @property
    def dtype(self) -> Any:
        return self.packed.dtype

    @property
    def ndim(self) -> int:
        return 2


def tiles(k: int, n: int) -> bool:
    """Whether a [k, n] weight fits the kernel's tiles."""
    return k % 32 == 0 and n % 32 == 0 and k > 0 and n > 0


def pack(w: jax.Array, transposed: bool = False) -> PackedWeight:
    """W [K, N] (``transposed``: given as [N, K], e.g. a tied embedding) -> PackedWeight."""
    w = jnp.asarray(w, jnp.bfloat16)
    k, n = (w.shape[1], w.shape[0]) if transposed else w.shape
    if not tiles(k, n):
        raise ValueError(f"a [{k}, {n}] weight does not tile (in and out % 32 must be 0)")
    if transposed:  # [g, t, c, kb, r, j] -> [g, kb, t, r, c, j]
        packed = w.reshape(n // 32, 2, 16, k // 32, 16, 2).transpose(0, 3, 1, 4, 2, 5)
    else:  # [kb, r, j, g, t, c] -> [g, kb, t, r, c, j]
        packed = w.reshape(k // 32, 16, 2, n // 32, 2, 16).transpose(3, 0, 4, 1, 5, 2)
    return PackedWeight(packed.reshape(n // 32, k // 32, 2, 16, 32), (k, n))


def unpack(w: PackedWeight) -> jax.Array:
    """PackedWeight -> W [K, N] bfloat16 (the inverse of ``pack``)."""
    k, n = w.shape
    six = w.packed.reshape(n // 32, k // 32, 2, 16, 16, 2)
    return six.transpose(1, 3, 5, 0, 2, 4).reshape(k, n)


def available() -> bool:
    """The library built and this CPU has AMX-BF16 with the tile state granted."""
    return native.available() and bool(native._state["lib"].ResearchAmxReady())


def unavailable_reason(dtype: Any) -> str | None:
    """Why the packed path cannot serve a model in ``dtype`` here (None: it can)."""
    if jnp.dtype(dtype) != jnp.bfloat16:
        return f"{jnp.dtype(dtype).name} weights (the AMX kernel multiplies bfloat16)"
    if jax.default_backend() != "cpu":
        return f"the {jax.default_backend()} backend (the kernel is for CPU)"
    if not native.available():
        return f"the native library did not build: {native.build_error()}"
    if not available():
        return "this CPU has no AMX-BF16 (or the OS did not grant the tile state)"
    return None


def resolve(backend: str, dtype: Any, sharded: bool = False) -> str:
    """``"auto"``: "native" where the packed path serves (bfloat16 on an AMX CPU, one device),
    else "xla". An explicit "native" that cannot serve is an error naming why."""
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"gemm_backend must be one of {GEMM_BACKENDS}, got {backend!r}")
    why = "tensor/expert parallel plans" if sharded else unavailable_reason(dtype)
    if backend == "auto":
        return "xla" if why else "native"
    if backend == "native" and why:
        raise ValueError(f'gemm_backend="native" cannot serve {why}; use "xla"')
    return backend


def pack_params(params: dict, tie_word_embeddings: bool) -> dict:
    """A model's params with every tiling bfloat16 projection packed; a tied embedding gains a
    packed ``lm_head`` beside it (the lookup keeps reading ``embed``)."""

    def maybe(w: Any, transposed: bool = False) -> Any:
        if not isinstance(w, jax.Array) or w.ndim != 2 or w.dtype != jnp.bfloat16:
            return w
        k, n = (w.shape[1], w.shape[0]) if transposed else w.shape
        return pack(w, transposed) if tiles(k, n) else w

    out = dict(params)
    out["layers"] = [
        {key: maybe(v) if key in PACKED_KEYS else v for key, v in lp.items()}
        for lp in params["layers"]
    ]
    if "lm_head" in params:
        out["lm_head"] = maybe(params["lm_head"])
    elif tie_word_embeddings:
        head = maybe(params["embed"], transposed=True)
        if isinstance(head, PackedWeight):
            out["lm_head"] = head
    return out


def matmul(x: jax.Array, w: PackedWeight) -> jax.Array:
    """x [..., K] @ W [K, N] -> float32 [..., N] through the AMX kernel."""
    if not native.available():  # builds and registers the library on first use
        raise RuntimeError(f"native gemm unavailable: {native.build_error()}")
    k, n = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features; the packed weight takes {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).astype(jnp.bfloat16)
    call = jax.ffi.ffi_call(
        native._GEMM_TARGET, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32)
    )
    return call(x2, w.packed).reshape(*lead, n)
