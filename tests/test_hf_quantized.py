"""Pre-quantized Hugging Face checkpoints load straight into QTensors.

compressed-tensors (the library llm-compressor writes with) makes NVFP4, MXFP4 and FP8 (per
channel and per tensor) checkpoints of a tiny Llama; the AutoAWQ GEMM layout is written here from
its documented packing, for a tiny Llama and a tiny Qwen3-MoE. Each must load with the file's
codes and scales as the QTensor's storage (bit for bit), dequantize to what the format's own
reference computes, and give the logits of a dense model holding those reference weights.
"""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

from research import LLM
from research.models.transformer import ContiguousKVCache, compute_logits, forward
from research.models.weights import load_hf_safetensors
from research.quant import dequantize
from research.quant.qtensor import QTensor
from tests.test_parity_tiny_hf import _llama, _qwen3_moe

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IDS = np.arange(3, 27)[None]  # 24 tokens


def _save(tensors: dict[str, np.ndarray], path) -> None:
    # safetensors.numpy writes an array's buffer as laid out: make each C-contiguous first.
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path))


def _read(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118


def _is_linear(key: str) -> bool:
    return key.endswith(".weight") and key.split(".")[-2] in LINEAR


def _logits(path) -> np.ndarray:
    cfg, params = load_hf_safetensors(path)
    cache = ContiguousKVCache.create(cfg, 1, IDS.shape[1])
    hidden, _ = forward(params, cfg, jnp.asarray(IDS), jnp.arange(IDS.shape[1])[None], cache)
    return np.asarray(compute_logits(params, cfg, hidden))


def _dense_reference(src, dst, weights: dict[str, np.ndarray]) -> None:
    """``src``'s checkpoint with each quantized module replaced by its reference dense weight
    [out, in] (float32) and no quantization_config: the oracle model."""
    tensors = {
        k: v.float().numpy()
        for k, v in _read(src).items()
        if not any(k.startswith(m + ".") for m in weights)
    }
    tensors |= {f"{m}.weight": w.astype(np.float32) for m, w in weights.items()}
    dst.mkdir()
    _save(tensors, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config))


# ------------------------------------------------------------------ compressed-tensors


def _compressed_tensors_checkpoint(path, preset: str, fmt: str) -> None:
    """A tiny Llama quantized with compressed-tensors' own scheme and compressor: min-max
    calibration of each weight with the library's calculate_qparams / generate_gparam."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStrategy,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    torch.manual_seed(0)
    model = _llama().eval()
    scheme = preset_name_to_scheme(preset, ["Linear"])
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            w, args, gscale = module.weight.data, module.quantization_scheme.weights, None
            if args.strategy == QuantizationStrategy.TENSOR_GROUP:
                gscale = generate_gparam(w.min(), w.max())
                module.weight_global_scale.data.copy_(gscale)
            if args.strategy in (QuantizationStrategy.TENSOR_GROUP, QuantizationStrategy.GROUP):
                blocks = w.reshape(w.shape[0], -1, args.group_size)
                lo, hi = blocks.amin(-1), blocks.amax(-1)
            elif args.strategy == QuantizationStrategy.CHANNEL:
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            else:
                lo, hi = w.min(), w.max()
            scale, zero = calculate_qparams(lo, hi, args, global_scale=gscale)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(str(path))


def _compressed_tensors_reference(path) -> dict[str, np.ndarray]:
    """Every quantized module's weight [out, in] as compressed-tensors dequantizes it, in
    float32 (its decompressor unpacks FP4 to bfloat16 by default; the formula is the same)."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

    config = json.loads((path / "config.json").read_text())["quantization_config"]
    qc = QuantizationConfig.model_validate(config)
    args = next(iter(qc.config_groups.values())).weights
    tensors = _read(path)
    out = {}
    for key, scale in tensors.items():
        if not key.endswith(".weight_scale"):
            continue
        module = key.removesuffix(".weight_scale")
        gscale = tensors.get(module + ".weight_global_scale")
        if module + ".weight_packed" in tensors:
            packed = tensors[module + ".weight_packed"]
            x = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, torch.float32)
            kind = NVFP4PackedCompressor if gscale is not None else MXFP4PackedCompressor
            scale = kind._decompress_scale(scale, torch.float32)
        else:
            x = tensors[module + ".weight"]
        w = ct_dequantize(x_q=x, scale=scale, args=args, global_scale=gscale, dtype=torch.float32)
        out[module] = w.numpy()
    return out


CT_CASES = {  # our format: (compressed-tensors preset, checkpoint format)
    "nvfp4": ("NVFP4A16", "nvfp4-pack-quantized"),
    "mxfp4": ("MXFP4A16", "mxfp4-pack-quantized"),
    "fp8-channel": ("FP8_DYNAMIC", "float-quantized"),
    "fp8-tensor": ("FP8", "float-quantized"),
}


@pytest.mark.parametrize("case", sorted(CT_CASES))
def test_compressed_tensors_checkpoints_load_bit_exact(case, tmp_path):
    path = tmp_path / case
    _compressed_tensors_checkpoint(path, *CT_CASES[case])
    fmt = case.split("-")[0]
    cfg, params = load_hf_safetensors(path)
    tensors = _read(path)
    reference = _compressed_tensors_reference(path)
    assert len(reference) == 7 * cfg.num_layers
    for i, layer in enumerate(params["layers"]):
        for ours, theirs in (("wq", "self_attn.q_proj"), ("w_down", "mlp.down_proj")):
            qt, module = layer[ours], f"model.layers.{i}.{theirs}"
            assert isinstance(qt, QTensor) and qt.fmt == fmt
            # The file's codes and scales are the QTensor's storage, bit for bit.
            stored = tensors[module + (".weight" if fmt == "fp8" else ".weight_packed")]
            np.testing.assert_array_equal(
                np.asarray(qt.codes).view(np.uint8), stored.T.contiguous().view(torch.uint8)
            )
            scale = tensors[module + ".weight_scale"]
            if fmt == "fp8":
                want = np.broadcast_to(scale.float().numpy().reshape(-1), qt.scales.shape)
                np.testing.assert_array_equal(np.asarray(qt.scales), want)
            else:
                np.testing.assert_array_equal(
                    np.asarray(qt.scales).view(np.uint8), scale.T.contiguous().view(torch.uint8)
                )
            # ...and decode to the library's own dequantization (float32, to the last ulp).
            np.testing.assert_allclose(
                np.asarray(dequantize(qt)), reference[module].T, rtol=2e-7, atol=0
            )
    assert "lm_head" not in {k.rsplit(".", 1)[0] for k in reference}  # ignored: loads dense
    _dense_reference(path, tmp_path / "dense", reference)
    np.testing.assert_allclose(_logits(path), _logits(tmp_path / "dense"), atol=1e-4)


def test_hf_runs_a_compressed_tensors_fp8_checkpoint_as_we_do(tmp_path):
    """transformers' own loader of the checkpoint (it decompresses FP8 exactly) is the oracle."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    _compressed_tensors_checkpoint(tmp_path / "fp8", "FP8_DYNAMIC", "float-quantized")
    hf = AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp8", quantization_config=CompressedTensorsConfig(run_compressed=False)
    ).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(_logits(tmp_path / "fp8"), ref, atol=1e-4)


# ------------------------------------------------------------------ AutoAWQ GEMM layout

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's pack order: slot i holds column order[i]


def _awq_pack(values: np.ndarray) -> np.ndarray:
    """AutoAWQ's GEMM packing, as its WQLinear_GEMM.from_linear loops: [R, O] -> int32 [R, O/8]."""
    packed = np.zeros((values.shape[0], values.shape[1] // 8), np.uint32)
    for col in range(values.shape[1] // 8):
        for i in range(8):
            packed[:, col] |= values[:, col * 8 + AWQ_ORDER[i]].astype(np.uint32) << (4 * i)
    return packed.view(np.int32)


def _awq_checkpoint(dense, path, group: int) -> dict[str, np.ndarray]:
    """``dense``'s checkpoint with every linear layer in AutoAWQ's layout (min-max, zero
    point, fp16 scales); returns each module's reference weight [out, in] = (q - z) * s."""
    tensors, reference = {}, {}
    for key, value in _read(dense).items():
        w = value.float().numpy()
        if not _is_linear(key):
            tensors[key] = w
            continue
        module = key.removesuffix(".weight")
        wt = w.T.reshape(w.shape[1] // group, group, w.shape[0])  # [G, S, O]
        lo = np.minimum(wt.min(axis=1), 0)
        hi = np.maximum(wt.max(axis=1), 0)
        scale = np.maximum((hi - lo) / 15, 2.0**-14).astype(np.float16)
        s = scale.astype(np.float32)
        zero = np.clip(np.round(-lo / s), 0, 15)
        q = np.clip(np.round(wt / s[:, None]) + zero[:, None], 0, 15).astype(np.uint8)
        reference[module] = ((q - zero[:, None]) * s[:, None]).reshape(w.shape[1], -1).T
        tensors[module + ".qweight"] = _awq_pack(q.reshape(w.shape[1], -1))
        tensors[module + ".qzeros"] = _awq_pack(zero.astype(np.uint8))
        tensors[module + ".scales"] = scale
    path.mkdir()
    _save(tensors, path / "model.safetensors")
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group,
        "zero_point": True,
        "version": "gemm",
    }
    (path / "config.json").write_text(json.dumps(config))
    return reference


@pytest.mark.parametrize("builder", [_llama, _qwen3_moe], ids=["llama", "qwen3_moe"])
def test_autoawq_checkpoints_load_bit_exact(builder, tmp_path):
    torch.manual_seed(0)
    builder().eval().save_pretrained(tmp_path / "dense")
    reference = _awq_checkpoint(tmp_path / "dense", tmp_path / "awq", group=32)
    cfg, params = load_hf_safetensors(tmp_path / "awq")
    tensors = _read(tmp_path / "awq")
    layer = params["layers"][1]
    experts = cfg.is_moe
    qt = layer["w_gate"]
    assert isinstance(qt, QTensor) and qt.fmt == "awq" and qt.group_size == 32
    for e in range(cfg.num_experts if experts else 1):
        module = (
            f"model.layers.1.mlp.experts.{e}.gate_proj"
            if experts
            else "model.layers.1.mlp.gate_proj"
        )
        codes = np.asarray(qt.codes)[e] if experts else np.asarray(qt.codes)
        np.testing.assert_array_equal(codes, tensors[module + ".qweight"].numpy())
        got = np.asarray(dequantize(qt))[e] if experts else np.asarray(dequantize(qt))
        np.testing.assert_array_equal(got, reference[module].T)
    _dense_reference(tmp_path / "awq", tmp_path / "ref", reference)
    shutil.rmtree(tmp_path / "dense")
    np.testing.assert_allclose(_logits(tmp_path / "awq"), _logits(tmp_path / "ref"), atol=1e-4)


def test_llm_takes_the_checkpoints_own_quantization(tmp_path):
    torch.manual_seed(0)
    _llama().eval().save_pretrained(tmp_path / "dense")
    _awq_checkpoint(tmp_path / "dense", tmp_path / "awq", group=32)
    llm = LLM(tmp_path / "awq", max_model_len=64, num_kv_blocks=16, max_num_seqs=2)
    assert llm.quantization == "awq"
    assert isinstance(llm.params["layers"][0]["wq"], QTensor)
    assert len(llm.generate([[5, 6, 7]])[0].token_ids) == 16
    with pytest.raises(ValueError, match="pre-quantized awq checkpoint; quantization='fp8'"):
        LLM(tmp_path / "awq", quantization="fp8", max_model_len=64, num_kv_blocks=16)
    config = json.loads((tmp_path / "awq" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "awq" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'gptq' is not supported"):
        load_hf_safetensors(tmp_path / "awq")
