"""Which step shapes a workload will make the engine compile, known before it runs.

The scheduler's decisions depend on the requests, the pool and the budget, never on the tokens a
model samples (with ``ignore_eos``, as the benchmark sends them) nor on how long a step takes
(in a closed loop). So the workload run through a shadow of the engine, the same scheduler
over an executor that computes nothing, makes exactly the calls the real run will make.
``predict_step_shapes`` returns their (N, R, T, M) shapes; ``ModelExecutor.precompile`` then
compiles them before the clock starts, as vLLM captures its CUDA graphs at start-up. With an
open-loop request rate the arrivals follow a virtual clock instead, so the prediction may miss
a shape: the benchmark's ``new_compilations`` column says so per point.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from research.engine.executor import StepResult


class ShapeRecorder:
    """An executor that runs nothing and records the call shapes ``executor`` would use."""

    def __init__(self, executor: Any):
        self.executor = executor
        self.shapes: set[tuple[int, int, int, int]] = set()
        self.num_compilations = 0

    def execute(self, plan: Any) -> StepResult:
        for group, is_decode in ((plan.decodes, True), (plan.prefills, False)):
            if group:
                self.shapes.add(self.executor.call_shape(group, is_decode))
        tokens = {item.seq.request_id: 0 for item in plan.scheduled}
        return StepResult(tokens, dict.fromkeys(tokens, math.inf), 0.0, 0.0)

    def poison_blocks(self, block_ids: list[int], value: float = float("nan")) -> None:
        del block_ids, value


def predict_step_shapes(
    engine: Any,
    requests: Sequence[Any],
    *,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
) -> set[tuple[int, int, int, int]]:
    """The (N, R, T, M) shapes of every call ``engine`` makes to serve ``requests`` (``BenchRequest``
    s) under the given load, found by running them through a shadow engine (same model config,
    pool size, scheduler and context length; nothing is computed)."""
    from research.bench.driver import run_benchmark
    from research.engine.engine import Engine
    from research.perf.simulated import VirtualClock

    recorder = ShapeRecorder(engine.executor)
    clock = VirtualClock()
    cache = dataclasses.replace(engine.cache_config, num_kv_blocks=engine.block_manager.num_blocks)
    shadow = Engine(
        engine.model_config,
        None,
        None,
        cache_config=cache,
        scheduler_config=engine.scheduler_config,
        max_model_len=engine.max_model_len,
        executor=recorder,
        clock=clock,
    )
    run_benchmark(
        shadow,
        requests,
        max_concurrency=max_concurrency,
        request_rate=request_rate,
        burstiness=burstiness,
        seed=seed,
        clock=clock,
        sleep=clock.sleep,
    )
    return recorder.shapes
