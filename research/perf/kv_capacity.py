"""How many KV-cache tokens fit on a machine: weights as stored, KV bytes per token, vLLM's formula.

vLLM sizes its paged KV pool once, at startup (docs/reference.md section 5)::

    available  = total_device_memory * gpu_memory_utilization - (weights + peak activations + other)
    num_blocks = floor(available / (block_size * kv_bytes_per_token))
    tokens     = num_blocks * block_size

``total_device_memory`` is what CUDA reports (``Hardware.cuda_visible_bytes``). Weights are the
stored parameter bytes (``weight_bytes``: packed 4-bit codes, scales and zero points included);
peak activations and "other" are what vLLM measures in a profile run, estimated by
``research.perf.activations.estimate_activation_bytes`` (an estimate, not a measurement: override
it with ``activation_bytes=`` when a real vLLM log gives the number).

Everything here is arithmetic on shapes: no parameter is allocated and JAX is not imported, so the
cost model and the simulated executor can size a 70B model on a laptop. Shapes come from
``research.models.shapes.param_shapes`` (the ones ``init_params`` allocates); the storage layouts
follow ``research.quant.layout`` (checked against the real quantizer on tiny models).

vLLM's own startup arithmetic, reproduced from the inputs a log gives, is in
``research.perf.vllm_kv``; its check against public DGX Spark (GB10) log lines in
``research.perf.vllm_kv_logs``.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

from research.config import KV_CACHE_DTYPES, QUANTIZATION_CHOICES, ModelConfig
from research.models.shapes import param_shapes
from research.perf.activations import (
    DEFAULT_OTHER_BYTES as DEFAULT_OTHER_BYTES,  # re-exported: research.perf imports it from here
)
from research.perf.activations import (
    dtype_bytes,
    estimate_activation_bytes,
    resolve_model,
    vllm_batch_defaults,
)
from research.perf.hardware import GiB, Hardware, get_hardware
from research.quant.layout import AWQ_PACK, GROUP_SIZES, awq_group_size, quantized_keys


def quantized_bytes(shape: tuple[int, ...], fmt: str) -> int:
    """Stored bytes of a weight of ``shape`` [..., I, O] quantized to ``fmt`` (one quantized
    matrix per leading index, e.g. per expert), as ``research.quant.QTensor.nbytes`` counts them:

    - awq:   I*O/2 (int4 codes, 8 per int32) + (I/G)*O*2 (fp16 scales) + (I/G)*O/2 (int4 zeros),
             G = ``awq_group_size(I)``;
    - nvfp4: I*O/2 (E2M1 codes) + (I/16)*O (E4M3 block scales) + 4 (fp32 tensor scale);
    - mxfp4: I*O/2 (E2M1 codes) + (I/32)*O (E8M0 block scales);
    - fp8:   I*O (E4M3) + 4*O (fp32 scale per output column).
    """
    if len(shape) not in (2, 3):
        raise ValueError(f"{fmt} quantizes [in, out] or [X, in, out] weights; got shape {shape}")
    lead = math.prod(shape[:-2])
    d_in, d_out = shape[-2:]
    if fmt == "fp8":
        return lead * (d_in * d_out + 4 * d_out)
    if fmt not in GROUP_SIZES:
        raise ValueError(
            f"unknown quantization format {fmt!r}; expected one of {QUANTIZATION_CHOICES[1:]}"
        )
    group = awq_group_size(d_in) if fmt == "awq" else GROUP_SIZES[fmt]
    if d_in % group:
        raise ValueError(
            f"{fmt} groups {group} input channels per scale; input dim {d_in} of shape {shape} "
            f"is not a multiple of {group}"
        )
    groups = d_in // group
    codes = d_in * d_out // 2
    if fmt == "awq":
        if d_out % AWQ_PACK:
            raise ValueError(
                f"awq packs {AWQ_PACK} output columns per int32; output dim {d_out} of shape "
                f"{shape} is not a multiple of {AWQ_PACK}"
            )
        return lead * (codes + groups * d_out * 2 + groups * d_out // 2)
    if fmt == "nvfp4":
        return lead * (codes + groups * d_out + 4)
    return lead * (codes + groups * d_out)  # mxfp4


def weight_bytes(
    model: str | ModelConfig, quantization: str | None = None, dtype: Any = "bfloat16"
) -> int:
    """Bytes of every parameter as stored, from the shapes alone (nothing is allocated).

    With ``quantization`` (awq | nvfp4 | mxfp4 | fp8) every layer's linear weights
    (``QUANTIZED_KEYS``: q/k/v/o and the MLP's or the stacked experts' gate/up/down) are counted
    in that format's storage (``quantized_bytes``); the embedding, lm_head, norms and MoE router
    stay in ``dtype``, as ``research.quant.quantize_params`` leaves them. Equals
    ``research.quant.weight_bytes(quantize_params(init_params(cfg, key, dtype), quantization))``
    except for gpt-oss, counted as openai ships it: quantized experts, everything else in
    ``dtype`` (``research.quant.layout.quantized_keys``).
    """
    cfg = resolve_model(model)
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"quantization must be one of {QUANTIZATION_CHOICES}, got {quantization!r}"
        )
    elem = dtype_bytes(dtype)
    shapes = param_shapes(cfg)
    total = sum(math.prod(s) * elem for key, s in shapes.items() if key != "layers")
    keys = quantized_keys(cfg.architecture)
    for layer in shapes["layers"]:
        for key, shape in layer.items():
            if quantization is not None and key in keys:
                total += quantized_bytes(shape, quantization)
            else:
                total += math.prod(shape) * elem
    return total


def kv_bytes_per_token(
    model: str | ModelConfig,
    kv_cache_dtype: str = "auto",
    dtype: Any = "bfloat16",
    layers: str = "all",
) -> int:
    """K and V bytes one token takes across all layers in our paged pool
    (``research.engine.kv_cache.kv_pool_bytes_per_block(cfg, block_size, dtype, kv) / block_size``):

        2 * layers * kv_heads * bytes_per_head, with bytes_per_head =
          auto: head_dim * dtype bytes      (K/V stored in the model dtype)
          fp8:  head_dim * 1 + 4            (E4M3 codes + one fp32 scale per token and kv head)
          int4: head_dim / 2 + 4            (packed int4 codes + one fp32 scale per token and head)

    vLLM's fp8 KV cache uses per-tensor (per-layer) k/v scales, so it stores head_dim bytes per
    head and no per-token scale: ours is 4 / head_dim larger (3% at head_dim 128). We follow our
    pool, since that is what the engine allocates.

    ``layers``: "all" (every layer), "full" (full-attention layers only; REFERENCE's 36,864
    bytes for gpt-oss-120b), "sliding" (sliding-window layers only) or "pool" (what one token
    of a block takes in our pool: max(full, sliding) layers, since the pool pairs a sliding
    with a full layer and gives each block to one kind, as vLLM's hybrid allocator does;
    "all" for models without sliding windows).
    """
    cfg = resolve_model(model)
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    e = cfg.head_dim
    if kv_cache_dtype == "auto":
        per_head = e * dtype_bytes(dtype)
    elif kv_cache_dtype == "fp8":
        per_head = e + 4
    else:
        if e % 2:
            raise ValueError(f"int4 KV packs two elements per byte; head_dim {e} is odd")
        per_head = e // 2 + 4
    full, sliding = cfg.num_layers - cfg.sliding_layers, cfg.sliding_layers
    counted = {
        "all": cfg.num_layers,
        "full": full,
        "sliding": sliding,
        "pool": max(full, sliding) if sliding else cfg.num_layers,
    }
    if layers not in counted:
        raise ValueError(f"layers must be one of {tuple(counted)}, got {layers!r}")
    return 2 * counted[layers] * cfg.num_kv_heads * per_head


def sliding_blocks_per_seq(cfg: ModelConfig, block_size: int) -> int:
    """Blocks a sequence's sliding-window layers hold at most once out-of-window blocks are
    freed: the window's W - 1 earlier keys plus the current token can straddle one more block
    than ceil(W / block_size)."""
    if not cfg.sliding_layers:
        return 0
    return math.ceil((cfg.sliding_window - 1) / block_size) + 1


@dataclass(frozen=True)
class KVCapacity:
    """vLLM's KV-pool sizing on one machine, every term of the formula kept."""

    model: str
    quantization: str | None
    hardware: str
    kv_cache_dtype: str
    block_size: int
    gpu_memory_utilization: float
    total_bytes: int  # cuda_visible_bytes
    budget_bytes: float  # total_bytes * gpu_memory_utilization
    weight_bytes: int
    activation_bytes: int  # peak activations + other (an estimate unless given)
    available_bytes: float  # budget - weights - activations: the KV pool
    kv_bytes_per_token: int  # per block token: kv_bytes_per_token(..., layers="pool")
    block_bytes: int  # block_size * kv_bytes_per_token
    num_blocks: int
    num_tokens: int  # num_blocks * block_size
    # Sliding-window models (gpt-oss): blocks a sequence's sliding layers hold at most
    # (``sliding_blocks_per_seq``), on top of its full layers' blocks; 0 otherwise.
    sliding_blocks_per_seq: int = 0

    def max_sequences(self, tokens_per_sequence: int) -> int:
        """How many sequences of ``tokens_per_sequence`` tokens (prompt + output) hold their
        whole KV at once: each needs ceil(tokens / block_size) blocks (and, with sliding
        windows, up to ``sliding_blocks_per_seq`` more)."""
        if tokens_per_sequence < 1:
            raise ValueError(f"tokens_per_sequence must be >= 1, got {tokens_per_sequence}")
        blocks = math.ceil(tokens_per_sequence / self.block_size)
        return self.num_blocks // (blocks + min(blocks, self.sliding_blocks_per_seq))


def kv_capacity(
    model: str | ModelConfig = "qwen3-coder-30b-a3b",
    quantization: str | None = "awq",
    hardware: str | Hardware = "gb10",
    gpu_memory_utilization: float = 0.85,
    block_size: int = 16,
    kv_cache_dtype: str = "auto",
    dtype: Any = "bfloat16",
    activation_bytes: int | None = None,
    *,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    tensor_parallel_size: int = 1,
) -> KVCapacity:
    """Size the KV pool as vLLM does (docs/reference.md section 5), per device:

        available  = cuda_visible_bytes * gpu_memory_utilization - (weights + activation_bytes)
        num_blocks = floor(available / (block_size * kv_bytes_per_token))
        tokens     = num_blocks * block_size

    ``activation_bytes`` (peak activations + other) defaults to ``estimate_activation_bytes`` with
    ``vllm serve``'s batch defaults for the machine (``vllm_batch_defaults``) unless
    ``max_num_batched_tokens`` / ``max_num_seqs`` are given. A ValueError gives the numbers when
    the weights and activations do not fit in the budget or not even one block is left.

    With ``tensor_parallel_size`` = N boxes, each holds 1/N of the weights, the share of every
    token's KV its kv heads make (``research.parallel.plan.SplitPlan``: 1/N, or 1/kv_heads when
    N exceeds them and kv heads are replicated) and 1/N of the activation estimate (an
    approximation: norms are in fact replicated). Tokens are the pool of the whole group.

    A model with sliding-window layers (gpt-oss) is sized as our engine and vLLM's hybrid
    allocator serve it: a block holds one kind of layer, max(full, sliding) layers of it
    (``kv_bytes_per_token(..., "pool")``); a sequence's full layers take blocks as it grows,
    its sliding layers at most ``sliding_blocks_per_seq`` (``KVCapacity.max_sequences``).
    """
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    cfg = resolve_model(model)
    hw = get_hardware(hardware)
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    from research.parallel.plan import SplitPlan

    split = SplitPlan.for_model(cfg, tensor_parallel_size)
    weights = weight_bytes(cfg, quantization, dtype) / tensor_parallel_size
    # Sliding-window models: a block holds one token of max(full, sliding) layers ("pool"),
    # for either kind, as in our engine's pool and vLLM's hybrid allocator.
    per_token = kv_bytes_per_token(cfg, kv_cache_dtype, dtype, "pool") / split.ways("kv_heads")
    if activation_bytes is None:
        default_tokens, default_seqs = vllm_batch_defaults(hw)
        activation_bytes = (
            estimate_activation_bytes(
                cfg,
                max_num_batched_tokens=(
                    default_tokens if max_num_batched_tokens is None else max_num_batched_tokens
                ),
                max_num_seqs=default_seqs if max_num_seqs is None else max_num_seqs,
                dtype=dtype,
            )
            // tensor_parallel_size
        )
    elif max_num_batched_tokens is not None or max_num_seqs is not None:
        raise ValueError(
            "max_num_batched_tokens / max_num_seqs only shape the activation estimate; "
            "they cannot be combined with an explicit activation_bytes"
        )
    elif activation_bytes < 0:
        raise ValueError(f"activation_bytes must be >= 0, got {activation_bytes}")
    budget = hw.cuda_visible_bytes * gpu_memory_utilization
    available = budget - (weights + activation_bytes)
    what = f"{cfg.name} ({quantization or dtype} weights) on {hw.name}"
    if available <= 0:
        raise ValueError(
            f"{what}: weights {weights / GiB:.2f} GiB + activations/other "
            f"{activation_bytes / GiB:.2f} GiB exceed the budget {budget / GiB:.2f} GiB "
            f"({hw.cuda_visible_bytes / GiB:.2f} GiB * gpu_memory_utilization "
            f"{gpu_memory_utilization}); nothing is left for the KV cache"
        )
    block_bytes = block_size * per_token
    num_blocks = math.floor(available / block_bytes)
    if num_blocks < 1:
        raise ValueError(
            f"{what}: {available / 2**20:.2f} MiB left after weights and activations is less "
            f"than one KV block ({block_size} tokens * {per_token} bytes = {block_bytes} bytes)"
        )
    return KVCapacity(
        model=cfg.name,
        quantization=quantization,
        hardware=hw.name,
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
        gpu_memory_utilization=gpu_memory_utilization,
        total_bytes=hw.cuda_visible_bytes,
        budget_bytes=budget,
        weight_bytes=int(weights),
        activation_bytes=int(activation_bytes),
        available_bytes=available,
        kv_bytes_per_token=int(per_token),
        block_bytes=int(block_bytes),
        num_blocks=num_blocks,
        num_tokens=num_blocks * block_size,
        sliding_blocks_per_seq=sliding_blocks_per_seq(cfg, block_size),
    )


def kv_capacity_blocks(*args: Any, **kwargs: Any) -> int:
    """``kv_capacity(...).num_blocks``: the same arguments and defaults."""
    return kv_capacity(*args, **kwargs).num_blocks


def kv_capacity_tokens(*args: Any, **kwargs: Any) -> int:
    """KV capacity in tokens, ``kv_capacity(...).num_tokens`` (num_blocks * block_size): the same
    arguments and defaults, e.g. ``kv_capacity_tokens(model="qwen3-coder-30b-a3b",
    quantization="awq", hardware="gb10", gpu_memory_utilization=0.85, block_size=16)``."""
    return kv_capacity(*args, **kwargs).num_tokens


def main(argv: list[str] | None = None) -> int:
    """``python -m research.perf.kv_capacity``: the default ``kv_capacity`` (Qwen3-Coder-30B-A3B
    AWQ on gb10). vLLM's own arithmetic: ``research.perf.vllm_kv``; the GB10 log check:
    ``research.perf.vllm_kv_logs``."""
    argparse.ArgumentParser(
        prog="python -m research.perf.kv_capacity", description=__doc__.splitlines()[0]
    ).parse_args(argv)
    cap = kv_capacity()
    print(
        f"{cap.model} ({cap.quantization}) on {cap.hardware}: {cap.num_blocks:,} blocks, "
        f"{cap.num_tokens:,} tokens (weights {cap.weight_bytes / GiB:.2f} GiB, "
        f"activations {cap.activation_bytes / GiB:.2f} GiB)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
