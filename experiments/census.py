"""What a long-running process retains: live objects by class for classes of this project,
live JAX arrays and their bytes, all gc-tracked objects. Two censuses at idle, before and after
some traffic, tell a per-request leak (growth with the requests served) from the handful of
objects the last step still references (``experiments.soak``)."""

from __future__ import annotations

import gc
from collections import Counter
from typing import Any

import jax


def object_census() -> tuple[Counter, int]:
    """Live objects by class for classes defined in this project (plus the live JAX arrays
    and their bytes, under ``jax:``), and all gc-tracked objects, after a full collection."""
    gc.collect()
    ours: Counter = Counter()
    objects = gc.get_objects()
    for obj in objects:
        cls = type(obj)
        module = getattr(cls, "__module__", "")
        if isinstance(module, str) and module.startswith(("research", "experiments")):
            ours[f"{module}.{cls.__qualname__}"] += 1
    total = len(objects)
    del objects
    arrays = jax.live_arrays()
    ours["jax:live_arrays"] = len(arrays)
    ours["jax:live_array_bytes"] = sum(a.nbytes for a in arrays)
    return ours, total


def census_growth(before: tuple[Counter, int], after: tuple[Counter, int]) -> dict[str, Any]:
    """What the soak left behind: per-class growth of this project's objects (classes that
    grew only), their total, and the change in all gc-tracked objects."""
    grew = {k: after[0][k] - before[0][k] for k in after[0] if after[0][k] > before[0][k]}

    def objects(c: Counter) -> int:
        return sum(v for k, v in c.items() if not k.startswith("jax:"))

    return {
        "project_objects_before": objects(before[0]),
        "project_objects_growth": objects(after[0]) - objects(before[0]),
        "live_arrays_growth": after[0]["jax:live_arrays"] - before[0]["jax:live_arrays"],
        "live_array_bytes_growth": (
            after[0]["jax:live_array_bytes"] - before[0]["jax:live_array_bytes"]
        ),
        "grew": dict(sorted(grew.items(), key=lambda kv: -kv[1])[:10]),
        "gc_objects_growth": after[1] - before[1],
    }
