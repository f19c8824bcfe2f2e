"""What a long-running process retains: live objects by class for classes of this project,
live JAX arrays and their bytes, all gc-tracked objects. Two censuses at idle, before and after
some traffic, tell a per-request leak (growth with the requests served) from the handful of
objects the last step still references (``benchmarks.soak``). A compiled executable keeps its
call's argument tree (``jax.stages.Compiled.args_info``: the step's weights, pool and inputs
with each leaf described), one set per compiled shape however many requests it serves; those
are counted apart (``held_by_executables``) so that a background compile after the first
census is not read as a leak."""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Iterable
from typing import Any

import jax


def object_census() -> tuple[Counter, int]:
    """Live objects by class for classes defined in this project (plus the live JAX arrays
    and their bytes, under ``jax:``), and all gc-tracked objects, after a full collection."""
    gc.collect()
    ours: Counter = Counter()
    objects = gc.get_objects()
    for obj in objects:
        name = _ours(obj)
        if name is not None:
            ours[name] += 1
    total = len(objects)
    del objects
    arrays = jax.live_arrays()
    ours["jax:live_arrays"] = len(arrays)
    ours["jax:live_array_bytes"] = sum(a.nbytes for a in arrays)
    return ours, total


def _ours(obj: Any) -> str | None:
    cls = type(obj)
    module = getattr(cls, "__module__", "")
    if isinstance(module, str) and module.startswith(("research", "experiments", "benchmarks")):
        return f"{module}.{cls.__qualname__}"
    return None


def held_by_executables(executables: Iterable[Any]) -> Counter:
    """Objects of this project's classes in the argument trees the compiled ``executables``
    keep (``args_info``), by class. The walk goes through this project's objects and plain
    containers only, so it never reaches what an executable shares with the engine."""
    counts: Counter = Counter()
    seen: set[int] = set()
    stack = [getattr(c, "args_info", None) for c in executables]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        name = _ours(obj)
        if name is not None:
            counts[name] += 1
        elif not isinstance(obj, (list, tuple, dict)):
            continue
        stack.extend(gc.get_referents(obj))
    return counts


def census_growth(
    before: tuple[Counter, int],
    after: tuple[Counter, int],
    compiled: tuple[Counter, Counter] = (Counter(), Counter()),
) -> dict[str, Any]:
    """What the soak left behind: per-class growth of this project's objects (classes that
    grew only), their total, and the change in all gc-tracked objects. ``compiled``: the
    objects held by the compiled executables at the two censuses (``held_by_executables``);
    ``retained_objects_growth`` is the growth that they do not explain."""
    grew = {k: after[0][k] - before[0][k] for k in after[0] if after[0][k] > before[0][k]}

    def objects(c: Counter) -> int:
        return sum(v for k, v in c.items() if not k.startswith("jax:"))

    growth = objects(after[0]) - objects(before[0])
    compiled_growth = sum(compiled[1].values()) - sum(compiled[0].values())
    return {
        "project_objects_before": objects(before[0]),
        "project_objects_growth": growth,
        "compiled_objects_growth": compiled_growth,
        "retained_objects_growth": growth - compiled_growth,
        "live_arrays_growth": after[0]["jax:live_arrays"] - before[0]["jax:live_arrays"],
        "live_array_bytes_growth": (
            after[0]["jax:live_array_bytes"] - before[0]["jax:live_array_bytes"]
        ),
        "grew": dict(sorted(grew.items(), key=lambda kv: -kv[1])[:10]),
        "gc_objects_growth": after[1] - before[1],
    }
