"""vLLM's memory profile on one worker, term by term, to the "Available KV cache memory" line:
what ``engine=vllm`` sizes its simulated pool by.

``research.perf.vllm_kv`` turns an available byte count into blocks and the printed token
count (exactly, from a log's own figure). This module derives that byte count from the model
and the machine instead of reading it off a log (vllm/v1/worker/gpu_worker.py
``determine_available_memory``; module notes of ``research.perf.vllm_kv``)::

    requested = ceil(total * gpu_memory_utilization)
    available = requested - weights - non_torch - forward_peak - cudagraphs

- ``total``: what the device reports. On a GB10 that is the driver's figure for the unified
  pool: 121.69 GiB on DGX OS 7 / CUDA 13.0 (the 2026 logs of ``gb10_vllm_kv_logs.json`` print
  "Free memory on device (114.54/121.69 GiB)"), 119.6 - 119.7 GiB on the launch drivers
  (docs/reference.md's figure, ``Hardware.cuda_visible_bytes``). ``GB10_REPORTED_TOTAL``.
- ``weights``: the stored bytes of the checkpoint's format (``kv_capacity.weight_bytes``) on
  this worker (1 / tensor_parallel_size).
- ``non_torch``: CUDA context, cuBLAS / NCCL workspaces and, on unified memory, host-side
  growth during the profile run (vLLM reads the host's MemAvailable there). Not derivable from
  shapes: ``NON_TORCH_BYTES`` is read off the one GB10 log that prints "consumed memory
  (weights + non-torch)" (qwen3-0.6b: 3.35 GiB consumed - 1.11 GiB of weights), so that record
  is fitted, not a check.
- ``forward_peak``: one forward of ``max_num_batched_tokens`` tokens
  (``activations.activation_elements_per_token``). No sampler term: the same log leaves 0.26
  GiB for transient peak + CUDA graphs, less than the float32 logits of the dummy sampler's
  1,024 rows alone (0.58 GiB), so the sampler's peak does not stack on the forward's.
- ``cudagraphs``: 0 for the vLLM version the profile cites (0.12 captures graphs after the KV
  pool is allocated, out of the 1 - utilization headroom); from v0.21.0 vLLM subtracts an
  estimate it measures, which only a log gives (``cudagraph_bytes=``).

Pure Python: JAX is not imported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from research.config import ModelConfig
from research.perf.activations import (
    activation_elements_per_token,
    dtype_bytes,
    resolve_model,
    vllm_batch_defaults,
)
from research.perf.hardware import GiB, Hardware, get_hardware
from research.perf.kv_capacity import weight_bytes
from research.perf.vllm_kv import (
    VLLM_BLOCK_SIZE,
    VllmKVCache,
    vllm_estimated_max_model_len,
    vllm_kv_cache_tokens,
)

# cudaMemGetInfo's total on a GB10, by driver (see the module notes).
GB10_REPORTED_TOTAL = {
    "dgx-os-7": round(121.69 * GiB),  # CUDA 13.0 driver, 2026 logs (qwen3-0.6b record)
    "launch": round(119.6 * GiB),  # docs/reference.md section 2
}
GB10_DRIVER = "dgx-os-7"
# Fitted on the qwen3-0.6b GB10 record (vLLM 0.27.1): consumed 3.35 GiB - weights 1.11 GiB.
NON_TORCH_BYTES = round(2.24 * GiB)


@dataclass(frozen=True)
class VllmMemoryProfile:
    """Every term of vLLM's budget on one worker, and the pool it leaves (``kv``)."""

    total_bytes: int
    gpu_memory_utilization: float
    requested_bytes: int
    weight_bytes: int
    non_torch_bytes: int
    forward_peak_bytes: int
    cudagraph_bytes: int
    available_bytes: int
    kv: VllmKVCache

    def terms_gib(self) -> dict[str, float]:
        return {
            k: getattr(self, f"{k}_bytes") / GiB
            for k in ("total", "requested", "weight", "non_torch", "forward_peak",
                      "cudagraph", "available")
        }  # fmt: skip


def reported_total_bytes(hardware: str | Hardware, driver: str | None = None) -> int:
    """The device total vLLM reads: ``GB10_REPORTED_TOTAL[driver]`` on a GB10 (default the
    current driver), the machine's ``cuda_visible_bytes`` elsewhere."""
    hw = get_hardware(hardware)
    if hw.name != "gb10":
        if driver is not None:
            raise ValueError(f"driver= names a GB10 driver; {hw.name!r} has one reported total")
        return hw.cuda_visible_bytes
    driver = GB10_DRIVER if driver is None else driver
    if driver not in GB10_REPORTED_TOTAL:
        raise ValueError(
            f"unknown GB10 driver {driver!r}; expected one of {sorted(GB10_REPORTED_TOTAL)}"
        )
    return GB10_REPORTED_TOTAL[driver]


def vllm_memory_profile(
    model: str | ModelConfig,
    quantization: str | None,
    hardware: str | Hardware = "gb10",
    gpu_memory_utilization: float = 0.9,
    *,
    max_num_batched_tokens: int | None = None,
    tensor_parallel_size: int = 1,
    block_size: int = VLLM_BLOCK_SIZE,
    kv_cache_dtype: str = "auto",
    dtype: Any = "bfloat16",
    max_model_len: int | None = None,
    cudagraph_bytes: int = 0,
    non_torch_bytes: int = NON_TORCH_BYTES,
    driver: str | None = None,
    token_report: str = "concurrency",
) -> VllmMemoryProfile:
    """vLLM's budget for ``model`` stored as ``quantization`` on one worker of ``hardware``
    (module notes), and the KV pool it leaves. A ValueError gives the terms when nothing is
    left for the cache."""
    cfg = resolve_model(model)
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    tokens_default, _ = vllm_batch_defaults(hardware)
    tokens = tokens_default if max_num_batched_tokens is None else max_num_batched_tokens
    total = reported_total_bytes(hardware, driver)
    requested = math.ceil(total * gpu_memory_utilization)
    weights = weight_bytes(cfg, quantization, dtype) // tensor_parallel_size
    forward = tokens * activation_elements_per_token(cfg) * dtype_bytes(dtype)
    forward //= tensor_parallel_size
    available = requested - weights - non_torch_bytes - forward - cudagraph_bytes
    if available <= 0:
        raise ValueError(
            f"{cfg.name} ({quantization or dtype}) on {get_hardware(hardware).name}: requested "
            f"{requested / GiB:.2f} GiB (utilization {gpu_memory_utilization}) - weights "
            f"{weights / GiB:.2f} - non-torch {non_torch_bytes / GiB:.2f} - forward peak "
            f"{forward / GiB:.2f} - CUDA graphs {cudagraph_bytes / GiB:.2f} leaves nothing for "
            "the KV cache; raise gpu_memory_utilization or tensor_parallel_size"
        )
    kv = vllm_kv_cache_tokens(
        cfg,
        available,
        block_size=block_size,
        kv_cache_dtype=kv_cache_dtype,
        dtype=dtype,
        tensor_parallel_size=tensor_parallel_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=tokens,
        token_report=token_report,
    )
    return VllmMemoryProfile(
        total_bytes=total,
        gpu_memory_utilization=gpu_memory_utilization,
        requested_bytes=requested,
        weight_bytes=weights,
        non_torch_bytes=non_torch_bytes,
        forward_peak_bytes=forward,
        cudagraph_bytes=cudagraph_bytes,
        available_bytes=available,
        kv=kv,
    )


def check_record(record: dict[str, Any]) -> dict[str, Any]:
    """One GB10 log record (``vllm_kv_logs.load_gb10_vllm_logs``) against the memory profile from
    nothing but the launch settings: the predicted available memory and the logged quantity
    (``record["compare"]``) recomputed from it. A CUDA-graph estimate the record relays
    (``logged["cudagraph_estimate_gib"]``) is charged; whether the record fitted
    ``NON_TORCH_BYTES`` is said (``fitted``)."""
    logged = record["logged"]
    graphs = round(logged.get("cudagraph_estimate_gib", 0.0) * GiB)
    prof = vllm_memory_profile(
        record["preset"],
        record["quantization"],
        "gb10",
        record["gpu_memory_utilization"],
        max_num_batched_tokens=record.get("max_num_batched_tokens"),
        tensor_parallel_size=record["tensor_parallel_size"],
        block_size=record["block_size"],
        kv_cache_dtype=record["kv_cache_dtype"],
        dtype=record["dtype"],
        max_model_len=record["max_model_len"],
        cudagraph_bytes=graphs,
        token_report=record["token_report"],
    )
    if record["compare"] == "gpu_kv_cache_tokens":
        predicted = prof.kv.num_tokens
    else:
        predicted = vllm_estimated_max_model_len(
            record["preset"],
            prof.available_bytes,
            max_model_len=record["max_model_len"],
            block_size=record["block_size"],
            kv_cache_dtype=record["kv_cache_dtype"],
            dtype=record["dtype"],
            tensor_parallel_size=record["tensor_parallel_size"],
        )
    target = logged[record["compare"]]
    return {
        "id": record["id"],
        "fitted": record["id"] == NON_TORCH_RECORD,
        "available_gib": prof.available_bytes / GiB,
        "logged_available_gib": logged["available_kv_cache_gib"],
        "available_error": prof.available_bytes / GiB / logged["available_kv_cache_gib"] - 1,
        "predicted": predicted,
        "logged": target,
        "error": predicted / target - 1,
        "terms_gib": prof.terms_gib(),
    }


NON_TORCH_RECORD = "qwen3-0.6b-util0.60"

__all__ = [
    "GB10_REPORTED_TOTAL",
    "NON_TORCH_BYTES",
    "VllmMemoryProfile",
    "check_record",
    "reported_total_bytes",
    "vllm_memory_profile",
]
