"""The KV block pool, on the host: allocation, reference counts, prefix caching. No JAX here.

A fixed pool of ``num_blocks`` blocks of ``block_size`` tokens. A sequence owns a list of block
ids (its block table); blocks are shared by reference count (forked sequences, common prefixes).

Prefix caching: a full block is identified by a hash chained over its tokens and its parent
block's hash, so equal hashes mean equal whole prefixes. Full blocks are registered once their
K/V are computed; a new sequence whose leading blocks hash to registered ones reuses them and
skips their prefill. Freed registered blocks stay in an LRU of evictable blocks and can still be
hit until a new allocation evicts them.

Copy on write: a forked sequence shares its parent's partially filled last block; the first one
to append to it gets a fresh block and a (src, dst) copy the executor applies on device.

Sliding windows (``sliding_window`` W, gpt-oss): the sliding-window layers get a second table,
``seq.sliding_block_ids``, from the same pool (vLLM's hybrid allocator; the pool pairs one
sliding with one full layer per tensor, so a block id names pages of one kind). A step whose
first query is at position p reads keys >= p - W + 1 only, so the sliding blocks wholly before
that go back to the pool, and new tokens that no later query will see are not stored there: a
decoding sequence holds at most ceil((W - 1) / block_size) + 1 sliding blocks. Prefix caching
and fork are not supported with a sliding window.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from research.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set while the block is registered in the prefix cache


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    """Chained hash of one full block: depends on every token of the prefix it ends."""
    h = hashlib.blake2b(parent or b"root", digest_size=16)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.sliding_window = sliding_window
        # Prefix hits would need the sliding layers' blocks too: off with a sliding window.
        self.enable_prefix_caching = enable_prefix_caching and sliding_window is None
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # ref 0, not registered
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, registered; LRU first
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for the executor
        # Blocks returned to the free list since the last take_freed_blocks() (for poisoning
        # freed memory in isolation tests); None disables the bookkeeping.
        self.freed_blocks: list[int] | None = None
        # Prefix-cache counters, in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_evictions = 0  # cached blocks taken back for new allocations

    # ------------------------------------------------------------------ counters

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free plus evictable cached blocks)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_concurrency(self, tokens_per_request: int) -> float:
        """How many requests of ``tokens_per_request`` tokens the whole pool holds at once
        (vLLM's "maximum concurrency" start-up figure); with a sliding window each also holds
        up to a window's blocks for its sliding layers."""
        blocks = self.blocks_needed(tokens_per_request)
        if self.sliding_window is not None:
            blocks += min(blocks, -(-(self.sliding_window - 1) // self.block_size) + 1)
        return self.num_blocks / blocks

    # ------------------------------------------------------------------ prefix cache

    def _extend_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        tokens = seq.token_ids
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_full_blocks):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of ``seq`` (for a sequence with nothing computed).

        At least the last token is always left to compute, so the step has logits to sample.
        A request that wants its prompt's log-probabilities computes every prompt token (as
        vLLM: cached tokens have no logits).
        """
        if not self.enable_prefix_caching or seq.num_computed_tokens or seq.block_ids:
            return []
        if seq.sampling_params.prompt_logprobs is not None:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, max_blocks)
        hits = []
        for h in seq.block_hashes[:max_blocks]:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_hit_blocks: int) -> None:
        """Count one admitted sequence's prompt tokens and, of them, those found cached (hit
        rate is in tokens; with caching off every token is computed)."""
        self.prefix_queries += num_tokens
        if self.enable_prefix_caching:
            self.prefix_hits += num_hit_blocks * self.block_size

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register ``seq``'s full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_ids))
        self._extend_hashes(seq, num_full)
        for i in range(seq.num_cached_blocks, num_full):
            block = self.blocks[seq.block_ids[i]]
            h = seq.block_hashes[i]
            if block.block_hash is None and h not in self._cached:
                block.block_hash = h
                self._cached[h] = block.block_id
        seq.num_cached_blocks = max(seq.num_cached_blocks, num_full)

    # ------------------------------------------------------------------ allocation

    def _take_free_block(self) -> int:
        if self._free:
            block_id = self._free.popleft()
            if self.freed_blocks is not None and block_id in self.freed_blocks:
                self.freed_blocks.remove(block_id)  # reused before poisoning: keep its new K/V
        else:  # evict the least recently freed cached block
            block_id, _ = self._evictable.popitem(last=False)
            self.num_evictions += 1
            block = self.blocks[block_id]
            del self._cached[block.block_hash]
            block.block_hash = None
        self.blocks[block_id].ref_count = 1
        return block_id

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._evictable.pop(block_id)
        block.ref_count += 1

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``seq`` (after its computed ones and
        any ``computed_blocks`` from the prefix cache). All or nothing: False if the pool
        cannot hold them, and then nothing changes."""
        computed_blocks = computed_blocks or []
        total = seq.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        have = len(seq.block_ids) + len(computed_blocks)
        need_new = max(0, self.blocks_needed(total) - have)
        cow = self._needs_copy_on_write(seq, num_new_tokens)
        reclaimed = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if self.sliding_window is not None:
            slide_out, slide_in = self._sliding_plan(seq, num_new_tokens)
            if need_new + len(slide_in) > self.num_free_blocks + len(slide_out):
                return False
            self._allocate_sliding(seq, slide_out, slide_in, self.blocks_needed(total))
        elif need_new + cow > self.num_free_blocks - reclaimed:
            return False
        for b in computed_blocks:
            self._touch(b)
            seq.block_ids.append(b)
        if cow:
            last = seq.block_ids[-1]
            new = self._take_free_block()
            self.blocks[last].ref_count -= 1  # still held by its other owner(s)
            seq.block_ids[-1] = new
            self.pending_copies.append((last, new))
        for _ in range(need_new):
            seq.block_ids.append(self._take_free_block())
        return True

    def _sliding_plan(self, seq: Sequence, num_new_tokens: int) -> tuple[list[int], list[int]]:
        """(entries of ``seq.sliding_block_ids`` whose blocks no query of this step or later
        reads, entries this step needs a new block for). The step's queries are at positions
        start .. end - 1 (start = computed tokens) and read keys >= start - W + 1; later steps
        read keys >= end - W + 1, so only new tokens from there on are stored."""
        bs, window = self.block_size, self.sliding_window
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        table = seq.sliding_block_ids
        read_from = max(0, start - window + 1) // bs  # first entry a query still reads
        keep_from = max(0, end - window + 1) // bs  # first entry new tokens are stored in
        slide_out = [i for i in range(min(read_from, len(table))) if table[i] >= 0]
        last = self.blocks_needed(end)
        slide_in = [i for i in range(max(keep_from, 0), last) if i >= len(table) or table[i] < 0]
        return slide_out, slide_in

    def _allocate_sliding(
        self, seq: Sequence, slide_out: list[int], slide_in: list[int], length: int
    ) -> None:
        table = seq.sliding_block_ids
        for i in slide_out:
            self._release(table[i])
            table[i] = -1
        table.extend([-1] * (length - len(table)))
        for i in slide_in:
            table[i] = self._take_free_block()

    def sliding_blocks_held(self, seq: Sequence) -> int:
        """Blocks ``seq``'s sliding-window layers hold now."""
        return sum(b >= 0 for b in seq.sliding_block_ids)

    def _release(self, block_id: int) -> None:
        """Drop one reference; an unshared block returns to the pool (or, registered in the
        prefix cache, to the evictable LRU)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count < 0:
            raise RuntimeError(f"block {block_id} freed more often than allocated")
        if block.ref_count == 0:
            if block.block_hash is not None:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)
                if self.freed_blocks is not None:
                    self.freed_blocks.append(block_id)

    def _needs_copy_on_write(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Appending into a partially filled last block that another sequence also holds."""
        if num_new_tokens == 0 or not seq.block_ids:
            return False
        if seq.num_computed_tokens % self.block_size == 0:
            return False  # the last block is full (or untouched); new tokens go to new blocks
        if seq.num_computed_tokens > len(seq.block_ids) * self.block_size:
            return False
        return self.blocks[seq.block_ids[-1]].ref_count > 1

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references. Unshared blocks return to the pool; registered ones stay
        hittable (evictable). Tail blocks are freed first, so they are evicted first."""
        for block_id in reversed(seq.block_ids):
            self._release(block_id)
        for block_id in reversed(seq.sliding_block_ids):
            if block_id >= 0:
                self._release(block_id)
        seq.block_ids = []
        seq.sliding_block_ids = []
        seq.num_cached_blocks = 0

    def trim(self, seq: Sequence, num_tokens: int) -> int:
        """Keep only the blocks that ``num_tokens`` tokens of ``seq`` need and release the rest
        (speculative decoding's rollback of rejected drafts' slots); returns how many were
        released."""
        keep = self.blocks_needed(num_tokens)
        released = seq.block_ids[keep:]
        for block_id in reversed(released):
            self._release(block_id)
        del seq.block_ids[keep:]
        seq.num_cached_blocks = min(seq.num_cached_blocks, keep)
        return len(released)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares all of ``parent``'s blocks (copy on write for the partial last one)."""
        if child.block_ids:
            raise ValueError("fork target already owns blocks")
        if self.sliding_window is not None:
            raise ValueError("fork is not supported with a sliding window")
        for block_id in parent.block_ids:
            self.blocks[block_id].ref_count += 1
        child.block_ids = list(parent.block_ids)
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = parent.num_cached_blocks
        child.num_computed_tokens = parent.num_computed_tokens

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # ------------------------------------------------------------------ checks

    def check_invariants(self, owners: list[Sequence]) -> None:
        """Raise AssertionError if the pool's bookkeeping disagrees with ``owners``' tables."""
        counts = [0] * self.num_blocks
        for seq in owners:
            for b in seq.block_ids + [b for b in seq.sliding_block_ids if b >= 0]:
                counts[b] += 1
        free = set(self._free)
        evictable = set(self._evictable)
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not free & evictable, "a block is both free and evictable"
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id} has a negative refcount"
            assert block.ref_count == counts[block.block_id], (
                f"block {block.block_id}: refcount {block.ref_count}, owners {counts[block.block_id]}"
            )
            idle = block.block_id in free or block.block_id in evictable
            assert idle == (block.ref_count == 0), (
                f"block {block.block_id} is owned and free, or leaked"
            )
            if block.block_id in evictable:
                assert block.block_hash is not None
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == block.block_id
        assert len(self._cached) == sum(b.block_hash is not None for b in self.blocks)
