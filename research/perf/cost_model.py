"""Price one engine step on a named machine: bytes moved, FLOPs, and a roofline with overheads.

A step is described by ``StepShape``: one ``(num_new_tokens, context_before)`` pair per scheduled
sequence (``context_before`` = tokens of that sequence already in the KV cache). ``CostModel``
turns it into seconds::

    time = max(bytes / (bandwidth_efficiency * hw.achievable_bandwidth),
               flops / (compute_efficiency * hw.tensor_flops[compute dtype]))
           + per_step_overhead_s + num_layers * per_layer_overhead_s

Bytes read/written per step (``CostModel.breakdown`` keeps every term):

- dense weights: every non-expert layer weight (q/k/v/o projections, norms, MoE router, a dense
  model's MLP) read once per step, whatever the batch; final norm and lm_head read once (the
  lm_head matmul streams the whole [hidden, vocab] matrix for the logits rows, one row per
  scheduled sequence); the embedding lookup reads only the rows of the step's tokens
  (tokens * hidden * dtype bytes: negligible, but counted). Quantized layouts are
  ``kv_capacity.quantized_bytes`` (AWQ/NVFP4/MXFP4/FP8: codes, scales and zeros); embedding,
  lm_head, norms and router stay in ``dtype``, as ``kv_capacity.weight_bytes`` counts them.
- MoE experts: per layer, the expected number of DISTINCT experts the step's T tokens route to,
  times the stored bytes of one expert (gate + up + down). ``moe_routing`` picks the law:

  * ``"uniform"``: each token picks k of E experts uniformly and independently:
    ``E * (1 - (1 - k/E)**T)``;
  * ``"hot_set"`` (the calibrated default): the same law over a hot set of
    ``E_eff = moe_hot_fraction * E`` experts: ``E_eff * (1 - (1 - k/E_eff)**T)``. Real routing is
    far from uniform: the published 37 ms TTFT of Qwen3-Coder-30B-A3B AWQ for a 128-token prompt
    on GB10 is below the ~65 ms it takes to stream all 128 experts' 4-bit weights at GB10's
    measured read bandwidth, which "uniform" would charge (128 tokens * 8 picks touch ~all 128
    experts). ``moe_hot_fraction`` is the one free parameter that point determines;
  * ``"all"``: every expert every step (an upper bound).

- KV read: for every sequence, its whole context (``context_before + num_new_tokens``) once per
  layer, K and V, at ``kv_capacity.kv_bytes_per_token`` (flash-attention style: a prefill chunk
  reads the context once per layer, not once per query token). Sliding-window layers (gpt-oss)
  are priced as full attention, as our paged pool stores them.
- KV written: new tokens * ``kv_bytes_per_token``.
- activations: ``ACTIVATION_BYTES_PER_ELEMENT`` bytes per token * hidden * layer (the bf16
  residual stream read and written around attention and MLP: ~4 accesses of 2 bytes); small.

FLOPs per step:

- linear: 2 * active params per new token; active = dense layer weights + k experts' weights per
  layer for MoE (embedding lookup and lm_head excluded here);
- lm_head: 2 * hidden * vocab per logits row (one per scheduled sequence);
- attention: per layer and per new token at chunk position i (0-based),
  ``4 * heads * head_dim * (context_before + i + 1)`` (QK^T and PV over the causal keys including
  itself), i.e. the quadratic term of a prefill.

Compute dtype (which tensor-core peak the compute term uses): bf16 for unquantized bf16 weights
and for W4A16 AWQ (dequantized to bf16 in the GEMM); fp8 for FP8 W8A8; NVFP4 / MXFP4 use the
machine's fp4 peak if it has one (GB10) and bf16 otherwise (H200 has no FP4 tensor path: the
weights are dequantized and multiplied in bf16); float32 weights use the bf16 peak halved (TF32).

The free parameters (``CostParams``) are fitted in ``research.perf.calibration``, only on the
published single-stream points; ``CostModel`` uses that fit by default.

Pure Python: JAX is not imported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from research.config import QUANTIZATION_CHOICES, ModelConfig
from research.models.shapes import param_shapes
from research.perf.hardware import Hardware, get_hardware
from research.perf.kv_capacity import (
    dtype_bytes,
    kv_bytes_per_token,
    quantized_bytes,
    resolve_model,
)
from research.quant.layout import QUANTIZED_KEYS

MOE_ROUTINGS = ("hot_set", "uniform", "all")
EXPERT_KEYS = ("w_gate", "w_up", "w_down")
# Bytes per token, hidden element and layer for the residual stream (bf16, ~4 accesses/layer).
ACTIVATION_BYTES_PER_ELEMENT = 8


# --------------------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class StepShape:
    """What one step computes, independent of the engine: ``(num_new_tokens, context_before)``
    per scheduled sequence (decodes are ``(1, context)``, a prefill chunk ``(n, start)``)."""

    seqs: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        seqs = tuple((int(n), int(c)) for n, c in self.seqs)
        for n, c in seqs:
            if n < 1 or c < 0:
                raise ValueError(
                    f"each sequence needs num_new_tokens >= 1 and context >= 0: {seqs}"
                )
        object.__setattr__(self, "seqs", seqs)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(n for n, _ in self.seqs)

    @classmethod
    def decode(cls, batch: int, context: int) -> StepShape:
        """``batch`` single-token decodes, each with ``context`` tokens already cached."""
        return cls(((1, context),) * batch)

    @classmethod
    def prefill(cls, prompt_len: int, context_before: int = 0) -> StepShape:
        """One prefill chunk of ``prompt_len`` tokens after ``context_before`` cached ones."""
        return cls(((prompt_len, context_before),))


def step_shape_from_plan(plan: Any) -> StepShape:
    """The ``StepShape`` of a scheduler ``StepPlan`` (duck-typed: ``plan.decodes`` and
    ``plan.prefills`` are lists of items with ``.start`` and ``.num_new_tokens``)."""
    items = list(plan.decodes) + list(plan.prefills)
    return StepShape(tuple((s.num_new_tokens, s.start) for s in items))


# ---------------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class CostParams:
    """The few free parameters of the cost model.

    bandwidth_efficiency: fraction of ``Hardware.achievable_bandwidth`` a step's reads reach.
    compute_efficiency: fraction of the tensor-core peak of the compute dtype a step reaches.
    per_step_overhead_s: fixed seconds per step (scheduling, sampling, launches, host sync).
    per_layer_overhead_s: fixed seconds per layer per step (kernel launches, small ops).
    moe_hot_fraction: for ``moe_routing="hot_set"``, the share of each layer's experts that
        routing effectively spreads over (1.0 = uniform).
    """

    bandwidth_efficiency: float
    compute_efficiency: float
    per_step_overhead_s: float
    per_layer_overhead_s: float = 0.0
    moe_hot_fraction: float = 1.0

    def __post_init__(self) -> None:
        for name in ("bandwidth_efficiency", "compute_efficiency", "moe_hot_fraction"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.moe_hot_fraction > 1:
            raise ValueError(f"moe_hot_fraction must be <= 1, got {self.moe_hot_fraction}")
        if self.per_step_overhead_s < 0 or self.per_layer_overhead_s < 0:
            raise ValueError("overheads must be >= 0")


def expected_distinct_experts(num_experts: float, top_k: int, num_tokens: int) -> float:
    """Expected distinct experts hit when ``num_tokens`` tokens each pick ``top_k`` of
    ``num_experts`` uniformly at random: ``E * (1 - (1 - k/E)**T)`` (each expert is missed by a
    token with probability 1 - k/E, independently across tokens)."""
    if num_tokens <= 0:
        return 0.0
    if not 0 < top_k <= num_experts:
        raise ValueError(f"need 0 < top_k ({top_k}) <= num_experts ({num_experts})")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def compute_dtype(
    quantization: str | None, hw: Hardware, dtype: Any = "bfloat16"
) -> tuple[str, float]:
    """(tensor dtype, FLOP/s peak) the compute term uses; see the module docstring."""
    if quantization == "fp8" and "fp8" in hw.tensor_flops:
        return "fp8", hw.tensor_flops["fp8"]
    if quantization in ("nvfp4", "mxfp4") and "fp4" in hw.tensor_flops:
        return "fp4", hw.tensor_flops["fp4"]
    if quantization is None and dtype_bytes(dtype) == 4:
        return "tf32", hw.tensor_flops["bf16"] / 2
    return "bf16", hw.tensor_flops["bf16"]


# ---------------------------------------------------------------------------------- cost model


# One all-reduce's fixed cost between two boxes (launch + RDMA round trip); an assumption, not
# fitted (the calibration points are single-box).
ALLREDUCE_LATENCY_S = 20e-6


class CostModel:
    """Seconds per step of ``model`` at ``quantization`` on ``hardware`` (module docstring).

    ``params`` defaults to the calibration for the machine
    (``research.perf.calibration.params_for(hardware)``).
    """

    def __init__(
        self,
        model: str | ModelConfig,
        quantization: str | None,
        hardware: str | Hardware,
        kv_cache_dtype: str = "auto",
        dtype: Any = "bfloat16",
        params: CostParams | None = None,
        moe_routing: str = "hot_set",
        tensor_parallel_size: int = 1,
        allreduce_latency_s: float = ALLREDUCE_LATENCY_S,
    ) -> None:
        if quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES}")
        if moe_routing not in MOE_ROUTINGS:
            raise ValueError(f"moe_routing must be one of {MOE_ROUTINGS}, got {moe_routing!r}")
        self.cfg = resolve_model(model)
        self.hw = get_hardware(hardware)
        self.quantization = quantization
        self.kv_cache_dtype = kv_cache_dtype
        self.dtype = dtype
        if params is None:
            from research.perf.calibration import params_for  # the fit prices with CostModel

            params = params_for(self.hw)
        self.params = params
        self.moe_routing = moe_routing
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        if tensor_parallel_size > 1 and not self.hw.interconnect_bandwidth:
            raise ValueError(f"{self.hw.name} has no interconnect to a second box in its data")
        self.tp = tensor_parallel_size
        self.allreduce_latency_s = allreduce_latency_s
        self.compute_dtype, self.peak_flops = compute_dtype(quantization, self.hw, dtype)
        self.kv_bytes_per_token = kv_bytes_per_token(self.cfg, kv_cache_dtype, dtype)

        cfg, elem = self.cfg, dtype_bytes(dtype)
        shapes = param_shapes(cfg)

        def stored(key: str, shape: tuple[int, ...]) -> int:
            if quantization is not None and key in QUANTIZED_KEYS:
                return quantized_bytes(shape, quantization)
            return math.prod(shape) * elem

        self.dense_layer_bytes = 0  # all layers, non-expert weights
        self.dense_layer_params = 0
        self.expert_bytes_per_layer: list[int] = []  # one expert's gate+up+down, per layer
        self.expert_params = 0  # one expert's params (per layer)
        for layer in shapes["layers"]:
            per_expert = 0
            for key, shape in layer.items():
                if cfg.is_moe and key in EXPERT_KEYS:
                    per_expert += stored(key, shape[1:])
                    self.expert_params = sum(math.prod(layer[k][1:]) for k in EXPERT_KEYS)
                else:
                    self.dense_layer_bytes += stored(key, shape)
                    self.dense_layer_params += math.prod(shape)
            if cfg.is_moe:
                self.expert_bytes_per_layer.append(per_expert)
        head_shape = shapes.get("lm_head", shapes["embed"])
        self.lm_head_bytes = math.prod(head_shape) * elem + math.prod(shapes["final_norm"]) * elem
        self.embed_row_bytes = cfg.hidden_size * elem
        self.active_params_per_token = self.dense_layer_params + cfg.num_layers * (
            cfg.num_experts_per_tok * self.expert_params
        )

    # ------------------------------------------------------------------ pieces

    def distinct_experts(self, num_tokens: int) -> float:
        """Expected distinct experts per layer the step's ``num_tokens`` tokens route to."""
        cfg = self.cfg
        if not cfg.is_moe or num_tokens <= 0:
            return 0.0
        if self.moe_routing == "all":
            return float(cfg.num_experts)
        pool = float(cfg.num_experts)
        if self.moe_routing == "hot_set":
            pool = max(cfg.num_experts_per_tok, self.params.moe_hot_fraction * cfg.num_experts)
        return expected_distinct_experts(pool, cfg.num_experts_per_tok, num_tokens)

    def breakdown(self, shape: StepShape) -> dict[str, Any]:
        """Every term of the step's price: bytes by kind, FLOPs by kind, the two roofline times,
        the all-reduce time (tensor parallel), the overhead and the total (seconds):
        ``total_s == max(memory_time_s, compute_time_s) + allreduce_s + overhead_s``."""
        cfg, p = self.cfg, self.params
        tokens = shape.num_tokens
        rows = shape.num_seqs
        experts = self.distinct_experts(tokens)
        kv_tokens_read = sum(c + n for n, c in shape.seqs)
        b = {
            "bytes_dense_weights": float(self.dense_layer_bytes),
            "bytes_expert_weights": experts * sum(self.expert_bytes_per_layer),
            "bytes_lm_head": float(self.lm_head_bytes) if rows else 0.0,
            "bytes_embedding": float(tokens * self.embed_row_bytes),
            "bytes_kv_read": float(kv_tokens_read * self.kv_bytes_per_token),
            "bytes_kv_write": float(tokens * self.kv_bytes_per_token),
            "bytes_activations": float(
                tokens * cfg.hidden_size * cfg.num_layers * ACTIVATION_BYTES_PER_ELEMENT
            ),
        }
        bytes_total = sum(b.values())
        # Causal keys summed over a chunk: sum_{i<n} (c + i + 1) = n*c + n(n+1)/2.
        keys = sum(n * c + n * (n + 1) // 2 for n, c in shape.seqs)
        f = {
            "flops_linear": 2.0 * self.active_params_per_token * tokens,
            "flops_lm_head": 2.0 * cfg.hidden_size * cfg.vocab_size * rows,
            "flops_attention": 4.0 * cfg.num_heads * cfg.head_dim * keys * cfg.num_layers,
        }
        flops_total = sum(f.values())
        bandwidth = p.bandwidth_efficiency * self.hw.achievable_bandwidth
        # Tensor parallel over tp boxes: each reads and computes 1/tp of everything (heads, MLP
        # columns, experts and the vocabulary are split), then two all-reduces per layer (after
        # the attention output and after the MLP) of tokens * hidden activations. A ring
        # all-reduce sends 2 (tp - 1) / tp of the buffer per box; not overlapped with compute.
        memory_time = bytes_total / bandwidth / self.tp
        compute_time = flops_total / (p.compute_efficiency * self.peak_flops) / self.tp
        comm_time = 0.0
        if self.tp > 1:
            buffer = tokens * cfg.hidden_size * dtype_bytes(self.dtype)
            per_allreduce = 2 * (self.tp - 1) / self.tp * buffer / self.hw.interconnect_bandwidth
            comm_time = 2 * cfg.num_layers * (per_allreduce + self.allreduce_latency_s)
        overhead = p.per_step_overhead_s + cfg.num_layers * p.per_layer_overhead_s
        return {
            **b,
            "bytes_total": bytes_total,
            "distinct_experts_per_layer": experts,
            **f,
            "flops_total": flops_total,
            "compute_dtype": self.compute_dtype,
            "memory_time_s": memory_time,
            "compute_time_s": compute_time,
            "bound": "memory" if memory_time >= compute_time else "compute",
            "allreduce_s": comm_time,
            "overhead_s": overhead,
            "total_s": max(memory_time, compute_time) + comm_time + overhead,
        }

    def step_time(self, shape: StepShape) -> float:
        """Seconds the step takes."""
        return self.breakdown(shape)["total_s"]

    def decode_time_per_token(self, prompt_len: int = 128, output_len: int = 512) -> float:
        """Single-stream TPOT: mean step time of ``((1, c),)`` for c = prompt_len ..
        prompt_len + output_len - 2 (the output_len - 1 decode steps after the prefill)."""
        contexts = range(prompt_len, prompt_len + max(output_len - 1, 1))
        return sum(self.step_time(StepShape(((1, c),))) for c in contexts) / len(contexts)

    def ttft(self, prompt_len: int = 128) -> float:
        """Single-stream TTFT: one prefill step of the whole prompt."""
        return self.step_time(StepShape.prefill(prompt_len))


def with_params(model: CostModel, **changes: Any) -> CostModel:
    """A copy of ``model`` with some ``CostParams`` fields changed (what-if studies)."""
    return CostModel(
        model.cfg,
        model.quantization,
        model.hw,
        model.kv_cache_dtype,
        model.dtype,
        replace(model.params, **changes),
        model.moe_routing,
        model.tp,
        model.allreduce_latency_s,
    )


__all__ = [
    "MOE_ROUTINGS",
    "CostModel",
    "CostParams",
    "StepShape",
    "compute_dtype",
    "expected_distinct_experts",
    "step_shape_from_plan",
    "with_params",
]
