"""The host-side KV block pool: allocation, reference counts, prefix caching, copy on write.

Unit tests pin each behaviour; a Hypothesis state machine then drives random operation
sequences (what the scheduler does: admit with a prefix-cache lookup, append/chunk, fork, free,
preempt, poison freed blocks) against a model of the device pool that records, for every slot,
which prefix's K/V it holds, so a block shared, evicted or reused wrongly shows up as a sequence
reading K/V that is not its own. No JAX.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from research.engine.block_manager import BlockManager, hash_block
from research.engine.request import RequestMetrics, SamplingParams
from research.engine.sequence import Sequence

_ids = iter(range(10**9))


def make_seq(prompt: list[int], output: list[int] | None = None) -> Sequence:
    return Sequence(
        request_id=f"s{next(_ids)}",
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(),
        seed=0,
        metrics=RequestMetrics(arrival_time=0.0),
        output_token_ids=list(output or []),
    )


def snapshot(bm: BlockManager, *seqs: Sequence) -> tuple:
    """Everything an allocation may change (for the all-or-nothing checks)."""
    return (
        [(b.ref_count, b.block_hash) for b in bm.blocks],
        list(bm._free),
        list(bm._evictable),
        dict(bm._cached),
        list(bm.pending_copies),
        [(list(s.block_ids), s.num_computed_tokens, s.num_cached_blocks) for s in seqs],
    )


def prefill(bm: BlockManager, seq: Sequence, computed: list[int] | None = None) -> None:
    """Admit ``seq`` (optionally with prefix-cache hits), compute its whole prompt, register its
    full blocks and append a sampled token, as the scheduler and engine do."""
    computed = computed or []
    num_hit = len(computed) * bm.block_size
    assert bm.allocate_slots(seq, seq.num_tokens - num_hit, computed)
    bm.record_prefix_lookup(seq.num_tokens, len(computed))
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    seq.output_token_ids.append(0)


def decode(bm: BlockManager, seq: Sequence, token: int = 0) -> bool:
    """Compute the last sampled token and sample the next one (False if the pool is full)."""
    if not bm.allocate_slots(seq, seq.num_uncomputed_tokens):
        return False
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    seq.output_token_ids.append(token)
    return True


# ---------------------------------------------------------------------------- unit tests


def test_constructor_validates():
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


@pytest.mark.parametrize("caching", [False, True])
def test_allocate_and_free_returns_pool_to_full(caching):
    bm = BlockManager(8, 4, caching)
    a, b = make_seq(list(range(10))), make_seq(list(range(100, 105)))
    assert bm.allocate_slots(a, 10)
    assert bm.allocate_slots(b, 5)
    assert len(a.block_ids) == 3 and len(b.block_ids) == 2
    assert len(set(a.block_ids) | set(b.block_ids)) == 5
    assert bm.num_free_blocks == 3 and bm.num_used_blocks == 5
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    assert a.block_ids == [] and b.block_ids == []
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0
    bm.check_invariants([])


def test_blocks_needed_rounds_up():
    bm = BlockManager(8, 4)
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_slots_grows_only_when_a_block_fills():
    bm = BlockManager(8, 4)
    seq = make_seq([1, 2, 3])
    assert bm.allocate_slots(seq, 3)
    seq.num_computed_tokens = 3
    first = list(seq.block_ids)
    seq.output_token_ids.append(4)
    assert bm.allocate_slots(seq, 1)  # fills block 0
    assert seq.block_ids == first
    seq.num_computed_tokens = 4
    seq.output_token_ids.append(5)
    assert bm.allocate_slots(seq, 1)  # first token of a new block
    assert len(seq.block_ids) == 2 and seq.block_ids[0] == first[0]
    bm.check_invariants([seq])


def test_allocate_slots_is_all_or_nothing():
    bm = BlockManager(3, 4, enable_prefix_caching=False)
    a = make_seq(list(range(8)))
    assert bm.allocate_slots(a, 8)
    b = make_seq(list(range(9)))  # needs 3 blocks, only 1 left
    before = snapshot(bm, a, b)
    assert not bm.allocate_slots(b, 9)
    assert snapshot(bm, a, b) == before
    assert b.block_ids == [] and bm.num_free_blocks == 1
    # Growing a running sequence past the pool fails the same way.
    a.num_computed_tokens = 8
    a.output_token_ids.extend([0] * 5)  # 5 uncomputed tokens need 2 new blocks
    before = snapshot(bm, a, b)
    assert not bm.allocate_slots(a, 5)
    assert snapshot(bm, a, b) == before
    assert bm.allocate_slots(a, 4)  # one more block does fit
    bm.check_invariants([a, b])


def test_all_or_nothing_counts_reclaimed_cached_blocks():
    """Hit blocks sitting in the evictable LRU are part of num_free_blocks but cannot also be
    handed out as new blocks to the same sequence."""
    bm = BlockManager(3, 4)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    prefill(bm, a)  # 3 blocks, the first two registered
    bm.free(a)  # 2 evictable + 1 free
    assert bm.num_free_blocks == 3
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9, 9])  # 13 tokens -> 4 blocks
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 2
    before = snapshot(bm, b)
    assert not bm.allocate_slots(b, 5, hits)  # 2 hits + 2 new > 3 blocks
    assert snapshot(bm, b) == before
    assert bm.allocate_slots(b, 4, hits)  # 2 hits + 1 new == 3 blocks
    assert b.block_ids[:2] == hits and bm.num_free_blocks == 0
    bm.check_invariants([b])


def test_prefix_cache_hit_after_registration():
    bm = BlockManager(16, 4)
    prefix = [7, 1, 7, 2, 7, 3, 7, 4]  # 2 full blocks
    a = make_seq([*prefix, 5, 5, 5])
    assert bm.allocate_slots(a, a.num_tokens)
    assert bm.get_computed_blocks(make_seq([*prefix, 9])) == []  # nothing registered yet
    a.num_computed_tokens = a.num_tokens
    bm.cache_full_blocks(a)
    assert a.num_cached_blocks == 2

    b = make_seq([*prefix, 6, 6, 6, 6, 6])
    hits = bm.get_computed_blocks(b)
    assert hits == a.block_ids[:2]
    assert bm.allocate_slots(b, b.num_tokens - 8, hits)
    b.num_computed_tokens = 8
    assert b.block_ids[:2] == a.block_ids[:2]
    assert b.block_ids[2:] != a.block_ids[2:]
    assert [bm.blocks[i].ref_count for i in hits] == [2, 2]
    bm.check_invariants([a, b])

    # A sequence that already has blocks or computed tokens does not look up.
    assert bm.get_computed_blocks(b) == []
    # Caching off: never a hit.
    off = BlockManager(16, 4, enable_prefix_caching=False)
    c = make_seq([*prefix, 1])
    prefill(off, c)
    assert off.get_computed_blocks(make_seq([*prefix, 1])) == []


def test_full_prompt_hit_leaves_a_token_to_compute():
    bm = BlockManager(16, 4)
    prompt = list(range(8))  # exactly 2 blocks
    a = make_seq(prompt)
    prefill(bm, a)
    assert a.num_cached_blocks == 2
    b = make_seq(prompt)
    hits = bm.get_computed_blocks(b)
    assert hits == a.block_ids[:1]  # at most 1 block: the last token must run for logits
    assert bm.allocate_slots(b, 4, hits)
    b.num_computed_tokens = 4
    bm.check_invariants([a, b])
    # One more token and both blocks hit.
    assert bm.get_computed_blocks(make_seq([*prompt, 0])) == a.block_ids[:2]
    # A 1-token or sub-block prompt never hits.
    assert bm.get_computed_blocks(make_seq(prompt[:1])) == []
    assert bm.get_computed_blocks(make_seq(prompt[:4])) == []


def test_freed_registered_blocks_stay_hittable_and_evict_lru():
    bm = BlockManager(4, 2)
    a = make_seq([1, 1, 9])  # block [1,1] registered, [9] partial
    b = make_seq([2, 2, 9])
    prefill(bm, a)
    prefill(bm, b)
    a_full, b_full = a.block_ids[0], b.block_ids[0]
    assert bm.num_free_blocks == 0
    bm.free(a)  # least recently freed
    bm.free(b)
    assert bm.num_free_blocks == 4
    bm.check_invariants([])
    # Both still hit after being freed.
    assert bm.get_computed_blocks(make_seq([1, 1, 5])) == [a_full]
    assert bm.get_computed_blocks(make_seq([2, 2, 5])) == [b_full]
    # The two partial blocks are taken first, then a's registered block is evicted before b's.
    c = make_seq([3, 4, 5, 6, 7])
    assert bm.allocate_slots(c, 5)
    assert a_full in c.block_ids and b_full not in c.block_ids
    assert bm.get_computed_blocks(make_seq([1, 1, 5])) == []
    assert bm.get_computed_blocks(make_seq([2, 2, 5])) == [b_full]
    assert bm.blocks[a_full].block_hash is None
    bm.check_invariants([c])
    d = make_seq([8, 8])
    assert bm.allocate_slots(d, 1)
    assert d.block_ids == [b_full]
    assert bm.get_computed_blocks(make_seq([2, 2, 5])) == []
    bm.check_invariants([c, d])


def test_hit_refreshes_lru_position():
    bm = BlockManager(3, 2)
    a, b = make_seq([1, 1, 9]), make_seq([2, 2, 9])
    prefill(bm, a)
    a_full = a.block_ids[0]
    bm.free(a)
    prefill(bm, b)  # takes the free partial block and a free block; a's block is untouched
    b_full = b.block_ids[0]
    bm.free(b)
    # Hit a's block again and free it: now b's block is the least recently freed.
    c = make_seq([1, 1, 3])
    hits = bm.get_computed_blocks(c)
    assert hits == [a_full]
    prefill(bm, c, hits)
    bm.free(c)
    assert list(bm._evictable) == [b_full, a_full]
    d = make_seq([5, 6, 7])
    assert bm.allocate_slots(d, 3)  # the free partial block, then one eviction
    assert b_full in d.block_ids and a_full not in d.block_ids
    assert bm.get_computed_blocks(make_seq([1, 1, 3])) == [a_full]
    assert bm.get_computed_blocks(make_seq([2, 2, 3])) == []
    bm.check_invariants([d])


def test_tail_blocks_are_evicted_first():
    bm = BlockManager(4, 2)
    a = make_seq([1, 2, 3, 4, 5, 6, 0])
    prefill(bm, a)  # 3 full registered blocks + 1 partial
    blocks = list(a.block_ids)
    bm.free(a)
    b = make_seq([9, 9, 9])
    assert bm.allocate_slots(b, 3)  # the partial block, then the tail full block is evicted
    assert sorted(b.block_ids) == sorted(blocks[2:])
    assert bm.get_computed_blocks(make_seq([1, 2, 3, 4, 5, 6, 7])) == blocks[:2]
    bm.check_invariants([b])


def test_hash_chaining():
    bm = BlockManager(16, 2)
    a = make_seq([5, 5, 1, 1, 7])  # registers [5,5] and [5,5|1,1]
    b = make_seq([0, 0, 9])  # registers [0,0]
    prefill(bm, a)
    prefill(bm, b)
    # [1,1] after [0,0]: the same block tokens as a's second block, a different prefix.
    c = make_seq([0, 0, 1, 1, 7])
    assert bm.get_computed_blocks(c) == [b.block_ids[0]]
    assert bm.get_computed_blocks(make_seq([1, 1, 7])) == []
    assert bm.get_computed_blocks(make_seq([5, 5, 1, 1, 7])) == a.block_ids[:2]
    h0 = hash_block(None, [5, 5])
    assert hash_block(h0, [1, 1]) != hash_block(hash_block(None, [0, 0]), [1, 1])
    assert hash_block(h0, [1, 1]) != hash_block(None, [1, 1])
    assert hash_block(None, [1, 1]) == hash_block(None, [1, 1])
    assert a.block_hashes[:2] == [h0, hash_block(h0, [1, 1])]


def test_duplicate_content_is_registered_once():
    """Two sequences computing the same prefix concurrently: the first registers it, the
    second's copy stays private and is freed straight to the free list."""
    bm = BlockManager(8, 2)
    a, b = make_seq([1, 2, 3]), make_seq([1, 2, 3])
    assert bm.allocate_slots(a, 3) and bm.allocate_slots(b, 3)
    for s in (a, b):
        s.num_computed_tokens = 3
        bm.cache_full_blocks(s)
    assert bm.blocks[a.block_ids[0]].block_hash is not None
    assert bm.blocks[b.block_ids[0]].block_hash is None
    bm.check_invariants([a, b])
    assert bm.get_computed_blocks(make_seq([1, 2, 3])) == [a.block_ids[0]]
    bm.free(b)
    bm.free(a)
    assert bm.num_free_blocks == 8
    bm.check_invariants([])


def test_prefix_hit_rate_counters():
    bm = BlockManager(16, 4)
    assert bm.prefix_cache_hit_rate == 0.0
    bm.record_prefix_lookup(10, 2)
    assert bm.prefix_queries == 10 and bm.prefix_hits == 8
    assert bm.prefix_cache_hit_rate == pytest.approx(0.8)
    bm.record_prefix_lookup(10, 0)
    assert bm.prefix_cache_hit_rate == pytest.approx(0.4)
    off = BlockManager(16, 4, enable_prefix_caching=False)
    off.record_prefix_lookup(10, 2)
    # With caching off the prompt tokens are still counted (all of them computed), none hit.
    assert off.prefix_queries == 10 and off.prefix_hits == 0 and off.prefix_cache_hit_rate == 0.0


def test_fork_shares_blocks_and_copy_on_write():
    bm = BlockManager(8, 4)
    parent = make_seq([1, 2, 3, 4, 5, 6])
    prefill(bm, parent)  # 2 blocks, the second partially filled; 7 tokens, 6 computed
    child = make_seq(parent.prompt_token_ids, parent.output_token_ids)
    bm.fork(parent, child)
    assert child.block_ids == parent.block_ids
    assert child.num_computed_tokens == 6
    assert [bm.blocks[b].ref_count for b in parent.block_ids] == [2, 2]
    assert bm.num_used_blocks == 2
    bm.check_invariants([parent, child])
    with pytest.raises(ValueError):
        bm.fork(parent, child)

    shared_full, shared_last = parent.block_ids
    child.output_token_ids[-1] = 9  # the child sampled something else
    assert decode(bm, child)
    assert child.block_ids[0] == shared_full
    assert child.block_ids[1] != shared_last
    assert bm.take_pending_copies() == [(shared_last, child.block_ids[1])]
    assert bm.take_pending_copies() == []
    assert bm.blocks[shared_full].ref_count == 2
    assert bm.blocks[shared_last].ref_count == 1
    bm.check_invariants([parent, child])

    # The parent now owns its last block alone: it appends in place.
    assert decode(bm, parent)
    assert parent.block_ids == [shared_full, shared_last]
    assert bm.take_pending_copies() == []
    bm.check_invariants([parent, child])
    bm.free(parent)
    assert bm.blocks[shared_full].ref_count == 1
    bm.free(child)
    assert bm.num_free_blocks == 8
    bm.check_invariants([])


def test_fork_with_full_last_block_needs_no_copy():
    bm = BlockManager(8, 4)
    parent = make_seq(list(range(8)))
    prefill(bm, parent)
    child = make_seq(parent.prompt_token_ids, parent.output_token_ids)
    bm.fork(parent, child)
    assert decode(bm, child) and decode(bm, parent)
    assert bm.take_pending_copies() == []
    assert child.block_ids[:2] == parent.block_ids[:2]
    assert child.block_ids[2] != parent.block_ids[2]
    bm.check_invariants([parent, child])


def test_copy_on_write_is_all_or_nothing():
    bm = BlockManager(2, 4, enable_prefix_caching=False)
    parent = make_seq([1, 2, 3, 4, 5])
    prefill(bm, parent)  # both blocks used, the last one partial
    child = make_seq(parent.prompt_token_ids, parent.output_token_ids)
    bm.fork(parent, child)
    before = snapshot(bm, parent, child)
    assert not bm.allocate_slots(child, 1)  # a copy needs a free block
    assert snapshot(bm, parent, child) == before
    bm.free(parent)  # now the child owns the last block alone
    assert decode(bm, child)
    assert bm.take_pending_copies() == []
    bm.check_invariants([child])


def test_double_free_is_harmless_or_detected():
    bm = BlockManager(4, 4)
    seq = make_seq([1, 2, 3, 4, 5])
    prefill(bm, seq)
    stale = make_seq(seq.prompt_token_ids)
    stale.block_ids = list(seq.block_ids)  # a second, stale copy of the table
    bm.free(seq)
    bm.free(seq)  # the table was cleared: a no-op
    assert bm.num_free_blocks == 4
    bm.check_invariants([])
    with pytest.raises(RuntimeError):
        bm.free(stale)
    with pytest.raises(AssertionError):
        bm.check_invariants([])


def test_check_invariants_detects_leaks():
    bm = BlockManager(4, 4)
    seq = make_seq([1, 2, 3])
    assert bm.allocate_slots(seq, 3)
    with pytest.raises(AssertionError):
        bm.check_invariants([])  # an owned block nobody claims
    bm.check_invariants([seq])


def test_freed_blocks_bookkeeping_never_lists_an_owned_block():
    """Blocks freed then reallocated before the engine poisons them must not be poisoned."""
    bm = BlockManager(2, 4, enable_prefix_caching=False)
    bm.freed_blocks = []
    a = make_seq([1, 2, 3, 4, 5])
    prefill(bm, a)
    bm.free(a)  # e.g. a preemption or an abort
    assert sorted(bm.freed_blocks) == [0, 1]
    b = make_seq([6])
    assert bm.allocate_slots(b, 1)  # reuses one of them in the same step
    assert not set(bm.freed_blocks) & set(b.block_ids)
    assert len(bm.freed_blocks) == 1
    bm.check_invariants([b])


# ---------------------------------------------------------------------------- state machine


class BlockManagerMachine(RuleBasedStateMachine):
    """Random scheduler-like use of one BlockManager against a model of the device pool.

    ``kv`` maps (block, slot) to the prefix (tuple of tokens) whose last token's K/V the slot
    holds, as the executor would write it. A sequence may only read slots holding its own
    prefix: every computed position of every live sequence is checked after every step.
    """

    def __init__(self):
        super().__init__()
        self.bm: BlockManager | None = None
        self.live: list[Sequence] = []  # sequences holding blocks (between steps)
        self.waiting: list[Sequence] = []  # new or preempted, no blocks
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}

    @initialize(num_blocks=st.integers(8, 24), block_size=st.integers(1, 4), caching=st.booleans())
    def setup(self, num_blocks, block_size, caching):
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.bm.freed_blocks = []

    # ------------------------------------------------------------------ helpers

    def slot(self, seq: Sequence, pos: int) -> tuple[int, int]:
        bs = self.bm.block_size
        return seq.block_ids[pos // bs], pos % bs

    def run_step(self, seq: Sequence, num_new: int, computed: list[int]) -> bool:
        """One scheduler step for ``seq``: allocate, apply copies, check reads, write, commit."""
        bm = self.bm
        bs = bm.block_size
        start = len(computed) * bs if computed else seq.num_computed_tokens
        last = seq.block_ids[-1] if seq.block_ids else None
        expect_cow = (
            last is not None
            and seq.num_computed_tokens % bs != 0
            and sum(s.block_ids.count(last) for s in self.live) > 1
        )
        num_old = len(seq.block_ids)
        free_before = set(bm._free) | set(bm._evictable)
        before = snapshot(bm, seq)
        if not bm.allocate_slots(seq, num_new, computed):
            assert snapshot(bm, seq) == before, "a failed allocation changed state"
            return False
        assert len(seq.block_ids) == bm.blocks_needed(start + num_new)
        copies = bm.take_pending_copies()
        if expect_cow:
            assert len(copies) == 1
            src, dst = copies[0]
            assert src == last and dst == seq.block_ids[num_old - 1]
            assert dst in free_before and src not in seq.block_ids
        else:
            assert copies == []
        for src, dst in copies:
            for i in range(bs):
                if (src, i) in self.kv:
                    self.kv[dst, i] = self.kv[src, i]
                else:
                    self.kv.pop((dst, i), None)
        if computed:
            bm.record_prefix_lookup(seq.num_tokens, len(computed))
            seq.num_computed_tokens = start
        tokens = seq.token_ids
        for p in range(start):  # attention reads the cached prefix
            assert self.kv.get(self.slot(seq, p)) == tuple(tokens[: p + 1]), (
                f"{seq.request_id} reads foreign K/V at position {p}"
            )
        for p in range(start, start + num_new):
            self.kv[self.slot(seq, p)] = tuple(tokens[: p + 1])
        seq.num_computed_tokens = start + num_new
        bm.cache_full_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(len(tokens) % 4)  # the sampled token
        return True

    # ------------------------------------------------------------------ rules

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=12))
    def add(self, prompt):
        self.waiting.append(make_seq(prompt))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data):
        seq = self.waiting[data.draw(st.integers(0, len(self.waiting) - 1), label="waiting")]
        bm = self.bm
        computed = bm.get_computed_blocks(seq)
        assert len(computed) * bm.block_size < seq.num_tokens
        assert len(set(computed)) == len(computed)
        for b in computed:
            assert bm.blocks[b].block_hash is not None
        if not bm.enable_prefix_caching:
            assert computed == []
        remaining = seq.num_tokens - len(computed) * bm.block_size
        chunk = data.draw(st.integers(1, remaining), label="chunk")
        if self.run_step(seq, chunk, computed):
            self.waiting.remove(seq)
            self.live.append(seq)
        else:
            assert seq.block_ids == [] and seq.num_computed_tokens == 0

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 3), max_size=4))
    def append(self, data, extra):
        """Compute 1..n more tokens (a decode, a prefill chunk, or several speculative ones)."""
        seq = self.live[data.draw(st.integers(0, len(self.live) - 1), label="live")]
        seq.output_token_ids.extend(extra)
        num_new = data.draw(st.integers(1, min(5, seq.num_uncomputed_tokens)), label="num_new")
        self.run_step(seq, num_new, [])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.live[data.draw(st.integers(0, len(self.live) - 1), label="live")]
        child = make_seq(parent.prompt_token_ids, parent.output_token_ids)
        used = self.bm.num_used_blocks
        self.bm.fork(parent, child)
        assert child.block_ids == parent.block_ids
        assert self.bm.num_used_blocks == used
        self.live.append(child)

    @precondition(lambda self: self.live or self.waiting)
    @rule(data=st.data())
    def free(self, data):
        pool = self.live + self.waiting
        seq = pool[data.draw(st.integers(0, len(pool) - 1), label="seq")]
        self.bm.free(seq)
        assert seq.block_ids == []
        (self.live if seq in self.live else self.waiting).remove(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data):
        seq = self.live[data.draw(st.integers(0, len(self.live) - 1), label="live")]
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        self.live.remove(seq)
        self.waiting.insert(0, seq)

    @rule()
    def poison_freed(self):
        """What the engine does in isolation mode: freed blocks lose their contents."""
        freed, self.bm.freed_blocks = self.bm.freed_blocks, []
        for b in freed:
            for i in range(self.bm.block_size):
                self.kv.pop((b, i), None)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def consistent(self):
        bm = self.bm
        if bm is None:
            return
        bm.check_invariants(self.live + self.waiting)
        owned = {b for s in self.live for b in s.block_ids}
        assert bm.num_free_blocks + len(owned) == bm.num_blocks
        assert bm.num_used_blocks == len(owned)
        assert not set(bm.freed_blocks) & owned, "a live block would be poisoned"
        assert 0.0 <= bm.prefix_cache_hit_rate <= 1.0
        for seq in self.waiting:
            assert seq.block_ids == [] and seq.num_computed_tokens == 0
        for seq in self.live:
            assert len(seq.block_ids) == bm.blocks_needed(seq.num_computed_tokens)
            assert 0 < seq.num_computed_tokens < seq.num_tokens
            tokens = seq.token_ids
            for p in range(seq.num_computed_tokens):
                assert self.kv.get(self.slot(seq, p)) == tuple(tokens[: p + 1])
        # Registered blocks hold exactly the prefix their hash names (checked via owners'
        # hashes: a registered block owned by a live sequence matches that sequence's hash).
        for seq in self.live:
            for i, b in enumerate(seq.block_ids[: seq.num_cached_blocks]):
                h = bm.blocks[b].block_hash
                assert h is None or h == seq.block_hashes[i]

    def teardown(self):
        bm = self.bm
        if bm is None:
            return
        for seq in self.live + self.waiting:
            bm.free(seq)
        assert bm.num_free_blocks == bm.num_blocks
        bm.check_invariants([])


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase


# ------------------------------------------------------------------ sliding windows (gpt-oss)


def _run(bm: BlockManager, seq: Sequence, chunk: int) -> list[tuple[int, int]]:
    """Prefill in ``chunk``-token steps, then decode to the end; (computed, sliding held)."""
    held = []
    while seq.num_computed_tokens < seq.num_tokens:
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        assert bm.allocate_slots(seq, n)
        seq.num_computed_tokens += n
        held.append((seq.num_computed_tokens, bm.sliding_blocks_held(seq)))
        bm.check_invariants([seq])
    return held


@pytest.mark.parametrize(("window", "block_size"), [(8, 4), (8, 8), (8, 16), (128, 16)])
def test_sliding_layers_hold_at_most_their_window(window, block_size):
    bm = BlockManager(4096, block_size, enable_prefix_caching=True, sliding_window=window)
    assert not bm.enable_prefix_caching  # hits would need the sliding blocks too
    seq = make_seq(list(range(10 * window)))
    held = _run(bm, seq, chunk=1)  # token by token, as decode steps
    limit = -(-(window - 1) // block_size) + 1
    assert max(h for _, h in held) == limit
    assert len(seq.block_ids) == bm.blocks_needed(10 * window)  # full layers keep everything
    # Every sliding entry before the window went back to the pool.
    first_read = (10 * window - window) // block_size
    assert all(b == -1 for b in seq.sliding_block_ids[:first_read])
    bm.free(seq)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants([])


def test_sliding_allocation_is_all_or_nothing():
    bm = BlockManager(7, 4, sliding_window=8)
    seq = make_seq(list(range(20)))
    # 12 tokens: 3 full blocks; later queries read keys >= 5, so 2 sliding blocks (4..11).
    assert bm.allocate_slots(seq, 12)
    seq.num_computed_tokens = 12
    assert seq.sliding_block_ids[0] == -1 and bm.num_free_blocks == 2
    other = make_seq(list(range(8)))
    before = snapshot(bm, seq, other)
    assert not bm.allocate_slots(other, 8)  # 2 full + 2 sliding > 2 free
    assert snapshot(bm, seq, other) == before
    assert not bm.allocate_slots(seq, 8)  # 2 full + 2 sliding (keys 13..19) > 2 free
    assert snapshot(bm, seq, other) == before
    assert bm.allocate_slots(seq, 1)  # position 12: 1 full + 1 sliding
    assert bm.sliding_blocks_held(seq) == 3 and len(seq.block_ids) == 4
    with pytest.raises(ValueError, match="fork"):
        bm.fork(seq, make_seq([1]))
