"""vLLM's own KV-cache sizing, reproduced from the inputs its startup log gives.

``vllm_kv_cache_tokens`` and its neighbours reproduce vLLM's startup arithmetic (the page size
per layer group, ``num_blocks``, the "GPU KV cache size" line, the budget and the CUDA-graph term,
version by version). ``research.perf.vllm_memory`` (the byte budget from first principles) builds
on it; ``python -m research.perf.vllm_kv_logs`` checks both against the public DGX Spark (GB10)
log lines in research/perf/data/gb10_vllm_kv_logs.json (docs/experiments/kv_capacity_gb10.md).
Pure Python: JAX is not imported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from research.config import ModelConfig
from research.perf.activations import (
    VLLM_BATCH_DEFAULTS_LARGE,
    dtype_bytes,
    resolve_model,
)

# What follows reproduces the numbers vLLM v1 prints at startup from the inputs it had, so that a
# published log line can be checked against arithmetic instead of against our estimates. Two
# halves, as in vLLM:
#
# 1. The worker's byte budget (vllm/v1/worker/gpu_worker.py ``Worker.determine_available_memory``,
#    vllm/utils/mem_utils.py ``MemorySnapshot`` / ``memory_profiling``,
#    vllm/v1/worker/utils.py ``request_memory``):
#
#        requested = ceil(total_memory * gpu_memory_utilization)
#        available = requested - non_kv_cache_memory - cudagraph_memory_estimate
#
#    ``total_memory`` is cudaMemGetInfo's total (121.69 or 121.63 GiB on current GB10 drivers,
#    119.64 - 119.7 GiB on earlier ones). What ``non_kv_cache_memory`` counts changed:
#    - up to about v0.2x: weights + torch peak increase during the profile run + non-torch
#      increase since the startup snapshot (``MemoryProfilingResult`` with ``weights_memory``);
#      ``requested`` was the plain product, not rounded up;
#    - later (v0.27.1 prints "consumed memory (weights + non-torch)"): the drop in free memory
#      from the startup snapshot to the end of the profile run (``total_consumed``) plus the
#      torch peak above what stays allocated (``transient_peak_headroom``).
#    ``cudagraph_memory_estimate`` is subtracted since v0.21.0 (vLLM's own log: "CUDA graph
#    memory profiling is enabled (default since v0.21.0)"; off with
#    VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0); before, graphs were captured after the KV cache
#    was allocated and only came out of the (1 - utilization) headroom.
#    On GB10 (sm_121, and Orin / Thor) the snapshot's free memory is the host's MemAvailable
#    (psutil), not cudaMemGetInfo's free, because CPU and GPU share one pool (``MemorySnapshot
#    .measure``: a (8,7)/(11,0)/(12,1) capability check, later ``is_integrated``). So host-side
#    growth during the profile run (compiler heaps, page cache) is charged as non-torch memory,
#    and a negative CUDA-graph estimate (free memory read non-monotonic on unified memory) has
#    been reported to inflate the KV budget (vllm-project/vllm#44740).
#
# 2. Bytes to blocks to the printed token count (vllm/v1/core/kv_cache_utils.py,
#    vllm/v1/kv_cache_interface.py): every attention layer's page is
#    2 * block_size * kv_heads_per_rank * head_size * element_bytes (``AttentionSpec
#    .page_size_bytes``). Layers of one kind form KV-cache groups of ``group_size`` layers (all
#    of them for a single kind; the smallest kind's count for sliding + full, padding the
#    others), one block of the pool holds one page of each layer of a group, and
#
#        num_blocks = available // page_size // group_size          (get_num_blocks)
#
#    The "GPU KV cache size: N tokens" line is
#    - ``num_blocks // num_groups * block_size`` up to v0.19 (``_report_kv_cache_config``;
#      vllm-project/vllm#40691 shows it on v0.19.0), and
#    - ``int(max_concurrency * max_model_len)`` in the v0.2x releases (v0.27.1 and v0.29 on the
#      GB10 logs), with max_concurrency = num_blocks / blocks a max_model_len request holds, summed
#      over groups (full attention: cdiv(max_model_len, block_size); sliding window W:
#      cdiv(min(W - 1 + max_num_batched_tokens, max_model_len), block_size) + 1).
#    For one group of full-attention layers and a max_model_len that is a multiple of the block
#    size both are num_blocks * block_size.

VLLM_BLOCK_SIZE = 16
VLLM_TOKEN_REPORTS = ("concurrency", "blocks")


@dataclass(frozen=True)
class VllmKVCache:
    """vLLM's KV-cache layout for one worker, as ``get_kv_cache_config`` derives it."""

    available_bytes: int
    page_size_bytes: int  # one block of one layer
    group_size: int  # layers per KV-cache group: the pages one pool block holds
    num_groups: int
    num_blocks: int
    blocks_per_request: int  # a max_model_len request, summed over groups
    max_model_len: int
    max_concurrency: float  # num_blocks / blocks_per_request
    num_tokens: int  # what "GPU KV cache size: N tokens" prints
    token_report: str


def _vllm_kv_element_bytes(kv_cache_dtype: str, dtype: Any) -> int:
    if kv_cache_dtype == "auto":
        return dtype_bytes(dtype)
    if kv_cache_dtype == "fp8":
        return 1  # vLLM's fp8 cache: E4M3 codes, per-layer k/v scales outside the pages
    raise ValueError(f"vLLM has no {kv_cache_dtype!r} KV cache; expected 'auto' or 'fp8'")


def vllm_page_size_bytes(
    model: str | ModelConfig,
    block_size: int = VLLM_BLOCK_SIZE,
    kv_cache_dtype: str = "auto",
    dtype: Any = "bfloat16",
    tensor_parallel_size: int = 1,
) -> int:
    """Bytes of one block of one attention layer on one worker (``AttentionSpec
    .page_size_bytes``): K and V for ``block_size`` tokens of the worker's KV heads, which are
    num_kv_heads / tensor_parallel_size, or one replicated head when the group is wider than the
    model has KV heads."""
    cfg = resolve_model(model)
    if block_size < 1 or tensor_parallel_size < 1:
        raise ValueError(
            f"block_size ({block_size}) and tensor_parallel_size ({tensor_parallel_size}) "
            "must be >= 1"
        )
    heads = max(1, cfg.num_kv_heads // tensor_parallel_size)
    return 2 * block_size * heads * cfg.head_dim * _vllm_kv_element_bytes(kv_cache_dtype, dtype)


def vllm_kv_groups(model: str | ModelConfig) -> tuple[int, dict[str, int]]:
    """(group_size, {layer kind: number of KV-cache groups}) as vLLM's hybrid allocator forms
    them (``_get_kv_cache_config_uniform_page_size``): one group of every layer when all layers
    are alike; otherwise groups of as many layers as the rarer kind has, the last group of a
    kind padded ("Add N padding layers")."""
    cfg = resolve_model(model)
    counts = {
        kind: n
        for kind, n in (
            ("full_attention", cfg.num_layers - cfg.sliding_layers),
            ("sliding_attention", cfg.sliding_layers),
        )
        if n
    }
    group_size = min(counts.values())
    return group_size, {kind: math.ceil(n / group_size) for kind, n in counts.items()}


def _vllm_blocks_per_request(
    kind: str, cfg: ModelConfig, block_size: int, max_model_len: int, max_num_batched_tokens: int
) -> int:
    """Blocks one group of ``kind`` holds for a request of ``max_model_len`` tokens
    (``FullAttentionSpec`` / ``SlidingWindowSpec.max_memory_usage_bytes`` over the page size)."""
    if kind == "full_attention":
        return math.ceil(max_model_len / block_size)
    window_tokens = min(cfg.sliding_window - 1 + max_num_batched_tokens, max_model_len)
    return math.ceil(window_tokens / block_size) + 1


def vllm_kv_cache_tokens(
    model: str | ModelConfig,
    available_bytes: float,
    *,
    block_size: int = VLLM_BLOCK_SIZE,
    kv_cache_dtype: str = "auto",
    dtype: Any = "bfloat16",
    tensor_parallel_size: int = 1,
    max_model_len: int | None = None,
    max_num_batched_tokens: int = VLLM_BATCH_DEFAULTS_LARGE[0],
    token_report: str = "concurrency",
) -> VllmKVCache:
    """The pool vLLM builds from ``available_bytes`` (one worker's "Available KV cache memory")
    and the token count its "GPU KV cache size" line prints (module notes above: the page size,
    the layer groups, ``num_blocks = available // page_size // group_size``, then the version's
    report, "concurrency" for v0.2x or "blocks" up to v0.19). ``max_model_len`` defaults to the
    model's context; ``max_num_batched_tokens`` only matters for sliding-window layers."""
    if token_report not in VLLM_TOKEN_REPORTS:
        raise ValueError(f"token_report must be one of {VLLM_TOKEN_REPORTS}, got {token_report!r}")
    if available_bytes <= 0:
        raise ValueError(f"available_bytes must be > 0, got {available_bytes}")
    cfg = resolve_model(model)
    max_len = cfg.max_position_embeddings if max_model_len is None else max_model_len
    page = vllm_page_size_bytes(cfg, block_size, kv_cache_dtype, dtype, tensor_parallel_size)
    group_size, groups = vllm_kv_groups(cfg)
    num_blocks = int(int(available_bytes) // page // group_size)
    num_groups = sum(groups.values())
    per_request = sum(
        n * _vllm_blocks_per_request(kind, cfg, block_size, max_len, max_num_batched_tokens)
        for kind, n in groups.items()
    )
    max_concurrency = num_blocks / per_request
    if token_report == "concurrency":
        num_tokens = int(max_concurrency * max_len)
    else:
        num_tokens = num_blocks // num_groups * block_size
    return VllmKVCache(
        available_bytes=int(available_bytes),
        page_size_bytes=page,
        group_size=group_size,
        num_groups=num_groups,
        num_blocks=num_blocks,
        blocks_per_request=per_request,
        max_model_len=max_len,
        max_concurrency=max_concurrency,
        num_tokens=num_tokens,
        token_report=token_report,
    )


def vllm_kv_bytes_needed(
    model: str | ModelConfig,
    max_model_len: int,
    *,
    block_size: int = VLLM_BLOCK_SIZE,
    kv_cache_dtype: str = "auto",
    dtype: Any = "bfloat16",
    tensor_parallel_size: int = 1,
    max_num_batched_tokens: int = VLLM_BATCH_DEFAULTS_LARGE[0],
) -> int:
    """KV bytes one request of ``max_model_len`` tokens needs on one worker, summed over every
    layer: the "X GiB KV cache is needed" of vLLM's ``check_enough_kv_cache_memory``."""
    cfg = resolve_model(model)
    page = vllm_page_size_bytes(cfg, block_size, kv_cache_dtype, dtype, tensor_parallel_size)
    kinds = {
        "full_attention": cfg.num_layers - cfg.sliding_layers,
        "sliding_attention": cfg.sliding_layers,
    }
    return sum(
        n
        * page
        * _vllm_blocks_per_request(kind, cfg, block_size, max_model_len, max_num_batched_tokens)
        for kind, n in kinds.items()
        if n
    )


def vllm_estimated_max_model_len(
    model: str | ModelConfig,
    available_bytes: float,
    *,
    max_model_len: int | None = None,
    **kwargs: Any,
) -> int:
    """The longest request ``available_bytes`` holds, by the binary search of vLLM's
    ``estimate_max_model_len`` ("Based on the available memory, the estimated maximum model
    length is N"); 0 when not even one token fits. ``kwargs`` go to ``vllm_kv_bytes_needed``."""
    cfg = resolve_model(model)
    lo, hi = 0, cfg.max_position_embeddings if max_model_len is None else max_model_len
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if vllm_kv_bytes_needed(cfg, mid, **kwargs) <= available_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def vllm_requested_bytes(total_bytes: float, gpu_memory_utilization: float) -> int:
    """vLLM's budget: ceil(total_memory * gpu_memory_utilization) (``request_memory``); the
    worker refuses to start when the startup free memory is below it."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    return math.ceil(total_bytes * gpu_memory_utilization)


def vllm_available_kv_bytes(
    total_bytes: float,
    gpu_memory_utilization: float,
    non_kv_cache_bytes: float,
    cudagraph_bytes: float = 0,
) -> int:
    """The "Available KV cache memory" vLLM logs, in bytes: requested - non_kv_cache_bytes -
    cudagraph_bytes.

    ``non_kv_cache_bytes`` is what the vLLM version charges (module notes above): weights + torch
    peak increase + non-torch increase in the older releases, consumed memory (weights +
    non-torch, read from free memory) + transient torch peak in the later ones. Pass the CUDA
    graph estimate as ``cudagraph_bytes`` for v0.21.0 and later (0 before, or with
    VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0)."""
    requested = vllm_requested_bytes(total_bytes, gpu_memory_utilization)
    return int(requested - non_kv_cache_bytes - cudagraph_bytes)
