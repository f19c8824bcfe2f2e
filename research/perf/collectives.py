"""Collectives between boxes under tensor parallelism: the all-reduces and all-gathers a
``research.parallel.plan.SplitPlan`` lists, priced over the interconnect. Pure Python.

A ring all-reduce moves ``2 (n - 1) / n`` of its buffer over the link, an all-gather
``(n - 1) / n``; each pays a fixed ``latency_s`` (launch + RDMA round trip).
"""

from __future__ import annotations

from typing import Any

from research.perf.step_shape import StepWork

# One all-reduce's fixed cost between two boxes (launch + RDMA round trip); an assumption, not
# fitted (the calibration points are single-box).
ALLREDUCE_LATENCY_S = 20e-6


def collective_seconds(
    split: Any, cfg: Any, tp: int, link_bandwidth: float | None, act_bytes: int,
    w: StepWork, latency_s: float = ALLREDUCE_LATENCY_S,
) -> float:  # fmt: skip
    """Seconds of the plan's collectives for one call of ``w`` over ``tp`` devices."""
    total = 0.0
    for c in split.collectives(cfg):
        rows = w.tokens if c.unit == "token" else w.logits_rows
        elem = act_bytes if c.unit == "token" else 4  # logits are float32
        share = (2 if c.kind == "all_reduce" else 1) * (tp - 1) / tp
        seconds = share * rows * c.width * elem / link_bandwidth
        total += (cfg.num_layers if c.per == "layer" else 1) * (seconds + latency_s)
    return total


__all__ = ["ALLREDUCE_LATENCY_S", "collective_seconds"]
