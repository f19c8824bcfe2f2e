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

import time
from typing import Any

from research.engine.executor import StepResult
from research.perf.cost_model import CostModel, step_shape_from_plan

SYNTHETIC_TOKEN = 0


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

    def __init__(self, cost_model: CostModel, clock: VirtualClock | None = None):
        self.cost_model = cost_model
        self.clock = clock or VirtualClock()
        self.num_compilations = 0  # nothing is compiled
        self.simulated_time = 0.0

    def execute(self, plan: Any) -> StepResult:
        t0 = time.perf_counter()
        seconds = self.cost_model.step_time(step_shape_from_plan(plan))
        self.clock.advance(seconds)
        self.simulated_time += seconds
        tokens = {item.seq.request_id: SYNTHETIC_TOKEN for item in plan.scheduled}
        gaps = dict.fromkeys(tokens, float("inf"))
        return StepResult(tokens, gaps, time.perf_counter() - t0, 0.0)

    def poison_blocks(self, block_ids: list[int], value: float = float("nan")) -> None:
        del block_ids, value  # no memory to poison
