"""GEMMs by weight format and kernel: what a weight file stores and which kernel multiplies it.

**Formats.** The engine formats (``research.config.QUANTIZATION_CHOICES``: AWQ, NVFP4, MXFP4,
FP8, none) are priced as ``kv_capacity.quantized_bytes`` stores them; llama.cpp's GGUF files as
stored (``GGUF_FORMATS``): ``q8_0`` keeps every matrix, embeddings and output included, as blocks
of 32 int8 codes and one fp16 scale (34 bytes per 32 weights); ``gguf_mxfp4`` (ggml-org's gpt-oss
files) keeps the experts as MXFP4 blocks (16 bytes of E2M1 codes and one E8M0 scale per 32) and
every other matrix as ``q8_0``; vectors (norms, biases, sinks) are float32.

**Kernels** (``KERNELS``). Which kernel runs a format is not the format's business but the
engine's, its version's and the machine's: vLLM's shipped images on GB10 (sm_121) run MXFP4 and
NVFP4 experts through Marlin, which dequantizes the 4-bit weights to bf16 in its inner loop and
multiplies on the bf16 tensor cores, although the chip has an FP4 tensor path. Each kernel says
the tensor type its math runs in and whether it dequantizes (a W4A16 kernel runs at
``dense_gemm_efficiency`` / ``expert_gemm_efficiency`` of the bf16 sustained rate; a kernel
that feeds the tensor cores as stored at ``native_gemm_efficiency`` of its type's rate).
Engine profiles (``research.perf.engines.profiles``) map each format to the kernel of their
dense and expert GEMMs, with the source. Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from research.config import QUANTIZATION_CHOICES
from research.perf.hardware import Hardware
from research.perf.kv_capacity import dtype_bytes

# llama.cpp weight files the cost model can price (module docstring); not engine formats.
GGUF_FORMATS = ("q8_0", "gguf_mxfp4")
WEIGHT_FORMATS = QUANTIZATION_CHOICES + GGUF_FORMATS
GGUF_BLOCK = 32
GGUF_BLOCK_BYTES = {"q8_0": 34, "mxfp4": 17}  # bytes per block of 32 weights
GEMM_CLASSES = ("dense", "expert")


def gguf_bytes(shape: tuple[int, ...], fmt: str, expert: bool = False) -> int:
    """Stored bytes of a GGUF tensor of ``shape`` in file format ``fmt`` (``GGUF_FORMATS``):
    vectors float32, matrices in blocks of 32 along the input dimension."""
    if fmt not in GGUF_FORMATS:
        raise ValueError(f"unknown GGUF format {fmt!r}; expected one of {GGUF_FORMATS}")
    n = math.prod(shape)
    if len(shape) < 2:
        return 4 * n
    block = "mxfp4" if fmt == "gguf_mxfp4" and expert else "q8_0"
    return math.ceil(n / GGUF_BLOCK) * GGUF_BLOCK_BYTES[block]


@dataclass(frozen=True)
class GemmKernel:
    """A GEMM kernel family as the cost model prices it: ``math`` is the tensor type it feeds
    (``"auto"``: the activation dtype's), ``dequantizes`` whether stored weights are widened
    in its inner loop (W4A16 / W8A16), ``formats`` what it multiplies."""

    name: str
    math: str
    dequantizes: bool
    formats: tuple[str | None, ...]
    source: str = field(default="", compare=False)


KERNELS: dict[str, GemmKernel] = {
    k.name: k
    for k in (
        GemmKernel(
            "tensor",
            "auto",
            False,
            (None,),
            "unquantized weights on the tensor cores in the activation dtype (cuBLAS)",
        ),
        GemmKernel(
            "marlin",
            "bf16",
            True,
            ("awq", "mxfp4", "nvfp4", "fp8"),
            "vllm csrc/quantization/marlin, csrc/moe/marlin_moe_wna16: 4-bit (and FP8) weights "
            "dequantized to bf16 in the inner loop, bf16 MMA (W4A16)",
        ),
        GemmKernel(
            "dequant_bf16",
            "bf16",
            True,
            ("awq", "mxfp4", "nvfp4", "fp8", *GGUF_FORMATS),
            "any stored format widened to bf16 before a bf16 MMA: a machine without the "
            "format's tensor path",
        ),
        GemmKernel(
            "cutlass_fp4",
            "fp4",
            False,
            ("nvfp4", "mxfp4"),
            "CUTLASS / FlashInfer block-scaled FP4 MMA: FP4 activations and weights (W4A4)",
        ),
        GemmKernel(
            "cutlass_fp8",
            "fp8",
            False,
            ("fp8",),
            "CUTLASS scaled_mm / Triton FP8 MoE: FP8 weights and activations (W8A8)",
        ),
        GemmKernel(
            "mmq",
            "fp8",
            False,
            GGUF_FORMATS,
            "ggml-cuda mmq.cuh: activations quantized to int8, int8 MMA at the fp8 rate",
        ),
    )
}


def default_kernel(quantization: str | None, hw: Hardware) -> str:
    """The kernel a format runs where no engine says otherwise: the fastest the machine has a
    tensor path for (the pre-profile behaviour: FP4 and FP8 natively where the chip has them,
    AWQ dequantizing)."""
    if quantization in GGUF_FORMATS:
        return "mmq" if "fp8" in hw.tensor_flops else "dequant_bf16"
    if quantization == "fp8":
        return "cutlass_fp8" if "fp8" in hw.tensor_flops else "dequant_bf16"
    if quantization in ("nvfp4", "mxfp4"):
        return "cutlass_fp4" if "fp4" in hw.tensor_flops else "dequant_bf16"
    if quantization == "awq":
        return "marlin"
    return "tensor"


def kernel_format(
    kernel: str, quantization: str | None, hw: Hardware, dtype: Any
) -> tuple[str, bool]:
    """(tensor type the GEMM's math runs in, whether it dequantizes) for ``kernel`` on ``hw``.
    Raises ValueError naming what the kernel runs when it cannot run ``quantization``, or when
    the machine has no tensor path for its type."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown GEMM kernel {kernel!r}; expected one of {sorted(KERNELS)}")
    k = KERNELS[kernel]
    if quantization not in k.formats:
        runs = ", ".join("none" if f is None else f for f in k.formats)
        raise ValueError(f"GEMM kernel {kernel!r} runs {runs}, not {quantization or 'none'}")
    if k.math == "auto":
        if dtype_bytes(dtype) == 4:
            return ("fp32" if "fp32" in hw.tensor_flops else "tf32"), False
        return "bf16", False
    if k.math not in hw.tensor_flops:
        raise ValueError(f"GEMM kernel {kernel!r} needs {k.math} tensor cores; {hw.name} has none")
    return k.math, k.dequantizes


def gemm_format(
    quantization: str | None, hw: Hardware, dtype: Any = "bfloat16"
) -> tuple[str, bool]:
    """(tensor dtype the GEMM runs in, whether weights are dequantized in the inner loop) of the
    format's ``default_kernel``."""
    return kernel_format(default_kernel(quantization, hw), quantization, hw, dtype)


__all__ = [
    "GEMM_CLASSES",
    "GGUF_FORMATS",
    "KERNELS",
    "WEIGHT_FORMATS",
    "GemmKernel",
    "default_kernel",
    "gemm_format",
    "gguf_bytes",
    "kernel_format",
]
