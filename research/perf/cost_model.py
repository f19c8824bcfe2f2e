"""Price one engine step on a named machine, operator class by operator class.

A step is a ``StepShape`` (``research.perf.step_shape``): one ``(num_new_tokens,
context_before)`` pair per scheduled sequence, so a mixed step is its prompt chunk plus every
decode it carries. ``CostModel`` turns it into ``StepWork`` and prices each operator class on
its own roofline::

    op_time  = max(op_bytes / (bandwidth_efficiency * hw.achievable_bandwidth),
                   op_flops / op_throughput)                       (per operator class)
    step     = sum(op_time / split) + collectives + launch and host time

Operator classes (``CostModel.breakdown`` keeps each one's bytes, FLOPs and seconds), each with
the module that holds its mechanism:

- ``dense_gemm`` (q/k/v/o, router, a dense MLP) and ``expert_gemm`` (the grouped experts):
  weights as stored, the kernel the engine runs for the format on the machine and its math rate
  (``research.perf.gemm``); experts read are the DISTINCT experts the step routes to
  (``research.perf.routing``), padded to MMQ tiles where the engine pads;
- ``attention``: K/V pages read whole, FLOPs per causal query-key pair, sliding windows and sinks
  (``research.perf.attention``);
- ``lm_head`` (one logits row per sequence, the sampler's passes) and ``elementwise`` (norms,
  RoPE, residuals, SwiGLU, embedding rows: memory bound);
- collectives under tensor parallelism (``research.perf.collectives``: the real engine's
  ``SplitPlan`` divides each operator and lists the all-reduces);
- host, launch and request-path time (``research.perf.launch``).

How an operator's memory and compute times add up is ``combine``: ``"max"`` (the default) takes
the larger, a kernel that overlaps its weight stream with its math; ``"sum"`` adds them (what
llama.cpp's batched decode on GB10 shows: ``research.perf.validation``).

The free parameters (``research.perf.params.CostParams``) are fitted on single-request points
(``research.perf.calibration``) and stored with the other fits (``research.perf.fits``);
``CostModel`` uses the machine's stored fit by default. Pure Python: JAX is not imported.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from research.config import ModelConfig
from research.parallel.plan import SplitPlan
from research.perf.attention import SINK_FLOPS, causal_pairs, page_efficiency, window_pairs
from research.perf.collectives import ALLREDUCE_LATENCY_S, collective_seconds
from research.perf.fits import params_for
from research.perf.gemm import (
    GEMM_CLASSES,
    GGUF_FORMATS,
    WEIGHT_FORMATS,
    default_kernel,
    gemm_format,
    gguf_bytes,
    kernel_format,
)
from research.perf.hardware import Hardware, get_hardware
from research.perf.kv_capacity import (
    dtype_bytes,
    kv_bytes_per_token,
    resolve_model,
)
from research.perf.launch import launch_overhead_s
from research.perf.params import CostParams
from research.perf.routing import (
    DEFAULT_ROUTING,
    ROUTING_LAWS,
    distinct_experts,
    expected_distinct_experts,
    load_sigma,
    lognormal_padded_rows,
    mmq_tile,
)
from research.perf.step_shape import StepShape, StepWork, step_shape_from_plan
from research.perf.stored_weights import stored_weights

MOE_ROUTINGS = ROUTING_LAWS
# Norms (2 per layer), RoPE, residual adds (2), SwiGLU product: ~8 reads/writes of a hidden
# vector per token and layer, in the activation dtype.
ELEMENTWISE_ACCESSES = 8
# The sampler's passes over [rows, vocab] float32 logits (softmax / penalties / top-k-p / argmax).
SAMPLER_PASSES = 4
OPERATORS = ("dense_gemm", "expert_gemm", "attention", "lm_head", "elementwise")
COMBINE_MODES = ("max", "sum")


class CostModel:
    """Seconds per step of ``model`` at ``quantization`` on ``hardware`` (module docstring).
    ``params`` defaults to the machine's stored calibration (``fits.params_for``)."""

    def __init__(
        self,
        model: str | ModelConfig,
        quantization: str | None,
        hardware: str | Hardware,
        kv_cache_dtype: str = "auto",
        dtype: Any = "bfloat16",
        params: CostParams | None = None,
        moe_routing: str = DEFAULT_ROUTING,
        tensor_parallel_size: int = 1,
        allreduce_latency_s: float = ALLREDUCE_LATENCY_S,
        block_size: int = 16,
        expert_parallel: bool = False,
        combine: str | dict[str, str] = "max",
        moe_load_sigma: float | None = None,
        quantized_weights: tuple[str, ...] | None = None,
        weight_only: bool = False,
        graph_max_tokens: int | None = None,
        expert_tiles: str | None = None,
        gemm_kernels: dict[str, str] | None = None,
    ) -> None:
        """``expert_tiles``: how the grouped expert GEMM pads each expert's routed rows; None
        computes exactly the routed rows, ``"mmq"`` pads them to llama.cpp's MMQ column tile
        (``routing.mmq_tile`` of the step's tokens), expected over the routing law's per-expert
        row counts (``routing.lognormal_padded_rows``: the ``lognormal`` law's popularity, or
        an even one under every other law).
        ``graph_max_tokens``: the most rows a step may have and still replay a captured
        graph; a step with more runs eagerly and pays ``params.eager_layer_overhead_s`` per
        layer (None: every step replays a graph).

        ``quantized_weights``: the per-layer weight keys (``wq``, ``w_gate``, ...) stored in
        ``quantization``, plus ``lm_head`` for the output layer; None: what a checkpoint of the
        architecture quantizes (``research.quant.layout.quantized_keys``), output layer in the
        model dtype. For engines that quantize more than the checkpoint does (a vLLM build's
        ``--mxfp4-layers moe,qkv,o,lm_head``). ``gemm_kernels``: the kernel of the ``dense``
        and ``expert`` GEMMs (``research.perf.gemm.KERNELS``) as the engine runs this format on
        this machine; a class not given runs the format's ``gemm.default_kernel``, or Marlin
        (W4A16) under ``weight_only`` (an ablation)."""
        if quantization not in WEIGHT_FORMATS:
            raise ValueError(f"quantization must be one of {WEIGHT_FORMATS}, got {quantization!r}")
        modes = combine.values() if isinstance(combine, dict) else (combine,)
        if set(modes) - set(COMBINE_MODES) or (
            isinstance(combine, dict) and set(combine) - set(OPERATORS)
        ):
            raise ValueError(
                f"combine must be one of {COMBINE_MODES} or a dict of operator -> mode "
                f"(operators {OPERATORS}), got {combine!r}"
            )
        self.combine = combine
        # The ``lognormal`` law's popularity shape (None: the model's measured one).
        self.moe_load_sigma = moe_load_sigma
        if moe_routing not in ROUTING_LAWS:
            raise ValueError(f"moe_routing must be one of {ROUTING_LAWS}, got {moe_routing!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.cfg = resolve_model(model)
        self.hw = get_hardware(hardware)
        self.quantization, self.kv_cache_dtype, self.dtype = quantization, kv_cache_dtype, dtype
        if params is None:
            params = params_for(self.hw)
        self.params = params
        self.moe_routing = moe_routing
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        if tensor_parallel_size > 1 and not self.hw.interconnect_bandwidth:
            raise ValueError(f"{self.hw.name} has no interconnect to a second box in its data")
        self.tp, self.allreduce_latency_s, self.block_size = (
            tensor_parallel_size,
            allreduce_latency_s,
            block_size,
        )
        self.split = SplitPlan.for_model(self.cfg, tensor_parallel_size, expert_parallel)
        self.weight_only = weight_only
        if graph_max_tokens is not None and graph_max_tokens < 0:
            raise ValueError(f"graph_max_tokens must be >= 0 or None, got {graph_max_tokens}")
        self.graph_max_tokens = graph_max_tokens
        if expert_tiles not in (None, "mmq"):
            raise ValueError(f"expert_tiles must be None or 'mmq', got {expert_tiles!r}")
        self.expert_tiles = expert_tiles
        kernels = dict(gemm_kernels or {})
        if unknown := set(kernels) - set(GEMM_CLASSES):
            raise ValueError(f"gemm_kernels keys must be in {GEMM_CLASSES}, got {sorted(unknown)}")
        fallback = default_kernel(quantization, self.hw)
        if weight_only and quantization is not None and quantization not in GGUF_FORMATS:
            fallback = "marlin"
        self.gemm_kernels = {c: kernels.get(c, fallback) for c in GEMM_CLASSES}
        # (tensor type, dequantizes) per GEMM class: the kernel's, on this machine.
        self.gemm_math = {
            c: kernel_format(k, quantization, self.hw, dtype) for c, k in self.gemm_kernels.items()
        }
        self.compute_dtype, self.dequantizes = self.gemm_math["dense"]
        self.peak_flops = self.hw.sustained_flops(self.compute_dtype)
        self.kv_bytes_per_token = kv_bytes_per_token(self.cfg, kv_cache_dtype, dtype)
        self.kv_bytes_per_layer_token = self.kv_bytes_per_token / self.cfg.num_layers
        head_bytes = self.kv_bytes_per_token / (2 * self.cfg.num_layers * self.cfg.num_kv_heads)
        self.page_efficiency = page_efficiency(block_size, head_bytes)

        cfg, elem = self.cfg, dtype_bytes(dtype)
        self.act_bytes = elem  # activations between kernels are in the model dtype
        self.quantized_weights = quantized_weights
        inv = stored_weights(cfg, quantization, dtype, self.split, quantized_weights)
        for name, value in vars(inv).items():
            setattr(self, name, value)

    # ------------------------------------------------------------------ pieces

    def distinct_experts(self, tokens_per_seq: int | tuple[int, ...]) -> float:
        """Expected distinct experts per layer for a step (one int = one sequence's tokens)."""
        cfg = self.cfg
        if not cfg.is_moe:
            return 0.0
        seqs = (tokens_per_seq,) if isinstance(tokens_per_seq, int) else tokens_per_seq
        return distinct_experts(
            self.moe_routing,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            seqs,
            self.params.moe_concentration,
            sigma=self.load_sigma,
        )

    @property
    def load_sigma(self) -> float:
        """The ``lognormal`` law's popularity shape: the model's measured one unless given."""
        return load_sigma(self.cfg.name) if self.moe_load_sigma is None else self.moe_load_sigma

    def expert_rows(self, tokens: int) -> float:
        """Token rows the grouped expert GEMM computes per layer for a call of ``tokens``:
        ``k * tokens`` routed rows, padded to whole tiles under ``expert_tiles``."""
        cfg = self.cfg
        if self.expert_tiles is None or tokens <= 0:
            return float(cfg.num_experts_per_tok * tokens)
        sigma = self.load_sigma if self.moe_routing == "lognormal" else 0.0
        return lognormal_padded_rows(
            cfg.num_experts, cfg.num_experts_per_tok, tokens, sigma, mmq_tile(tokens)
        )

    def work(self, shape: StepShape) -> list[StepWork]:
        """The kernel work of a step: one call over the packed tokens, no padding (vLLM)."""
        bs = self.block_size
        pages = [math.ceil((c + n) / bs) for n, c in shape.seqs]
        window = self.cfg.sliding_window if self.cfg.sliding_layers else None
        window_pages = pairs_in_window = None
        if window is not None:
            # Keys max(0, c - W + 1) .. c + n - 1 are visible to some query of the chunk; the
            # pages that hold them are read whole.
            window_pages = sum(
                (c + n - 1) // bs - max(0, c - window + 1) // bs + 1 for n, c in shape.seqs
            )
            pairs_in_window = float(sum(window_pairs(n, c, window) for n, c in shape.seqs))
        return [
            StepWork(
                tokens=shape.num_tokens,
                logits_rows=shape.num_seqs + shape.extra_logits_rows,
                seq_tokens=tuple(n for n, _ in shape.seqs),
                kv_read_tokens=float(sum(pages) * bs),
                kv_pages=float(sum(pages)),
                attention_pairs=float(sum(causal_pairs(n, c) for n, c in shape.seqs)),
                kv_write_tokens=shape.num_tokens,
                window_read_tokens=None if window is None else float(window_pages * bs),
                window_pairs=pairs_in_window,
            )
        ]

    def gemm_throughput(self, expert: bool = False) -> float:
        """FLOP/s of the dense (or expert) GEMMs: the kernel's tensor type's sustained rate,
        times ``native_gemm_efficiency`` where it multiplies as stored, else the W4A16
        efficiency of its class."""
        p = self.params
        math_dtype, dequantizes = self.gemm_math["expert" if expert else "dense"]
        peak = self.hw.sustained_flops(math_dtype)
        if not dequantizes:
            return p.native_gemm_efficiency * peak
        return (p.expert_gemm_efficiency if expert else p.dense_gemm_efficiency) * peak

    def price(self, w: StepWork) -> dict[str, dict[str, float]]:
        """bytes, flops and seconds of each operator class for one call (before TP split)."""
        cfg, p, layers = self.cfg, self.params, self.cfg.num_layers
        bf16 = self.hw.sustained_flops("bf16")
        act = self.act_bytes
        ops: dict[str, tuple[float, float, float, float]] = {}  # bytes, flops, bw, flop/s
        bw = p.bandwidth_efficiency * self.hw.achievable_bandwidth
        ops["dense_gemm"] = (
            self.dense_layer_bytes + w.tokens * self.dense_io_elements * act,
            2.0 * self.dense_layer_params * w.tokens,
            bw,
            self.gemm_throughput(),
        )
        if cfg.is_moe:
            k, d, f = cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
            experts = self.distinct_experts(w.seq_tokens)
            ops["expert_gemm"] = (
                experts * sum(self.expert_bytes_per_layer)
                + w.tokens * k * (2 * d + 3 * f) * act * layers,
                2.0 * self.expert_params * self.expert_rows(w.tokens) * layers,
                bw,
                self.gemm_throughput(expert=True),
            )
        sliding = cfg.sliding_layers if w.window_read_tokens is not None else 0
        read_tokens = w.kv_read_tokens * (layers - sliding)  # summed over layers
        pairs = w.attention_pairs * (layers - sliding)
        if sliding:
            read_tokens += w.window_read_tokens * sliding
            pairs += w.window_pairs * sliding
        sink_flops = SINK_FLOPS * cfg.num_heads * w.tokens * layers if cfg.attention_sinks else 0
        kv_read = read_tokens * self.kv_bytes_per_layer_token
        ops["attention"] = (
            kv_read / self.page_efficiency + w.kv_write_tokens * self.kv_bytes_per_token,
            4.0 * cfg.num_heads * cfg.head_dim * pairs + sink_flops,
            bw * p.attention_read_efficiency,
            p.attention_efficiency * bf16,
        )
        ops["lm_head"] = (
            self.lm_head_bytes + w.logits_rows * cfg.vocab_size * 4 * (1 + SAMPLER_PASSES),
            2.0 * cfg.hidden_size * cfg.vocab_size * w.logits_rows,
            bw,
            p.native_gemm_efficiency
            * self.hw.sustained_flops(gemm_format(None, self.hw, self.dtype)[0]),
        )
        ops["elementwise"] = (
            w.tokens * cfg.hidden_size * layers * ELEMENTWISE_ACCESSES * act
            + w.tokens * self.embed_row_bytes,
            0.0,
            bw,
            bf16,
        )
        # How many ways the plan splits each operator's (bytes, FLOPs) over the devices.
        sp = self.split
        dense = self.dense_layer_bytes / self.dense_bytes_per_device
        splits = {
            "dense_gemm": (dense, dense),
            "expert_gemm": (sp.ways("experts") * sp.ways("expert_ffn"),) * 2,
            "attention": (sp.ways("kv_heads"), sp.ways("q_heads")),
            "lm_head": (sp.ways("vocab"),) * 2,
            "elementwise": (1, 1),
        }
        out = {}
        for name, (nbytes, flops, band, rate) in ops.items():
            mem_ways, flop_ways = splits[name]
            mem, comp = nbytes / band / mem_ways, flops / rate / flop_ways
            out[name] = {"bytes": nbytes, "flops": flops, "memory_s": mem, "compute_s": comp}
            mode = self.combine if isinstance(self.combine, str) else self.combine.get(name, "max")
            out[name]["s"] = max(mem, comp) if mode == "max" else mem + comp
        return out

    def breakdown(self, shape: StepShape) -> dict[str, Any]:
        """Every term of the step's price: per operator class ``<op>_bytes``, ``<op>_flops``,
        ``<op>_s``; the sums ``bytes_total`` and ``flops_total``; ``kernels_s`` (sum over
        operators and calls), ``allreduce_s``, ``overhead_s`` and
        ``total_s == kernels_s + allreduce_s + overhead_s``."""
        p = self.params
        calls = self.work(shape)
        out: dict[str, Any] = {
            f"{op}_{x}": 0.0 for op in OPERATORS for x in ("bytes", "flops", "s")
        }
        bound = {"memory": 0.0, "compute": 0.0}
        for w in calls:
            for op, v in self.price(w).items():
                for x in ("bytes", "flops", "s"):
                    out[f"{op}_{x}"] += v[x]
                bound["memory" if v["memory_s"] >= v["compute_s"] else "compute"] += v["s"]
        comm = sum(self.collective_time(w) for w in calls)
        kernels = sum(out[f"{op}_s"] for op in OPERATORS)
        overhead = launch_overhead_s(p, shape, self.cfg.num_layers, self.graph_max_tokens)
        experts = self.distinct_experts(tuple(n for n, _ in shape.seqs))
        return out | {
            "bytes_total": sum(out[f"{op}_bytes"] for op in OPERATORS),
            "flops_total": sum(out[f"{op}_flops"] for op in OPERATORS),
            "distinct_experts_per_layer": experts,
            "compute_dtype": self.compute_dtype,
            "memory_bound_s": bound["memory"],
            "compute_bound_s": bound["compute"],
            "bound": "memory" if bound["memory"] >= bound["compute"] else "compute",
            "kernels_s": kernels,
            "allreduce_s": comm,
            "overhead_s": overhead,
            "total_s": kernels + comm + overhead,
        }

    def collective_time(self, w: StepWork) -> float:
        """Seconds of the plan's collectives for one call (``research.perf.collectives``)."""
        return collective_seconds(
            self.split, self.cfg, self.tp, self.hw.interconnect_bandwidth, self.act_bytes, w,
            self.allreduce_latency_s,
        )  # fmt: skip

    def step_time(self, shape: StepShape) -> float:  # seconds
        return self.breakdown(shape)["total_s"]

    def decode_time_per_token(self, prompt_len: int = 128, output_len: int = 512) -> float:
        """Single-stream TPOT: mean step time of ``((1, c),)`` for c = prompt_len ..
        prompt_len + output_len - 2 (the output_len - 1 decode steps after the prefill)."""
        contexts = range(prompt_len, prompt_len + max(output_len - 1, 1))
        return sum(self.step_time(StepShape(((1, c),))) for c in contexts) / len(contexts)

    def speculative_decode_time_per_token(
        self,
        num_speculative_tokens: int,
        acceptance_rate: float,
        batch: int = 1,
        context: int = 640,
        proposer_s_per_seq: float = 0.0,
    ) -> float:
        """Seconds per generated token of ``batch`` sequences that each verify
        ``num_speculative_tokens`` n-gram drafts per step, every draft accepted independently
        with probability ``acceptance_rate`` until the first rejection (so a step emits
        (1 - a^(k+1)) / (1 - a) tokens per sequence), the lookup costing
        ``proposer_s_per_seq`` of host time per sequence."""
        k, a = num_speculative_tokens, acceptance_rate
        emitted = k + 1 if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)
        shape = StepShape(((1 + k, context),) * batch, k * batch)
        return (self.step_time(shape) + proposer_s_per_seq * batch) / (emitted * batch)

    def ttft(self, prompt_len: int = 128) -> float:
        """Single-stream TTFT: one prefill step of the whole prompt."""
        return self.step_time(StepShape.prefill(prompt_len))

    def options(self) -> dict[str, Any]:
        """The constructor's keyword arguments (to rebuild a variant of this model)."""
        return dict(
            kv_cache_dtype=self.kv_cache_dtype,
            dtype=self.dtype,
            params=self.params,
            moe_routing=self.moe_routing,
            tensor_parallel_size=self.tp,
            allreduce_latency_s=self.allreduce_latency_s,
            block_size=self.block_size,
            expert_parallel=self.split.expert_parallel,
            combine=self.combine,
            moe_load_sigma=self.moe_load_sigma,
            quantized_weights=self.quantized_weights,
            weight_only=self.weight_only,
            gemm_kernels=self.gemm_kernels,
            graph_max_tokens=self.graph_max_tokens,
            expert_tiles=self.expert_tiles,
        )


def with_params(model: CostModel, **changes: Any) -> CostModel:
    """A copy of ``model`` with some ``CostParams`` fields changed (what-if studies)."""
    opts = model.options() | {"params": replace(model.params, **changes)}
    return type(model)(model.cfg, model.quantization, model.hw, **opts)


__all__ = [
    "GGUF_FORMATS",
    "MOE_ROUTINGS",
    "OPERATORS",
    "WEIGHT_FORMATS",
    "CostModel",
    "CostParams",
    "StepShape",
    "StepWork",
    "expected_distinct_experts",
    "gemm_format",
    "gguf_bytes",
    "page_efficiency",
    "step_shape_from_plan",
    "with_params",
]
