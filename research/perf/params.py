"""The free parameters of the cost model (``CostParams``): what calibration fits and what an
engine profile may fix. Below every module that prices, fits or stores them. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class CostParams:
    """The free parameters of the cost model (``research.perf.cost_model``); efficiencies are
    in (0, 1].

    bandwidth_efficiency: fraction of ``Hardware.achievable_bandwidth`` the reads reach.
    per_step_overhead_s: host seconds per step (scheduling, launches, sync), whatever the batch.
    per_seq_overhead_s: host seconds per scheduled sequence per step (scheduling, sampling
        bookkeeping, detokenizing): what makes host time grow with the batch.
    dense_gemm_efficiency / expert_gemm_efficiency: W4A16 (dequantizing) dense and grouped expert
        GEMMs, fraction of the bf16 sustained rate.
    native_gemm_efficiency: GEMMs whose operands go to the tensor cores as stored.
    attention_efficiency: attention FLOPs, fraction of the bf16 sustained rate.
    attention_read_efficiency: fraction of the read bandwidth (``bandwidth_efficiency`` of
        the achievable one) that attention's K/V reads reach. 1 for a paged kernel that streams
        whole pages (what the GB10 fit assumes, pages priced by ``page_efficiency``); lower
        where attention gathers each row's pages into a padded copy first (our XLA path).
    moe_concentration: working-set fraction of the ``sequence_locality`` / ``hot_set`` laws.
    eager_layer_overhead_s: host seconds per layer that a step pays when it is launched kernel by
        kernel instead of replayed from a captured graph (``CostModel(graph_max_tokens=...)``
        says which steps are): the launches and the framework's per-node work that a graph
        replay skips, exposed because small decode kernels finish faster than they launch.
    request_path_s: seconds a request spends outside the engine's steps before its first token
        reaches the client (the server's request path: HTTP, tokenization, the hand-off to the
        engine core, the first streamed chunk). Charged once per request on the client's
        clock (``research.perf.launch``); 0 where the points it is fitted on hold none apart.
    """

    bandwidth_efficiency: float
    per_step_overhead_s: float
    per_seq_overhead_s: float = 0.0
    dense_gemm_efficiency: float = 1.0
    expert_gemm_efficiency: float = 1.0
    native_gemm_efficiency: float = 1.0
    attention_efficiency: float = 1.0
    attention_read_efficiency: float = 1.0
    moe_concentration: float = 1.0
    eager_layer_overhead_s: float = 0.0
    request_path_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s"):
                if value < 0:
                    raise ValueError(f"{f.name} must be >= 0, got {value}")
            elif not 0.0 < value <= 1.0:
                raise ValueError(f"{f.name} must be in (0, 1] (never above a peak), got {value}")

    def to_dict(self) -> dict[str, float]:
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}


__all__ = ["CostParams"]
