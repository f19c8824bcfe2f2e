"""Tensor and expert parallelism on JAX's own sharding (``ShardingPlan``)."""

from research.parallel.sharding import ShardingPlan, check_divisible, valid_sizes

__all__ = ["ShardingPlan", "check_divisible", "valid_sizes"]
