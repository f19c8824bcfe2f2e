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
from research.engine.proposer import NgramProposer
from research.engine.request import RequestMetrics, RequestOutput, SamplingParams
from research.engine.scheduler import ScheduledSeq, Scheduler, StepPlan
from research.engine.sequence import Sequence
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
        elif spec is not None and spec.method == "ngram":
            self.proposer = NgramProposer(spec)
        elif spec is not None:
            self.proposer = self._draft_proposer(spec, draft_model, dtype, attention_backend)
        if spec is not None and hasattr(self.executor, "verify_tokens_per_row"):
            self.executor.verify_tokens_per_row = 1 + spec.num_speculative_tokens
        # Timestamps in RequestMetrics come from ``clock`` (a simulated executor's virtual clock
        # replaces it); step and device times below are always real wall-clock seconds.
        self.clock = clock
        self.requests: dict[str, Sequence] = {}
        self.num_steps = 0
        self.step_time = 0.0  # wall seconds inside step()
        self.device_time = 0.0  # of which inside the jitted calls (dispatch to results ready)
        self.num_forward_passes = 0  # forward passes the executor ran (one per step)
        self._counter = 0
        # Called after each schedule(), before the step runs (the server refreshes its gauges).
        self.on_schedule: Callable[[], None] | None = None
        self._eos = set(cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self._eos.add(tokenizer.eos_token_id)

    # ------------------------------------------------------------------ requests

    def validate(self, prompt_token_ids: Seq[int], sp: SamplingParams) -> None:
        """Raise ValueError with the reason if the request cannot be served."""
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(sp).__name__}")
        sp.validate()
        if (sp.logprobs is not None or sp.prompt_logprobs is not None) and not getattr(
            self.executor, "computes_logprobs", False
        ):
            raise ValueError(
                f"logprobs need the model's logits; the {type(self.executor).__name__} does not "
                "compute any"
            )
        vocab = self.model_config.vocab_size
        if isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__len__"):
            raise ValueError(
                f"a prompt is a list of token ids here, got {type(prompt_token_ids).__name__}"
            )
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt is empty (0 tokens)")
        for t in prompt_token_ids:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab})")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; max_model_len is {self.max_model_len}")
        if n + sp.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens and max_tokens is {sp.max_tokens}: {n + sp.max_tokens} "
                f"exceeds max_model_len {self.max_model_len}"
            )
        budget = self.scheduler_config.max_num_batched_tokens
        if not self.scheduler_config.enable_chunked_prefill and n + sp.max_tokens > budget:
            # A preempted request recomputes prompt + outputs in one step without chunking.
            raise ValueError(
                f"prompt + max_tokens = {n + sp.max_tokens} tokens exceeds "
                f"max_num_batched_tokens {budget} and chunked prefill is off"
            )
        pool_tokens = self.block_manager.num_blocks * self.block_manager.block_size
        if n + sp.max_tokens > pool_tokens:
            raise ValueError(
                f"prompt + max_tokens = {n + sp.max_tokens} tokens exceeds the whole KV pool "
                f"({pool_tokens} tokens); raise num_kv_blocks"
            )

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
            self._propose()
        plan = self.scheduler.schedule()
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
            plan, result, culprits = isolate_failure(self.executor, plan, self._check_seq)
            failed = [self._fail(seq, reason) for seq, reason in culprits]
        self.num_steps += 1
        outputs = failed + self._commit(plan, result)
        self.device_time += result.device_time
        self.num_forward_passes += getattr(result, "forward_passes", 0)
        self.step_time += time.perf_counter() - t0
        return outputs

    def _draft_proposer(
        self,
        spec: SpeculativeConfig,
        draft_model: tuple[ModelConfig, Params] | None,
        dtype: Any,
        attention_backend: str,
    ) -> Any:
        from research.engine.draft_proposer import DraftModelProposer

        if draft_model is None:
            from research.models.load import load_model

            cfg, params, _ = load_model(spec.model, dtype, self.seed)
        else:
            cfg, params = draft_model
        if cfg.vocab_size != self.model_config.vocab_size:
            raise ValueError(
                f"speculative_config: the draft model {spec.model!r} has a vocabulary of "
                f"{cfg.vocab_size} tokens; the target's has {self.model_config.vocab_size}"
            )
        return DraftModelProposer(
            spec,
            cfg,
            params,
            num_blocks=self.block_manager.num_blocks,
            block_size=self.block_manager.block_size,
            max_num_seqs=self.scheduler_config.max_num_seqs,
            max_model_len=self.max_model_len,
            dtype=dtype,
            attention_backend=attention_backend,
        )

    def _propose(self) -> None:
        """Drafts for every caught-up running sequence (none for requests that want logprobs:
        those are returned per sampled position). A sequence never drafts past max_tokens."""
        t0 = time.perf_counter()
        requests = []
        for seq in self.scheduler.running:
            seq.spec_token_ids = []
            sp = seq.sampling_params
            if seq.num_uncomputed_tokens != 1 or sp.logprobs is not None:
                continue
            room = sp.max_tokens - len(seq.output_token_ids) - 1
            if room > 0:
                requests.append((seq, room))
        if requests:
            drafts = self.proposer.propose_batch(requests)
            for seq, room in requests:
                seq.spec_token_ids = drafts.get(seq.request_id, [])[:room]
        self.spec_stats.proposer_time += time.perf_counter() - t0

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
                    seq.logprobs.append(decode_logprobs(raw, token, n, self._token_text))
                self._append_and_check_stop(seq, token)
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
        if self.poison_freed_blocks:
            freed, self.block_manager.freed_blocks = self.block_manager.freed_blocks, []
            self.executor.poison_blocks(freed)
        return outputs

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
        stats.num_drafts += 1
        stats.num_draft_tokens += len(item.draft_token_ids)
        stats.num_accepted_tokens += len(accepted)
        for j in range(len(accepted)):
            stats.accepted_per_position[j] = stats.accepted_per_position.get(j, 0) + 1
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        try:
            for token, gap in zip(tokens, gaps, strict=True):
                m.token_times.append(now)
                seq.top2_gaps.append(gap)
                self._append_and_check_stop(seq, token)
                if seq.finish_reason is not None:
                    break
        except Exception as error:  # e.g. a detokenizer error: this request's alone
            self.scheduler.commit_verified(item, len(accepted))
            return self._fail(seq, f"{type(error).__name__}: {error}")
        stats.num_rollback_blocks += self.scheduler.commit_verified(item, len(accepted))
        if seq.finish_reason is not None:
            self._finish(seq)
        return self._output(seq)

    def _append_and_check_stop(self, seq: Sequence, token: int) -> None:
        """vLLM's stop rules: the token is always kept in ``token_ids`` (EOS included); the
        length cap is checked first, then EOS (``stop_reason`` None), then stop token ids
        (``stop_reason`` the token); a stop string found in the text overrides them all and cuts
        the text there. A token that stopped the request is left out of its text."""
        sp = seq.sampling_params
        seq.output_token_ids.append(token)
        if len(seq.output_token_ids) >= sp.max_tokens:
            seq.finish_reason = "length"
        elif not sp.ignore_eos and token in self._eos:
            seq.finish_reason, seq.stop_reason = "stop", None
        elif token in sp.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        if sp.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(self._text_ids(seq), sp.skip_special_tokens)
            hit = next((s for s in sp.stop if s in text), None)
            if hit is not None:
                seq.finish_reason, seq.stop_reason = "stop", hit
                seq.output_text = text[: text.index(hit)]

    @staticmethod
    def _text_ids(seq: Sequence) -> list[int]:
        """The output tokens that make its text: all but a final EOS or stop token."""
        if seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str):
            return seq.output_token_ids[:-1]
        return seq.output_token_ids

    def _token_text(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _prompt_logprobs(self, seq: Sequence) -> list | None:
        """vLLM's ``prompt_logprobs``: None for the first prompt token, then a dict per token;
        decoded once, when the whole prompt has been computed."""
        n = seq.sampling_params.prompt_logprobs
        if n is None or seq.prompt_logprobs is not None:
            return seq.prompt_logprobs
        prompt = seq.prompt_token_ids
        if any(p not in seq.prompt_logprobs_raw for p in range(1, len(prompt))):
            return None  # still prefilling (or stopped before it finished)
        raw = seq.prompt_logprobs_raw
        seq.prompt_logprobs = [None] + [
            decode_logprobs(raw[p], prompt[p], n, self._token_text) for p in range(1, len(prompt))
        ]
        seq.prompt_logprobs_raw = {}
        return seq.prompt_logprobs

    def _finish(self, seq: Sequence) -> None:
        if self.proposer is not None:
            self.proposer.release(seq.request_id)
        self.requests.pop(seq.request_id, None)
        self.scheduler.finish(seq)
        seq.metrics.finished_time = self.clock()

    def _output(self, seq: Sequence) -> RequestOutput:
        text = seq.output_text
        # Text is decoded once, at the end; streaming callers decode token ids themselves.
        if self.tokenizer is not None and seq.is_finished and not isinstance(seq.stop_reason, str):
            text = self.tokenizer.decode(
                self._text_ids(seq), seq.sampling_params.skip_special_tokens
            )
            seq.output_text = text
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=text,
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            metrics=seq.metrics,
            stop_reason=seq.stop_reason,
            top2_logit_gaps=list(seq.top2_gaps),
            num_preemptions=seq.num_preemptions,
            logprobs=None if seq.sampling_params.logprobs is None else list(seq.logprobs),
            prompt_logprobs=self._prompt_logprobs(seq),
        )

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
            "step_time_s": self.step_time,
            "device_time_s": self.device_time,
            "host_time_s": self.step_time - self.device_time,
        } | (self.spec_stats.as_dict(self.num_steps) if self.proposer is not None else {})


@dataclasses.dataclass
class SpecStats:
    """Speculative decoding counters (vLLM's names where it has them)."""

    num_drafts: int = 0  # verified rows that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: dict[int, int] = dataclasses.field(default_factory=dict)
    num_rollback_blocks: int = 0  # blocks released by rolling back rejected drafts
    proposer_time: float = 0.0  # wall seconds spent proposing drafts

    def as_dict(self, num_steps: int) -> dict[str, Any]:
        n, drafted = self.num_drafts, self.num_draft_tokens
        return {
            "spec_num_drafts": n,
            "spec_num_draft_tokens": drafted,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": self.num_accepted_tokens / drafted if drafted else 0.0,
            # Tokens a verified row emits on average: its accepted drafts plus one sampled.
            "spec_mean_acceptance_length": 1 + self.num_accepted_tokens / n if n else 0.0,
            "spec_draft_tokens_per_step": drafted / num_steps if num_steps else 0.0,
            "spec_accepted_per_position": [
                self.accepted_per_position.get(j, 0)
                for j in range(max(self.accepted_per_position, default=-1) + 1)
            ],
            "spec_rollback_blocks": self.num_rollback_blocks,
            "spec_proposer_time_s": self.proposer_time,
        }
