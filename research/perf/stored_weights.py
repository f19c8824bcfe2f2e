"""The weights a step reads, as the engine stores them: per layer the non-expert matrices
(split as the tensor-parallel plan places them) and one expert's matrices, the output layer and
an embedding row, in the stored format (``research.perf.gemm``: engine formats and GGUF files).
Pure Python."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from research.config import ModelConfig
from research.models.shapes import param_shapes
from research.perf.gemm import GGUF_FORMATS, gguf_bytes
from research.perf.kv_capacity import dtype_bytes, quantized_bytes
from research.quant.layout import EXPERT_KEYS, quantized_keys

EXPERT_BIAS_KEYS = ("b_gate", "b_up", "b_down")  # gpt-oss: read with their expert


@dataclass
class StoredWeights:
    """Bytes and parameter counts of a model's weights as stored (``stored_weights``)."""

    dense_layer_bytes: int = 0  # all layers, non-expert weights
    dense_layer_params: int = 0
    dense_bytes_per_device: float = 0.0  # the same, each weight divided as the plan splits it
    dense_io_elements: int = 0  # in + out activation elements per token, all dense GEMMs
    expert_bytes_per_layer: list[int] = field(default_factory=list)  # one expert, per layer
    expert_params: int = 0  # one expert's params (per layer)
    lm_head_bytes: int = 0
    embed_row_bytes: int = 0
    active_params_per_token: int = 0


def stored_weights(
    cfg: ModelConfig,
    quantization: str | None,
    dtype: Any,
    split: Any,
    quantized_weights: tuple[str, ...] | None = None,
) -> StoredWeights:
    """What ``cfg``'s weights weigh in ``quantization`` (``quantized_weights``: the keys stored
    quantized, None: what a checkpoint of the architecture quantizes), the non-expert ones
    also per device under ``split`` (a ``SplitPlan``)."""
    elem = dtype_bytes(dtype)
    shapes = param_shapes(cfg)
    keys = quantized_keys(cfg.architecture) if quantized_weights is None else quantized_weights
    if quantized_weights is not None and (quantization is None or quantization in GGUF_FORMATS):
        raise ValueError(
            f"quantized_weights needs an engine weight format, got quantization={quantization!r}"
        )

    def stored(key: str, shape: tuple[int, ...]) -> int:
        if quantization in GGUF_FORMATS:
            return gguf_bytes(shape, quantization, expert=cfg.is_moe and key in EXPERT_KEYS)
        if quantization is not None and key in keys:
            return quantized_bytes(shape, quantization)
        return math.prod(shape) * elem

    inv = StoredWeights()
    for layer in shapes["layers"]:
        per_expert = 0
        for key, shape in layer.items():
            if cfg.is_moe and key in EXPERT_BIAS_KEYS:
                per_expert += stored(key, shape[1:])
            elif cfg.is_moe and key in EXPERT_KEYS:
                per_expert += stored(key, shape[1:])
                inv.expert_params = sum(math.prod(layer[k][1:]) for k in EXPERT_KEYS)
            else:
                inv.dense_layer_bytes += stored(key, shape)
                inv.dense_layer_params += math.prod(shape)
                ways = split.param_ways(key, len(shape))
                inv.dense_bytes_per_device += stored(key, shape) / ways
                if len(shape) == 2:
                    inv.dense_io_elements += sum(shape)
        if cfg.is_moe:
            inv.expert_bytes_per_layer.append(per_expert)
    head_shape = shapes.get("lm_head", shapes["embed"])
    inv.lm_head_bytes = math.prod(head_shape) * elem + math.prod(shapes["final_norm"]) * elem
    inv.embed_row_bytes = cfg.hidden_size * elem
    if "lm_head" in keys:
        inv.lm_head_bytes = (
            quantized_bytes(head_shape, quantization) + math.prod(shapes["final_norm"]) * elem
        )
    if quantization in GGUF_FORMATS:
        inv.lm_head_bytes = gguf_bytes(head_shape, quantization) + gguf_bytes(
            shapes["final_norm"], quantization
        )
        inv.embed_row_bytes = gguf_bytes((1, cfg.hidden_size), quantization)
    inv.active_params_per_token = inv.dense_layer_params + cfg.num_layers * (
        cfg.num_experts_per_tok * inv.expert_params
    )
    return inv


__all__ = ["EXPERT_BIAS_KEYS", "StoredWeights", "stored_weights"]
