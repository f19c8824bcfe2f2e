"""Reference weight quantization (AWQ int4, NVFP4, MXFP4, FP8 E4M3) in plain jax.numpy.

``quantize(w, fmt) -> QTensor`` and ``dequantize(qt) -> float32``; the element codecs and packing
helpers in ``research.quant.formats`` are written so Pallas kernels can reuse them. Names load on
first use, so ``research.quant.layout`` (what is quantized, in which groups) stays JAX-free for
the cost model.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "formats": (
        "AWQ_ORDER",
        "awq_pack",
        "awq_unpack",
        "e2m1_decode",
        "e2m1_encode",
        "e8m0_decode",
        "e8m0_encode",
        "pack_nibbles",
        "unpack_nibbles",
    ),
    "layout": ("FORMATS", "GROUP_SIZES"),
    "params": ("QUANTIZATIONS", "quantize_params", "weight_bytes"),
    "qtensor": ("QTensor", "dequantize", "quantize"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        return getattr(import_module(f"research.quant.{_MODULE_OF[name]}"), name)
    raise AttributeError(f"module 'research.quant' has no attribute {name!r}")
