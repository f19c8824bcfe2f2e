"""Tensor and expert parallelism as data: logical axis names on every parameter and KV page, and
one rules table that maps them to mesh axes (the MaxText / jax-llm-examples way).

A model is split over ``tensor_parallel_size`` = N devices arranged as a mesh
``(tp_kv, tp_q)``: query heads, the MLP width and the vocabulary are split over all N; kv heads
over ``tp_kv`` = min(N, kv heads), so when N exceeds the kv heads each kv head is replicated on
``tp_q`` = N / kv_heads devices (vLLM does the same), and every device's query heads read the kv
head they belong to. With ``expert_parallel`` the MoE experts are split over the N devices
instead of their width. Everything else (norms, the router, head_dim) is replicated.

The jitted step keeps its shapes: parameters and the KV pool are placed with ``NamedSharding``
and XLA inserts the collectives (an all-reduce after the attention output and MLP down
projections, a gather of the vocabulary-split logits). Attention and the expert-parallel MoE run
under ``shard_map`` so each device reads only its own kv heads' pages and its own experts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from research.config import ModelConfig
from research.parallel.plan import (
    KV_PAGE_AXES,
    KV_SCALE_AXES,
    MESH_AXES,
    check_divisible,
    param_axes,
    rules,
)
from research.quant.qtensor import QTensor


@dataclass(frozen=True)
class ShardingPlan:
    """Where every parameter and KV page of one model lives on a ``(tp_kv, tp_q)`` mesh."""

    mesh: Mesh
    expert_parallel: bool = False

    @classmethod
    def create(
        cls,
        cfg: ModelConfig,
        tensor_parallel_size: int,
        expert_parallel: bool = False,
        devices: list[Any] | None = None,
    ) -> ShardingPlan:
        check_divisible(cfg, tensor_parallel_size, expert_parallel)
        devices = list(jax.devices() if devices is None else devices)
        n = tensor_parallel_size
        if len(devices) < n:
            raise ValueError(
                f"tensor_parallel_size={n} needs {n} devices; JAX sees {len(devices)} "
                f"({devices[0].platform}). On CPU, set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={n} before JAX starts"
            )
        tp_kv = min(n, cfg.num_kv_heads)
        grid = np.array(devices[:n], dtype=object).reshape(tp_kv, n // tp_kv)
        return cls(Mesh(grid, MESH_AXES), expert_parallel)

    @property
    def size(self) -> int:
        return self.mesh.size

    def spec(self, logical: tuple[str | None, ...]) -> PartitionSpec:
        table = rules(self.expert_parallel)
        parts = []
        for name in logical:
            axes = tuple(a for a in table.get(name or "", ()) if self.mesh.shape[a] > 1)
            parts.append(axes[0] if len(axes) == 1 else (axes or None))
        return PartitionSpec(*parts)

    def sharding(self, logical: tuple[str | None, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical))

    # ------------------------------------------------------------------ parameters

    def param_axes(self, key: str, ndim: int) -> tuple[str, ...]:
        return param_axes(key, ndim)

    def param_shardings(self, params: Any) -> Any:
        """A pytree of NamedSharding matching ``params`` (a QTensor's storage is split along the
        same axes as the matrix it holds)."""

        def one(path: Any, leaf: Any) -> Any:
            key = _key(path)
            if isinstance(leaf, QTensor):
                return self._qtensor_shardings(key, leaf)
            axes = self.param_axes(key, np.ndim(leaf))
            self._check_leaf(key, np.shape(leaf), axes)
            return self.sharding(axes)

        return jax.tree_util.tree_map_with_path(
            one, params, is_leaf=lambda x: isinstance(x, QTensor)
        )

    def _qtensor_shardings(self, key: str, qt: QTensor) -> QTensor:
        axes = self.param_axes(key, len(qt.shape))
        lead, (ax_in, ax_out) = axes[:-2], axes[-2:]

        def leaf(name: str) -> NamedSharding | None:
            value = getattr(qt, name)
            if value is None:
                return None
            rank = np.ndim(value)
            if rank == len(lead):  # nvfp4's per-tensor (per-expert) scale
                leaf_axes = lead
            elif rank == len(lead) + 1:  # fp8's per-column scales
                leaf_axes = (*lead, ax_out)
            else:
                leaf_axes = (*lead, ax_in, ax_out)
            self._check_leaf(f"{key}.{name} ({qt.fmt})", np.shape(value), leaf_axes)
            return self.sharding(leaf_axes)

        return dataclasses.replace(
            qt,
            codes=leaf("codes"),
            scales=leaf("scales"),
            zeros=leaf("zeros"),
            tensor_scale=leaf("tensor_scale"),
        )

    def _check_leaf(self, key: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> None:
        spec = self.spec(axes)
        for dim, part in zip(shape, spec, strict=True):
            parts = (part,) if isinstance(part, str) else part or ()
            ways = int(np.prod([self.mesh.shape[a] for a in parts]))
            if dim % ways:
                raise ValueError(
                    f"{key}: dimension {dim} cannot be split {ways} ways (shape {shape}, "
                    f"logical axes {axes}) at tensor_parallel_size={self.size}"
                )

    def place_params(self, params: Any) -> Any:
        return jax.device_put(params, self.param_shardings(params))

    # ------------------------------------------------------------------ KV pool

    def pool_shardings(self, pool: Any) -> Any:
        """KVPool of NamedSharding: pages and scales split by kv head."""
        pages = self.sharding(KV_PAGE_AXES)
        scales = self.sharding(KV_SCALE_AXES)
        for p in [*pool.k, *pool.v]:
            self._check_leaf("kv pages", p.shape, KV_PAGE_AXES)
        return dataclasses.replace(
            pool,
            k=[pages] * len(pool.k),
            v=[pages] * len(pool.v),
            k_scales=[scales] * len(pool.k_scales),
            v_scales=[scales] * len(pool.v_scales),
        )

    def place_pool(self, pool: Any) -> Any:
        return jax.device_put(pool, self.pool_shardings(pool))

    def describe(self) -> str:
        return (
            f"tensor parallel {self.size} (mesh tp_kv={self.mesh.shape['tp_kv']} x "
            f"tp_q={self.mesh.shape['tp_q']})"
            + (", experts split over every device" if self.expert_parallel else "")
        )


def _key(path: Any) -> str:
    """The parameter's own name: the last dict key on its path."""
    for entry in reversed(path):
        if isinstance(entry, jax.tree_util.DictKey):
            return str(entry.key)
    raise ValueError(f"parameter at {jax.tree_util.keystr(path)} has no name")
