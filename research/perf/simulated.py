"""The simulated executor: the real engine and scheduler, a cost model instead of a model.

``SimulatedExecutor.execute(plan)`` prices the step plan with ``CostModel`` on a named machine,
advances a virtual clock by that time and returns a synthetic token for every scheduled sequence
(token ``SYNTHETIC_TOKEN``: workloads use ``ignore_eos``, so the token's value never matters). The
engine stamps every request's timestamps with this clock, so the benchmark driver computes TTFT,
TPOT, ITL and throughput from the same code as for the real executor. No weights are allocated:
a 70B model is simulated on a laptop. The KV pool is sized by vLLM's formula on the machine
(``kv_capacity_blocks``), so preemption happens where the real box would preempt.
"""

from __future__ import annotations

import heapq
import random
import time
from typing import Any

from research.engine.executor import StepResult
from research.parallel.replicas import Replica, Router
from research.perf.cost_model import CostModel, StepShape, step_shape_from_plan

SYNTHETIC_TOKEN = 0
# Host seconds of one sequence's n-gram lookup per step (an assumption, not fitted: vLLM's
# numba lookup over a few thousand tokens takes microseconds).
NGRAM_LOOKUP_S = 20e-6


class SyntheticProposer:
    """Simulated speculative decoding: every caught-up sequence drafts its k tokens (synthetic
    ones); ``SimulatedExecutor`` decides how many the target accepts."""

    def __init__(self, num_speculative_tokens: int):
        self.k = num_speculative_tokens

    def propose_batch(self, requests: list[tuple[Any, int]]) -> dict[str, list[int]]:
        return {seq.request_id: [SYNTHETIC_TOKEN] * min(self.k, room) for seq, room in requests}

    def release(self, request_id: str) -> None:
        """Nothing is kept per request."""


class VirtualClock:
    """Seconds since the simulation started; only the executor (and ``sleep``) move it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"the virtual clock cannot go back ({seconds} s)")
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        """What an open-loop driver calls while it waits for the next arrival."""
        self.advance(max(0.0, seconds))


class SimulatedExecutor:
    """Same interface as ``ModelExecutor`` for the engine: ``execute``, ``poison_blocks``,
    ``num_compilations``."""

    def __init__(
        self,
        cost_model: CostModel,
        clock: VirtualClock | None = None,
        acceptance_rate: float = 0.0,
        proposer_s_per_seq: float = NGRAM_LOOKUP_S,
        seed: int = 0,
    ):
        """Speculative rows (``plan.verifies``): each draft is accepted with probability
        ``acceptance_rate``, independently, until the first rejection (the model behind
        vLLM's and Leviathan et al.'s expected speedup); the step is priced as the target's
        verification of every draft plus ``proposer_s_per_seq`` of lookup per row."""
        if not 0.0 <= acceptance_rate <= 1.0:
            raise ValueError(f"acceptance_rate must be in [0, 1], got {acceptance_rate}")
        self.acceptance_rate = acceptance_rate
        self.proposer_s_per_seq = proposer_s_per_seq
        self._rng = random.Random(seed)
        self.cost_model = cost_model
        self.clock = clock or VirtualClock()
        self.num_compilations = 0  # nothing is compiled
        self.simulated_time = 0.0
        # (clock before, seconds, StepShape) of every step while ``step_log`` is a list (None: off); the
        # prediction band re-prices a closed-loop run from it (``research.perf.bands``).
        self.step_log: list[tuple[float, float, StepShape]] | None = None

    def reseed(self, seed: int) -> None:
        """Start the acceptance draws from ``seed`` (what a benchmark point does first)."""
        self._rng = random.Random(seed)

    def execute(self, plan: Any) -> StepResult:
        t0 = time.perf_counter()
        shape = step_shape_from_plan(plan)
        verifies = getattr(plan, "verifies", [])
        seconds = self.cost_model.step_time(shape) + self.proposer_s_per_seq * len(verifies)
        if self.step_log is not None:
            self.step_log.append((self.clock.now, seconds, shape))
        self.clock.advance(seconds)
        self.simulated_time += seconds
        tokens = {item.seq.request_id: SYNTHETIC_TOKEN for item in plan.scheduled}
        gaps = dict.fromkeys(tokens, float("inf"))
        result = StepResult(tokens, gaps, time.perf_counter() - t0, 0.0)
        for item in verifies:
            accepted = 0
            while (
                accepted < len(item.draft_token_ids) and self._rng.random() < self.acceptance_rate
            ):
                accepted += 1
            rid = item.seq.request_id
            result.accepted[rid] = [SYNTHETIC_TOKEN] * accepted
            result.accepted_top2_gaps[rid] = [float("inf")] * accepted
        return result

    def poison_blocks(self, block_ids: list[int], value: float = float("nan")) -> None:
        del block_ids, value  # no memory to poison


def trace_summary(
    step_log: list[tuple[float, float, StepShape]], prompt_tokens: int
) -> dict[str, float]:
    """What a simulated run's steps spent their time on, from the executor's ``step_log``:
    ``prefill_tokens`` (prompt tokens computed, chunks of recomputed prompts included),
    ``recomputed_prefill_tokens`` (beyond the ``prompt_tokens`` the requests brought: the cost
    of preemption by recompute), ``prefill_time_share`` (seconds of steps that carry a prefill
    chunk over all step seconds) and ``mean_decode_rows`` (decodes per step)."""
    total = sum(seconds for _, seconds, _ in step_log)
    prefill = decodes = 0
    prefill_seconds = 0.0
    for _, seconds, shape in step_log:
        chunks = [n for n, _ in shape.seqs if n > 1]
        prefill += sum(chunks)
        decodes += shape.num_seqs - len(chunks)
        if chunks:
            prefill_seconds += seconds
    return {
        "prefill_tokens": prefill,
        "recomputed_prefill_tokens": max(0, prefill - prompt_tokens),
        "prefill_time_share": prefill_seconds / total if total else 0.0,
        "mean_decode_rows": decodes / len(step_log) if step_log else 0.0,
    }


class ReplicaRouter:
    """N independent simulated boxes behind a router (data parallelism), as one engine for the
    benchmark driver: ``add_request`` sends each request to the replica ``routing`` picks (the
    policies of the real router, ``research.parallel.replicas``: random by default, seeded),
    ``step`` advances a discrete-event simulation.

    Each replica has its own virtual clock. A step runs the busy replica whose clock is earliest
    (its next step starts then); its outputs are held until the router's clock reaches their
    timestamps, so the driver sees every finish in time order and refills a freed slot at the
    right moment. An idle replica that receives a request first catches up to the present.
    """

    def __init__(self, engines: list[Any], seed: int = 0, routing: str = "random"):
        if not engines:
            raise ValueError("a router needs at least one replica")
        self.engines = engines
        self.router = Router([Replica(str(i)) for i in range(len(engines))], routing, seed=seed)
        self._owner: dict[str, int] = {}  # request id -> replica index
        self._now = 0.0
        self._held: list[tuple[float, int, Any]] = []  # (time, tiebreak, RequestOutput) heap
        self._count = 0

    def clock(self) -> float:
        return self._now

    def sleep(self, seconds: float) -> None:
        self._now += max(0.0, seconds)

    def add_request(
        self,
        prompt_token_ids: Any,
        sampling_params: Any = None,
        request_id: str | None = None,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        prefix = " ".join(map(str, list(prompt_token_ids)[:64]))
        index = int(self.router.choose(prefix).url)
        engine = self.engines[index]
        clock = engine.executor.clock
        clock.now = max(clock.now, self._now)
        request_id = request_id or f"router-{self._count}"
        self._count += 1
        rid = engine.add_request(
            prompt_token_ids,
            sampling_params,
            request_id=request_id,
            prompt=prompt,
            arrival_time=self._now if arrival_time is None else arrival_time,
        )
        self.router.start(self.router.replicas[index])
        self._owner[rid] = index
        return rid

    def has_unfinished_requests(self) -> bool:
        return bool(self._held) or any(e.has_unfinished_requests() for e in self.engines)

    def step(self) -> list[Any]:
        busy = [e for e in self.engines if e.has_unfinished_requests()]
        next_start = min((e.executor.clock.now for e in busy), default=float("inf"))
        if self._held and self._held[0][0] <= next_start:
            # Every replica's next step starts after the earliest held output: release it.
            self._now = max(self._now, self._held[0][0])
        elif busy:
            engine = min(busy, key=lambda e: e.executor.clock.now)
            self._now = max(self._now, engine.executor.clock.now)
            for out in engine.step():
                stamp = out.metrics.token_times[-1] if out.metrics.token_times else self._now
                heapq.heappush(self._held, (stamp, self._count, out))
                self._count += 1
            return []
        released = []
        while self._held and self._held[0][0] <= self._now:
            out = heapq.heappop(self._held)[2]
            if out.finished and out.request_id in self._owner:
                self.router.done(self.router.replicas[self._owner.pop(out.request_id)])
            released.append(out)
        return released

    def stats(self) -> dict[str, Any]:
        per = [e.stats() for e in self.engines]
        summed = (
            "num_steps",
            "num_preemptions",
            "prefix_cache_queries",
            "prefix_cache_hits",
            "kv_evictions",
        )
        merged = {k: sum(s[k] for s in per) for k in summed}
        return merged | {"replicas": len(self.engines), "per_replica": per}
