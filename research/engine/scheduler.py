"""Iteration-level scheduler, on the host. No JAX here.

Every step: running sequences first (one decode token each, or the next prefill chunk), then
waiting ones, under ``max_num_seqs`` and a token budget of ``max_num_batched_tokens``. When the
block pool cannot hold a running sequence's next tokens, the newest running sequence is
preempted by recompute: its blocks are freed and it goes back to the head of the waiting queue.

Speculative decoding: a caught-up running sequence with drafts (``seq.spec_token_ids``) is
scheduled as a verify chunk of its last token and the drafts (as many as the budget leaves room
for), if the pool holds their slots; else it decodes one token as usual. ``commit_verified``
rolls back the rejected drafts' slots.

``static`` policy: a batch admits waiting sequences, prefills chunked under the token budget
over as many steps as that takes, until it holds ``max_num_seqs``, the queue is empty or the
pool is full; then it runs until its longest member finishes (the baseline continuous batching
is measured against).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from research.config import SchedulerConfig
from research.engine.block_manager import BlockManager
from research.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    """``num_new_tokens`` tokens of ``seq`` starting at position ``start`` run this step."""

    seq: Sequence
    start: int
    num_new_tokens: int
    # Speculative decoding: the drafts verified after the sequence's last token (the chunk is
    # that token and these: num_new_tokens = 1 + len(draft_token_ids)).
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True if this chunk reaches the sequence's last token, so its sample is kept."""
        return self.start + self.num_new_tokens - len(self.draft_token_ids) == self.seq.num_tokens


@dataclass
class StepPlan:
    """What one step computes. Decodes are single-token rows; prefills are chunks; verifies are
    a sequence's last token followed by its drafts (speculative decoding)."""

    decodes: list[ScheduledSeq] = field(default_factory=list)
    prefills: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    verifies: list[ScheduledSeq] = field(default_factory=list)
    # Decode steps the plan's rows run in one call (``Scheduler.extend_decodes``): each row's
    # sample is its next token, its slots for them allocated ahead.
    num_steps: int = 1

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        return self.decodes + self.prefills + self.verifies

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills and not self.verifies


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Static batching: the batch admits waiting sequences (over as many steps as the token
        # budget needs) until it holds max_num_seqs, the queue is empty or the pool is full;
        # then it is closed until every member has finished.
        self.static_batch_open = True

    # ------------------------------------------------------------------ queues

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a running or waiting sequence and return its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> StepPlan:
        cfg = self.config
        plan = StepPlan()
        budget = cfg.max_num_batched_tokens

        # 1. Running sequences, oldest first; the newest is preempted when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = seq.num_uncomputed_tokens
            drafts, seq.spec_token_ids = seq.spec_token_ids[: budget - 1], []
            # A caught-up sequence with drafts verifies them (if the pool holds their slots;
            # else it decodes one token as usual).
            if num_new == 1 and drafts and self.block_manager.allocate_slots(seq, 1 + len(drafts)):
                item = ScheduledSeq(seq, seq.num_computed_tokens, 1 + len(drafts), drafts)
                self._add_to_plan(plan, item)
                budget -= item.num_new_tokens
                i += 1
                continue
            if num_new > budget and not cfg.enable_chunked_prefill:
                i += 1
                continue
            num_new = min(num_new, budget)
            start = seq.num_computed_tokens
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is seq:
                    break
            else:
                self._add_to_plan(plan, ScheduledSeq(seq, start, num_new))
                budget -= num_new
                i += 1

        # 2. Waiting sequences, in order, while there is room (never in a step that preempted).
        # Static batching admits only while its batch is open (see ``static_batch_open``).
        static = cfg.scheduling_policy == "static"
        if static and not self.running:
            self.static_batch_open = True
        admit = not plan.preempted and (not static or self.static_batch_open)
        pool_full = False
        while admit and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            computed = self.block_manager.get_computed_blocks(seq)
            num_computed = len(computed) * self.block_manager.block_size
            num_new = seq.num_tokens - num_computed
            if num_new > budget:
                if not cfg.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.block_manager.allocate_slots(seq, num_new, computed):
                pool_full = True
                break
            self.waiting.popleft()
            self.block_manager.record_prefix_lookup(seq.num_tokens, len(computed))
            seq.num_computed_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_to_plan(plan, ScheduledSeq(seq, num_computed, num_new))
            budget -= num_new
        if (
            static
            and admit
            and (pool_full or not self.waiting or len(self.running) >= cfg.max_num_seqs)
        ):
            self.static_batch_open = False

        plan.block_copies = self.block_manager.take_pending_copies()
        return plan

    def extend_decodes(self, plan: StepPlan, max_steps: int, max_model_len: int) -> int:
        """Multi-step scheduling (vLLM's ``num_scheduler_steps``): a plan of decodes only runs
        up to ``max_steps`` steps in one call, each row's sample its next token. Every row gets
        its slots for them now (never by preempting anyone: if the pool cannot hold them all,
        the plan stays one step). No row runs past its ``max_tokens`` or ``max_model_len``:
        the steps are as many as the row closest to either has left; a row that wants
        ``logprobs`` keeps the plan at one step. Sets and returns ``plan.num_steps``."""
        if max_steps <= 1 or not plan.decodes or plan.prefills or plan.verifies:
            return plan.num_steps
        rows = plan.decodes
        n = min(max_steps, *(self._steps_left(item.seq, max_model_len) for item in rows))
        if n <= 1:
            return plan.num_steps
        bm = self.block_manager
        need = sum(
            max(0, bm.blocks_needed(item.start + n) - len(item.seq.block_ids)) for item in rows
        )
        if need > bm.num_free_blocks:
            return plan.num_steps
        for item in rows:
            if not bm.allocate_slots(item.seq, n):  # cannot fail: the room was counted
                raise RuntimeError(f"request {item.seq.request_id}: look-ahead slots vanished")
        plan.num_steps = n
        return n

    @staticmethod
    def _steps_left(seq: Sequence, max_model_len: int) -> int:
        sp = seq.sampling_params
        if sp.logprobs is not None:  # a call of several steps returns no log-probabilities
            return 1
        return min(sp.max_tokens - len(seq.output_token_ids), max_model_len - seq.num_tokens)

    @staticmethod
    def _add_to_plan(plan: StepPlan, item: ScheduledSeq) -> None:
        if item.draft_token_ids:
            plan.verifies.append(item)
        else:
            (plan.decodes if item.num_new_tokens == 1 else plan.prefills).append(item)

    def commit(self, plan: StepPlan) -> list[Sequence]:
        """Advance computed counts after the executor ran ``plan``; register full blocks.
        Verified chunks are committed by ``commit_verified`` once their tokens are appended.

        Returns the sequences whose sample this step is a new token (the caller appends it)."""
        sampled = []
        for item in plan.decodes + plan.prefills:
            seq = item.seq
            seq.num_computed_tokens = item.start + item.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
            if item.samples:
                sampled.append(seq)
        return sampled

    def commit_verified(self, item: ScheduledSeq, num_accepted: int) -> int:
        """Commit a verified chunk once its accepted drafts and sampled token are appended:
        ``research.engine.spec.rollback``. Returns how many blocks were released."""
        from research.engine.spec.speculator import rollback

        return rollback(self.block_manager, item, num_accepted)
