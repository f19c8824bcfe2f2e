"""The draft-model proposer: a smaller model with the target's vocabulary drafts k tokens.

The draft keeps its own paged KV pool (its own ``BlockManager`` and ``ModelExecutor``) and one
shadow sequence per target request: the target's tokens, then the draft's own proposals. Each
round, a shadow is rolled back to the longest prefix it shares with its target (the drafts the
target rejected are dropped, their slots released where the rollback crosses a block boundary),
catches up on the tokens the target accepted or sampled, and decodes k tokens greedily, all
shadows of the round batched in one call per token.

Greedy drafting makes the proposal a point mass, as n-gram lookup is: the rejection sampler
accepts draft x with probability p(x) and resamples from p without x, so the target's output
distribution is kept for any temperature, top-k and top-p.
"""

from __future__ import annotations

from typing import Any

from research.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from research.engine.block_manager import BlockManager
from research.engine.executor import ModelExecutor
from research.engine.request import RequestMetrics, SamplingParams
from research.engine.scheduler import ScheduledSeq, StepPlan
from research.engine.sequence import Sequence

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 30)


class DraftModelProposer:
    def __init__(
        self,
        config: SpeculativeConfig,
        cfg: ModelConfig,
        params: Any,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        dtype: Any,
        attention_backend: str = "xla",
    ):
        self.k = config.num_speculative_tokens
        self.model_config = cfg
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        # A catch-up chunk is at most a whole sequence (after the target was preempted and
        # recomputed, or on the first round): the prefill bucket must hold it.
        sched = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_seqs * max_model_len
        )
        self.executor = ModelExecutor(
            cfg,
            params,
            CacheConfig(block_size=block_size, num_kv_blocks=num_blocks),
            sched,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            dtype=dtype,
            attention_backend=attention_backend,
        )
        self.shadows: dict[str, Sequence] = {}
        self.num_calls = 0

    def release(self, request_id: str) -> None:
        """The target request finished or was aborted: free its shadow's blocks."""
        shadow = self.shadows.pop(request_id, None)
        if shadow is not None:
            self.block_manager.free(shadow)

    def _shadow(self, seq: Sequence) -> Sequence:
        """``seq``'s shadow, rolled back to their common prefix and given the target's tokens."""
        shadow = self.shadows.get(seq.request_id)
        if shadow is None:
            shadow = Sequence(seq.request_id, [], _GREEDY, 0, RequestMetrics(0.0))
            self.shadows[seq.request_id] = shadow
        target = seq.token_ids
        mine = shadow.token_ids
        common = 0
        for a, b in zip(mine[: shadow.num_computed_tokens], target, strict=False):
            if a != b:
                break
            common += 1
        shadow.num_computed_tokens = common
        self.block_manager.trim(shadow, common)
        shadow.prompt_token_ids, shadow.output_token_ids = list(target), []
        return shadow

    def propose_batch(self, requests: list[tuple[Sequence, int]]) -> dict[str, list[int]]:
        """Up to ``min(k, room)`` greedy draft tokens for each (sequence, room), by request id.
        A shadow the draft pool cannot hold drafts nothing this round."""
        rounds = {seq.request_id: (self._shadow(seq), min(self.k, room)) for seq, room in requests}
        active = {rid: s for rid, (s, room) in rounds.items() if room > 0}
        for _ in range(self.k):
            plan = StepPlan()
            for rid, shadow in list(active.items()):
                if len(shadow.output_token_ids) >= rounds[rid][1]:
                    del active[rid]
                    continue
                num_new = shadow.num_tokens - shadow.num_computed_tokens
                if not self.block_manager.allocate_slots(shadow, num_new):
                    del active[rid]
                    continue
                item = ScheduledSeq(shadow, shadow.num_computed_tokens, num_new)
                (plan.decodes if num_new == 1 else plan.prefills).append(item)
            if plan.is_empty:
                break
            result = self.executor.execute(plan)
            self.num_calls += 1
            for item in plan.scheduled:
                item.seq.num_computed_tokens = item.start + item.num_new_tokens
                item.seq.output_token_ids.append(result.tokens[item.seq.request_id])
        return {rid: list(shadow.output_token_ids) for rid, (shadow, _) in rounds.items()}
