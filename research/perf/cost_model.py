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

Calibration (``fit_calibration``; ``CALIBRATED`` is computed at import from ``CALIBRATION_POINTS``,
the published REFERENCE.md section 1 figures, so no fitted constant is written in this file).
The four numbers are single-stream on GB10, 128 prompt tokens, 512 generated:
Qwen3-Coder-30B-A3B AWQ decode 12.3 ms/token and TTFT 37 ms; Llama-3.3-70B AWQ 167.4 ms/token and
TTFT 186 ms. Single-stream decode time per token is the mean step time of ``((1, c),)`` over
c = prompt_len .. prompt_len + output_len - 2 (the first token comes from the prefill, the other
output_len - 1 from decode steps: vLLM's TPOT); TTFT is one prefill step ``((prompt_len, 0),)``.
Four numbers determine four parameters, fitted in closed form, one regime at a time:

1. Decode steps at batch 1 are memory bound (checked), and a single token touches exactly k
   experts under any routing law, so each decode point is ``bytes / (e * BW) + s``: linear in
   ``(1/e, s)``. Least squares (exact with two points) gives ``bandwidth_efficiency`` e and
   ``per_step_overhead_s`` s. Two decode points cannot tell a per-step from a per-layer
   overhead; the fit puts all of it in the per-step term and sets ``per_layer_overhead_s = 0``
   (the field is there for machines calibrated on more points).
2. A dense 128-token prefill is compute bound (checked): ``compute_efficiency`` =
   mean over dense TTFT points of ``flops / (peak * (ttft - s))``.
3. The MoE prefill is memory bound (checked): ``moe_hot_fraction`` solves
   ``bytes(fraction) / (e * BW) + s = ttft`` by bisection (mean over MoE TTFT points).

``calibration_report()`` prices the four targets with the full model and gives the errors.
On H200 (or any machine without its own entry in ``CALIBRATED``) the GB10 parameters are used as
they are: an assumption, not a fit to H200 (the efficiencies are relative to each machine's own
achievable bandwidth and peak FLOP/s; the per-step overhead, mostly host-side, is kept in
seconds).

Pure Python: JAX is not imported.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
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

    ``params`` defaults to the calibration for the machine (``params_for(hardware)``).
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
        self.params = params if params is not None else params_for(self.hw)
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


# ----------------------------------------------------------------------------------- calibration


@dataclass(frozen=True)
class CalibrationPoint:
    """A published single-stream measurement: time per output token (TPOT) and median TTFT,
    seconds. The quoted ms per output token is the target (REFERENCE gives it next to the
    rounded tok/s: 6.0 tok/s is 1000 / 167.4)."""

    model: str
    quantization: str | None
    hardware: str
    tpot_s: float
    ttft_s: float
    prompt_len: int = 128
    output_len: int = 512
    source: str = field(default="", compare=False)

    @property
    def tok_s(self) -> float:
        return 1.0 / self.tpot_s


CALIBRATION_POINTS: tuple[CalibrationPoint, ...] = (
    CalibrationPoint(
        "qwen3-coder-30b-a3b",
        "awq",
        "gb10",
        tpot_s=0.0123,
        ttft_s=0.037,
        source="REFERENCE.md section 1: 80.9 tok/s (12.3 ms/token), median TTFT 37 ms",
    ),
    CalibrationPoint(
        "llama-3.3-70b",
        "awq",
        "gb10",
        tpot_s=0.1674,
        ttft_s=0.186,
        source="REFERENCE.md section 1: 6.0 tok/s (167.4 ms/token), median TTFT 186 ms",
    ),
)


def _decode_bytes(model: CostModel, pt: CalibrationPoint) -> float:
    """Mean bytes of the single-stream decode steps (bytes are linear in the context, and one
    token touches k experts under any routing law, so the mean context prices the mean)."""
    mean_context = pt.prompt_len + (max(pt.output_len - 1, 1) - 1) / 2
    lo = model.breakdown(StepShape(((1, math.floor(mean_context)),)))["bytes_total"]
    hi = model.breakdown(StepShape(((1, math.ceil(mean_context)),)))["bytes_total"]
    return lo + (hi - lo) * (mean_context - math.floor(mean_context))


def fit_calibration(points: Sequence[CalibrationPoint] = CALIBRATION_POINTS) -> CostParams:
    """Fit ``CostParams`` on single-stream points of ONE machine (module docstring, steps 1-3).

    Needs at least two decode points with different weight bytes, at least one dense point
    (for compute_efficiency) and, for ``moe_hot_fraction``, MoE points (else it stays 1.0).
    Raises a ValueError when a fitted point is not in the regime the scheme assumes.
    """
    points = list(points)
    if len({pt.hardware for pt in points}) != 1:
        raise ValueError("calibrate one machine at a time")
    if len(points) < 2:
        raise ValueError("need at least two single-stream points")
    probe = CostParams(1.0, 1.0, 0.0)
    models = [CostModel(pt.model, pt.quantization, pt.hardware, params=probe) for pt in points]
    hw = models[0].hw

    # 1. decode: t = bytes / (e * BW) + s, least squares in relative error over (1/e, s).
    xs = [
        _decode_bytes(m, pt) / hw.achievable_bandwidth for m, pt in zip(models, points, strict=True)
    ]
    ts = [pt.tpot_s for pt in points]
    # Weighted normal equations of t_i ~ a * x_i + s with weights 1/t_i^2.
    w = [1.0 / t**2 for t in ts]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs, strict=True))
    st = sum(wi * t for wi, t in zip(w, ts, strict=True))
    sxx = sum(wi * x * x for wi, x in zip(w, xs, strict=True))
    sxt = sum(wi * x * t for wi, x, t in zip(w, xs, ts, strict=True))
    det = sw * sxx - sx * sx
    if det <= 0:
        raise ValueError("decode points must differ in bytes read to separate e from overhead")
    a = (sw * sxt - sx * st) / det
    s = (st - a * sx) / sw
    if a <= 0 or s < 0:
        raise ValueError(f"decode fit is unphysical: 1/e = {a:.4g}, overhead {s:.4g} s")
    e = 1.0 / a

    # 2. dense TTFT: compute bound, t = flops / (c * peak) + s.
    cs = []
    for m, pt in zip(models, points, strict=True):
        if m.cfg.is_moe:
            continue
        bd = m.breakdown(StepShape.prefill(pt.prompt_len))
        if pt.ttft_s <= s:
            raise ValueError(f"{pt.model}: TTFT {pt.ttft_s} s is below the per-step overhead")
        c = bd["flops_total"] / (m.peak_flops * (pt.ttft_s - s))
        if bd["bytes_total"] / (e * hw.achievable_bandwidth) > pt.ttft_s - s:
            raise ValueError(f"{pt.model}: prefill is not compute bound; cannot fit compute")
        cs.append(c)
    if not cs:
        raise ValueError("need a dense model's TTFT to fit compute_efficiency")
    c = sum(cs) / len(cs)

    # 3. MoE TTFT: memory bound, solve bytes(fraction) / (e * BW) + s = ttft by bisection.
    fractions = []
    for pt in points:
        cfg = resolve_model(pt.model)
        if not cfg.is_moe:
            continue

        def ttft_at(frac: float, pt: CalibrationPoint = pt) -> dict[str, Any]:
            params = CostParams(e, c, s, 0.0, frac)
            model = CostModel(pt.model, pt.quantization, pt.hardware, params=params)
            return model.breakdown(StepShape.prefill(pt.prompt_len))

        lo, hi = cfg.num_experts_per_tok / cfg.num_experts, 1.0
        if ttft_at(hi)["total_s"] <= pt.ttft_s:
            fractions.append(1.0)
            continue
        if ttft_at(lo)["total_s"] > pt.ttft_s:
            raise ValueError(f"{pt.model}: TTFT {pt.ttft_s} s unreachable even with k experts")
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if ttft_at(mid)["total_s"] < pt.ttft_s else (lo, mid)
        if ttft_at(hi)["bound"] != "memory":
            raise ValueError(f"{pt.model}: MoE prefill is compute bound; routing not identifiable")
        fractions.append((lo + hi) / 2)
    hot = sum(fractions) / len(fractions) if fractions else 1.0
    return CostParams(
        bandwidth_efficiency=e,
        compute_efficiency=c,
        per_step_overhead_s=s,
        per_layer_overhead_s=0.0,
        moe_hot_fraction=hot,
    )


CALIBRATED: dict[str, CostParams] = {"gb10": fit_calibration(CALIBRATION_POINTS)}


def params_for(hardware: str | Hardware) -> CostParams:
    """The calibration of ``hardware``, or GB10's where the machine has none (an assumption:
    efficiencies and overheads carried over, not fitted to that machine)."""
    name = get_hardware(hardware).name
    return CALIBRATED.get(name, CALIBRATED["gb10"])


def predict_single_stream(
    model: str | ModelConfig,
    quantization: str | None,
    hardware: str | Hardware,
    prompt_len: int = 128,
    output_len: int = 512,
    **kwargs: Any,
) -> dict[str, float]:
    """Single-request figures as ``vllm bench serve`` reports them: ``tok_s`` = 1 / TPOT (mean
    decode step over the output), ``tpot_ms`` and ``ttft_ms`` (one prefill step). Extra keyword
    arguments go to ``CostModel`` (``params``, ``moe_routing``, ``kv_cache_dtype``, ``dtype``)."""
    cm = CostModel(model, quantization, hardware, **kwargs)
    tpot = cm.decode_time_per_token(prompt_len, output_len)
    return {"tok_s": 1.0 / tpot, "tpot_ms": tpot * 1e3, "ttft_ms": cm.ttft(prompt_len) * 1e3}


def calibration_report(
    points: Iterable[CalibrationPoint] = CALIBRATION_POINTS, params: CostParams | None = None
) -> list[dict[str, Any]]:
    """Predicted vs target for every calibration number (ms per output token and TTFT ms), with
    the relative error in percent."""
    rows = []
    for pt in points:
        kw = {} if params is None else {"params": params}
        pred = predict_single_stream(
            pt.model, pt.quantization, pt.hardware, pt.prompt_len, pt.output_len, **kw
        )
        for metric, got, want in (
            ("tpot_ms", pred["tpot_ms"], pt.tpot_s * 1e3),
            ("ttft_ms", pred["ttft_ms"], pt.ttft_s * 1e3),
        ):
            rows.append(
                {
                    "model": pt.model,
                    "quantization": pt.quantization,
                    "hardware": pt.hardware,
                    "metric": metric,
                    "predicted": got,
                    "target": want,
                    "error_pct": 100.0 * (got - want) / want,
                }
            )
    return rows


def format_calibration_report(rows: list[dict[str, Any]] | None = None) -> str:
    """``calibration_report()`` as a fixed-width text table."""
    rows = calibration_report() if rows is None else rows
    lines = [f"{'model':<22}{'quant':<7}{'hw':<6}{'metric':<9}{'pred':>9}{'target':>9}{'err%':>7}"]
    for r in rows:
        lines.append(
            f"{r['model']:<22}{r['quantization'] or '-':<7}{r['hardware']:<6}{r['metric']:<9}"
            f"{r['predicted']:>9.2f}{r['target']:>9.2f}{r['error_pct']:>7.2f}"
        )
    return "\n".join(lines)


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
    )


__all__ = [
    "CALIBRATED",
    "CALIBRATION_POINTS",
    "MOE_ROUTINGS",
    "CalibrationPoint",
    "CostModel",
    "CostParams",
    "StepShape",
    "calibration_report",
    "compute_dtype",
    "expected_distinct_experts",
    "fit_calibration",
    "format_calibration_report",
    "params_for",
    "predict_single_stream",
    "step_shape_from_plan",
    "with_params",
]
