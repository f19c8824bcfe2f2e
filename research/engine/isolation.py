"""Finding the requests that make a step fail, so that only they fail. No JAX here.

A step runs many requests together, so one request the device step cannot handle (or a fault
tied to it) would otherwise fail everyone in the batch. When ``execute(plan)`` raises, each
scheduled request is first re-validated on its own (its sampling params and token ids); then
the rest is bisected: a part of the batch is run as its own plan, a part that runs is clean
(its tokens are kept), a part that fails is halved again down to single requests.

Re-running is safe. A step writes each token's K/V to that token's own slot whatever else is in
the batch, and a request's sample depends only on its own logits, seed and step count, so the
clean requests get exactly the tokens the whole step would have given them. A copy-on-write
block copy is replayed only with the part holding the request that owns the destination block,
so it never overwrites K/V that another part already wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from research.engine.executor import StepResult
from research.engine.scheduler import ScheduledSeq, StepPlan
from research.engine.sequence import Sequence

_MAX_REASON = 500  # characters of an exception kept in a failed request's error


def _reason(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 3] + "..."


def _sub_plan(plan: StepPlan, items: list[ScheduledSeq]) -> StepPlan:
    """The part of ``plan`` that runs ``items`` (with the block copies they own)."""
    chosen = {id(item) for item in items}
    owned = {b for item in items for b in item.seq.block_ids}
    return StepPlan(
        decodes=[i for i in plan.decodes if id(i) in chosen],
        prefills=[i for i in plan.prefills if id(i) in chosen],
        verifies=[i for i in plan.verifies if id(i) in chosen],
        block_copies=[(src, dst) for src, dst in plan.block_copies if dst in owned],
    )


def isolate_failure(
    executor: Any,
    plan: StepPlan,
    check: Callable[[Sequence], None],
) -> tuple[StepPlan, StepResult, list[tuple[Sequence, str]]]:
    """After ``executor.execute(plan)`` raised: returns the plan of the requests that
    ran (to commit), their result, and (sequence, reason) for each request that fails.

    ``check(seq)`` raises ``ValueError`` if a request's own state is invalid. If every part
    runs when retried (a transient fault), nobody fails; if every single request fails alone,
    every request fails with its own error."""
    culprits: list[tuple[Sequence, str]] = []
    suspects: list[ScheduledSeq] = []
    for item in plan.scheduled:
        try:
            check(item.seq)
        except ValueError as invalid:
            culprits.append((item.seq, str(invalid)))
        else:
            suspects.append(item)
    tokens: dict[str, int] = {}
    gaps: dict[str, float] = {}
    logprobs: dict[str, Any] = {}
    prompt_logprobs: dict[str, Any] = {}
    accepted: dict[str, list[int]] = {}
    accepted_gaps: dict[str, list[float]] = {}
    duration = device_time = kernel_time = 0.0
    clean: list[ScheduledSeq] = []
    parts = [suspects] if suspects else []
    while parts:
        items = parts.pop()
        try:
            result = executor.execute(_sub_plan(plan, items))
        except Exception as part_error:
            if len(items) == 1:
                culprits.append((items[0].seq, _reason(part_error)))
            else:
                half = len(items) // 2
                parts += [items[half:], items[:half]]
            continue
        clean += items
        tokens.update(result.tokens)
        gaps.update(result.top2_gaps)
        logprobs.update(result.logprobs)
        prompt_logprobs.update(result.prompt_logprobs)
        accepted.update(result.accepted)
        accepted_gaps.update(result.accepted_top2_gaps)
        duration += result.duration
        device_time += result.device_time
        kernel_time += result.kernel_time
    committed = _sub_plan(plan, clean)
    committed.preempted, committed.block_copies = plan.preempted, plan.block_copies
    return (
        committed,
        StepResult(
            tokens,
            gaps,
            duration,
            device_time,
            logprobs,
            prompt_logprobs,
            accepted,
            accepted_gaps,
            kernel_time=kernel_time,
        ),
        culprits,
    )
