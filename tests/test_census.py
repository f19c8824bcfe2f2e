"""The census that tells a per-request leak from what compiled executables keep: the objects of
this project's classes in an executable's argument tree are counted, once per executable, and
subtracted from the growth (``benchmarks.census``)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import jax
import jax.numpy as jnp

from benchmarks.census import census_growth, held_by_executables, object_census
from research.engine.attention import AttentionMetadata

NAME = f"{AttentionMetadata.__module__}.{AttentionMetadata.__qualname__}"


def _compile(n: int):
    spec = jax.ShapeDtypeStruct((n,), jnp.int32)
    meta = AttentionMetadata(
        **{f.name: spec for f in dataclasses.fields(AttentionMetadata) if f.init}
    )
    return jax.jit(lambda m: jax.tree_util.tree_leaves(m)[0] + 1).lower(meta).compile()


def test_an_executable_keeps_its_argument_tree_and_the_census_counts_it_apart():
    before, compiled_before = object_census(), held_by_executables([])
    executables = [_compile(3), _compile(5)]
    after = object_census()
    held = held_by_executables(executables)
    assert held == Counter({NAME: 2})  # one per executable, nothing the walk should not reach
    assert after[0][NAME] - before[0][NAME] == 2  # jax really keeps them alive
    growth = census_growth(before, after, (compiled_before, held))
    assert growth["compiled_objects_growth"] == 2
    assert growth["retained_objects_growth"] == growth["project_objects_growth"] - 2
    assert growth["retained_objects_growth"] == 0
