"""A cost model of OUR real engine on the machine at hand, calibrated the way GB10 is: on
single-stream runs only. It is how the simulator's structure is checked against something we
can measure (``python -m experiments.run experiment=validate_host``).

``HostCostModel`` is ``CostModel`` priced over the work our ``ModelExecutor`` actually launches
(``research.engine.executor``): one call per step over every scheduled token, its rows padded to
a power of two (``bucket``), its tokens to ``token_bucket`` (powers of two and 1.5x midpoints). Attention depends on the engine's
``attention_backend``: the XLA reference cuts each row's tokens into query tiles
(``research.engine.attention.tile_size``), each reading its row's bucketed block table
(``context_bucket``, at least 128 tokens; none when every row is a fresh prompt) and scoring
it and the step's new tokens; the native CPU kernel (``research.native``) reads each row's own
cached tokens in place, in one causal pass over the packed tokens (no padding).
The step pays the per-step host overhead (packing arrays, dispatch, reading the sampled tokens
back).

``fit_host`` fits the machine's effective read bandwidth, its effective matmul rate, the
attention's FLOP efficiency relative to it and the share of the read bandwidth attention's K/V
reads reach on four single-stream numbers: the decode time per token and the TTFT at two prompt
lengths (concurrency 1). The last is its own parameter because K/V pages scattered over the pool
are not read at the rate weights stream at (the XLA attention even gathers them into a padded
copy first); the decode-time difference between the two prompt lengths (the same weights, more
keys) is what measures it. The per-call host overhead is the engine's
own measured host time per step in those runs (``Engine.stats()``), or fitted when not given.
Bandwidth and FLOP/s are fitted as absolute rates, i.e. a ``Hardware`` whose peaks ARE the fitted
rates: no peak of this CPU is published or measured independently. Host time per extra sequence
is assumed 0 (one sequence cannot separate it from the per-call overhead). Everything at
concurrency > 1 is then a prediction.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any

from research.config import CacheConfig, ModelConfig, SchedulerConfig
from research.perf.cost_model import CostModel, CostParams, StepShape, StepWork
from research.perf.hardware import GiB, Hardware

# How the native GEMM kernels' operators price (``CostModel``'s ``combine``): they read each
# weight and multiply it on the same cores, so a step's projections and head take their reads'
# time plus their arithmetic's, not the larger of the two. On a 2-core Zen 4, one sequence's
# bf16 decode step took 11.9 ms and four sequences' 16.3 ms, where the weights read the same
# and the fitted arithmetic rate prices three more rows at ~3.7 ms.
NATIVE_GEMM_COMBINE = {"dense_gemm": "sum", "lm_head": "sum"}


def _bucket(n: int, minimum: int, maximum: int) -> int:
    """``research.engine.executor.bucket`` (duplicated arithmetic: that module imports JAX)."""
    return min(max(minimum, 1 << max(0, n - 1).bit_length()), maximum)


def _num_tiles(n: int, r: int, b: int) -> int:
    """``research.engine.attention.num_tiles``."""
    return max(1, min(n, (n + r * (b - 1)) // b))


def _tile_size(n: int, r: int) -> int:
    """``research.engine.attention.tile_size``."""
    return min((1, 2, 4, 8, 16, 32, 64), key=lambda b: (_num_tiles(n, r, b) * (b + 8), b))


def _context_bucket(n: int, minimum: int, maximum: int) -> int:
    """``research.engine.executor.context_bucket``: minimum * {1, 2, 3, 4, 6, 8, 12, ...}."""
    if n <= minimum:
        return min(minimum, maximum)
    p = minimum
    while True:
        for size in (2 * p, 3 * p):
            if size >= n:
                return min(size, maximum)
        p *= 2


def host_hardware(bandwidth: float, flops: float, name: str = "host-fit") -> Hardware:
    """A ``Hardware`` whose peaks are fitted effective rates (bytes/s, FLOP/s)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 16 * GiB
    return Hardware(
        name=name,
        memory_bytes=memory,
        cuda_visible_bytes=memory,
        peak_bandwidth=bandwidth,
        achievable_bandwidth=bandwidth,
        tensor_flops={"bf16": flops, "fp32": flops},
        notes="fitted on single-stream runs of our engine (research.perf.host_model)",
    )


class HostCostModel(CostModel):
    """``CostModel`` over the padded calls of our ``ModelExecutor`` (module docstring)."""

    def __init__(
        self,
        model: str | ModelConfig,
        quantization: str | None,
        hardware: Hardware,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        attention_backend: str = "xla",
        **kwargs: Any,
    ) -> None:
        if attention_backend not in ("xla", "native"):
            raise ValueError(
                f"HostCostModel prices attention_backend 'xla' or 'native', got "
                f"{attention_backend!r}"
            )
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("params", CostParams(1.0, 0.0))
        super().__init__(model, quantization, hardware, **kwargs)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.attention_backend = attention_backend
        # Both attentions read whole token rows (no page-transfer overhead model).
        self.page_efficiency = 1.0

    def options(self) -> dict[str, Any]:
        return super().options() | dict(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            attention_backend=self.attention_backend,
        )

    def work(self, shape: StepShape) -> list[StepWork]:
        bs = self.block_size
        max_blocks = -(-self.max_model_len // bs)
        m_min = -(-128 // bs)
        seqs = shape.seqs
        if not seqs:
            return []
        r = _bucket(len(seqs), 1, self.max_num_seqs)
        cap = max(self.max_num_batched_tokens, self.max_num_seqs)
        total = sum(k for k, _ in seqs)
        n = max(r, _bucket(total, 1, cap) if total <= 16 else _context_bucket(total, 16, cap))
        if self.attention_backend == "native":
            # One packed causal pass: each row's own cached tokens, read in place, and its new
            # tokens up to each query's own.
            read = float(sum(c for _, c in seqs))
            pages = float(sum(math.ceil(c / bs) for _, c in seqs))
            pairs = float(sum(k * c + k * (k + 1) // 2 for k, c in seqs))
        else:
            # The XLA reference: query tiles of b tokens, each gathering its row's bucketed
            # table (none when every row is a fresh prompt) and scoring it and the N new tokens.
            b = _tile_size(n, r)
            q = _num_tiles(n, r, b)
            keys = 0
            if any(c > 0 for _, c in seqs):
                longest_table = max(math.ceil((c + k) / bs) for k, c in seqs)
                keys = _context_bucket(longest_table, m_min, max_blocks) * bs
            read, pages, pairs = float(q * keys), float(q * keys / bs), float(q * b * (keys + n))
        return [
            StepWork(
                tokens=n,
                logits_rows=r,
                seq_tokens=tuple(k for k, _ in seqs),
                kv_read_tokens=read,
                kv_pages=pages,
                attention_pairs=pairs,
                kv_write_tokens=n,
            )
        ]


@dataclass(frozen=True)
class SingleStream:
    """Measured single-stream figures of our engine, seconds, per prompt length: median TPOT
    and median TTFT; ``host_s_per_step``: the engine's own host time per step in those runs
    (``Engine.stats()``: step time minus time in the jitted calls), or None to fit it.

    Behind an HTTP server on a core of its own (replicas), the CPU work outside the engine per
    generated token of a stream: ``server_s_per_token`` (the server's event loop, on the
    engine's core, so inside the single-stream steps) and ``shared_s_per_token`` (the router
    and the benchmark client: with one stream they run on an idle core; once every core runs
    a replica they take their time from the replicas' steps). None: not measured (one engine
    in process, no server)."""

    output_len: int
    tpot_s: dict[int, float]
    ttft_s: dict[int, float]
    host_s_per_step: float | None = None
    server_s_per_token: float | None = None
    shared_s_per_token: float | None = None


def fit_host(
    model: str | ModelConfig,
    measured: SingleStream,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    block_size: int = 16,
    quantization: str | None = None,
    dtype: str = "float32",
    peaks: dict[str, float] | None = None,
    attention_backend: str = "xla",
    combine: str | dict[str, str] = "max",
) -> HostCostModel:
    """Fit read bandwidth, matmul FLOP/s and attention efficiency (and the per-call host time
    when not measured) on ``measured`` by least squares on the logs of every number.
    ``peaks`` (``research.perf.host_peaks``: "flops", "bandwidth") bound the fitted rates: no
    fitted rate may exceed what the machine measures."""
    from scipy.optimize import least_squares

    if len(measured.ttft_s) < 2:
        raise ValueError("fit_host needs the TTFT at two prompt lengths")
    sizes = dict(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=block_size,
        dtype=dtype,
        attention_backend=attention_backend,
        combine=combine,
    )
    host = measured.host_s_per_step
    # Per sequence and step: the server's work on the engine's core (in every fitted step),
    # then, for the prediction, the router's and client's too (module docstring of SingleStream).
    server = measured.server_s_per_token or 0.0
    shared = measured.shared_s_per_token or 0.0

    def build(x: Any, per_seq: float = server) -> HostCostModel:
        hw = host_hardware(math.exp(x[0]) * 1e9, math.exp(x[1]) * 1e9)
        overhead = host if host is not None else max(0.0, x[4]) / 1e3
        params = CostParams(
            1.0,
            overhead,
            per_seq_overhead_s=per_seq,
            attention_efficiency=min(1.0, math.exp(x[2])),
            attention_read_efficiency=min(1.0, math.exp(x[3])),
        )
        return HostCostModel(model, quantization, hw, params=params, **sizes)

    def residuals(x: Any) -> list[float]:
        cm = build(x)
        res = []
        for n, t in sorted(measured.tpot_s.items()):
            mean = n + (measured.output_len - 2) // 2
            res.append(math.log(cm.step_time(StepShape.decode(1, mean)) / t))
        res += [math.log(cm.ttft(n) / t) for n, t in sorted(measured.ttft_s.items())]
        return res

    x0 = [math.log(10.0), math.log(50.0), math.log(0.5), math.log(0.5), 1.0]
    lower = [math.log(0.1), math.log(0.1), math.log(1e-3), math.log(1e-3), 0.0]
    upper = [math.log(1e4), math.log(1e6), 0.0, 0.0, 1e3]
    if peaks is not None:
        upper[0] = math.log(peaks["bandwidth"] / 1e9)
        upper[1] = math.log(peaks["flops"] / 1e9)
        x0[:2] = [min(x0[0], upper[0] - 0.1), min(x0[1], upper[1] - 0.1)]
    n = 4 if host is not None else 5
    fit = least_squares(
        residuals, x0[:n], bounds=(lower[:n], upper[:n]), x_scale=[0.3, 0.3, 0.3, 0.3, 1.0][:n]
    )
    if not fit.success:
        raise ValueError(f"host fit did not converge: {fit.message}")
    return build(fit.x, server + shared)


def simulated_engine(
    cost_model: CostModel,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    max_model_len: int,
) -> Any:
    """Our real engine and scheduler over a ``SimulatedExecutor`` pricing with ``cost_model``
    (``cache_config.num_kv_blocks`` must be set: the pool of the engine being predicted)."""
    from research.engine.engine import Engine
    from research.perf.simulated import SimulatedExecutor

    if cache_config.num_kv_blocks is None:
        raise ValueError("simulated_engine needs cache_config.num_kv_blocks")
    sim = SimulatedExecutor(cost_model)
    return Engine(
        cost_model.cfg,
        None,
        None,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        max_model_len=max_model_len,
        executor=sim,
        clock=sim.clock,
    )


__all__ = ["HostCostModel", "SingleStream", "fit_host", "host_hardware", "simulated_engine"]


def roofline(
    model: HostCostModel, shapes: Any, seconds: float, peaks: dict[str, float]
) -> dict[str, float]:
    """Achieved FLOP/s and bytes/s of the steps ``shapes`` (``StepShape`` s, repeats counted)
    that took ``seconds``, as ``model`` counts their padded calls, and their fractions of
    ``peaks`` (``research.perf.host_peaks.device_peaks``)."""
    flops = nbytes = 0.0
    for shape, count in Counter(shapes).items():
        b = model.breakdown(shape)
        flops += count * b["flops_total"]
        nbytes += count * b["bytes_total"]
    return {
        "achieved_gflops": flops / seconds / 1e9,
        "achieved_gbps": nbytes / seconds / 1e9,
        "flops_fraction": flops / seconds / peaks["flops"],
        "bandwidth_fraction": nbytes / seconds / peaks["bandwidth"],
        "peak_gflops": peaks["flops"] / 1e9,
        "peak_gbps": peaks["bandwidth"] / 1e9,
    }
