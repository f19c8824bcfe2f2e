"""The host side of a step: a persistent input batch (vLLM v1's ``InputBatch``).

Each request the executor serves holds a slot: numpy buffers of its token ids, block table(s)
and sampling settings, updated in place as it arrives, advances and leaves (new tokens
appended, new blocks written from the first one that changed), not rebuilt every step. A step's
flat inputs (``research.engine.step.StepInputs``) are then gathered from the scheduled
requests' slots with vectorized numpy indexing, padded to the step's compiled shape (N tokens,
R rows, M blocks per row): padded rows have no tokens and length 0, padded tokens sit in row R
at position -1 and their slot is past the pool (the K/V scatter drops them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from research.engine.attention import AttentionMetadata
from research.engine.sampler import SamplingTensors
from research.engine.scheduler import ScheduledSeq
from research.engine.sequence import Sequence, SequenceStatus
from research.engine.step import StepInputs


@dataclass
class HostStep:
    """A step's inputs (numpy) and what the executor needs to unpack its outputs."""

    inputs: StepInputs
    slot_mapping: np.ndarray  # [N] int32: each token's flat KV slot (past the pool = none)
    sliding_slot_mapping: np.ndarray | None  # [N]: the same in the sliding-window layers' blocks
    positions: np.ndarray  # [N] int32
    query_start_loc: np.ndarray  # [R+1] int32
    prompt_targets: np.ndarray  # [N] int32


class InputBatch:
    """Per-request slots (up to ``max_slots`` requests at once) and the step gather."""

    def __init__(
        self,
        *,
        max_slots: int,
        max_model_len: int,
        max_blocks_per_seq: int,
        block_size: int,
        num_blocks: int,
        num_scored: int = 1,
        hybrid: bool = False,
    ):
        self.block_size = block_size
        self.pad_slot = num_blocks * block_size  # past the pool: the scatter drops it
        self.max_blocks = max_blocks_per_seq
        self.num_scored = num_scored  # S: 1 + drafts per verification row
        self.hybrid = hybrid
        width = max_model_len + num_scored  # room for the drafts past the last token
        self.token_ids = np.zeros((max_slots, width), np.int32)
        self.num_tokens = np.zeros(max_slots, np.int64)  # synced tokens per slot
        self.prompt_len = np.zeros(max_slots, np.int64)
        self.block_table = np.zeros((max_slots, max_blocks_per_seq), np.int32)
        self.sliding_table = np.zeros((max_slots, max_blocks_per_seq), np.int32)
        self.temperature = np.zeros(max_slots, np.float32)
        self.top_k = np.zeros(max_slots, np.int32)
        self.top_p = np.ones(max_slots, np.float32)
        self.seed = np.zeros(max_slots, np.uint32)
        self.wants_logprobs = np.zeros(max_slots, bool)
        self.wants_prompt_logprobs = np.zeros(max_slots, bool)
        self.slot_of: dict[str, int] = {}
        self.seqs: list[Sequence | None] = [None] * max_slots
        # what a slot's block table was synced from: (list object, its length, first block,
        # preemptions) -- the block manager appends, replaces the last block (copy-on-write),
        # truncates (rejected drafts) or replaces the whole list (free, fork)
        self._table_state: list[tuple[list[int], int, int, int] | None] = [None] * max_slots
        self._token_lists: list[tuple[list[int], list[int]] | None] = [None] * max_slots
        self.free = list(range(max_slots - 1, -1, -1))

    # ------------------------------------------------------------------ slots

    def _evict_idle(self, keep: set[str]) -> None:
        for rid, slot in list(self.slot_of.items()):
            seq = self.seqs[slot]
            if rid not in keep and (seq is None or seq.status is not SequenceStatus.RUNNING):
                self.remove(rid)

    def remove(self, request_id: str) -> None:
        """Free a request's slot (it finished, or was preempted and will come back fresh)."""
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.seqs[slot] = None
            self._table_state[slot] = None
            self._token_lists[slot] = None
            self.free.append(slot)

    def _add(self, seq: Sequence) -> int:
        slot = self.free.pop()
        self.slot_of[seq.request_id] = slot
        self.seqs[slot] = seq
        self._token_lists[slot] = None  # copied by _sync
        sp = seq.sampling_params
        self.temperature[slot] = sp.temperature
        self.top_k[slot] = max(sp.top_k, 0)
        self.top_p[slot] = sp.top_p
        self.seed[slot] = np.uint32(seq.seed)
        self.wants_logprobs[slot] = sp.logprobs is not None
        self.wants_prompt_logprobs[slot] = sp.prompt_logprobs is not None
        self._table_state[slot] = None
        return slot

    def _sync(self, seq: Sequence) -> int:
        """The request's slot, its new tokens and changed blocks written in place."""
        slot = self.slot_of.get(seq.request_id)
        if slot is None or self.seqs[slot] is not seq:
            if slot is not None:
                self.remove(seq.request_id)
            slot = self._add(seq)
        prompt, out = seq.prompt_token_ids, seq.output_token_ids
        lists = self._token_lists[slot]
        if lists is None or lists[0] is not prompt or lists[1] is not out:
            # new token lists (a draft model's shadow is re-pointed at its target): copy all
            self.token_ids[slot, : len(prompt)] = prompt
            self.prompt_len[slot] = self.num_tokens[slot] = len(prompt)
        have, total = int(self.num_tokens[slot]), seq.num_tokens
        if total < have:
            raise RuntimeError(f"request {seq.request_id}: its tokens shrank in place")
        if total > have:  # engine tokens only append (drafts are not tokens until accepted)
            start = have - int(self.prompt_len[slot])
            self.token_ids[slot, have:total] = out[start:]
            self.num_tokens[slot] = total
        # the synced lists are held, so a new list can never reuse their identity
        self._token_lists[slot] = (prompt, out)
        ids = seq.block_ids
        n = len(ids)
        state = (ids, n, ids[0] if n else -1, seq.num_preemptions)
        old = self._table_state[slot]
        if old is None or old[0] is not ids or old[2] != state[2] or old[3] != state[3]:
            first = 0
        else:  # same list: rewrite from its last synced block on (it may have been replaced)
            first = max(0, min(old[1], n) - 1)
        if n > first:
            self.block_table[slot, first:n] = ids[first:n]
        stale = self.max_blocks if old is None or first == 0 else old[1]
        if stale > n:  # truncated (rejected drafts) or replaced: no stale block stays behind
            self.block_table[slot, n:stale] = 0
        self._table_state[slot] = state
        if self.hybrid:  # sliding entries leave the window in place (-1): rewrite them all
            sliding = np.asarray(seq.sliding_block_ids, np.int32)
            self.sliding_table[slot, : len(sliding)] = sliding
        return slot

    # ------------------------------------------------------------------ a step

    def prepare(self, rows: list[ScheduledSeq], shape: tuple[int, int, int]) -> HostStep:
        """The step's inputs for ``rows`` (in order) at ``shape`` = (N, R, M)."""
        n, r, m = shape
        self._evict_idle({item.seq.request_id for item in rows})
        slots = np.array([self._sync(item.seq) for item in rows], np.int64)
        n_rows = len(rows)
        starts = np.array([item.start for item in rows], np.int64)
        counts = np.array([item.num_new_tokens for item in rows], np.int64)
        num_drafts = np.zeros(r, np.int32)
        s = self.num_scored
        draft_tokens = np.full((r, s - 1), -1, np.int32)
        verify = np.zeros(r, bool)
        for i, item in enumerate(rows):
            if item.draft_token_ids:  # drafts sit past the last token in the slot's buffer
                d = len(item.draft_token_ids)
                at = item.seq.num_tokens
                self.token_ids[slots[i], at : at + d] = item.draft_token_ids
                draft_tokens[i, :d] = item.draft_token_ids
                num_drafts[i] = d
            verify[i] = bool(item.draft_token_ids)
        total = int(counts.sum())
        qsl = np.full(r + 1, total, np.int32)
        qsl[0] = 0
        qsl[1 : n_rows + 1] = np.cumsum(counts)
        token_row = np.full(n, r, np.int32)
        row_of = np.repeat(np.arange(n_rows), counts)
        token_row[:total] = row_of
        positions = np.full(n, -1, np.int32)
        pos = starts[row_of] + np.arange(total) - qsl[row_of]
        positions[:total] = pos
        token_ids = np.zeros(n, np.int32)
        token_slot = slots[row_of]
        token_ids[:total] = self.token_ids[token_slot, pos]
        bs = self.block_size
        slot_mapping = np.full(n, self.pad_slot, np.int32)
        slot_mapping[:total] = self.block_table[token_slot, pos // bs] * bs + pos % bs
        sliding_mapping = None
        if self.hybrid:
            ids = self.sliding_table[token_slot, pos // bs]
            sliding_mapping = np.full(n, self.pad_slot, np.int32)
            sliding_mapping[:total] = np.where(ids >= 0, ids * bs + pos % bs, self.pad_slot)
        seq_lens = np.zeros(r, np.int32)
        seq_lens[:n_rows] = starts + counts
        tables = np.zeros((r, m), np.int32)
        tables[:n_rows] = self.block_table[slots, :m]
        sliding_tables = None
        if self.hybrid:  # -1: slid out of the window (masked; stored nowhere)
            sliding_tables = np.zeros((r, m), np.int32)
            sliding_tables[:n_rows] = np.maximum(self.sliding_table[slots, :m], 0)
        last = qsl[1 : n_rows + 1] - 1
        logits_indices = np.zeros((r, s), np.int32)
        logits_indices[:n_rows, 0] = last
        for i in np.flatnonzero(verify):  # the row's last committed token, then each draft
            d = int(num_drafts[i])
            logits_indices[i, : d + 1] = qsl[i] + np.arange(d + 1)
        prompt_targets = np.full(n, -1, np.int32)
        wants = self.wants_prompt_logprobs[token_slot]
        if wants.any():
            nxt = pos + 1
            inside = wants & (nxt < self.prompt_len[token_slot])
            prompt_targets[:total][inside] = self.token_ids[token_slot[inside], nxt[inside]]

        def per_row(values: np.ndarray, fill: float, dtype: type) -> np.ndarray:
            out = np.full(r, fill, dtype)
            out[:n_rows] = values[slots]
            return out

        steps = np.zeros(r, np.int32)
        steps[:n_rows] = self.num_tokens[slots] - self.prompt_len[slots]
        sampling = SamplingTensors(
            temperature=per_row(self.temperature, 0.0, np.float32),
            top_k=per_row(self.top_k, 0, np.int32),
            top_p=per_row(self.top_p, 1.0, np.float32),
            seed=per_row(self.seed, 0, np.uint32),
            step=steps,
            logprobs=per_row(self.wants_logprobs, False, bool),
        )
        meta = AttentionMetadata(positions, token_row, qsl, seq_lens, tables, sliding_tables)
        inputs = StepInputs(
            token_ids, meta, logits_indices, draft_tokens, num_drafts, verify, sampling,
            prompt_targets,
        )  # fmt: skip
        return HostStep(inputs, slot_mapping, sliding_mapping, positions, qsl, prompt_targets)

    def padding(self, shape: tuple[int, int, int]) -> HostStep:
        """A step of ``shape`` that is all padding: it writes, reads and samples nothing."""
        return self.prepare([], shape)
