"""The engine: one step is schedule -> execute -> commit.

``add_request`` validates and queues; ``step`` runs one iteration of continuous batching and
returns a RequestOutput for every request that produced a token or finished; ``abort`` drops a
request and returns its blocks. Timestamps (arrival, first scheduled, first token, every token,
finish) ride on each output for the benchmark metrics.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import zlib
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import jax.numpy as jnp
import numpy as np

from research.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from research.engine.block_manager import BlockManager
from research.engine.executor import ModelExecutor, StepResult, decode_logprobs, num_blocks_for
from research.engine.isolation import isolate_failure
from research.engine.output import OutputProcessor
from research.engine.request import RequestMetrics, RequestOutput, SamplingParams
from research.engine.scheduler import ScheduledSeq, Scheduler, StepPlan
from research.engine.sequence import Sequence
from research.engine.spec import SpecStats, make_proposer, propose
from research.engine.validation import validate_request
from research.models.transformer import Params
from research.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def kv_cache_summary(bm: BlockManager, max_model_len: int) -> str:
    """vLLM's start-up line: the pool in blocks and tokens, and how many max_model_len-token
    requests it holds at once."""
    n, size = bm.num_blocks, bm.block_size
    return (
        f"# KV cache blocks: {n} ({n * size} tokens of {size}); maximum concurrency for "
        f"{max_model_len} tokens per request: {bm.max_concurrency(max_model_len):.2f}x"
    )


class Engine:
    def __init__(
        self,
        cfg: ModelConfig,
        params: Params,
        tokenizer: Tokenizer | None = None,
        *,
        cache_config: CacheConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        max_model_len: int | None = None,
        dtype: Any = None,
        attention_backend: str = "auto",
        kv_cache_dtype: str = "auto",
        gemm_backend: str = "auto",
        block_activations: str | None = None,
        seed: int = 0,
        poison_freed_blocks: bool = False,
        clock: Callable[[], float] = time.perf_counter,
        executor: Any = None,
        plan: Any = None,
        speculative_config: SpeculativeConfig | dict[str, Any] | None = None,
        draft_model: tuple[ModelConfig, Params] | None = None,
        proposer: Any = None,
    ):
        """``executor``: an object with ``ModelExecutor``'s ``execute`` / ``poison_blocks`` /
        ``num_compilations`` (e.g. ``research.perf.simulated.SimulatedExecutor``) to use instead
        of running ``params`` here; the pool size then comes from ``cache_config.num_kv_blocks``.
        ``plan``: a ``research.parallel.ShardingPlan`` (tensor / expert parallel).
        ``speculative_config``: vLLM's dict (``{"method": "ngram", "num_speculative_tokens":
        k, ...}``) or a ``SpeculativeConfig``: each caught-up sequence proposes up to k drafts
        that the step verifies (requests that ask for logprobs decode without drafts).
        ``draft_model``: the (config, params) of ``speculative_config``'s draft model, if it is
        loaded already (else it is loaded here by name). ``proposer``: an object with
        ``propose_batch`` and ``release`` to use instead of the configured method's (the
        simulated executor's ``SyntheticProposer``)."""
        self.speculative_config = SpeculativeConfig.from_dict(speculative_config)
        self.spec_stats = SpecStats()
        self.model_config = cfg
        self.tokenizer = tokenizer
        self.cache_config = cache_config or CacheConfig()
        self.scheduler_config = scheduler_config or SchedulerConfig()
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        self.seed = seed
        dtype = dtype or jnp.float32
        num_blocks = num_blocks_for(
            cfg, self.cache_config, self.scheduler_config, self.max_model_len, dtype, kv_cache_dtype
        )
        self.block_manager = BlockManager(
            num_blocks,
            self.cache_config.block_size,
            self.cache_config.enable_prefix_caching,
            # sliding-window layers keep only their window's blocks (see BlockManager)
            sliding_window=cfg.sliding_window if cfg.sliding_layers else None,
        )
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager)
        # Isolation testing: pages start as NaN and every freed block is refilled with NaN.
        self.poison_freed_blocks = poison_freed_blocks
        if poison_freed_blocks:
            self.block_manager.freed_blocks = []
        self.executor = executor or ModelExecutor(
            cfg,
            params,
            self.cache_config,
            self.scheduler_config,
            num_blocks=num_blocks,
            max_model_len=self.max_model_len,
            dtype=dtype,
            attention_backend=attention_backend,
            kv_cache_dtype=kv_cache_dtype,
            kv_fill_value=float("nan") if poison_freed_blocks else 0.0,
            plan=plan,
            gemm_backend=gemm_backend,
            block_activations=block_activations,
        )
        self.proposer: Any = None
        spec = self.speculative_config
        if spec is not None and cfg.sliding_layers:
            raise ValueError(
                f"speculative_config: {cfg.name} has sliding-window layers, whose "
                "blocks a rollback of rejected drafts does not restore; serve it without "
                "speculation"
            )
        if spec is not None and proposer is not None:
            self.proposer = proposer
        elif spec is not None:
            self.proposer = make_proposer(
                spec,
                cfg,
                draft_model=draft_model,
                dtype=dtype,
                attention_backend=attention_backend,
                seed=self.seed,
                num_blocks=self.block_manager.num_blocks,
                block_size=self.block_manager.block_size,
                max_num_seqs=self.scheduler_config.max_num_seqs,
                max_model_len=self.max_model_len,
            )
        if spec is not None and hasattr(self.executor, "verify_tokens_per_row"):
            self.executor.verify_tokens_per_row = 1 + spec.num_speculative_tokens
        # Multi-step scheduling: up to this many decode steps per call (1: one per step).
        self.num_scheduler_steps = self.scheduler_config.num_scheduler_steps
        if self.num_scheduler_steps > 1:
            why = getattr(
                self.executor, "supports_multi_step", "its executor runs one step per call"
            )
            if spec is not None:
                why = "speculative decoding verifies drafts one step at a time"
            if why is not None:
                raise ValueError(f"num_scheduler_steps={self.num_scheduler_steps}: {why}; use 1")
            self.executor.num_scheduler_steps = self.num_scheduler_steps
        # Timestamps in RequestMetrics come from ``clock`` (a simulated executor's virtual clock
        # replaces it); step and device times below are always real wall-clock seconds.
        self.clock = clock
        self.requests: dict[str, Sequence] = {}
        self.num_steps = 0
        self.step_time = 0.0  # wall seconds inside step()
        self.device_time = 0.0  # of which inside the jitted calls (dispatch to results ready)
        self.kernel_time = 0.0  # of which inside the native CPU kernels (the rest: XLA's work)
        self.num_forward_passes = 0  # forward passes the executor ran (one per step)
        self._counter = 0
        # Called after each schedule(), before the step runs (the server refreshes its gauges).
        self.on_schedule: Callable[[], None] | None = None
        eos = set(cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.outputs = OutputProcessor(tokenizer, eos)

    @classmethod
    def from_config(
        cls,
        config: Any,
        cfg: ModelConfig,
        params: Params,
        tokenizer: Tokenizer | None = None,
        **kwargs: Any,
    ) -> Engine:
        """An engine configured by one ``research.engine.args.EngineConfig`` (``for_model``
        already applied); ``kwargs``: ``plan``, ``executor``, ``clock``, ``proposer``."""
        engine = cls(
            cfg,
            params,
            tokenizer,
            cache_config=config.cache,
            scheduler_config=config.scheduler,
            max_model_len=config.max_model_len,
            dtype=config.jnp_dtype,
            attention_backend=config.attention_backend,
            kv_cache_dtype=config.kv_cache_dtype,
            gemm_backend=config.gemm_backend,
            block_activations=config.block_activations,
            seed=config.seed,
            poison_freed_blocks=config.poison_freed_blocks,
            speculative_config=config.speculative,
            **kwargs,
        )
        engine.config = config
        return engine

    # ------------------------------------------------------------------ requests

    def validate(self, prompt_token_ids: Seq[int], sp: SamplingParams) -> None:
        """Raise ValueError with the reason if the request cannot be served
        (``research.engine.validation``)."""
        validate_request(self, prompt_token_ids, sp)

    def add_request(
        self,
        prompt_token_ids: Seq[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Bad input raises ValueError and
        leaves the engine and every running request untouched."""
        sp = SamplingParams() if sampling_params is None else sampling_params
        if request_id is None:
            request_id = f"req-{self._counter}"
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = [int(t) if isinstance(t, np.integer) else t for t in prompt_token_ids]
        self.validate(ids, sp)
        self._counter += 1
        seed = (
            sp.seed
            if sp.seed is not None
            else self.seed * 1_000_003 + zlib.crc32(request_id.encode())
        )
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(ids),
            sampling_params=sp,
            seed=seed & 0xFFFFFFFF,
            metrics=RequestMetrics(
                arrival_time=self.clock() if arrival_time is None else arrival_time
            ),
            prompt=prompt,
        )
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def generate(
        self,
        prompt_token_ids: Seq[Seq[int]],
        sampling_params: Seq[SamplingParams],
        prompts: Seq[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Validate every request, queue them all, step until all finish; outputs in order.

        A refused batch adds nothing. If the call fails midway (a request failed in a step, or
        the caller interrupted it), every request it added is aborted before the error
        propagates, so the engine is left as it was found."""
        prompts = prompts or [None] * len(prompt_token_ids)
        if not len(prompts) == len(prompt_token_ids) == len(sampling_params):
            raise ValueError(
                f"got {len(prompt_token_ids)} prompts, {len(sampling_params)} sampling params "
                f"and {len(prompts)} prompt texts"
            )
        for i, (ids, sp) in enumerate(zip(prompt_token_ids, sampling_params, strict=True)):
            try:
                self.validate(ids, sp)
            except ValueError as error:
                raise ValueError(f"prompt {i}: {error}") if len(prompts) > 1 else error from None
        order: list[str] = []
        try:
            for ids, sp, text in zip(prompt_token_ids, sampling_params, prompts, strict=True):
                order.append(self.add_request(ids, sp, prompt=text))
            final: dict[str, RequestOutput] = {}
            while len(final) < len(order):
                for out in self.step():
                    if out.finish_reason == "error" and out.request_id in order:
                        i = order.index(out.request_id)
                        raise RuntimeError(f"prompt {i} failed in the engine: {out.error}")
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:
            for request_id in order:
                self.abort(request_id)
            raise
        return [final[rid] for rid in order]

    def abort(self, request_id: str) -> bool:
        """Stop a request and return its blocks to the pool. False if it is unknown or done."""
        seq = self.requests.get(request_id)
        if seq is None or seq.is_finished:
            return False
        seq.finish_reason = "abort"
        self._finish(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_compilations(self) -> int:
        return self.executor.num_compilations

    # ------------------------------------------------------------------ one step

    def step(self) -> list[RequestOutput]:
        """Schedule, execute and commit one iteration; outputs of requests that advanced.

        If the executor raises, the requests that make it fail are found (``isolate_failure``) and
        finished with ``finish_reason="error"``; the others advance as if nothing happened."""
        t0 = time.perf_counter()
        if self.proposer is not None:
            propose(self.proposer, self.scheduler.running, self.spec_stats)
        plan = self.scheduler.schedule()
        if self.num_scheduler_steps > 1:
            self.scheduler.extend_decodes(plan, self.num_scheduler_steps, self.max_model_len)
        if self.on_schedule is not None:
            self.on_schedule()
        if plan.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError(
                    "the scheduler could not schedule any waiting request; this is a bug "
                    f"(stats: {self.stats()})"
                )
            return []
        now = self.clock()
        for item in plan.scheduled:
            if item.seq.metrics.first_scheduled_time is None:
                item.seq.metrics.first_scheduled_time = now
        failed: list[RequestOutput] = []
        try:
            result = self.executor.execute(plan)
        except Exception as error:
            logger.warning(
                "a step of %d requests failed (%r); isolating", len(plan.scheduled), error
            )
            plan.num_steps = 1  # the isolating steps run one step each (slots stay allocated)
            plan, result, culprits = isolate_failure(self.executor, plan, self._check_seq)
            failed = [self._fail(seq, reason) for seq, reason in culprits]
        self.num_steps += 1
        outputs = failed + self._commit(plan, result)
        self.device_time += result.device_time
        self.kernel_time += getattr(result, "kernel_time", 0.0)
        self.num_forward_passes += getattr(result, "forward_passes", 0)
        self.step_time += time.perf_counter() - t0
        return outputs

    def _check_seq(self, seq: Sequence) -> None:
        """Re-validate a scheduled request's own state (ValueError if it cannot be served)."""
        self.validate(seq.prompt_token_ids, seq.sampling_params)
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in seq.output_token_ids):
            raise ValueError(f"a generated token id is outside the vocabulary [0, {vocab})")

    def _fail(self, seq: Sequence, reason: str) -> RequestOutput:
        """Finish ``seq`` with ``finish_reason="error"``; its blocks return to the pool."""
        logger.error("request %s failed and was stopped: %s", seq.request_id, reason)
        seq.finish_reason, seq.stop_reason = "error", None
        self._finish(seq)
        return dataclasses.replace(self._output(seq), error=reason)

    def _commit(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        now = self.clock()
        if plan.num_steps > 1:
            outputs = [self._commit_steps(item, result, now) for item in plan.decodes]
            self._poison_freed()
            return outputs
        outputs = []
        for item in plan.scheduled:
            item.seq.prompt_logprobs_raw.update(result.prompt_logprobs.get(item.seq.request_id, {}))
        for seq in self.scheduler.commit(plan):
            token = result.tokens[seq.request_id]
            m = seq.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.token_times.append(now)
            seq.top2_gaps.append(result.top2_gaps[seq.request_id])
            try:
                n = seq.sampling_params.logprobs
                if n is not None:
                    raw = result.logprobs[seq.request_id]
                    seq.logprobs.append(decode_logprobs(raw, token, n, self.outputs.token_text))
                self.outputs.append_and_check_stop(seq, token)
            except Exception as error:  # e.g. a detokenizer error: this request's alone
                outputs.append(self._fail(seq, f"{type(error).__name__}: {error}"))
                continue
            if seq.finish_reason is not None:
                self._finish(seq)
            outputs.append(self._output(seq))
        for item in plan.verifies:
            output = self._commit_verified(item, result, now)
            if output is not None:
                outputs.append(output)
        self._poison_freed()
        return outputs

    def _poison_freed(self) -> None:
        if self.poison_freed_blocks:
            freed, self.block_manager.freed_blocks = self.block_manager.freed_blocks, []
            self.executor.poison_blocks(freed)

    def _commit_steps(self, item: ScheduledSeq, result: StepResult, now: float) -> RequestOutput:
        """Append a multi-step row's samples in order, each step's input token then computed,
        up to a stop: what the row sampled past it is dropped (its slots go back with its
        blocks)."""
        seq = item.seq
        rid = seq.request_id
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        try:
            appended = self._append(seq, result.steps[rid], result.steps_top2_gaps[rid], now)
        except Exception as error:  # e.g. a detokenizer error: this request's alone
            return self._fail(seq, f"{type(error).__name__}: {error}")
        seq.num_computed_tokens = item.start + appended  # each appended token's input
        self.block_manager.cache_full_blocks(seq)
        if seq.finish_reason is not None:
            self._finish(seq)
        return self._output(seq)

    def _commit_verified(
        self, item: ScheduledSeq, result: StepResult, now: float
    ) -> RequestOutput | None:
        """Append a verified row's accepted drafts and its sampled token (up to a stop), then
        roll back the rejected drafts' slots."""
        seq = item.seq
        rid = seq.request_id
        accepted = result.accepted.get(rid, [])
        tokens = [*accepted, result.tokens[rid]]
        gaps = [*result.accepted_top2_gaps.get(rid, []), result.top2_gaps[rid]]
        stats = self.spec_stats
        stats.record(item, accepted)
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        try:
            self._append(seq, tokens, gaps, now)
        except Exception as error:  # e.g. a detokenizer error: this request's alone
            self.scheduler.commit_verified(item, len(accepted))
            return self._fail(seq, f"{type(error).__name__}: {error}")
        stats.num_rollback_blocks += self.scheduler.commit_verified(item, len(accepted))
        if seq.finish_reason is not None:
            self._finish(seq)
        return self._output(seq)

    def _append(self, seq: Sequence, tokens: list[int], gaps: list[float], now: float) -> int:
        """Append ``tokens`` (and their top-2 gaps, each stamped ``now``) up to a stop; returns
        how many were appended."""
        for k, (token, gap) in enumerate(zip(tokens, gaps, strict=True)):
            seq.metrics.token_times.append(now)
            seq.top2_gaps.append(gap)
            self.outputs.append_and_check_stop(seq, token)
            if seq.finish_reason is not None:
                return k + 1
        return len(tokens)

    def _finish(self, seq: Sequence) -> None:
        if self.proposer is not None:
            self.proposer.release(seq.request_id)
        self.requests.pop(seq.request_id, None)
        self.scheduler.finish(seq)
        seq.metrics.finished_time = self.clock()

    def _output(self, seq: Sequence) -> RequestOutput:
        return self.outputs.output(seq)

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        bm = self.block_manager
        return {
            "num_steps": self.num_steps,
            "num_compilations": self.num_compilations,
            "num_forward_passes": self.num_forward_passes,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "prefix_cache_hit_rate": bm.prefix_cache_hit_rate,
            "prefix_cache_queries": bm.prefix_queries,  # prompt tokens looked up
            "prefix_cache_hits": bm.prefix_hits,  # of them, tokens found cached
            "kv_evictions": bm.num_evictions,
            "step_time_s": self.step_time,
            "device_time_s": self.device_time,
            "host_time_s": self.step_time - self.device_time,
            # The native CPU kernels' share of device_time (process-wide counters: one engine
            # stepping at a time); device_time_s - kernel_time_s is XLA's work around them.
            "kernel_time_s": self.kernel_time,
        } | (self.spec_stats.as_dict(self.num_steps) if self.proposer is not None else {})
