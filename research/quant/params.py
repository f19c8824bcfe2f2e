"""Quantize a model's parameter pytree at load time (``LLM(quantization=...)``).

Every linear weight of every layer is replaced by a ``QTensor``: attention q/k/v/o, the dense
MLP's gate/up/down and the stacked experts' gate/up/down of MoE layers. The token embedding, the
lm_head, the norms and the MoE router stay in the model dtype, as in vLLM's AWQ, FP8 and
NVFP4/MXFP4 checkpoints (the router is tiny and routing is sensitive to it).
"""

from __future__ import annotations

from typing import Any

import jax

from research.quant.layout import FORMATS, QUANTIZED_KEYS, awq_group_size
from research.quant.qtensor import QTensor, quantize

QUANTIZATIONS = (None, *FORMATS)


def quantize_params(params: dict[str, Any], fmt: str | None) -> dict[str, Any]:
    """A copy of ``params`` with every layer's linear weights quantized to ``fmt``."""
    if fmt is None:
        return params
    if fmt not in FORMATS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {fmt!r}")

    def convert(w: jax.Array) -> QTensor:
        group = awq_group_size(w.shape[-2]) if fmt == "awq" else None
        return quantize(w, fmt, group_size=group)

    layers = [
        {key: convert(w) if key in QUANTIZED_KEYS else w for key, w in layer.items()}
        for layer in params["layers"]
    ]
    return {**params, "layers": layers}


def stored_quantization(params: dict[str, Any]) -> str | None:
    """The format of the QTensors already in ``params`` (a pre-quantized checkpoint), or None."""
    formats = {
        leaf.fmt
        for leaf in jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, QTensor))
        if isinstance(leaf, QTensor)
    }
    if len(formats) > 1:
        raise ValueError(f"the checkpoint mixes quantization formats {sorted(formats)}")
    return formats.pop() if formats else None


def weight_bytes(params: dict[str, Any]) -> int:
    """Bytes of every parameter as stored (packed codes, scales and zero points included)."""
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(params))
