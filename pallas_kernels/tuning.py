"""Per-GPU block configurations for the two kernels, keyed by device kind.

Every configuration here is a set of power-of-two blocks that Triton accepts (dot operands >= 16
in every dimension) and whose shared memory fits the target's per-block limit. That is checked
without a GPU by compiling each configuration offline for its target (``pallas_kernels.verify``
and tests/test_triton_ir.py): H200 is sm_90 with up to 227 KiB of shared memory per block, GB10
is sm_121 with 99 KiB (100 KB per SM). An unknown GPU gets the conservative ``FALLBACK``, sized
to the 48 KiB every CUDA GPU gives a block without opting in.

The numbers are chosen to fit, not yet tuned for speed on the hardware: fewer pipeline stages
where shared memory is small (GB10), and the larger tiles where it is not. float32 operands run
as IEEE float32 dots on FMA units with their operands in registers, so float32 tiles are smaller
and get 8 warps (the sizes that ptxas compiles without spills). One case still spills: float32
attention over 128-token pages, because a page is the kernel's smallest tile (bf16 does not).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class PagedAttentionConfig:
    compute_block_tokens: int = 128  # tokens per inner-loop tile (a whole number of pages)
    k_splits: int = 16  # programs per sequence and kv head (capped at the compute blocks)
    num_warps: int = 4
    num_stages: int = 2
    max_tile_bytes: int | None = None  # K + V tile bytes in shared memory; None: no limit
    # float32 compute (IEEE float32 dots run on FMA units, not tensor cores, and hold their
    # operands in registers): tiles of at most this many tokens x head_dim elements, with
    # ``float32_num_warps`` warps. Compiled offline, T x D = 2048 with 8 warps spills nothing
    # at D = 64 and 128, while 4096 spills at D = 128. None: the bf16 rules apply.
    float32_tile_elements: int | None = 2048
    float32_num_warps: int = 8

    def kwargs(
        self, *, page_size: int, head_dim: int, code_dim: int, q_dtype: Any, page_dtype: Any
    ) -> dict[str, int]:
        """Kernel keyword arguments for pages [.., page_size, code_dim] of ``page_dtype`` read
        by queries of ``q_dtype`` (the kernel computes in float32 when either is float32 and
        the pages are not quantized, or when q is float32).

        The tile is ``compute_block_tokens`` tokens, halved while its K and V tiles exceed
        ``max_tile_bytes`` (or, in float32, while T x D exceeds ``float32_tile_elements``),
        never below one page (the kernel's unit) or 16 tokens (Triton's smallest dot)."""
        page_dtype, q_dtype = jnp.dtype(page_dtype), jnp.dtype(q_dtype)
        quantized = page_dtype in (jnp.dtype(jnp.uint8), jnp.dtype(jnp.float8_e4m3fn))
        compute = q_dtype if quantized else jnp.promote_types(q_dtype, page_dtype)
        float32 = compute == jnp.float32 and self.float32_tile_elements is not None
        code_bytes = code_dim * page_dtype.itemsize
        floor = max(page_size, 16)
        tokens = self.compute_block_tokens

        def too_big(tokens: int) -> bool:
            if float32 and tokens * head_dim > self.float32_tile_elements:
                return True
            return self.max_tile_bytes is not None and 2 * tokens * code_bytes > self.max_tile_bytes

        while tokens > floor and too_big(tokens):
            tokens //= 2
        return dict(
            pages_per_compute_block=max(1, tokens // page_size),
            k_splits=self.k_splits,
            num_warps=self.float32_num_warps if float32 else self.num_warps,
            num_stages=self.num_stages,
        )


@dataclasses.dataclass(frozen=True)
class GroupedExpertsConfig:
    block_m: int = 16  # routed rows per tile (decode: few rows per expert)
    block_n: int = 128
    block_k: int = 128  # an upper bound: the kernel call uses the largest power of two dividing K
    num_warps: int = 4
    num_stages: int = 3
    # float32 activations (IEEE float32 dots, operands in registers): weight tiles of at most
    # this many block_k x block_n elements, with ``float32_num_warps`` warps. Compiled offline
    # for sm_90, 64 x 64 and 32 x 128 with 8 warps spill nothing, 64 x 128 spills. None: the
    # bf16 rules apply.
    float32_tile_elements: int | None = 4096
    float32_num_warps: int = 8

    def kwargs(self, k: int, lhs_dtype: Any = jnp.bfloat16) -> dict[str, int]:
        """Kernel keyword arguments for a reduction width ``k`` and activations of
        ``lhs_dtype``."""
        from pallas_kernels.grouped_experts import MIN_BLOCK, fitting_block_k

        block_n, block_k = self.block_n, fitting_block_k(k, self.block_k)
        num_warps = self.num_warps
        if jnp.dtype(lhs_dtype) == jnp.float32 and self.float32_tile_elements is not None:
            num_warps = self.float32_num_warps
            while block_n * block_k > self.float32_tile_elements:
                if block_k >= block_n and block_k > MIN_BLOCK:
                    block_k //= 2
                elif block_n > MIN_BLOCK:
                    block_n //= 2
                else:
                    break
        return dict(
            block_m=self.block_m,
            block_n=block_n,
            block_k=block_k,
            num_warps=num_warps,
            num_stages=self.num_stages,
        )


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One GPU the kernels are configured for."""

    name: str
    device_kinds: tuple[str, ...]  # substrings of ``jax.Device.device_kind`` (upper case)
    compute_capability: int  # e.g. 90 for sm_90
    max_shared_bytes: int  # dynamic shared memory a block may use
    paged_attention: PagedAttentionConfig
    grouped_experts: GroupedExpertsConfig

    @property
    def supports_fp8(self) -> bool:
        """Whether Triton lowers float8_e4m3fn here: sm_89 or newer (its fp8e4nv type; on sm_80
        the conversion to LLVM fails). The interpreter runs everything."""
        return self.compute_capability == 0 or self.compute_capability >= FP8_MIN_CAPABILITY

    def require_fp8(self, what: str) -> None:
        """Refuse an fp8 operand where Triton cannot compile one, saying what to use instead."""
        if not self.supports_fp8:
            raise ValueError(
                f"{what} is fp8, which the Pallas Triton kernels compile only for sm_"
                f"{FP8_MIN_CAPABILITY} or newer; this GPU is sm_{self.compute_capability}: use "
                'another KV cache dtype or weight format, or attention_backend="xla"'
            )


FP8_MIN_CAPABILITY = 89

TARGETS: dict[str, GpuTarget] = {
    "h200": GpuTarget(
        name="h200",
        device_kinds=("H200", "H100"),
        compute_capability=90,
        max_shared_bytes=227 * 1024,
        paged_attention=PagedAttentionConfig(num_stages=3, max_tile_bytes=160 * 1024),
        grouped_experts=GroupedExpertsConfig(block_n=128, block_k=128, num_stages=3),
    ),
    "gb10": GpuTarget(
        name="gb10",
        device_kinds=("GB10",),
        compute_capability=121,
        max_shared_bytes=99 * 1024,
        paged_attention=PagedAttentionConfig(num_stages=2, max_tile_bytes=80 * 1024),
        grouped_experts=GroupedExpertsConfig(block_n=64, block_k=128, num_stages=2),
    ),
}

# Unknown GPUs: small tiles and two stages, within the 48 KiB every CUDA GPU allows a block.
# Compiled offline for sm_80, the oldest target with bf16 MMAs.
FALLBACK = GpuTarget(
    name="fallback",
    device_kinds=(),
    compute_capability=80,
    max_shared_bytes=48 * 1024,
    paged_attention=PagedAttentionConfig(
        compute_block_tokens=64, num_stages=2, max_tile_bytes=32 * 1024
    ),
    grouped_experts=GroupedExpertsConfig(block_n=64, block_k=64, num_stages=2),
)

# Pallas' interpreter on CPU (tests): block sizes only change how many grid points run.
INTERPRET = GpuTarget(
    name="interpret",
    device_kinds=(),
    compute_capability=0,
    max_shared_bytes=0,
    paged_attention=PagedAttentionConfig(float32_tile_elements=None),
    grouped_experts=GroupedExpertsConfig(float32_tile_elements=None),
)


def target_for_kind(device_kind: str) -> GpuTarget:
    """The configured target whose name appears in ``device_kind``, else ``FALLBACK``."""
    kind = device_kind.upper()
    for target in TARGETS.values():
        if any(name in kind for name in target.device_kinds):
            return target
    return FALLBACK


@functools.cache
def target_for_backend(backend: str) -> GpuTarget:
    """Where the engine's kernels run: ``"pallas"`` -> the local GPU's target (by its device
    kind), ``"pallas_interpret"`` -> ``INTERPRET``."""
    if backend == "pallas_interpret":
        return INTERPRET
    if backend != "pallas":
        raise ValueError(f"no kernel configuration for backend {backend!r}")
    import jax

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        raise ValueError(
            'attention_backend="pallas" needs a GPU; use "pallas_interpret" to run the kernels '
            'on CPU or "xla" for the reference path'
        )
    target = target_for_kind(gpus[0].device_kind)
    if target is FALLBACK:  # an unlisted GPU: its own compute capability decides fp8
        cc = getattr(gpus[0], "compute_capability", None)
        if isinstance(cc, str) and "." in cc:
            major, minor = cc.split(".")[:2]
            target = dataclasses.replace(target, compute_capability=int(major) * 10 + int(minor))
    return target
