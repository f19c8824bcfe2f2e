"""Reference weight quantization (AWQ int4, NVFP4, MXFP4, FP8 E4M3) in plain jax.numpy.

``quantize(w, fmt) -> QTensor`` and ``dequantize(qt) -> float32``; the element codecs and packing
helpers in ``research.quant.formats`` are written so Pallas kernels can reuse them.
"""

from research.quant.formats import (
    AWQ_ORDER,
    awq_pack,
    awq_unpack,
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    e8m0_encode,
    pack_nibbles,
    unpack_nibbles,
)
from research.quant.params import QUANTIZATIONS, quantize_params, weight_bytes
from research.quant.qtensor import FORMATS, GROUP_SIZES, QTensor, dequantize, quantize

__all__ = [
    "AWQ_ORDER",
    "FORMATS",
    "GROUP_SIZES",
    "QUANTIZATIONS",
    "QTensor",
    "awq_pack",
    "awq_unpack",
    "dequantize",
    "e2m1_decode",
    "e2m1_encode",
    "e8m0_decode",
    "e8m0_encode",
    "pack_nibbles",
    "quantize",
    "quantize_params",
    "unpack_nibbles",
    "weight_bytes",
]
