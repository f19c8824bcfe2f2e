"""Price one engine step on a named machine, operator class by operator class.

A step is described by ``StepShape``: one ``(num_new_tokens, context_before)`` pair per scheduled
sequence (``context_before`` = tokens of that sequence already in the KV cache). ``CostModel``
turns it into ``StepWork`` (what the kernels process: rows through the GEMMs, logits rows, KV
tokens and pages read, query-key pairs) and prices every kernel class on its own roofline::

    op_time  = max(op_bytes / (bandwidth_efficiency * hw.achievable_bandwidth),
                   op_flops / op_throughput)                       (per operator class)
    step     = sum(op_time / split) + collectives + per_step_overhead_s + per_seq_overhead_s * seqs
               + eager_layer_overhead_s * layers     (steps of more rows than ``graph_max_tokens``)

Operator classes (``CostModel.breakdown`` keeps each one's bytes, FLOPs and seconds):

- ``dense_gemm``: q/k/v/o projections, the MoE router and a dense model's MLP. Bytes: every
  such weight as stored (``kv_capacity.quantized_bytes`` for AWQ / NVFP4 / MXFP4 / FP8; router
  and norms in ``dtype``) + the activations in and out; FLOPs ``2 * params * tokens``.
- ``expert_gemm``: the grouped expert GEMMs. Bytes: the DISTINCT experts the step routes to per
  layer (``research.perf.routing``, law ``moe_routing``) times one expert's stored bytes (its
  biases included, gpt-oss), plus the routed activations; FLOPs ``2 * k * expert_params *
  tokens``. gpt-oss in MXFP4 is priced as openai ships it: MXFP4 experts, bf16 attention
  (``research.quant.layout.quantized_keys``).
- ``attention``: per layer, K and V of every sequence's context read once (flash style), as
  whole pages (the last page is read in full), plus the new K/V written; FLOPs
  ``4 * heads * head_dim`` per causal query-key pair. Sliding-window layers (gpt-oss) read only
  the pages that hold the window's keys and pair each query with at most ``sliding_window``
  keys; attention sinks add one logit per query and head (``SINK_FLOPS``). Small pages cost bandwidth: each page and
  kv head is a separate gather behind a page-table read, priced as ``PAGE_OVERHEAD_BYTES`` extra
  per transfer (``page_efficiency``); those reads reach ``attention_read_efficiency`` of the read
  bandwidth (1 for a kernel that streams pages; our XLA path's gather is slower, see host_model).
- ``lm_head``: the [hidden, vocab] matrix streamed once, one logits row per scheduled sequence
  (vLLM computes logits for the last token only), and the sampler's ``SAMPLER_PASSES`` passes
  over the float32 logits.
- ``elementwise``: norms, RoPE, residual adds, the SwiGLU product, the embedding rows:
  ``ELEMENTWISE_BYTES_PER_ELEMENT`` bytes per token, hidden element and layer. Memory bound.
- tensor parallel over ``tp`` boxes reads the same ``research.parallel.plan.SplitPlan`` the real
  engine places its arrays by: each operator's bytes and FLOPs are divided by how many ways the
  rules split its weights (query heads, kv heads, MLP width, experts, vocabulary; norms and
  elementwise work are replicated), and the step pays the collectives the plan lists (ring
  all-reduces of ``tokens * hidden`` after attention's output and the MLP's down projection in
  every layer and after the embedding, an all-gather of the logits) over the interconnect, plus
  a fixed latency each (``allreduce_s``).

GEMM throughput depends on the weight format (``gemm_format``): bf16 / fp16 / fp8 W8A8 / native
FP4 (NVFP4, MXFP4 where the machine has an FP4 tensor path) feed the tensor cores directly and run
at ``native_gemm_efficiency`` of the machine's sustained rate for that type
(``Hardware.sustained_flops``); W4A16 formats that dequantize in the inner loop (AWQ; FP4 on a
machine without an FP4 path; FP8 without an FP8 path) run at ``dense_gemm_efficiency`` (dense) or
``expert_gemm_efficiency`` (grouped experts) of the bf16 sustained rate. Attention runs at
``attention_efficiency`` of the bf16 sustained rate. Efficiencies are fractions <= 1: no
operator is ever priced above a measured peak.

llama.cpp's GGUF files are priced as stored (``GGUF_FORMATS``): ``q8_0`` keeps every matrix,
embeddings and output included, as blocks of 32 int8 codes and one fp16 scale (34 bytes per 32
weights); ``gguf_mxfp4`` (ggml-org's gpt-oss files) keeps the experts as MXFP4 blocks (16 bytes of
E2M1 codes and one E8M0 scale per 32) and every other matrix as ``q8_0``; vectors (norms, biases,
sinks) are float32. Their GEMMs run on int8 tensor cores (llama.cpp's MMQ quantizes activations
to 8 bits), priced against the machine's int8 = fp8 rate without a dequantizing penalty.

How an operator's memory and compute times add up is ``combine``: ``"max"`` (the default) takes
the larger, a kernel that overlaps its weight stream with its math; ``"sum"`` adds them, a kernel
that does not (what llama.cpp's batched decode on GB10 shows: see ``research.perf.validation``).

The free parameters (``CostParams``) are fitted in ``research.perf.calibration`` on single-request
points only; ``CostModel`` uses that fit by default. Pure Python: JAX is not imported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from research.config import QUANTIZATION_CHOICES, ModelConfig
from research.models.shapes import param_shapes
from research.parallel.plan import SplitPlan
from research.perf.hardware import Hardware, get_hardware
from research.perf.kv_capacity import (
    dtype_bytes,
    kv_bytes_per_token,
    quantized_bytes,
    resolve_model,
)
from research.perf.routing import (
    DEFAULT_ROUTING,
    ROUTING_LAWS,
    distinct_experts,
    expected_distinct_experts,
    load_sigma,
    lognormal_padded_rows,
    mmq_tile,
)
from research.quant.layout import EXPERT_KEYS, quantized_keys

MOE_ROUTINGS = ROUTING_LAWS
EXPERT_BIAS_KEYS = ("b_gate", "b_up", "b_down")  # gpt-oss: read with their expert
# Attention sinks: the sink's exp and its add to the denominator, per query, head and layer.
SINK_FLOPS = 2
# Norms (2 per layer), RoPE, residual adds (2), SwiGLU product: ~8 reads/writes of a hidden
# vector per token and layer, in the activation dtype.
ELEMENTWISE_ACCESSES = 8
# The sampler's passes over [rows, vocab] float32 logits (softmax / penalties / top-k-p / argmax).
SAMPLER_PASSES = 4
# One page gather of the attention kernel: a dependent page-table read plus a partly used DRAM
# burst at the transfer's ends, expressed as bytes of bandwidth lost per page and kv head
# (an assumption, not fitted; it sets how much small pages cost, see ``page_efficiency``).
PAGE_OVERHEAD_BYTES = 256
# One all-reduce's fixed cost between two boxes (launch + RDMA round trip); an assumption, not
# fitted (the calibration points are single-box).
ALLREDUCE_LATENCY_S = 20e-6
OPERATORS = ("dense_gemm", "expert_gemm", "attention", "lm_head", "elementwise")
# llama.cpp weight files the cost model can price (module docstring); not engine formats.
GGUF_FORMATS = ("q8_0", "gguf_mxfp4")
WEIGHT_FORMATS = QUANTIZATION_CHOICES + GGUF_FORMATS
GGUF_BLOCK = 32
GGUF_BLOCK_BYTES = {"q8_0": 34, "mxfp4": 17}  # bytes per block of 32 weights
COMBINE_MODES = ("max", "sum")


def gguf_bytes(shape: tuple[int, ...], fmt: str, expert: bool = False) -> int:
    """Stored bytes of a GGUF tensor of ``shape`` in file format ``fmt`` (``GGUF_FORMATS``):
    vectors float32, matrices in blocks of 32 along the input dimension."""
    if fmt not in GGUF_FORMATS:
        raise ValueError(f"unknown GGUF format {fmt!r}; expected one of {GGUF_FORMATS}")
    n = math.prod(shape)
    if len(shape) < 2:
        return 4 * n
    block = "mxfp4" if fmt == "gguf_mxfp4" and expert else "q8_0"
    return math.ceil(n / GGUF_BLOCK) * GGUF_BLOCK_BYTES[block]


@dataclass(frozen=True)
class StepShape:
    """What one step computes, independent of the engine: ``(num_new_tokens, context_before)``
    per scheduled sequence (decodes are ``(1, context)``, a prefill chunk ``(n, start)``).
    ``extra_logits_rows``: logits rows beyond one per sequence (speculative decoding verifies
    a row's last token and its d drafts as a chunk ``(1 + d, context)`` and scores all 1 + d
    positions: d extra rows)."""

    seqs: tuple[tuple[int, int], ...]
    extra_logits_rows: int = 0

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
    """The ``StepShape`` of a scheduler ``StepPlan`` (duck-typed: ``plan.decodes``,
    ``plan.prefills`` and ``plan.verifies`` are lists of items with ``.start`` and
    ``.num_new_tokens``; verified items also have ``.draft_token_ids``)."""
    verifies = list(getattr(plan, "verifies", []))
    items = list(plan.decodes) + list(plan.prefills) + verifies
    drafts = sum(len(s.draft_token_ids) for s in verifies)
    return StepShape(tuple((s.num_new_tokens, s.start) for s in items), drafts)


@dataclass(frozen=True)
class StepWork:
    """What one kernel launch sequence processes (one call of the model's forward)."""

    tokens: int  # rows through the GEMMs (packed; padded where the engine pads)
    logits_rows: int  # rows through lm_head and the sampler
    seq_tokens: tuple[int, ...]  # real new tokens per sequence (the routing law reads these)
    kv_read_tokens: float  # K/V tokens read per layer, summed over sequences (whole pages)
    kv_pages: float  # pages read per layer and kv head
    attention_pairs: float  # query-key pairs per layer and head
    kv_write_tokens: int
    # The same per sliding-window layer (None: those layers read like full ones, as our XLA
    # engine's gather does).
    window_read_tokens: float | None = None
    window_pairs: float | None = None


@dataclass(frozen=True)
class CostParams:
    """The free parameters of the cost model (module docstring); efficiencies are in (0, 1].

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

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s"):
                if value < 0:
                    raise ValueError(f"{f.name} must be >= 0, got {value}")
            elif not 0.0 < value <= 1.0:
                raise ValueError(f"{f.name} must be in (0, 1] (never above a peak), got {value}")


def gemm_format(
    quantization: str | None, hw: Hardware, dtype: Any = "bfloat16"
) -> tuple[str, bool]:
    """(tensor dtype the GEMM runs in, whether weights are dequantized in the inner loop)."""
    # GGUF files run on int8 MMA (llama.cpp's MMQ), whose rate is the fp8 one on sm_89+.
    if quantization == "fp8" or quantization in GGUF_FORMATS:
        return ("fp8", False) if "fp8" in hw.tensor_flops else ("bf16", True)
    if quantization in ("nvfp4", "mxfp4"):
        return ("fp4", False) if "fp4" in hw.tensor_flops else ("bf16", True)
    if quantization == "awq":
        return "bf16", True
    if dtype_bytes(dtype) == 4:
        return ("fp32" if "fp32" in hw.tensor_flops else "tf32"), False
    return "bf16", False


def page_efficiency(block_size: int, head_bytes_per_token: float) -> float:
    """Share of the bandwidth a paged attention kernel gets: a page moves
    ``block_size * head_bytes_per_token`` bytes per kv head for K (and again for V) behind one
    page-table lookup, ``x / (x + PAGE_OVERHEAD_BYTES)``. bf16, head_dim 128 (256 bytes per
    token and head): 89% at 8-token pages, 94% at 16, 98.5% at 64."""
    x = block_size * head_bytes_per_token
    return x / (x + PAGE_OVERHEAD_BYTES)


class CostModel:
    """Seconds per step of ``model`` at ``quantization`` on ``hardware`` (module docstring).
    ``params`` defaults to the calibration of the machine (``calibration.params_for``)."""

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
        ``--mxfp4-layers moe,qkv,o,lm_head``). ``weight_only``: the GEMMs dequantize the
        stored weights to the activation dtype in the inner loop (W4A16, vLLM's Marlin kernels)
        instead of feeding them to the tensor cores as stored, whatever the hardware has."""
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
            from research.perf.calibration import params_for  # the fit prices with CostModel

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
        self.compute_dtype, self.dequantizes = gemm_format(quantization, self.hw, dtype)
        self.weight_only = weight_only
        if graph_max_tokens is not None and graph_max_tokens < 0:
            raise ValueError(f"graph_max_tokens must be >= 0 or None, got {graph_max_tokens}")
        self.graph_max_tokens = graph_max_tokens
        if expert_tiles not in (None, "mmq"):
            raise ValueError(f"expert_tiles must be None or 'mmq', got {expert_tiles!r}")
        self.expert_tiles = expert_tiles
        if weight_only and quantization is not None and quantization not in GGUF_FORMATS:
            self.compute_dtype, self.dequantizes = "bf16", True
        self.peak_flops = self.hw.sustained_flops(self.compute_dtype)
        self.kv_bytes_per_token = kv_bytes_per_token(self.cfg, kv_cache_dtype, dtype)
        self.kv_bytes_per_layer_token = self.kv_bytes_per_token / self.cfg.num_layers
        head_bytes = self.kv_bytes_per_token / (2 * self.cfg.num_layers * self.cfg.num_kv_heads)
        self.page_efficiency = page_efficiency(block_size, head_bytes)

        cfg, elem = self.cfg, dtype_bytes(dtype)
        self.act_bytes = elem  # activations between kernels are in the model dtype
        shapes = param_shapes(cfg)

        self.quantized_weights = quantized_weights
        keys = quantized_keys(cfg.architecture) if quantized_weights is None else quantized_weights
        if quantized_weights is not None and (quantization is None or quantization in GGUF_FORMATS):
            raise ValueError(
                f"quantized_weights needs an engine weight format, got quantization={quantization!r}"
            )

        def stored(key: str, shape: tuple[int, ...]) -> int:
            if quantization in GGUF_FORMATS:
                return gguf_bytes(shape, quantization, expert=cfg.is_moe and key in EXPERT_KEYS)
            if quantization is not None and key in keys:
                return quantized_bytes(shape, quantization)
            return math.prod(shape) * elem

        self.dense_layer_bytes = 0  # all layers, non-expert weights
        self.dense_layer_params = 0
        self.dense_bytes_per_device = 0.0  # the same, each weight divided as the plan splits it
        self.dense_io_elements = 0  # in + out activation elements per token, all dense GEMMs
        self.expert_bytes_per_layer: list[int] = []  # one expert's gate+up+down, per layer
        self.expert_params = 0  # one expert's params (per layer)
        for layer in shapes["layers"]:
            per_expert = 0
            for key, shape in layer.items():
                if cfg.is_moe and key in EXPERT_BIAS_KEYS:
                    per_expert += stored(key, shape[1:])
                elif cfg.is_moe and key in EXPERT_KEYS:
                    per_expert += stored(key, shape[1:])
                    self.expert_params = sum(math.prod(layer[k][1:]) for k in EXPERT_KEYS)
                else:
                    self.dense_layer_bytes += stored(key, shape)
                    self.dense_layer_params += math.prod(shape)
                    ways = self.split.param_ways(key, len(shape))
                    self.dense_bytes_per_device += stored(key, shape) / ways
                    if len(shape) == 2:
                        self.dense_io_elements += sum(shape)
            if cfg.is_moe:
                self.expert_bytes_per_layer.append(per_expert)
        head_shape = shapes.get("lm_head", shapes["embed"])
        self.lm_head_bytes = math.prod(head_shape) * elem + math.prod(shapes["final_norm"]) * elem
        self.embed_row_bytes = cfg.hidden_size * elem
        if "lm_head" in keys:
            self.lm_head_bytes = (
                quantized_bytes(head_shape, quantization) + math.prod(shapes["final_norm"]) * elem
            )
        if quantization in GGUF_FORMATS:
            self.lm_head_bytes = gguf_bytes(head_shape, quantization) + gguf_bytes(
                shapes["final_norm"], quantization
            )
            self.embed_row_bytes = gguf_bytes((1, cfg.hidden_size), quantization)
        self.active_params_per_token = self.dense_layer_params + cfg.num_layers * (
            cfg.num_experts_per_tok * self.expert_params
        )

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
        window_pages = window_pairs = None
        if window is not None:
            # Keys max(0, c - W + 1) .. c + n - 1 are visible to some query of the chunk; the
            # pages that hold them are read whole.
            window_pages = sum(
                (c + n - 1) // bs - max(0, c - window + 1) // bs + 1 for n, c in shape.seqs
            )
            window_pairs = float(sum(_window_pairs(n, c, window) for n, c in shape.seqs))
        return [
            StepWork(
                tokens=shape.num_tokens,
                logits_rows=shape.num_seqs + shape.extra_logits_rows,
                seq_tokens=tuple(n for n, _ in shape.seqs),
                kv_read_tokens=float(sum(pages) * bs),
                kv_pages=float(sum(pages)),
                # Causal keys over a chunk: sum_{i<n} (c + i + 1) = n*c + n(n+1)/2.
                attention_pairs=float(sum(n * c + n * (n + 1) // 2 for n, c in shape.seqs)),
                kv_write_tokens=shape.num_tokens,
                window_read_tokens=None if window is None else float(window_pages * bs),
                window_pairs=window_pairs,
            )
        ]

    def gemm_throughput(self, expert: bool = False) -> float:
        p = self.params
        if not self.dequantizes:
            return p.native_gemm_efficiency * self.peak_flops
        eff = p.expert_gemm_efficiency if expert else p.dense_gemm_efficiency
        return eff * self.peak_flops

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
        overhead = p.per_step_overhead_s + p.per_seq_overhead_s * shape.num_seqs
        if self.graph_max_tokens is not None and shape.num_tokens > self.graph_max_tokens:
            overhead += p.eager_layer_overhead_s * self.cfg.num_layers
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
        """Seconds of the plan's collectives for one call: a ring all-reduce moves
        2 (n - 1) / n of its buffer over the interconnect, an all-gather (n - 1) / n."""
        n, total = self.tp, 0.0
        for c in self.split.collectives(self.cfg):
            rows = w.tokens if c.unit == "token" else w.logits_rows
            elem = self.act_bytes if c.unit == "token" else 4  # logits are float32
            share = (2 if c.kind == "all_reduce" else 1) * (n - 1) / n
            seconds = share * rows * c.width * elem / self.hw.interconnect_bandwidth
            total += (self.cfg.num_layers if c.per == "layer" else 1) * (
                seconds + self.allreduce_latency_s
            )
        return total

    def step_time(self, shape: StepShape) -> float:
        """Seconds the step takes."""
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
        )


def _window_pairs(n: int, c: int, window: int) -> int:
    """Query-key pairs of a chunk of n queries at positions c .. c + n - 1 when each sees at
    most ``window`` keys: sum_{i<n} min(c + i + 1, window)."""
    unclipped = max(0, min(n, window - c))  # queries that still see all c + i + 1 keys
    return unclipped * c + unclipped * (unclipped + 1) // 2 + (n - unclipped) * window


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
