"""Tensor and expert parallelism on JAX's own sharding.

``plan`` (no JAX): the logical axes, the rules table, ``SplitPlan`` and its collectives;
``sharding``: ``ShardingPlan``, which places parameters and the KV pool on a device mesh;
``ops``: the ``shard_map`` parts of the step; ``launch``: one model across processes with
``jax.distributed``."""

from research.parallel.plan import SplitPlan, check_divisible, valid_sizes


def __getattr__(name: str):
    if name == "ShardingPlan":
        from research.parallel.sharding import ShardingPlan

        return ShardingPlan
    raise AttributeError(name)


__all__ = ["ShardingPlan", "SplitPlan", "check_divisible", "valid_sizes"]
