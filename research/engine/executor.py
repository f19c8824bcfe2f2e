"""The real executor: turns a StepPlan into fixed-shape arrays and runs the jitted step.

Shapes are bucketed to powers of two so a run compiles a bounded number of functions:
rows R (sequences in the call, up to max_num_seqs), tokens per row T (1 for decode, a bucket of
the longest chunk for prefill) and blocks per row M (a bucket of the longest block table).
Decode rows and prefill chunks run as two calls of the same function in one step. The KV pool is
donated through every call, so it is updated in place.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from research.config import CacheConfig, ModelConfig, SchedulerConfig
from research.engine.kv_cache import (
    ATTENTION_BACKENDS,
    PagedKVCache,
    copy_blocks,
    fill_blocks,
    init_kv_pool,
    kv_pool_bytes_per_block,
    write_kv,
)
from research.engine.request import SamplingParams
from research.engine.sampler import SamplingTensors, sample
from research.engine.scheduler import ScheduledSeq, StepPlan
from research.models.transformer import Params, compute_logits, forward

_PAD_PARAMS = SamplingParams(temperature=0.0)


def bucket(n: int, minimum: int, maximum: int) -> int:
    """Smallest power of two >= n and >= minimum, capped at maximum (which may be any n)."""
    return min(max(minimum, 1 << max(0, n - 1).bit_length()), maximum)


@dataclass
class StepResult:
    """Sampled token and top-2 logit gap per scheduled sequence (request id -> value)."""

    tokens: dict[str, int]
    top2_gaps: dict[str, float]
    duration: float


def num_blocks_for(
    cfg: ModelConfig, cache: CacheConfig, sched: SchedulerConfig, max_model_len: int, dtype: Any
) -> int:
    """Pool size: as given, else what fits in ``kv_cache_memory_bytes`` (never more than
    max_num_seqs full-length sequences need)."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    per_block = kv_pool_bytes_per_block(cfg, cache.block_size, jnp.dtype(dtype).itemsize)
    fit = cache.kv_cache_memory_bytes // per_block
    want = sched.max_num_seqs * -(-max_model_len // cache.block_size)
    return int(max(1, min(fit, want)))


class ModelExecutor:
    def __init__(
        self,
        cfg: ModelConfig,
        params: Params,
        cache: CacheConfig,
        sched: SchedulerConfig,
        *,
        num_blocks: int,
        max_model_len: int,
        dtype: Any = jnp.float32,
        attention_backend: str = "xla",
        kv_fill_value: float = 0.0,
    ):
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}"
            )
        self.cfg = cfg
        self.params = params
        self.block_size = cache.block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = sched.max_num_seqs
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.max_blocks_per_seq = -(-max_model_len // cache.block_size)
        self.backend = attention_backend
        self.k_pool, self.v_pool = init_kv_pool(
            cfg, num_blocks, cache.block_size, dtype, kv_fill_value
        )
        self.num_compilations = 0  # traces of the step function (one per new shape)
        self._step = jax.jit(self._step_fn)
        self._write = jax.jit(write_kv, donate_argnums=(0, 1))
        self._copy = jax.jit(copy_blocks, donate_argnums=(0, 1))
        self._fill = jax.jit(fill_blocks, donate_argnums=(0, 1), static_argnums=(3,))

    # ------------------------------------------------------------------ device

    def _step_fn(
        self,
        params,
        k_pool,
        v_pool,
        tokens,
        positions,
        block_tables,
        logits_index,
        st: SamplingTensors,
    ):
        """Forward + sample; returns the new K/V (written by ``write_kv``), tokens, top-2 gaps."""
        self.num_compilations += 1  # runs only while tracing
        cache = PagedKVCache(k_pool, v_pool, block_tables, backend=self.backend)
        hidden, cache = forward(params, self.cfg, tokens, positions, cache)
        rows = jnp.arange(tokens.shape[0])
        logits = compute_logits(params, self.cfg, hidden[rows, logits_index])  # [R, V]
        top2 = jax.lax.top_k(logits, 2)[0]
        return cache.new_k, cache.new_v, sample(logits, st), top2[:, 0] - top2[:, 1]

    # ------------------------------------------------------------------ host

    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        if plan.block_copies:
            src, dst = zip(*plan.block_copies, strict=True)
            self.k_pool, self.v_pool = self._copy(
                self.k_pool, self.v_pool, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32)
            )
        tokens: dict[str, int] = {}
        gaps: dict[str, float] = {}
        for group, is_decode in ((plan.decodes, True), (plan.prefills, False)):
            if group:
                self._run(group, is_decode, tokens, gaps)
        return StepResult(tokens, gaps, time.perf_counter() - t0)

    def _run(
        self,
        group: list[ScheduledSeq],
        is_decode: bool,
        tokens_out: dict[str, int],
        gaps_out: dict[str, float],
    ) -> None:
        n = len(group)
        r = bucket(n, 1, self.max_num_seqs)
        longest = max(item.num_new_tokens for item in group)
        t = 1 if is_decode else bucket(longest, 16, max(16, self.max_num_batched_tokens))
        # At least 128 tokens of context per row: fewer shapes to compile for short sequences.
        m_min = -(-128 // self.block_size)
        m = bucket(max(len(item.seq.block_ids) for item in group), m_min, self.max_blocks_per_seq)
        pad_slot = self.num_blocks * self.block_size  # out of range: the scatter drops it

        tokens = np.zeros((r, t), np.int32)
        positions = np.full((r, t), -1, np.int32)
        slots = np.full((r, t), pad_slot, np.int32)
        block_tables = np.zeros((r, m), np.int32)
        logits_index = np.zeros((r,), np.int32)
        params, seeds, steps = [], [], []
        for i, item in enumerate(group):
            seq, start, k = item.seq, item.start, item.num_new_tokens
            table = np.asarray(seq.block_ids, np.int32)
            pos = np.arange(start, start + k, dtype=np.int32)
            tokens[i, :k] = seq.token_ids[start : start + k]
            positions[i, :k] = pos
            slots[i, :k] = table[pos // self.block_size] * self.block_size + pos % self.block_size
            block_tables[i, : len(table)] = table
            logits_index[i] = k - 1
            params.append(seq.sampling_params)
            seeds.append(seq.seed)
            steps.append(len(seq.output_token_ids))
        pad = r - n
        st = SamplingTensors.from_params(
            params + [_PAD_PARAMS] * pad, seeds + [0] * pad, steps + [0] * pad
        )
        new_k, new_v, sampled, gaps = self._step(
            self.params, self.k_pool, self.v_pool, tokens, positions, block_tables, logits_index, st
        )
        self.k_pool, self.v_pool = self._write(self.k_pool, self.v_pool, new_k, new_v, slots)
        sampled, gaps = np.asarray(sampled), np.asarray(gaps)
        for i, item in enumerate(group):
            tokens_out[item.seq.request_id] = int(sampled[i])
            gaps_out[item.seq.request_id] = float(gaps[i])

    def poison_blocks(self, block_ids: list[int], value: float = float("nan")) -> None:
        """Fill blocks with ``value`` (isolation tests: freed memory must never be read)."""
        if block_ids:
            self.k_pool, self.v_pool = self._fill(
                self.k_pool, self.v_pool, jnp.asarray(block_ids, jnp.int32), value
            )
