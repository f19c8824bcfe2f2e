"""The real executor: turns a StepPlan into fixed-shape arrays and runs the jitted step.

Tokens of all scheduled sequences are packed into one row of N tokens (so projections and MLPs
cost what the real tokens cost); attention unpacks them per sequence. Shapes are bucketed to
powers of two so a run compiles a bounded number of functions: packed tokens N, rows R
(sequences in the call, up to max_num_seqs), tokens per row T (1 for decode, a bucket of the
longest chunk for prefill) and blocks per row M (a bucket of the longest block table).
Decode rows and prefill chunks run as two calls of the same function in one step; speculative
rows (a sequence's last token and its drafts) run as a third call of ``verify_step``, which
scores every one of their positions and accepts or rejects the drafts on device. The step
reads the KV pool; a second jitted call scatters the new K/V into the donated pool in place.

The jitted functions live at module level with the model config as a static argument, so every
executor of the same model in a process shares compiled code. ``STEP_TRACES`` counts how often
the step was traced (= compiled) in this process; each executor also records the distinct step
shapes it ran, which is what its compile count is bounded by.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from research.config import CacheConfig, ModelConfig, SchedulerConfig
from research.engine.kv_cache import (
    KVPool,
    PagedKVCache,
    copy_blocks,
    fill_blocks,
    init_kv_pool,
    kv_pool_bytes_per_block,
    resolve_attention_backend,
    write_kv,
)
from research.engine.rejection_sampler import rejection_sample
from research.engine.request import MAX_LOGPROBS, Logprob, SamplingParams
from research.engine.sampler import SamplingTensors, greedy, sample, token_logprobs
from research.engine.scheduler import ScheduledSeq, StepPlan
from research.models.transformer import Params, compute_logits, forward
from research.native import gemm as native_gemm

logger = logging.getLogger(__name__)

_PAD_PARAMS = SamplingParams(temperature=0.0)


STEP_TRACES = [0]


@jax.tree_util.register_dataclass
@dataclass
class StepBatch:
    """One call's inputs: N packed tokens from R sequences (rows), as device arrays."""

    tokens: jax.Array  # [N] int32
    positions: jax.Array  # [N] int32, -1 = padding
    token_row: jax.Array  # [N] int32, R = padding
    token_col: jax.Array  # [N] int32
    row_positions: jax.Array  # [R, T] int32, -1 = padding
    block_tables: jax.Array  # [R, M] int32
    logits_index: jax.Array  # [R] int32: the packed index of each row's last token
    sampling: SamplingTensors  # [R] each
    # [N] int32: the next prompt token after each packed token, for requests that want their
    # prompt's log-probabilities; -1 elsewhere
    prompt_targets: jax.Array
    # [R, M] int32: the sliding-window layers' block tables (models that have them)
    sliding_block_tables: jax.Array | None = None


def _paged_cache(pool: KVPool, batch: StepBatch, backend: str, plan: Any) -> PagedKVCache:
    """The paged cache a step's forward reads and collects new K/V in."""
    return PagedKVCache(
        pool,
        batch.block_tables,
        batch.token_row,
        batch.token_col,
        batch.row_positions,
        backend=backend,
        plan=plan,
        sliding_block_tables=batch.sliding_block_tables,
    )


@functools.partial(jax.jit, static_argnames=("cfg", "backend", "plan"))
def model_step(
    params: Params,
    pool: KVPool,
    batch: StepBatch,
    *,
    cfg: ModelConfig,
    backend: str,
    plan: Any = None,
) -> tuple[list[jax.Array], list[jax.Array], jax.Array, jax.Array, dict[str, jax.Array]]:
    """Forward + sample. Returns new K/V per layer ([N, K, E], for ``write_kv``), the sampled
    token per row [R], the gap between each row's two largest logits [R], and log-probabilities:
    of each row's sample ("sample_*", [R] and [R, MAX_LOGPROBS]) and of each packed token's
    next prompt token ("prompt_*", [N] and [N, MAX_LOGPROBS]). Each log-probability branch runs
    only when a row (or packed token) of the call asks for it; otherwise it returns zeros."""
    STEP_TRACES[0] += 1  # runs only while tracing
    cache = _paged_cache(pool, batch, backend, plan)
    hidden, cache = forward(params, cfg, batch.tokens[None], batch.positions[None], cache, backend)
    logits = compute_logits(params, cfg, hidden[0, batch.logits_index])  # [R, V]
    greedy_tokens, gaps = greedy(logits)
    sampled = sample(logits, batch.sampling, greedy_tokens)
    logprobs = {
        f"sample_{k}": v
        for k, v in _when(
            jnp.any(batch.sampling.logprobs),
            lambda: token_logprobs(logits, sampled, MAX_LOGPROBS),
            sampled.shape[0],
        ).items()
    }
    logprobs |= {
        f"prompt_{k}": v
        for k, v in _when(
            jnp.any(batch.prompt_targets >= 0),
            lambda: _prompt_logprobs(params, cfg, hidden[0], batch.prompt_targets),
            batch.tokens.shape[0],
        ).items()
    }
    return cache.new_k, cache.new_v, sampled, gaps, logprobs


@jax.tree_util.register_dataclass
@dataclass
class VerifyInputs:
    """Speculative rows' drafts, for ``verify_step``: T verified positions per row."""

    logits_index: jax.Array  # [R, T] int32: packed index of each row's t-th token (0 = padding)
    draft_tokens: jax.Array  # [R, T - 1] int32, -1 = padding
    num_drafts: jax.Array  # [R] int32


VERIFY_TRACES = [0]


@functools.partial(jax.jit, static_argnames=("cfg", "backend", "plan"))
def verify_step(
    params: Params,
    pool: KVPool,
    batch: StepBatch,
    verify: VerifyInputs,
    *,
    cfg: ModelConfig,
    backend: str,
    plan: Any = None,
) -> tuple[list[jax.Array], list[jax.Array], jax.Array, jax.Array, jax.Array]:
    """Forward over each row's last token and drafts, then rejection sampling
    (``research.engine.rejection_sampler``). Returns new K/V per layer ([N, K, E]), tokens
    [R, T] (accepted drafts, the sampled token, then -1), accepted counts [R] and the top-2
    logit gap at every verified position [R, T]. A separate function from ``model_step``, so
    runs without speculation compile and run exactly what they did before."""
    VERIFY_TRACES[0] += 1  # runs only while tracing
    cache = _paged_cache(pool, batch, backend, plan)
    hidden, cache = forward(params, cfg, batch.tokens[None], batch.positions[None], cache, backend)
    r, t = verify.logits_index.shape
    logits = compute_logits(params, cfg, hidden[0, verify.logits_index.reshape(-1)])  # [R*T, V]
    gaps = greedy(logits)[1].reshape(r, t)
    tokens, num_accepted = rejection_sample(
        logits.reshape(r, t, -1), verify.draft_tokens, verify.num_drafts, batch.sampling
    )
    return cache.new_k, cache.new_v, tokens, num_accepted, gaps


def _when(pred: jax.Array, fn: Any, rows: int) -> dict[str, jax.Array]:
    """``token_logprobs``-shaped results of ``fn()`` if ``pred``, else zeros (lax.cond)."""
    names = ("logprob", "rank", "top_ids", "top_logprobs")

    def zeros() -> tuple[jax.Array, ...]:
        k = MAX_LOGPROBS
        return (
            jnp.zeros(rows),
            jnp.zeros(rows, jnp.int32),
            jnp.zeros((rows, k), jnp.int32),
            jnp.zeros((rows, k)),
        )

    return dict(zip(names, jax.lax.cond(pred, fn, zeros), strict=True))


def _prompt_logprobs(
    params: Params, cfg: ModelConfig, hidden: jax.Array, targets: jax.Array
) -> tuple[jax.Array, ...]:
    """``token_logprobs`` of every packed token's next prompt token: hidden [N, D], targets [N].
    The head runs over chunks of at most 64 tokens, so the logits never take N x V at once."""
    n = hidden.shape[0]
    chunk = min(n & -n, 64)  # a power of two that divides N

    def one(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        h, t = args
        return token_logprobs(compute_logits(params, cfg, h), t, MAX_LOGPROBS)

    out = jax.lax.map(one, (hidden.reshape(n // chunk, chunk, -1), targets.reshape(-1, chunk)))
    return tuple(x.reshape(n, *x.shape[2:]) for x in out)


_write_kv = jax.jit(write_kv, donate_argnums=0)
_copy_blocks = jax.jit(copy_blocks, donate_argnums=0)
_fill_blocks = jax.jit(fill_blocks, donate_argnums=0, static_argnums=2)


def to_host(x: jax.Array) -> np.ndarray:
    """A step output on the host. Across processes (``jax.distributed``) the outputs are
    replicated on every device, so this process's own copy is the whole value."""
    if x.is_fully_addressable:
        return np.asarray(x)
    if not x.is_fully_replicated:
        raise ValueError(f"a step output is split across processes: {x.sharding}")
    return np.asarray(x.addressable_data(0))


def _raw(lps: dict[str, jax.Array], kind: str) -> tuple[np.ndarray, ...]:
    return tuple(
        to_host(lps[f"{kind}_{k}"]) for k in ("logprob", "rank", "top_ids", "top_logprobs")
    )


def context_bucket(n: int, minimum: int, maximum: int) -> int:
    """Blocks per row: the smallest of minimum * {1, 2, 3, 4, 6, 8, 12, ...} (powers of two and
    their 1.5x midpoints) >= n, capped at maximum. Attention reads every bucketed block, so
    finer steps than powers of two cut up to half the context read for twice the shapes."""
    if n <= minimum:
        return min(minimum, maximum)
    p = minimum
    while True:  # (2p, 3p) for p = m, 2m, 4m, ...: 2m, 3m, 4m, 6m, 8m, 12m, ...
        for size in (2 * p, 3 * p):
            if size >= n:
                return min(size, maximum)
        p *= 2


def _spec(a: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None))


def bucket(n: int, minimum: int, maximum: int) -> int:
    """Smallest power of two >= n and >= minimum, capped at maximum (which may be any n)."""
    return min(max(minimum, 1 << max(0, n - 1).bit_length()), maximum)


# One position's log-probabilities, as the step returns them: (log-probability of the chosen
# token, its rank, the top MAX_LOGPROBS token ids, their log-probabilities).
RawLogprobs = tuple[float, int, np.ndarray, np.ndarray]


@dataclass
class StepResult:
    """Sampled token and top-2 logit gap per scheduled sequence (request id -> value)."""

    tokens: dict[str, int]
    top2_gaps: dict[str, float]
    duration: float  # wall seconds of execute()
    device_time: float  # of which from dispatching the jitted calls to their results being ready
    # Rows whose request asked for logprobs: their sample's.
    logprobs: dict[str, RawLogprobs] = field(default_factory=dict)
    # Requests that asked for prompt_logprobs: {position of the prompt token: its entry}.
    prompt_logprobs: dict[str, dict[int, RawLogprobs]] = field(default_factory=dict)
    # Speculative rows: the drafts accepted (in order, before ``tokens[id]``) and the top-2
    # logit gap where each was verified.
    accepted: dict[str, list[int]] = field(default_factory=dict)
    accepted_top2_gaps: dict[str, list[float]] = field(default_factory=dict)


def decode_logprobs(raw: RawLogprobs, token: int, n: int, decode: Any) -> dict[int, Logprob]:
    """vLLM's per-position dict: the chosen ``token`` and the ``n`` most likely ones, each a
    ``Logprob`` with its rank (1 = most likely) and text (``decode(id)``, or None)."""
    logprob, rank, ids, values = raw
    entries = {
        int(t): Logprob(float(v), i + 1, decode(int(t)))
        for i, (t, v) in enumerate(zip(ids[:n], values[:n], strict=True))
    }
    if token not in entries:
        entries = {token: Logprob(float(logprob), int(rank), decode(token)), **entries}
    return entries


def num_blocks_for(
    cfg: ModelConfig,
    cache: CacheConfig,
    sched: SchedulerConfig,
    max_model_len: int,
    dtype: Any,
    kv_cache_dtype: str = "auto",
) -> int:
    """Pool size: as given, else what fits in ``kv_cache_memory_bytes`` (never more than
    max_num_seqs full-length sequences need)."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    per_block = kv_pool_bytes_per_block(cfg, cache.block_size, dtype, kv_cache_dtype)
    fit = cache.kv_cache_memory_bytes // per_block
    want = sched.max_num_seqs * -(-max_model_len // cache.block_size)
    return int(max(1, min(fit, want)))


class ModelExecutor:
    computes_logprobs = True  # the engine refuses logprobs on executors without logits

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
        attention_backend: str = "auto",
        kv_cache_dtype: str = "auto",
        kv_fill_value: float = 0.0,
        plan: Any = None,
        gemm_backend: str = "auto",
    ):
        """``plan``: a ``research.parallel.ShardingPlan`` to split the parameters and the KV pool
        over its devices (tensor / expert parallel); None runs on one device. ``gemm_backend``:
        "native" packs the bfloat16 projections for the AMX kernel (``research.native.gemm``),
        "xla" leaves them to XLA, "auto" picks native where it serves."""
        sharded = plan is not None and plan.size > 1
        self.gemm_backend = native_gemm.resolve(gemm_backend, dtype, sharded)
        if self.gemm_backend == "native":
            params = native_gemm.pack_params(params, cfg.tie_word_embeddings)
        attention_backend = resolve_attention_backend(
            attention_backend,
            dtype,
            kv_cache_dtype,
            sharded=sharded,
            cfg=cfg,
        )
        self.cfg = cfg
        self.params = params
        self.block_size = cache.block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = sched.max_num_seqs
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.max_blocks_per_seq = -(-max_model_len // cache.block_size)
        self.backend = attention_backend
        self.pool = init_kv_pool(
            cfg, num_blocks, cache.block_size, dtype, kv_fill_value, kv_cache_dtype
        )
        self.plan = plan
        self._write_kv, self._copy_blocks, self._fill_blocks = _write_kv, _copy_blocks, _fill_blocks
        if plan is not None:
            self.params = plan.place_params(params)
            self.pool = plan.place_pool(self.pool)
            # The pool keeps its split through every in-place update.
            keep = plan.pool_shardings(self.pool)
            self._write_kv = jax.jit(write_kv, donate_argnums=0, out_shardings=keep)
            self._copy_blocks = jax.jit(copy_blocks, donate_argnums=0, out_shardings=keep)
            self._fill_blocks = jax.jit(
                fill_blocks, donate_argnums=0, static_argnums=2, out_shardings=keep
            )
        self.step_shapes: set[tuple[int, ...]] = set()  # (N, R, T, M) of every call run
        self.verify_shapes: set[tuple[int, ...]] = set()  # the same, of speculative verification
        # Speculative decoding: 1 + num_speculative_tokens (set by the engine); 0 = none.
        self.verify_tokens_per_row = 0
        # Serving: a call whose shape is not compiled runs padded to the cheapest compiled shape
        # that holds it (a "cover") while its own shape compiles on a background thread; the
        # step never waits for a compile when a cover exists (``precompile_covers``).
        self.compile_in_background = False
        self._background: dict[tuple[int, ...], Any] = {}  # shape -> jax Compiled
        self._verify_compiled: dict[tuple[int, ...], Any] = {}  # the same, of verify_step
        self._writes: dict[int, Any] = {}  # N -> compiled K/V write of N packed tokens
        self._pending: set[tuple[bool, tuple[int, ...]]] = set()  # (verify, shape)
        self._lock = threading.Lock()
        self._compiler: ThreadPoolExecutor | None = None
        self.covered_calls = 0  # calls run padded to a cover

    @property
    def num_compilations(self) -> int:
        """Distinct step shapes this executor ran: each compiled once (bounded by the buckets)."""
        return len(self.step_shapes) + len(self.verify_shapes)

    # ------------------------------------------------------------------ host

    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        if plan.block_copies:
            src, dst = zip(*plan.block_copies, strict=True)
            self.pool = self._copy_blocks(
                self.pool, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32)
            )
        result = StepResult({}, {}, 0.0, 0.0)
        for group, is_decode in ((plan.decodes, True), (plan.prefills, False)):
            if group:
                result.device_time += self._run(group, is_decode, result)
        if plan.verifies:
            result.device_time += self._run(plan.verifies, False, result, verify=True)
        result.duration = time.perf_counter() - t0
        return result

    def call_shape(
        self, group: list[ScheduledSeq], is_decode: bool, verify: bool = False
    ) -> tuple[int, int, int, int]:
        """(N packed tokens, R rows, T tokens per row, M blocks per row) of the call that runs
        ``group``: each a bucket, so a run compiles a bounded number of shapes. Verification
        rows (``verify``: last token + drafts) take T = ``verify_tokens_per_row`` (1 + the
        configured drafts), not a bucket from 16: every position of theirs is scored."""
        r = bucket(len(group), 1, self.max_num_seqs)
        n_tokens = sum(item.num_new_tokens for item in group)
        n = r if is_decode else bucket(n_tokens, 16, max(16, self.max_num_batched_tokens))
        longest = max(item.num_new_tokens for item in group)
        if verify:  # every verification call of a run has the same T: fewer shapes
            t = max(longest, self.verify_tokens_per_row)
        else:
            t = 1 if is_decode else bucket(longest, 16, n)
        if not is_decode and not verify and all(item.start == 0 for item in group):
            return n, r, t, 0  # fresh prompts only: no cached context to read (M = 0)
        # At least 128 tokens of context per row: fewer shapes to compile for short sequences.
        m_min = -(-128 // self.block_size)
        longest_table = max(len(item.seq.block_ids) for item in group)
        return n, r, t, context_bucket(longest_table, m_min, self.max_blocks_per_seq)

    def _padding_batch(self, n: int, r: int, t: int, m: int) -> StepBatch:
        """A batch of shape (N, R, T, M) that is all padding: it writes and samples nothing."""
        return StepBatch(
            np.zeros(n, np.int32),
            np.full(n, -1, np.int32),
            np.full(n, r, np.int32),
            np.zeros(n, np.int32),
            np.full((r, t), -1, np.int32),
            np.zeros((r, m), np.int32),
            np.zeros(r, np.int32),
            SamplingTensors.from_params([_PAD_PARAMS] * r, [0] * r, [0] * r),
            np.full(n, -1, np.int32),
            np.zeros((r, m), np.int32) if self.pool.layer_slots else None,
        )

    def cover_shapes(self, max_attention_bytes: int = 512 << 20) -> list[tuple[int, int, int, int]]:
        """Shapes that hold every call the configuration can make, up to a memory bound: per
        row bucket R, a decode (R, R, 1, M_max); per tokens-per-row bucket T, a prefill of
        max_num_seqs rows (fewer where R x T x keys float32 scores per head would pass
        ``max_attention_bytes``) over the longest context, and one of fresh prompts (M = 0),
        which reads no cached context."""
        m_max = self.max_blocks_per_seq
        keys = m_max * self.block_size
        cap = max(16, self.max_num_batched_tokens)
        rows = {bucket(k, 1, self.max_num_seqs) for k in range(1, self.max_num_seqs + 1)}
        shapes = {(r, r, 1, m_max) for r in rows}
        t = 16
        while True:
            t_cap = min(t, cap)
            # over the longest context, and fresh prompts only (M = 0: keys are the new tokens)
            for m, m_keys in ((m_max, keys), (0, t_cap)):
                r = self.max_num_seqs
                while r > 1 and r * t_cap * m_keys * self.cfg.num_heads * 4 > max_attention_bytes:
                    r = bucket(r // 2, 1, self.max_num_seqs)
                n = bucket(min(cap, r * t_cap), 16, cap)
                shapes.add((n, r, min(t_cap, n), m))
            if t_cap >= min(cap, keys):
                break
            t *= 2
        return sorted(shapes)

    def verify_cover_shapes(self) -> list[tuple[int, int, int, int]]:
        """Shapes that hold every verification call (speculative decoding; none without): per
        row bucket R, R rows of ``verify_tokens_per_row`` positions over the longest context."""
        t = self.verify_tokens_per_row
        if t == 0:
            return []
        cap = max(16, self.max_num_batched_tokens)
        rows = {bucket(k, 1, self.max_num_seqs) for k in range(1, self.max_num_seqs + 1)}
        return sorted((bucket(r * t, 16, cap), r, t, self.max_blocks_per_seq) for r in rows)

    def precompile_covers(self, progress: bool = False) -> int:
        """Compile ``cover_shapes`` (and, with speculative decoding, ``verify_cover_shapes``)
        ahead of time and serve from then on without compiling inside a step. The covers are
        compiled, not run: the largest (max_num_seqs rows over the longest context) would take
        gigabytes to execute once. Verification calls are covered as the step's are."""
        todo = sorted(set(self.cover_shapes()) - self.step_shapes)
        verify_todo = sorted(set(self.verify_cover_shapes()) - self.verify_shapes)
        for shape in verify_todo:
            self._store_verify(shape, *self._compile(shape, verify=True))
        for i, shape in enumerate(todo):
            t0 = time.perf_counter()
            self._store(shape, *self._compile(shape))
            if progress:
                print(
                    f"  compiled {i + 1}/{len(todo)}: N={shape[0]} R={shape[1]} T={shape[2]} "
                    f"M={shape[3]} ({time.perf_counter() - t0:.1f} s)",
                    flush=True,
                )
        self.compile_in_background = True
        return len(todo) + len(verify_todo)

    def _compile(self, shape: tuple[int, int, int, int], verify: bool = False) -> tuple[Any, Any]:
        """Ahead-of-time executables of the step (``verify_step`` if ``verify``) and of its K/V
        write for ``shape``."""
        spec = functools.partial(jax.tree_util.tree_map, _spec)
        batch = self._padding_batch(*shape)
        args = (spec(self.params), spec(self.pool), batch)
        if verify:
            _, r, t, _ = shape
            args += (VerifyInputs(*self._padding_verify(r, t)),)
        lowered = (verify_step if verify else model_step).lower(
            *args, cfg=self.cfg, backend=self.backend, plan=self.plan
        )
        new_k, new_v = (list(map(_spec, kv)) for kv in lowered.out_info[:2])
        slots = jax.ShapeDtypeStruct((shape[0],), jnp.int32)
        sliding = slots if self.pool.layer_slots else None
        write = self._write_kv.lower(spec(self.pool), new_k, new_v, slots, sliding).compile()
        return lowered.compile(), write

    def _store(self, shape: tuple[int, int, int, int], step: Any, write: Any) -> None:
        with self._lock:
            self._background[shape] = step
            self._writes.setdefault(shape[0], write)
            self.step_shapes.add(shape)

    def _store_verify(self, shape: tuple[int, int, int, int], step: Any, write: Any) -> None:
        with self._lock:
            self._verify_compiled[shape] = step
            self._writes.setdefault(shape[0], write)
            self.verify_shapes.add(shape)

    def _cover(
        self, shape: tuple[int, int, int, int], verify: bool = False
    ) -> tuple[int, ...] | None:
        """The cheapest compiled shape (of ``verify_step`` if ``verify``) at least as large as
        ``shape`` in every dimension."""
        with self._lock:
            ready = list(self.verify_shapes if verify else self.step_shapes)
        fits = [s for s in ready if all(a >= b for a, b in zip(s, shape, strict=True))]
        return min(fits, key=lambda s: (s[1] * s[2] * s[3] + s[0], s)) if fits else None

    def _compile_later(self, shape: tuple[int, int, int, int], verify: bool = False) -> None:
        with self._lock:
            done = self.verify_shapes if verify else self.step_shapes
            if (verify, shape) in self._pending or shape in done:
                return
            self._pending.add((verify, shape))
            if self._compiler is None:
                self._compiler = ThreadPoolExecutor(1, thread_name_prefix="step-compiler")
        self._compiler.submit(self._compile_in_background, shape, verify)

    def _compile_in_background(
        self, shape: tuple[int, int, int, int], verify: bool = False
    ) -> None:
        try:
            step, write = self._compile(shape, verify)
            if verify:
                self._store_verify(shape, step, write)
            else:
                self._store(shape, step, write)
        except Exception:  # the covering shape keeps serving; the next miss retries
            logger.exception("background compile of step shape %s failed", shape)
        finally:
            with self._lock:
                self._pending.discard((verify, shape))

    def precompile(self, shapes: Any, progress: bool = False) -> int:
        """Compile every (N, R, T, M) of ``shapes`` not run yet, by running a batch that is all
        padding (nothing is written to the pool, nothing is sampled for anyone); returns how many
        were compiled. ``research.engine.shapes.predict_step_shapes`` says which shapes a workload
        will use."""
        todo = sorted(set(shapes) - self.step_shapes)
        pad_slot = self.num_blocks * self.block_size
        for i, (n, r, t, m) in enumerate(todo):
            t0 = time.perf_counter()
            batch = self._padding_batch(n, r, t, m)
            new_k, new_v, sampled, _, _ = model_step(
                self.params, self.pool, batch, cfg=self.cfg, backend=self.backend, plan=self.plan
            )
            self.pool = self._write_kv(self.pool, new_k, new_v, np.full(n, pad_slot, np.int32))
            to_host(sampled)
            with self._lock:
                self.step_shapes.add((n, r, t, m))
            if progress:
                print(
                    f"  compiled {i + 1}/{len(todo)}: N={n} R={r} T={t} M={m} "
                    f"({time.perf_counter() - t0:.1f} s)",
                    flush=True,
                )
        return len(todo)

    def _run(
        self, group: list[ScheduledSeq], is_decode: bool, out: StepResult, verify: bool = False
    ) -> float:
        """Pack, run and unpack one call; returns the seconds spent in the jitted calls."""
        if verify:
            return self._run_verify(group, out)
        shape = self.call_shape(group, is_decode)
        cover = None
        if self.compile_in_background and shape not in self.step_shapes:
            cover = self._cover(shape)
        if cover is not None:
            self._compile_later(shape)
            self.covered_calls += 1
            shape = cover
        batch, slots, sliding_slots, positions, prompt_targets, params = self._pack(group, shape)
        n = shape[0]
        with self._lock:
            self.step_shapes.add(shape)
            compiled = self._background.get(shape)
            write = self._writes.get(n, self._write_kv)
        t0 = time.perf_counter()
        if compiled is not None:
            new_k, new_v, sampled, gaps, lps = compiled(self.params, self.pool, batch)
        else:
            new_k, new_v, sampled, gaps, lps = model_step(
                self.params, self.pool, batch, cfg=self.cfg, backend=self.backend, plan=self.plan
            )
        self.pool = write(self.pool, new_k, new_v, slots, sliding_slots)
        sampled, gaps = to_host(sampled), to_host(gaps)
        want = {i for i, p in enumerate(params) if p.logprobs is not None}
        if want:
            sample_lps = _raw(lps, "sample")
        if (prompt_targets >= 0).any():
            prompt_lps = _raw(lps, "prompt")
        device_time = time.perf_counter() - t0
        offset = 0
        for i, item in enumerate(group):
            rid = item.seq.request_id
            out.tokens[rid] = int(sampled[i])
            out.top2_gaps[rid] = float(gaps[i])
            if i in want:
                out.logprobs[rid] = tuple(x[i] for x in sample_lps)
            for j in range(offset, offset + item.num_new_tokens):
                if prompt_targets[j] >= 0:
                    entry = tuple(x[j] for x in prompt_lps)
                    out.prompt_logprobs.setdefault(rid, {})[int(positions[j]) + 1] = entry
            offset += item.num_new_tokens
        return device_time

    def _run_verify(self, group: list[ScheduledSeq], out: StepResult) -> float:
        """One call over the speculative rows: each row's last token and its drafts are scored
        and the drafts accepted or rejected on device (``verify_step``). The K/V of every
        verified token is written; the rejected ones' slots are rolled back by the scheduler."""
        shape = self.call_shape(group, False, verify=True)
        if self.compile_in_background and shape not in self.verify_shapes:
            cover = self._cover(shape, verify=True)
            if cover is not None:
                self._compile_later(shape, verify=True)
                self.covered_calls += 1
                shape = cover
        batch, slots, sliding_slots, _, _, _ = self._pack(group, shape)
        n, r, t, _ = shape
        logits_index, draft_tokens, num_drafts = self._padding_verify(r, t)
        offset = 0
        for i, item in enumerate(group):
            d = len(item.draft_token_ids)
            logits_index[i, : d + 1] = np.arange(offset, offset + d + 1)
            draft_tokens[i, :d] = item.draft_token_ids
            num_drafts[i] = d
            offset += item.num_new_tokens
        verify = VerifyInputs(logits_index, draft_tokens, num_drafts)
        with self._lock:
            self.verify_shapes.add(shape)
            compiled = self._verify_compiled.get(shape)
        t0 = time.perf_counter()
        if compiled is not None:
            new_k, new_v, tokens, accepted, gaps = compiled(self.params, self.pool, batch, verify)
        else:
            new_k, new_v, tokens, accepted, gaps = verify_step(
                self.params,
                self.pool,
                batch,
                verify,
                cfg=self.cfg,
                backend=self.backend,
                plan=self.plan,
            )
        write = self._writes.get(n, self._write_kv)
        self.pool = write(self.pool, new_k, new_v, slots, sliding_slots)
        tokens, accepted, gaps = to_host(tokens), to_host(accepted), to_host(gaps)
        device_time = time.perf_counter() - t0
        for i, item in enumerate(group):
            rid, a = item.seq.request_id, int(accepted[i])
            out.accepted[rid] = [int(x) for x in tokens[i, :a]]
            out.accepted_top2_gaps[rid] = [float(x) for x in gaps[i, :a]]
            out.tokens[rid] = int(tokens[i, a])
            out.top2_gaps[rid] = float(gaps[i, a])
        return device_time

    @staticmethod
    def _padding_verify(r: int, t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``VerifyInputs``' arrays for R rows of T positions, all padding (no drafts)."""
        return np.zeros((r, t), np.int32), np.full((r, t - 1), -1, np.int32), np.zeros(r, np.int32)

    def _pack(
        self, group: list[ScheduledSeq], shape: tuple[int, int, int, int]
    ) -> tuple[
        StepBatch, np.ndarray, np.ndarray | None, np.ndarray, np.ndarray, list[SamplingParams]
    ]:
        """The call's inputs for ``group`` at ``shape``: the batch, each packed token's KV slot
        (and its slot in the sliding-window layers' blocks, for hybrid pools), position and next
        prompt token (for prompt_logprobs), and each row's sampling params."""
        n_rows = len(group)
        n, r, t, m = shape
        pad_slot = self.num_blocks * self.block_size  # out of range: the scatter drops it

        tokens = np.zeros(n, np.int32)
        positions = np.full(n, -1, np.int32)
        slots = np.full(n, pad_slot, np.int32)
        token_row = np.full(n, r, np.int32)
        token_col = np.zeros(n, np.int32)
        row_positions = np.full((r, t), -1, np.int32)
        block_tables = np.zeros((r, m), np.int32)
        hybrid = bool(self.pool.layer_slots)
        sliding_tables = np.zeros((r, m), np.int32) if hybrid else None
        sliding_slots = np.full(n, pad_slot, np.int32) if hybrid else None
        logits_index = np.zeros(r, np.int32)
        prompt_targets = np.full(n, -1, np.int32)
        params, seeds, steps = [], [], []
        offset = 0
        for i, item in enumerate(group):
            seq, start, k = item.seq, item.start, item.num_new_tokens
            table = np.asarray(seq.block_ids, np.int32)
            pos = np.arange(start, start + k, dtype=np.int32)
            span = slice(offset, offset + k)
            source = seq.token_ids + item.draft_token_ids
            tokens[span] = source[start : start + k]
            positions[span] = pos
            slots[span] = table[pos // self.block_size] * self.block_size + pos % self.block_size
            token_row[span] = i
            token_col[span] = np.arange(k)
            row_positions[i, :k] = pos
            block_tables[i, : min(len(table), m)] = table[:m]
            if hybrid:  # -1: slid out of the window (masked; stored nowhere)
                sliding = np.asarray(seq.sliding_block_ids, np.int32)
                sliding_tables[i, : min(len(sliding), m)] = np.maximum(sliding[:m], 0)
                ids = sliding[pos // self.block_size]
                sliding_slots[span] = np.where(
                    ids >= 0, ids * self.block_size + pos % self.block_size, pad_slot
                )
            logits_index[i] = offset + k - 1
            if seq.sampling_params.prompt_logprobs is not None:
                prompt = seq.prompt_token_ids
                inside = pos + 1 < len(prompt)
                prompt_targets[span][inside] = np.asarray(prompt)[pos[inside] + 1]
            offset += k
            params.append(seq.sampling_params)
            seeds.append(seq.seed)
            steps.append(len(seq.output_token_ids))
        pad = r - n_rows
        batch = StepBatch(
            tokens,
            positions,
            token_row,
            token_col,
            row_positions,
            block_tables,
            logits_index,
            SamplingTensors.from_params(
                params + [_PAD_PARAMS] * pad, seeds + [0] * pad, steps + [0] * pad
            ),
            prompt_targets,
            sliding_tables,
        )
        return batch, slots, sliding_slots, positions, prompt_targets, params

    def poison_blocks(self, block_ids: list[int], value: float = float("nan")) -> None:
        """Fill blocks with ``value`` (isolation tests: freed memory must never be read)."""
        if block_ids:
            self.pool = self._fill_blocks(self.pool, jnp.asarray(block_ids, jnp.int32), value)
