"""The real executor: runs a ``StepPlan`` as one forward pass over a ragged token batch.

Every token scheduled in a step (decodes, prefill chunks, speculative verifications, in any
mix) goes into one call of the jitted ``research.engine.step.model_step``: the persistent
``InputBatch`` gathers the step's flat inputs, the ``CompileManager`` picks the step's compiled
shape (N tokens, R rows, M blocks per row), the step samples (and verifies drafts) on device,
and a second jitted call scatters the new K/V into the donated pool (with the native attention
kernel the step stores them itself, into the pool it is given donated: one call).
``StepResult`` carries ``forward_passes`` (1 per step with tokens) so every results row can
show it.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from research import native
from research.config import CacheConfig, ModelConfig, SchedulerConfig
from research.engine.attention import choose_attention_backend, writes_in_step
from research.engine.call_params import compact
from research.engine.compile_manager import (  # noqa: F401 (re-exported)
    CompileManager,
    Shape,
    _spec,
    bucket,
    context_bucket,
    lower_step,
)
from research.engine.input_batch import InputBatch
from research.engine.kv_cache import (
    copy_blocks,
    fill_blocks,
    init_kv_pool,
    kv_pool_bytes_per_block,
    write_kv,
)
from research.engine.request import Logprob
from research.engine.scheduler import ScheduledSeq, StepPlan
from research.engine.step import (  # noqa: F401 (re-exported)
    STEP_TRACES,
    copy_blocks_jit,
    fill_blocks_jit,
    model_multi_step,
    model_step,
    model_step_writing,
    to_host,
    write_kv_jit,
)
from research.models.transformer import Params
from research.native import gemm as native_gemm

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
    forward_passes: int = 0  # forward passes the step ran (1 whenever it had tokens)
    # Of device_time, seconds inside the native CPU kernels (``research.native.kernel_seconds``;
    # 0 on the XLA and Pallas paths): the rest of device_time is XLA's own work around them.
    kernel_time: float = 0.0
    # A plan of several decode steps (``StepPlan.num_steps``): each row's samples in order (its
    # ``tokens`` entry is the last) and their top-2 logit gaps.
    steps: dict[str, list[int]] = field(default_factory=dict)
    steps_top2_gaps: dict[str, list[float]] = field(default_factory=dict)


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
        block_activations: str | None = None,
    ):
        """``plan``: a ``research.parallel.ShardingPlan`` to split the parameters and the KV pool
        over its devices (tensor / expert parallel); None runs on one device. ``gemm_backend``:
        "native" packs the bfloat16 projections for the AMX kernel (``research.native.gemm``),
        "xla" leaves them to XLA, "auto" picks native where it serves. ``block_activations``:
        how weights read as stored (GGUF, AWQ blocks) take their activations, "float" or "int8"
        (``research.native.gemm.BlockWeight``); None keeps each weight's own."""
        sharded = plan is not None and plan.size > 1
        self.gemm_backend = native_gemm.resolve(gemm_backend, dtype, sharded)
        choice = choose_attention_backend(
            attention_backend, dtype, kv_cache_dtype, sharded=sharded, cfg=cfg
        )
        if self.gemm_backend == "native":
            # AWQ weights go to the block kernel unless the Pallas kernels were asked for
            # (their quantized matmul reads the QTensor as it is).
            awq = not choice.name.startswith("pallas")
            params = native_gemm.pack_params(params, cfg.tie_word_embeddings, awq_blocks=awq)
        if block_activations is not None:
            params = native_gemm.with_activations(params, block_activations)
        if self.gemm_backend == "native" and not sharded:
            params = native_gemm.stack_layers(params)
        self.attention_choice = choice
        self.backend = choice.name
        self.cfg = cfg
        self.params = params
        self.block_size = cache.block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = sched.max_num_seqs
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // cache.block_size)
        self.pool = init_kv_pool(
            cfg, num_blocks, cache.block_size, dtype, kv_fill_value, kv_cache_dtype
        )
        self.plan = plan
        # The native attention stores the new K/V itself: one call per step, not two.
        self.writes_in_step = writes_in_step(self.backend, self.pool, plan)
        self._step = model_step_writing if self.writes_in_step else model_step
        self._write_kv, self._copy_blocks, self._fill_blocks = (
            write_kv_jit,
            copy_blocks_jit,
            fill_blocks_jit,
        )
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
        self.compiler = CompileManager(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_blocks_per_seq=self.max_blocks_per_seq,
            block_size=self.block_size,
            reads_whole_table=self.backend == "xla",
            lower=self._lower,
        )
        self.step_calls = 0  # calls of the jitted step (one forward pass each)
        # Decode steps one call may run (the engine's ``num_scheduler_steps``).
        self.num_scheduler_steps = 1
        self._new_batch(1)

    @property
    def params(self) -> Params:
        """The model's parameters (packed for the native kernels where they serve)."""
        return self._params

    @params.setter
    def params(self, params: Params) -> None:
        self._params = params
        # What each step's call passes: each distinct buffer once (``call_params``).
        self._call_params = compact(params)

    def _new_batch(self, num_scored: int) -> None:
        self.compiler.num_scored = num_scored
        self.batch = InputBatch(
            max_slots=self.max_num_seqs,
            max_model_len=self.max_model_len,
            max_blocks_per_seq=self.max_blocks_per_seq,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            num_scored=num_scored,
            hybrid=bool(self.pool.layer_slots),
        )

    @property
    def verify_tokens_per_row(self) -> int:
        """Speculative decoding: 1 + num_speculative_tokens positions scored per row (set by the
        engine); 0 = no speculation."""
        s = self.compiler.num_scored
        return s if s > 1 else 0

    @verify_tokens_per_row.setter
    def verify_tokens_per_row(self, value: int) -> None:
        if self.compiler.shapes:
            raise RuntimeError("set the scored positions per row before the first step")
        self._new_batch(max(1, value))

    @property
    def num_compilations(self) -> int:
        """Distinct step shapes this executor compiled (bounded by the buckets)."""
        return len(self.compiler.shapes)

    @property
    def step_shapes(self) -> set[Shape]:
        return self.compiler.shapes

    @property
    def covered_calls(self) -> int:
        return self.compiler.covered_calls

    @property
    def step_compiles(self) -> int:
        """Step shapes compiled inside a step (the step waited for XLA), as opposed to ahead
        of time or in the background while a cover served."""
        return self.compiler.step_compiles

    def wait_for_background_compiles(self, timeout: float = 120.0) -> bool:
        return self.compiler.wait_for_background(timeout)

    @property
    def compile_in_background(self) -> bool:
        return self.compiler.compile_in_background

    @compile_in_background.setter
    def compile_in_background(self, value: bool) -> None:
        self.compiler.compile_in_background = value

    def _static(self) -> dict[str, Any]:
        return dict(cfg=self.cfg, backend=self.backend, plan=self.plan)

    def _lower(self, shape: Shape) -> tuple[Any, Any]:
        inputs = self.batch.padding(shape).inputs
        write = None if self.writes_in_step else self._write_kv
        return lower_step(self._step, write, (self._call_params, self.pool, inputs), self._static())

    # ------------------------------------------------------------------ host

    @staticmethod
    def rows(plan: StepPlan) -> list[ScheduledSeq]:
        """The step's rows, in the order the step packs them."""
        return plan.decodes + plan.prefills + plan.verifies

    def call_shape(self, plan: StepPlan) -> Shape:
        """The bucketed (N, R, M) of the one call that runs ``plan``."""
        return self.compiler.shape_for(self.rows(plan))

    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        if plan.block_copies:
            src, dst = zip(*plan.block_copies, strict=True)
            self.pool = self._copy_blocks(
                self.pool, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32)
            )
        result = StepResult({}, {}, 0.0, 0.0)
        rows = self.rows(plan)
        calls = self.step_calls
        if rows:
            kernels = native.kernel_seconds()
            if plan.num_steps > 1:
                result.device_time = self._run_steps(rows, result, plan)
            else:
                result.device_time = self._run(rows, result)
            result.kernel_time = native.kernel_seconds() - kernels
        result.forward_passes = self.step_calls - calls  # each call is one forward
        result.duration = time.perf_counter() - t0
        return result

    def _call(
        self, shape: Shape, host: Any, exact: bool = False
    ) -> tuple[Any, dict[str, Any], float]:
        """One step: the forward at ``shape`` (or, when serving, the compiled cover that holds
        it), then the K/V write into the donated pool. ``host(shape)`` -> ``HostStep``. Returns
        the host step, the outputs and when they were dispatched."""
        shape, compiled, write = self.compiler.resolve(shape, exact=exact)
        step = host(shape)
        self.step_calls += 1
        t0 = time.perf_counter()
        if compiled is not None:
            out = compiled(self._call_params, self.pool, step.inputs)
        else:
            out = self._step(self._call_params, self.pool, step.inputs, **self._static())
        if self.writes_in_step:
            self.pool = out["pool"]
            return step, out, t0
        write = write or self._write_kv
        self.pool = write(
            self.pool, out["new_k"], out["new_v"], step.slot_mapping, step.sliding_slot_mapping
        )
        return step, out, t0

    @property
    def supports_multi_step(self) -> str | None:
        """None if a call can run several decode steps (``_run_steps``), else why not."""
        if self.plan is not None:
            return "a sharded model runs one decode step per call"
        if self.pool.layer_slots:
            return "a model with sliding-window layers runs one decode step per call"
        return None

    def _run_steps(self, rows: list[ScheduledSeq], out: StepResult, plan: StepPlan) -> float:
        """``plan.num_steps`` decode steps of ``rows`` in one call (``model_multi_step``,
        compiled per step shape for at most ``num_scheduler_steps`` steps); returns its
        seconds. When serving, a loop still compiling in the background leaves the call one
        step (``plan.num_steps`` = 1: what ran)."""
        num_steps = plan.num_steps
        if num_steps > self.num_scheduler_steps or any(item.num_new_tokens != 1 for item in rows):
            raise ValueError(f"{num_steps} steps of {len(rows)} rows: decodes only, at most "
                             f"num_scheduler_steps = {self.num_scheduler_steps}")  # fmt: skip
        shape = self.compiler.shape_for(rows)
        host = self.batch.prepare(rows, shape)
        args = (self._call_params, self.pool, host.inputs, host.slot_mapping, np.int32(num_steps))
        compiled = self.compiler.multi.get(shape)  # the lowering's specs only when missing
        if compiled is None:
            compiled = self.compiler.resolve_multi(shape, self._multi_lowering(args))
        if compiled is None:
            plan.num_steps = 1
            return self._run(rows, out)
        self.step_calls += num_steps
        t0 = time.perf_counter()
        res = compiled(*args)
        self.pool = res["pool"]
        tokens, gaps = to_host(res["tokens"]), to_host(res["gaps"])
        device_time = time.perf_counter() - t0
        for i, item in enumerate(rows):
            rid = item.seq.request_id
            out.steps[rid] = [int(t) for t in tokens[:num_steps, i]]
            out.steps_top2_gaps[rid] = [float(g) for g in gaps[:num_steps, i]]
            out.tokens[rid], out.top2_gaps[rid] = out.steps[rid][-1], out.steps_top2_gaps[rid][-1]
        return device_time

    def _multi_lowering(self, args: tuple[Any, ...]) -> Any:
        """A function compiling the multi-step loop for ``args``' shapes (taken now, on this
        thread: the input batch is not thread-safe)."""
        specs = jax.tree_util.tree_map(_spec, args)
        static = dict(
            self._static(), writes=self.writes_in_step, max_steps=self.num_scheduler_steps,
            block_size=self.block_size, pad_slot=self.batch.pad_slot,
        )  # fmt: skip
        return lambda: model_multi_step.lower(*specs, **static).compile()

    def _run(self, rows: list[ScheduledSeq], out: StepResult) -> float:
        """Pack, run and unpack the step; returns the seconds spent in the jitted calls."""
        host, res, t0 = self._call(
            self.compiler.shape_for(rows), functools.partial(self.batch.prepare, rows)
        )
        tokens, accepted, gaps = (to_host(res[k]) for k in ("tokens", "num_accepted", "gaps"))
        want = [i for i, item in enumerate(rows) if item.seq.sampling_params.logprobs is not None]
        if want:
            sample_lps = _raw(res, "sample")
        prompt_targets = host.prompt_targets
        if (prompt_targets >= 0).any():
            prompt_lps = _raw(res, "prompt")
        device_time = time.perf_counter() - t0
        qsl, positions = host.query_start_loc, host.positions
        for i, item in enumerate(rows):
            rid = item.seq.request_id
            if item.draft_token_ids:
                a = int(accepted[i])
                out.accepted[rid] = [int(x) for x in tokens[i, :a]]
                out.accepted_top2_gaps[rid] = [float(x) for x in gaps[i, :a]]
                out.tokens[rid] = int(tokens[i, a])
                out.top2_gaps[rid] = float(gaps[i, a])
                continue
            out.tokens[rid] = int(tokens[i, 0])
            out.top2_gaps[rid] = float(gaps[i, 0])
            if i in want:
                out.logprobs[rid] = tuple(x[i] for x in sample_lps)
            for j in range(int(qsl[i]), int(qsl[i + 1])):
                if prompt_targets[j] >= 0:
                    entry = tuple(x[j] for x in prompt_lps)
                    out.prompt_logprobs.setdefault(rid, {})[int(positions[j]) + 1] = entry
        return device_time

    # ------------------------------------------------------------------ compiling ahead

    def cover_shapes(self) -> list[Shape]:
        return self.compiler.cover_shapes()

    def precompile_covers(self, progress: bool = False) -> int:
        """Compile (not run) ``cover_shapes`` ahead of time and serve from then on without
        compiling inside a step: a step of a new shape runs padded to its cover while its own
        shape compiles in the background. The covers are compiled, not run: the largest
        (max_num_seqs rows over the longest context) would take gigabytes to execute once.
        Speculative verification runs in the same step, so it is covered too."""
        n = self.compiler.compile(self.compiler.cover_shapes(), progress)
        self.compiler.compile_in_background = True
        return n

    def precompile(self, shapes: Any, progress: bool = False) -> int:
        """Compile every (N, R, M) of ``shapes`` not compiled yet by running a step that is all
        padding (nothing is written to the pool, nothing is sampled for anyone); returns how
        many were compiled. ``research.engine.shapes.predict_step_shapes`` says which shapes a
        workload will use. With ``num_scheduler_steps`` > 1 the multi-step loop of each shape a
        step of decodes only takes (N = R) is compiled too (not run)."""
        shapes = set(shapes)
        todo = sorted(shapes - self.compiler.shapes)
        for shape in sorted(shapes) if self.num_scheduler_steps > 1 else []:
            n, r, _ = shape
            if n == r and shape not in self.compiler.multi:  # a step of decodes only: its loop
                host = self.batch.padding(shape)
                args = (self._call_params, self.pool, host.inputs, host.slot_mapping, np.int32(1))
                self.compiler.resolve_multi(shape, self._multi_lowering(args), ahead=True)
        for i, shape in enumerate(todo):
            t0 = time.perf_counter()
            _, res, _ = self._call(shape, self.batch.padding, exact=True)
            to_host(res["tokens"])
            if progress:
                print(
                    f"  compiled {i + 1}/{len(todo)}: N={shape[0]} R={shape[1]} M={shape[2]} "
                    f"({time.perf_counter() - t0:.1f} s)",
                    flush=True,
                )
        return len(todo)

    def poison_blocks(self, block_ids: list[int], value: float = float("nan")) -> None:
        """Fill blocks with ``value`` (isolation tests: freed memory must never be read)."""
        if block_ids:
            self.pool = self._fill_blocks(self.pool, jnp.asarray(block_ids, jnp.int32), value)


def _raw(res: dict[str, jax.Array], kind: str) -> tuple[np.ndarray, ...]:
    return tuple(
        to_host(res[f"{kind}_{k}"]) for k in ("logprob", "rank", "top_ids", "top_logprobs")
    )
