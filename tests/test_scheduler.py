"""The iteration-level scheduler driven by a fake executor loop (no JAX).

Each step: ``plan = sched.schedule()``, a fake executor that checks and writes K/V slots,
``sampled = sched.commit(plan)``, then a fake token is appended to every sampled sequence and
sequences reaching ``max_tokens`` are finished. The fake executor keeps, for every pool slot,
the prefix (a running hash of the tokens) whose K/V it holds, applies the plan's block copies
first, and fails if a scheduled sequence's attention would read K/V that is not its own. After
each step the blocks freed to the free list are "poisoned" (forgotten), as the engine's
``poison_freed_blocks`` isolation mode does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from research.config import SchedulerConfig
from research.engine.block_manager import BlockManager
from research.engine.request import RequestMetrics, SamplingParams
from research.engine.scheduler import Scheduler, StepPlan
from research.engine.sequence import Sequence, SequenceStatus


def make_seq(rid: str, prompt: list[int], max_tokens: int) -> Sequence:
    return Sequence(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        seed=0,
        metrics=RequestMetrics(arrival_time=0.0),
    )


def prefix_keys(tokens: list[int]) -> list[int]:
    """keys[p] identifies tokens[: p + 1] (what the K/V at position p depends on)."""
    keys, h = [], 0
    for t in tokens:
        h = hash((h, t))
        keys.append(h)
    return keys


@dataclass
class StepRecord:
    plan: StepPlan
    running_before: list[Sequence]
    waiting_before: list[Sequence]
    admitted: list[Sequence]  # sequences taken from the waiting queue this step
    samples: dict[str, bool]  # request id -> ScheduledSeq.samples, read before commit
    num_running: int  # right after schedule()
    finished: list[Sequence] = field(default_factory=list)
    # The static batch was closed when the step was scheduled (it admits nobody then).
    batch_formed: bool = False


class Harness:
    def __init__(
        self,
        *,
        num_blocks: int = 256,
        block_size: int = 4,
        caching: bool = True,
        **sched_kwargs,
    ):
        self.config = SchedulerConfig(**sched_kwargs)
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.sched = Scheduler(self.config, self.bm)
        self.bm.freed_blocks = []  # poison freed blocks after every step, as the engine can
        self.kv: dict[int, int] = {}  # pool slot -> prefix key
        self.steps: list[StepRecord] = []
        self.finished: list[Sequence] = []
        self.closed_before = False
        self._counter = 0

    def add(self, prompt: list[int], max_tokens: int) -> Sequence:
        seq = make_seq(f"r{self._counter}", prompt, max_tokens)
        self._counter += 1
        self.sched.add(seq)
        return seq

    # ------------------------------------------------------------------ fake executor

    def _slot(self, seq: Sequence, pos: int) -> int:
        bs = self.bm.block_size
        return seq.block_ids[pos // bs] * bs + pos % bs

    def execute(self, plan: StepPlan) -> None:
        bs = self.bm.block_size
        for src, dst in plan.block_copies:
            for i in range(bs):
                if src * bs + i in self.kv:
                    self.kv[dst * bs + i] = self.kv[src * bs + i]
                else:
                    self.kv.pop(dst * bs + i, None)
        seen = set()
        for item in plan.scheduled:
            seq = item.seq
            assert seq.request_id not in seen, "a sequence is scheduled twice in one step"
            seen.add(seq.request_id)
            assert seq.status is SequenceStatus.RUNNING
            assert item.num_new_tokens >= 1
            assert item.start == seq.num_computed_tokens
            assert item.start + item.num_new_tokens <= seq.num_tokens
            assert len(seq.block_ids) * bs >= item.start + item.num_new_tokens
            keys = prefix_keys(seq.token_ids)
            for p in range(item.start):
                assert self.kv.get(self._slot(seq, p)) == keys[p], (
                    f"{seq.request_id} would read foreign K/V at position {p}"
                )
        for item in plan.scheduled:
            keys = prefix_keys(item.seq.token_ids)
            for p in range(item.start, item.start + item.num_new_tokens):
                self.kv[self._slot(item.seq, p)] = keys[p]
        for item in plan.scheduled:  # nobody's writes clobbered a sequence of this step
            keys = prefix_keys(item.seq.token_ids)
            for p in range(item.start + item.num_new_tokens):
                assert self.kv.get(self._slot(item.seq, p)) == keys[p]

    def poison_freed_blocks(self) -> None:
        """The engine's isolation mode: blocks returned to the free list lose their K/V."""
        owned = {b for seq in self.sched.running for b in seq.block_ids}
        freed, self.bm.freed_blocks = self.bm.freed_blocks, []
        assert not set(freed) & owned, "a block in use would be poisoned"
        bs = self.bm.block_size
        for b in freed:
            for i in range(bs):
                self.kv.pop(b * bs + i, None)

    # ------------------------------------------------------------------ loop

    def step(self) -> StepRecord:
        running_before, waiting_before = list(self.sched.running), list(self.sched.waiting)
        self.closed_before = bool(running_before) and not self.sched.static_batch_open
        return self.complete(self.sched.schedule(), running_before, waiting_before)

    def complete(
        self, plan: StepPlan, running_before: list[Sequence], waiting_before: list[Sequence]
    ) -> StepRecord:
        """Check, execute and commit a plan ``sched.schedule()`` just returned."""
        sched = self.sched
        admitted = [s for s in waiting_before if s in sched.running]
        rec = StepRecord(
            plan,
            running_before,
            waiting_before,
            admitted,
            {item.seq.request_id: item.samples for item in plan.scheduled},
            len(sched.running),
            batch_formed=self.closed_before,
        )
        self.check_plan(rec)
        self.execute(plan)
        for seq in sched.commit(plan):
            seq.output_token_ids.append(len(seq.token_ids) % 7)
            if len(seq.output_token_ids) == seq.sampling_params.max_tokens:
                sched.finish(seq)
                rec.finished.append(seq)
                self.finished.append(seq)
        self.poison_freed_blocks()
        self.bm.check_invariants(sched.running + list(sched.waiting))
        self.steps.append(rec)
        return rec

    def check_plan(self, rec: StepRecord) -> None:
        plan, cfg, sched = rec.plan, self.config, self.sched
        assert plan.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(plan.scheduled) <= cfg.max_num_seqs
        assert len(sched.running) <= cfg.max_num_seqs
        assert all(item.num_new_tokens == 1 for item in plan.decodes)
        assert all(item.num_new_tokens > 1 for item in plan.prefills)
        if not cfg.enable_chunked_prefill:  # whole prompts (or recomputes) only
            for item in plan.scheduled:
                assert item.start + item.num_new_tokens == item.seq.num_tokens
        if plan.preempted:
            assert rec.admitted == []  # never admit in a step that preempted
        if cfg.scheduling_policy == "static" and rec.batch_formed:
            assert rec.admitted == []
        for seq in sched.waiting:
            assert seq.block_ids == [] and seq.num_computed_tokens == 0
            assert seq.status is SequenceStatus.WAITING

    def run(self, max_steps: int = 10_000) -> int:
        n = 0
        while self.sched.has_unfinished():
            self.step()
            n += 1
            assert n < max_steps, "the scheduler made no progress"
        return n

    def assert_all_done(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            assert seq.is_finished
            assert len(seq.output_token_ids) == seq.sampling_params.max_tokens
            assert seq.block_ids == []
            # The fake tokens depend only on the length: recompute changes nothing.
            n = len(seq.prompt_token_ids)
            assert seq.output_token_ids == [(n + i) % 7 for i in range(len(seq.output_token_ids))]
        assert not self.sched.has_unfinished()
        assert self.bm.num_free_blocks == self.bm.num_blocks
        self.bm.check_invariants([])


def first_step(h: Harness, seq: Sequence, *, admitted: bool = True) -> int:
    for i, rec in enumerate(h.steps):
        if admitted and seq in rec.admitted:
            return i
        if not admitted and seq in rec.finished:
            return i
    raise AssertionError(f"{seq.request_id} never {'admitted' if admitted else 'finished'}")


# ---------------------------------------------------------------------------- tests


def mixed_workload(h: Harness) -> list[Sequence]:
    return [h.add([i + 1] * 5, max_tokens=2 if i % 2 else 20) for i in range(10)]


def test_continuous_batching_admits_as_soon_as_a_slot_frees():
    h = Harness(max_num_seqs=4)
    seqs = mixed_workload(h)
    steps = h.run()
    h.assert_all_done(seqs)
    for i, rec in enumerate(h.steps[:-1]):
        if rec.finished and h.steps[i + 1].waiting_before:
            nxt = h.steps[i + 1]
            assert len(nxt.admitted) == min(len(rec.finished), len(nxt.waiting_before))
    # Admissions happen while others are still running, not only between batches.
    assert any(rec.admitted and rec.running_before for rec in h.steps)
    assert max(len(rec.plan.scheduled) for rec in h.steps) == 4

    static = Harness(max_num_seqs=4, scheduling_policy="static")
    static_seqs = mixed_workload(static)
    static_steps = static.run()
    static.assert_all_done(static_seqs)
    assert steps < static_steps


def test_static_policy_admits_only_into_an_empty_batch():
    h = Harness(max_num_seqs=4, scheduling_policy="static")
    seqs = mixed_workload(h)
    h.run()
    h.assert_all_done(seqs)
    admissions = [rec for rec in h.steps if rec.admitted]
    assert len(admissions) == 3  # batches of 4, 4 and 2
    for rec in h.steps:
        if rec.running_before:
            assert rec.admitted == []
        else:
            assert len(rec.admitted) == min(4, len(rec.waiting_before))
    # Each batch runs until its longest member finishes.
    for rec in admissions[:-1]:
        start = h.steps.index(rec)
        batch_end = max(first_step(h, s, admitted=False) for s in rec.admitted)
        assert all(not r.admitted for r in h.steps[start + 1 : batch_end + 1])


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("budget", [8, 16, 33])
def test_token_budget_is_respected(chunked, budget):
    h = Harness(max_num_seqs=8, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    lengths = [1, 3, 5, 8, 13, 7, 2, 8]
    seqs = [h.add(list(range(n)), max_tokens=1 + n % 5) for n in lengths]
    h.run()  # check_plan asserts the budget every step
    h.assert_all_done(seqs)
    assert max(rec.plan.num_batched_tokens for rec in h.steps) <= budget


def test_chunked_prefill_splits_a_long_prompt():
    h = Harness(max_num_batched_tokens=32, enable_chunked_prefill=True, num_blocks=64)
    seq = h.add(list(range(100)), max_tokens=3)
    chunks, samples = [], []
    while not seq.is_finished:
        rec = h.step()
        (item,) = rec.plan.scheduled
        chunks.append(item.num_new_tokens)
        samples.append(rec.samples[seq.request_id])
    assert chunks == [32, 32, 32, 4, 1, 1]
    assert samples == [False, False, False, True, True, True]
    assert [len(rec.plan.prefills) for rec in h.steps] == [1, 1, 1, 1, 0, 0]
    h.assert_all_done([seq])


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    h = Harness(max_num_batched_tokens=32, enable_chunked_prefill=False, max_num_seqs=4)
    running = [h.add([1, 2, 3], max_tokens=10) for _ in range(3)]
    h.step()
    late = h.add(list(range(31)), max_tokens=2)
    rec = h.step()  # 3 decodes leave 29 tokens: the 31-token prompt does not fit
    assert len(rec.plan.decodes) == 3 and rec.admitted == []
    h.sched.finish(running[0])
    rec = h.step()  # 2 decodes leave 30
    assert rec.admitted == []
    h.sched.finish(running[1])
    rec = h.step()  # 1 decode leaves 31
    assert rec.admitted == [late] and rec.plan.num_batched_tokens == 32
    h.run()
    assert late.is_finished and running[2].is_finished
    assert h.bm.num_free_blocks == h.bm.num_blocks


def test_running_decodes_are_scheduled_before_waiting_prefills():
    h = Harness(max_num_batched_tokens=8, max_num_seqs=8)
    running = [h.add([i, i, i], max_tokens=50) for i in range(4)]
    for _ in range(3):  # 4 prompts of 3 tokens fill the first two steps (one is chunked)
        h.step()
    assert all(s.status is SequenceStatus.RUNNING for s in running)
    long = h.add(list(range(100)), max_tokens=2)
    rec = h.step()
    assert sorted(i.seq.request_id for i in rec.plan.decodes) == sorted(
        s.request_id for s in running
    )
    assert [(i.seq, i.num_new_tokens) for i in rec.plan.prefills] == [(long, 4)]
    # The running long prefill's next chunk also goes before a new admission.
    newer = h.add([9] * 10, max_tokens=2)
    rec = h.step()
    assert len(rec.plan.decodes) == 4
    assert [(i.seq, i.start, i.num_new_tokens) for i in rec.plan.prefills] == [(long, 4, 4)]
    assert newer in h.sched.waiting
    # A budget taken whole by decodes admits nothing.
    h2 = Harness(max_num_batched_tokens=4, max_num_seqs=8)
    first = [h2.add([i], max_tokens=20) for i in range(4)]
    h2.step()
    h2.add([7, 7], max_tokens=2)
    for _ in range(5):
        rec = h2.step()
        assert {i.seq.request_id for i in rec.plan.scheduled} == {s.request_id for s in first}
        assert rec.admitted == []


@pytest.mark.parametrize("max_num_seqs", [1, 3, 5])
def test_max_num_seqs_is_never_exceeded(max_num_seqs):
    h = Harness(max_num_seqs=max_num_seqs, max_num_batched_tokens=64)
    seqs = [h.add([i % 5] * (1 + i % 4), max_tokens=1 + i % 6) for i in range(12)]
    h.run()  # check_plan asserts it every step
    h.assert_all_done(seqs)
    assert max(len(rec.plan.scheduled) for rec in h.steps) == max_num_seqs
    assert max(rec.num_running for rec in h.steps) == max_num_seqs


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_by_recompute(caching):
    h = Harness(num_blocks=6, block_size=4, caching=caching, max_num_seqs=4)
    seqs = [h.add([10 * i + j for j in range(6)], max_tokens=10) for i in range(4)]
    h.run()
    h.assert_all_done(seqs)
    assert h.sched.num_preemptions > 0
    assert sum(s.num_preemptions for s in seqs) == h.sched.num_preemptions
    preempting = [rec for rec in h.steps if rec.plan.preempted]
    assert preempting
    for rec in preempting:
        victims = rec.plan.preempted
        # The newest running sequences go, newest first ...
        assert victims == rec.running_before[::-1][: len(victims)]
        # ... and wait at the head of the queue in their original running order.
        assert h.steps.index(rec) + 1 < len(h.steps)
        nxt = h.steps[h.steps.index(rec) + 1]
        assert nxt.waiting_before[: len(victims)] == victims[::-1]
        assert rec.admitted == []
    h2 = Harness(num_blocks=6, block_size=4, caching=caching, max_num_seqs=4)
    seqs2 = [h2.add([10 * i + j for j in range(6)], max_tokens=10) for i in range(4)]
    first_preempting = None
    while h2.sched.has_unfinished():
        rec = h2.step()
        if rec.plan.preempted and first_preempting is None:
            first_preempting = rec
            victim = rec.plan.preempted[-1]
            assert h2.sched.waiting[0] is victim
            assert victim.block_ids == [] and victim.num_computed_tokens == 0
            assert victim.status is SequenceStatus.WAITING
            assert len(victim.output_token_ids) > 0  # outputs are kept and recomputed
    assert first_preempting is not None
    h2.assert_all_done(seqs2)


def test_a_sequence_too_big_for_the_rest_preempts_itself_and_resumes():
    h = Harness(num_blocks=3, block_size=2, caching=False, max_num_seqs=2)
    a = h.add([1, 2], max_tokens=4)  # needs 3 blocks at its longest
    b = h.add([3, 4], max_tokens=4)
    h.run()
    h.assert_all_done([a, b])
    assert h.sched.num_preemptions > 0


def test_prefix_caching_through_the_scheduler():
    bs = 4
    h = Harness(block_size=bs, caching=True, max_num_batched_tokens=8)
    shared = [5, 6, 7, 8, 1, 2, 3, 4, 9, 9, 9, 9]  # 3 blocks
    a = h.add([*shared, 1, 1], max_tokens=4)
    while a.num_computed_tokens < len(a.prompt_token_ids):
        h.step()
    assert h.bm.prefix_cache_hit_rate == 0.0
    b = h.add([*shared, 2, 2, 2], max_tokens=4)
    running_before, waiting_before = list(h.sched.running), list(h.sched.waiting)
    plan = h.sched.schedule()
    assert b.num_computed_tokens == 3 * bs  # set at admission, before the step runs
    rec = h.complete(plan, running_before, waiting_before)
    assert rec.admitted == [b]
    (item,) = [i for i in rec.plan.scheduled if i.seq is b]
    assert item.start == 3 * bs and item.num_new_tokens == 3
    assert b.block_ids[:3] == a.block_ids[:3]
    assert h.bm.prefix_cache_hit_rate > 0
    assert h.bm.prefix_hits == 3 * bs
    assert h.bm.prefix_queries == len(a.prompt_token_ids) + len(b.prompt_token_ids)
    h.run()
    h.assert_all_done([a, b])


def test_prefix_cache_hit_at_admission_sets_computed_tokens():
    bs = 4
    h = Harness(block_size=bs, caching=True)
    shared = list(range(12))
    a = h.add([*shared, 99], max_tokens=2)
    h.run()  # a finished: its registered blocks stay hittable
    b = h.add([*shared, 98], max_tokens=2)
    waiting_before = list(h.sched.waiting)
    plan = h.sched.schedule()
    assert b.num_computed_tokens == 3 * bs
    assert [(i.start, i.num_new_tokens) for i in plan.scheduled] == [(12, 1)]
    assert plan.decodes and not plan.prefills  # a 1-token chunk runs as a decode row
    h.complete(plan, [], waiting_before)
    assert h.bm.prefix_cache_hit_rate > 0
    h.run()
    h.assert_all_done([a, b])


def test_no_prefix_hits_when_caching_is_off():
    h = Harness(block_size=4, caching=False)
    a = h.add([*range(12), 1], max_tokens=2)
    h.run()
    b = h.add([*range(12), 2], max_tokens=2)
    rec = h.step()
    assert rec.plan.scheduled[0].start == 0
    h.run()
    h.assert_all_done([a, b])
    assert h.bm.prefix_cache_hit_rate == 0.0


def test_finish_removes_waiting_and_running_sequences():
    h = Harness(max_num_seqs=1)
    a = h.add([1, 2, 3], max_tokens=5)
    b = h.add([4, 5, 6], max_tokens=5)
    h.step()
    h.sched.finish(b)  # aborted while waiting
    assert b.is_finished and b not in h.sched.waiting
    h.sched.finish(a)  # aborted while running
    assert not h.sched.has_unfinished()
    assert h.bm.num_free_blocks == h.bm.num_blocks
    assert h.sched.schedule().is_empty


# ---------------------------------------------------------------------------- property test


@st.composite
def workloads(draw):
    block_size = draw(st.integers(1, 4))
    chunked = draw(st.booleans())
    requests = draw(
        st.lists(
            st.tuples(
                st.lists(st.integers(0, 2), min_size=1, max_size=10),  # prompt
                st.integers(1, 6),  # max_tokens
                st.integers(0, 6),  # arrival step
            ),
            min_size=1,
            max_size=8,
        )
    )
    longest = max(len(p) + m for p, m, _ in requests)
    num_blocks = draw(st.integers(-(-longest // block_size), 24))
    budget = draw(st.integers(longest if not chunked else 1, 40))
    config = {
        "max_num_seqs": draw(st.integers(1, 6)),
        "max_num_batched_tokens": budget,
        "scheduling_policy": draw(st.sampled_from(["continuous", "static"])),
        "enable_chunked_prefill": chunked,
    }
    return block_size, num_blocks, draw(st.booleans()), config, requests


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_with_consistent_kv(workload):
    """Any feasible workload finishes: every request gets exactly max_tokens outputs, the plans
    respect every limit, K/V reads are always the sequence's own, the pool ends full."""
    block_size, num_blocks, caching, config, requests = workload
    h = Harness(num_blocks=num_blocks, block_size=block_size, caching=caching, **config)
    pending = sorted(requests, key=lambda r: r[2])
    seqs, step = [], 0
    while pending or h.sched.has_unfinished():
        while pending and pending[0][2] <= step:
            prompt, max_tokens, _ = pending.pop(0)
            seqs.append(h.add(prompt, max_tokens))
        if h.sched.has_unfinished():
            h.step()
        step += 1
        assert step < 2000, "no progress"
    h.assert_all_done(seqs)
    assert 0.0 <= h.bm.prefix_cache_hit_rate <= 1.0


def test_static_batch_fills_max_num_seqs_whatever_the_token_budget():
    """A static batch forms over as many steps as its prefills need under the budget: 32
    prompts of 16 tokens with a 64-token budget make one batch of 32 (not 64 / 16 = 4)."""
    h = Harness(max_num_seqs=32, max_num_batched_tokens=64, scheduling_policy="static")
    seqs = [h.add(list(range(i, i + 16)), max_tokens=40) for i in range(40)]
    h.run()
    h.assert_all_done(seqs)
    assert max(rec.num_running for rec in h.steps) == 32
    first_decode = next(i for i, rec in enumerate(h.steps) if rec.batch_formed)
    assert sum(len(rec.admitted) for rec in h.steps[:first_decode]) == 32
