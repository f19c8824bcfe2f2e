"""Pre-quantized Hugging Face checkpoints read straight into ``QTensor``s (no dequantize and
requantize): the codes and scales in the file become the QTensor's storage, transposed from the
checkpoint's [out, in] to the project's [in, out] where the layout needs it.

Layouts (per linear module ``prefix``; O = out features, I = in features):

- AutoAWQ GEMM (``quant_method: "awq"``, ``version: "gemm"``, 4 bits, zero point):
  ``qweight`` int32 [I, O/8], ``qzeros`` int32 [I/G, O/8] (both 8 nibbles per word in AWQ's
  order), ``scales`` float16 [I/G, O]. Already the project's AWQ storage, as is.
- compressed-tensors ``nvfp4-pack-quantized`` (llm-compressor's NVFP4): ``weight_packed`` uint8
  [O, I/2] (E2M1 pairs along I, low nibble first), ``weight_scale`` float8_e4m3fn [O, I/16] and
  ``weight_global_scale`` float32 [1], with w = e2m1 * weight_scale / weight_global_scale. The
  QTensor's per-tensor scale is 1 / weight_global_scale.
- compressed-tensors ``mxfp4-pack-quantized``: ``weight_packed`` uint8 [O, I/2] and E8M0
  ``weight_scale`` uint8 [O, I/32].
- compressed-tensors ``float-quantized`` with 8-bit float weights (FP8, FP8_DYNAMIC):
  ``weight`` float8_e4m3fn [O, I] and ``weight_scale`` float32 [O, 1] (per channel) or [1] (per
  tensor, broadcast to every column). Activation scales (``input_scale``) are not used: the
  engine runs these weight-only, with activations in the model dtype.

Modules a checkpoint leaves unquantized (compressed-tensors' ``ignore``) keep a dense ``weight``
and load as dense matrices.

gpt-oss's own MXFP4 layout (``quant_method: "mxfp4"``: experts as ``*_blocks`` / ``*_scales``,
everything else dense) is read by ``research.models.gpt_oss``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from research.quant.layout import AWQ_PACK, GROUP_SIZES
from research.quant.qtensor import QTensor

# format name in the checkpoint -> the project's QTensor format
_CT_FORMATS = {"nvfp4-pack-quantized": "nvfp4", "mxfp4-pack-quantized": "mxfp4"}


def checkpoint_quantization(hf_config: dict[str, Any]) -> str | None:
    """The QTensor format of a checkpoint's ``quantization_config`` (None if it has none).
    Layouts this loader cannot read without converting them are refused by name."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if qc.get("bits", 4) != 4 or version != "gemm" or not qc.get("zero_point", True):
            raise ValueError(
                "AWQ checkpoints load in AutoAWQ's 4-bit GEMM layout with zero points; this one "
                f"has bits={qc.get('bits')}, version={version!r}, zero_point={qc.get('zero_point')}"
            )
        return "awq"
    if method == "compressed-tensors":
        fmt = qc.get("format")
        if fmt in _CT_FORMATS:
            return _CT_FORMATS[fmt]
        if fmt in ("float-quantized", "naive-quantized"):
            for group in (qc.get("config_groups") or {}).values():
                w = group.get("weights") or {}
                if w.get("type") != "float" or w.get("num_bits") != 8:
                    raise ValueError(
                        f"compressed-tensors {fmt} weights must be 8-bit floats; got {w}"
                    )
                if w.get("strategy") not in ("channel", "tensor"):
                    raise ValueError(
                        f"FP8 weights are read with per-channel or per-tensor scales; this "
                        f"checkpoint's strategy is {w.get('strategy')!r}"
                    )
            return "fp8"
        raise ValueError(
            f"compressed-tensors format {fmt!r} is not supported (nvfp4-pack-quantized, "
            "mxfp4-pack-quantized, float-quantized)"
        )
    if method == "mxfp4":  # gpt-oss: experts as *_blocks / *_scales, everything else dense
        return "mxfp4"
    if method == "fp8":
        raise ValueError(
            "quant_method 'fp8' checkpoints (block-wise weight_scale_inv) are not supported: the "
            "project's FP8 has one scale per output column; use a compressed-tensors FP8 "
            "checkpoint (per channel or per tensor)"
        )
    raise ValueError(
        f"quantization_config.quant_method {method!r} is not supported (awq, compressed-tensors, "
        "mxfp4)"
    )


def read_linear(
    get: Callable[[str], np.ndarray | None], prefix: str, fmt: str | None, dtype: str
) -> QTensor | np.ndarray:
    """One linear module ``prefix`` as a QTensor [I, O] in ``fmt`` or, if the checkpoint stored
    it dense, as a float32 matrix [I, O]. ``get(name)`` returns a tensor as stored (its own
    dtype), or None if absent."""
    dense = get(f"{prefix}.weight")
    if fmt is None or (dense is not None and dense.dtype != ml_dtypes.float8_e4m3fn):
        if dense is None:
            raise ValueError(f"tensor {prefix}.weight is missing")
        return np.asarray(dense, np.float32).T

    def need(name: str) -> np.ndarray:
        value = get(f"{prefix}.{name}")
        if value is None:
            raise ValueError(f"tensor {prefix}.{name} is missing ({fmt} checkpoint)")
        return value

    if fmt == "awq":
        codes, zeros, scales = need("qweight"), need("qzeros"), need("scales")
        d_in, d_out = codes.shape[0], codes.shape[1] * AWQ_PACK
        group = d_in // scales.shape[0]
        _expect(prefix, "scales", scales, (d_in // group, d_out))
        _expect(prefix, "qzeros", zeros, (d_in // group, d_out // AWQ_PACK))
        return QTensor(
            codes.astype(np.int32),
            scales.astype(np.float16),
            zeros=zeros.astype(np.int32),
            fmt="awq",
            shape=(d_in, d_out),
            group_size=group,
            dtype=dtype,
        )
    if fmt in ("nvfp4", "mxfp4"):
        packed, scale = need("weight_packed"), need("weight_scale")
        d_out, d_in = packed.shape[0], packed.shape[1] * 2
        group = GROUP_SIZES[fmt]
        _expect(prefix, "weight_scale", scale, (d_out, d_in // group))
        meta = dict(fmt=fmt, shape=(d_in, d_out), group_size=group, dtype=dtype)
        codes = np.ascontiguousarray(packed.T)
        if fmt == "mxfp4":
            return QTensor(codes, np.ascontiguousarray(scale.T).view(np.uint8), **meta)
        global_scale = np.asarray(need("weight_global_scale"), np.float32).reshape(())
        return QTensor(
            codes,
            np.ascontiguousarray(scale.T),
            tensor_scale=np.float32(1.0) / global_scale,
            **meta,
        )
    weight, scale = need("weight"), np.asarray(need("weight_scale"), np.float32)
    d_out, d_in = weight.shape
    if scale.size not in (1, d_out):
        raise ValueError(
            f"{prefix}.weight_scale has shape {scale.shape}: expected one scale per output "
            f"channel ({d_out}) or one for the tensor"
        )
    scales = np.broadcast_to(scale.reshape(-1), (d_out,)).copy()
    return QTensor(
        np.ascontiguousarray(weight.T),
        scales,
        fmt="fp8",
        shape=(d_in, d_out),
        group_size=d_in,
        dtype=dtype,
    )


def stack_experts(experts: list[QTensor | np.ndarray]) -> QTensor | np.ndarray:
    """Per-expert matrices [I, O] -> stacked experts [X, I, O] (QTensor storage stacked leaf by
    leaf; the format and group size must agree)."""
    first = experts[0]
    if not isinstance(first, QTensor):
        if any(isinstance(e, QTensor) for e in experts):
            raise ValueError("an MoE layer mixes quantized and dense experts")
        return np.stack(experts)
    if any(
        not isinstance(e, QTensor)
        or (e.fmt, e.shape, e.group_size) != (first.fmt, first.shape, first.group_size)
        for e in experts
    ):
        raise ValueError("an MoE layer's experts differ in format, shape or group size")

    def stacked(name: str) -> np.ndarray | None:
        leaves = [getattr(e, name) for e in experts]
        return None if leaves[0] is None else np.stack([np.asarray(x) for x in leaves])

    return QTensor(
        stacked("codes"),
        stacked("scales"),
        zeros=stacked("zeros"),
        tensor_scale=stacked("tensor_scale"),
        fmt=first.fmt,
        shape=(len(experts), *first.shape),
        group_size=first.group_size,
        dtype=first.dtype,
    )


def _expect(prefix: str, name: str, value: np.ndarray, shape: tuple[int, ...]) -> None:
    if tuple(value.shape) != shape:
        raise ValueError(f"{prefix}.{name} has shape {tuple(value.shape)}; expected {shape}")
