"""What a tensor / expert parallel plan splits, without devices (no JAX here): the logical axes
of every parameter and KV page, the rules table mapping them to mesh axes, the divisibility
checks, and the collectives the split implies. ``research.parallel.sharding.ShardingPlan``
places arrays by these tables; the cost model (``research.perf.cost_model``) prices a
tensor-parallel step from the same ``SplitPlan``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from research.config import ModelConfig

MESH_AXES = ("tp_kv", "tp_q")
TP = MESH_AXES  # "split over every tensor-parallel device"

# Logical axes of every parameter, by its key; weights are [in, out], stacked experts lead.
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("embed",),
    "attn_norm": ("embed",),
    "mlp_norm": ("embed",),
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
    "wq": ("embed", "q_heads"),
    "wk": ("embed", "kv_heads"),
    "wv": ("embed", "kv_heads"),
    "wo": ("q_heads", "embed"),
    "w_gate": ("embed", "ffn"),
    "w_up": ("embed", "ffn"),
    "w_down": ("ffn", "embed"),
    "router": ("embed", "router_experts"),
    # gpt-oss: attention biases and sinks, router bias, expert biases
    "bq": ("q_heads",),
    "bk": ("kv_heads",),
    "bv": ("kv_heads",),
    "bo": ("embed",),
    "sinks": ("q_heads",),
    "router_bias": ("router_experts",),
    "b_gate": ("experts", "expert_ffn"),
    "b_up": ("experts", "expert_ffn"),
    "b_down": ("experts", "embed"),
}
MOE_AXES: dict[str, tuple[str, ...]] = {
    "w_gate": ("experts", "embed", "expert_ffn"),
    "w_up": ("experts", "embed", "expert_ffn"),
    "w_down": ("experts", "expert_ffn", "embed"),
}
# KV pages [K, B, P, E'] and their scales [K, B, P] (quantized KV), every layer.
KV_PAGE_AXES = ("kv_heads", "blocks", "block_tokens", "head_dim")
KV_SCALE_AXES = ("kv_heads", "blocks", "block_tokens")


def rules(expert_parallel: bool) -> dict[str, tuple[str, ...]]:
    """Logical axis -> mesh axes it is split over; axes not named here are replicated."""
    return {
        "vocab": TP,
        "q_heads": TP,
        "ffn": TP,
        "kv_heads": ("tp_kv",),
        "experts": TP if expert_parallel else (),
        "expert_ffn": () if expert_parallel else TP,
    }


def valid_sizes(cfg: ModelConfig, expert_parallel: bool, limit: int = 64) -> list[int]:
    """Every tensor-parallel size up to ``limit`` that splits the model evenly."""
    return [n for n in range(1, limit + 1) if _problem(cfg, n, expert_parallel) is None]


def check_divisible(cfg: ModelConfig, n: int, expert_parallel: bool) -> None:
    """ValueError naming the first dimension ``n`` devices cannot split evenly, and the sizes
    that would."""
    if n < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {n}")
    problem = _problem(cfg, n, expert_parallel)
    if problem is not None:
        raise ValueError(
            f"tensor_parallel_size={n} {problem}; sizes that split every dimension of "
            f"{cfg.name}: {valid_sizes(cfg, expert_parallel)}"
        )


def _problem(cfg: ModelConfig, n: int, expert_parallel: bool) -> str | None:
    checks = [("num_heads (query heads)", cfg.num_heads), ("vocab_size", cfg.vocab_size)]
    if cfg.is_moe:
        if expert_parallel:
            checks.append(("num_experts", cfg.num_experts))
        else:
            checks.append(("moe_intermediate_size", cfg.moe_intermediate_size))
    else:
        checks.append(("intermediate_size", cfg.intermediate_size))
    for name, size in checks:
        if size % n:
            return f"does not divide {name}={size}"
    k = cfg.num_kv_heads
    if k % n and n % k:
        return (
            f"and num_kv_heads={k}: one must divide the other (kv heads are split, or "
            "replicated when there are fewer than devices)"
        )
    return None


# A layer output that sums over a split axis needs an all-reduce: attention's output
# projection sums over query heads; the MLP's down projection over its width, and an MoE's
# weighted combine over the experts.
SUMMED_AXES: dict[str, tuple[str, ...]] = {
    "wo": ("q_heads",),
    "w_down": ("ffn", "expert_ffn", "experts"),
}


def param_axes(key: str, ndim: int) -> tuple[str, ...]:
    """The logical axes of parameter ``key`` (``ndim`` 3: stacked experts)."""
    if ndim == 3 and key in MOE_AXES:
        return MOE_AXES[key]
    if key not in PARAM_AXES:
        raise ValueError(f"parameter {key!r} has no logical axes in the sharding rules")
    return PARAM_AXES[key]


@dataclass(frozen=True)
class Collective:
    """One collective a step runs: ``kind`` after ``after``, ``per`` layer or step, moving
    ``width`` elements per token ("token") or per logits row ("logits_row")."""

    kind: str  # "all_reduce" | "all_gather"
    after: str
    per: str  # "layer" | "step"
    unit: str  # "token" | "logits_row"
    width: int


@dataclass(frozen=True)
class SplitPlan:
    """How ``tp`` devices split one model: a (tp_kv, tp_q) mesh (kv heads over tp_kv, replicated
    over tp_q) and the rules table. Device-free; ``ShardingPlan`` is its placement."""

    tp: int = 1
    tp_kv: int = 1
    expert_parallel: bool = False

    @classmethod
    def for_model(cls, cfg: ModelConfig, tp: int, expert_parallel: bool = False) -> SplitPlan:
        check_divisible(cfg, tp, expert_parallel)
        return cls(tp, min(tp, cfg.num_kv_heads), expert_parallel)

    @property
    def mesh_shape(self) -> dict[str, int]:
        return {"tp_kv": self.tp_kv, "tp_q": self.tp // self.tp_kv}

    def ways(self, logical: str) -> int:
        """How many ways the rules split a logical axis (1: replicated)."""
        return math.prod(self.mesh_shape[a] for a in rules(self.expert_parallel).get(logical, ()))

    def param_ways(self, key: str, ndim: int) -> int:
        """The share of parameter ``key`` each device holds is 1 / this."""
        return math.prod(self.ways(a) for a in param_axes(key, ndim))

    def collectives(self, cfg: ModelConfig) -> list[Collective]:
        """The collectives the split implies, read off the tables: an all-reduce after every
        layer output that sums over a split axis, one after the embedding lookup when the
        vocabulary is split (each device looks up its rows), and an all-gather of the logits."""
        out = []
        for key, summed in SUMMED_AXES.items():
            if any(
                self.ways(a) > 1 for a in summed if a in param_axes(key, 3 if cfg.is_moe else 2)
            ):
                out.append(Collective("all_reduce", key, "layer", "token", cfg.hidden_size))
        if self.ways("vocab") > 1:
            out.append(Collective("all_reduce", "embed", "step", "token", cfg.hidden_size))
            out.append(Collective("all_gather", "lm_head", "step", "logits_row", cfg.vocab_size))
        return out
