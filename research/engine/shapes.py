"""Which step shapes a workload will make the engine compile, known before it runs.

The scheduler's decisions depend on the requests, the pool and the budget, never on the tokens a
model samples (with ``ignore_eos``, as the benchmark sends them) nor on how long a step takes
(in a closed loop). So the workload run through a shadow of the engine, the same scheduler
over an executor that computes nothing, makes exactly the calls the real run will make.
``predict_step_shapes`` returns their (N, R, M) shapes; ``ModelExecutor.precompile`` then
compiles them before the clock starts, as vLLM captures its CUDA graphs at start-up. With an
open-loop request rate the arrivals follow a virtual clock instead, so the prediction may miss
a shape: the benchmark's ``new_compilations`` column says so per point.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from research.engine.compile_manager import token_bucket
from research.engine.executor import StepResult


class ShapeRecorder:
    """An executor that runs nothing and records the call shapes ``executor`` would use."""

    def __init__(self, executor: Any):
        self.executor = executor
        self.shapes: set[tuple[int, int, int]] = set()
        self.num_compilations = 0

    def execute(self, plan: Any) -> StepResult:
        if not plan.is_empty:
            self.shapes.add(self.executor.call_shape(plan))
        tokens = {item.seq.request_id: 0 for item in plan.scheduled}
        return StepResult(tokens, dict.fromkeys(tokens, math.inf), 0.0, 0.0, forward_passes=1)

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
) -> set[tuple[int, int, int]]:
    """The (N, R, M) shapes of every step ``engine`` makes to serve ``requests`` (``BenchRequest``
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
    return _with_verification(engine.executor, recorder.shapes)


def _with_verification(
    executor: Any, shapes: set[tuple[int, int, int]]
) -> set[tuple[int, int, int]]:
    """With speculative decoding, rows may also carry drafts, which the shadow (no proposer, no
    model) cannot know: each predicted step may hold up to S - 1 more tokens per row, so the
    token buckets up to that many are added."""
    s = getattr(executor, "verify_tokens_per_row", 0)
    if s <= 1:
        return shapes
    cap = executor.compiler.token_cap
    out = set(shapes)
    for n, r, m in shapes:
        most = token_bucket(n + r * (s - 1), cap)
        while n < most:
            n = token_bucket(n + 1, cap)
            out.add((n, r, m))
    return out
