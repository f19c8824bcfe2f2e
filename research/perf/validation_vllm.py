"""The vLLM engine profile of the GB10 validation: continuous batching, replayed through our own
engine and scheduler.

A published vLLM concurrency curve is not a sum of independent steps: requests join a running
batch, prompts are cut into chunks that share steps with other requests' decodes, and the
client's own arithmetic decides what part of the run a rate covers. So each point is replayed,
not priced: ``replay`` runs our engine and scheduler (``research.perf.host_model.
simulated_engine``) over the cost model with vLLM's serving defaults on a >= 70 GiB device
(``max_num_seqs=1024``, ``max_num_batched_tokens=8192``, chunked prefill, block size 16), the
source's flags (memory utilization, ``max_model_len``, KV dtype, which layers are quantized)
and the source's client.

Client: ``llama-benchy`` (the kubis.ai gpt-oss-120b curve, C = 1 .. 64, pp1024 tg128) sends C
requests at once per run and reports, for C > 1, ``(generated tokens - C) / (last end - first
first-token)``: the window opens when the first request's prefill finishes, so at high C it
holds the other requests' prefills too (that is why the published curve stops growing past 32).
For C = 1 the same formula is the request's decode rate.

Fit: ``bandwidth_efficiency`` on the C = 1 point (a decode-only rate); every other parameter is
the vLLM profile's GB10 calibration (``engines.calibration.vllm_gb10_params``, fitted on vLLM single-request points
of other models). Every point past C = 1 is predicted.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from research.perf.cost_model import CostModel, CostParams
from research.perf.measurements import DATA, Row, records

# The sources the vLLM profile replays: the checkpoint our preset stands for and the run's flags.
VLLM_SOURCES: dict[str, dict[str, Any]] = {
    "kubis_gptoss120b_topology": {
        "preset": "gpt-oss-120b",
        "quantization": "mxfp4",
        # --mxfp4-layers moe,qkv,o,lm_head (quantization.quantized_layers)
        "quantized_layers": ("moe", "qkv", "o", "lm_head"),
        "kv_cache_dtype": "fp8",
        "gpu_memory_utilization": 0.70,
        "max_model_len": 4096,
        "client": "llama-benchy",
        "token_source": "random",  # llama-benchy's prompts are random token ids
        # vllm-node-mxfp4: the community MXFP4 build (eugr/spark-vllm-docker 'mxfp4' flavour,
        # NVIDIA developer forum thread 356651 p.7: its MXFP4 kernels 'only exist in his
        # original container and inside my build'), FlashInfer CUTLASS block-scaled MXFP4
        # instead of the Marlin fallback of vLLM's published images (vllm#43969, #51158)
        # (engine.gemm_kernels).
        "gemm_kernels": {"dense": "cutlass_fp4", "expert": "cutlass_fp4"},
    },
}


@dataclass(frozen=True)
class BurstPoint:
    """One published level of a concurrency curve: ``concurrency`` requests of ``input_len``
    prompt and ``output_len`` generated tokens sent together; ``published`` is the client's
    generation rate (tok/s, over all streams)."""

    source: str
    model: str
    concurrency: int
    input_len: int
    output_len: int
    published: float
    raw_row: str = field(default="", compare=False)

    @property
    def label(self) -> str:
        return f"C={self.concurrency} pp{self.input_len} tg{self.output_len}"


def load_burst_points() -> tuple[BurstPoint, ...]:
    return tuple(
        BurstPoint(
            source=r["source"],
            model=r["model"],
            concurrency=r["concurrency"],
            input_len=r["input_len"],
            output_len=r["output_len"],
            published=r["tg128_tok_s"],
            raw_row=r.get("raw_row", ""),
        )
        for r in records(DATA)
        if r["source"] in VLLM_SOURCES and "tg128_tok_s" in r
    )


def serving(source: str) -> Any:
    """The ``vllm`` engine profile on GB10 as the source ran it (``research.perf.engines``: the
    same resolution every ``engine=vllm`` experiment goes through)."""
    from research.perf.engines import resolve

    s = VLLM_SOURCES[source]
    return resolve(
        "vllm",
        "gb10",
        model=s["preset"],
        quantization=s["quantization"],
        token_source=s["token_source"],
        max_model_len=s["max_model_len"],
        enable_prefix_caching=False,  # random prompts share nothing
    )


def cost_model(source: str, params: CostParams, **options: Any) -> CostModel:
    from research.perf.engines.serving import with_build

    s = VLLM_SOURCES[source]
    # The build's kernels and layers as a user sets them (engine.gemm_kernels,
    # quantization.quantized_layers): the same path as a simulated run's.
    built = with_build(serving(source), s.get("gemm_kernels"), s.get("quantized_layers"))
    profile = built.cost_model_options | {"params": params}
    return CostModel(
        s["preset"], s["quantization"], "gb10", kv_cache_dtype=s["kv_cache_dtype"],
        **(profile | options),
    )  # fmt: skip


def replay(p: BurstPoint, cm: CostModel) -> dict[str, Any]:
    """``p``'s run through our engine and scheduler over ``cm``: the client's rate and the
    requests' times (seconds from the send)."""
    from research.bench.workload import random_requests
    from research.config import CacheConfig, SchedulerConfig
    from research.engine.request import SamplingParams
    from research.perf import kv_capacity_blocks
    from research.perf.host_model import simulated_engine

    s, serve = VLLM_SOURCES[p.source], serving(p.source)
    blocks = kv_capacity_blocks(
        cm.cfg,
        s["quantization"],
        "gb10",
        s["gpu_memory_utilization"],
        serve.block_size,
        kv_cache_dtype=s["kv_cache_dtype"],
    )
    engine = simulated_engine(
        cm,
        CacheConfig(
            block_size=serve.block_size,
            num_kv_blocks=blocks,
            enable_prefix_caching=serve.enable_prefix_caching,
        ),
        SchedulerConfig(
            max_num_seqs=serve.max_num_seqs,
            max_num_batched_tokens=serve.max_num_batched_tokens,
            scheduling_policy=serve.profile.scheduling_policy,
            enable_chunked_prefill=serve.enable_chunked_prefill,
        ),
        serve.max_model_len,
    )
    reqs = random_requests(p.concurrency, p.input_len, p.output_len, seed=p.concurrency)
    for i, r in enumerate(reqs):
        sp = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)
        engine.add_request(r.prompt_token_ids, sp, request_id=f"r{i}")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finish_reason is not None:
                done[out.request_id] = out
    if len(done) != p.concurrency:
        raise RuntimeError(f"{p.label}: {len(done)} of {p.concurrency} requests finished")
    outs = list(done.values())
    first = [o.metrics.first_token_time for o in outs]
    end = [o.metrics.finished_time for o in outs]
    generated = sum(len(o.token_ids) for o in outs)
    rate = (generated - len(outs)) / (max(end) - min(first))
    return {
        "rate": rate,
        "ttft": [f - o.metrics.arrival_time for f, o in zip(first, outs, strict=True)],
        "preemptions": sum(o.num_preemptions for o in outs),
        "kv_blocks": blocks,
    }


@dataclass(frozen=True)
class BurstRow(Row):
    """A burst point's row, with the replay's p99 TTFT."""

    ttft_p99_s: float


def fit_bandwidth(p: BurstPoint, base: CostParams, **options: Any) -> CostParams:
    """``bandwidth_efficiency`` at which the replay of ``p`` meets its published rate."""
    from scipy.optimize import brentq

    def gap(eff: float) -> float:
        cm = cost_model(p.source, replace(base, bandwidth_efficiency=eff), **options)
        return math.log(replay(p, cm)["rate"] / p.published)

    lo, hi = 0.05, 1.0
    if gap(hi) < 0:
        raise ValueError(
            f"{p.source}: the calibration's other costs leave no bandwidth efficiency <= 1 "
            f"that meets {p.published} tok/s at {p.label}"
        )
    return replace(base, bandwidth_efficiency=brentq(gap, lo, hi, xtol=1e-4))


def validate(
    points: Sequence[BurstPoint] | None = None, base: CostParams | None = None, **options: Any
) -> tuple[list[BurstRow], dict[str, CostParams]]:
    """Per source: fit on its C = 1 point, replay every point."""
    import numpy as np

    from research.perf.engines.calibration import vllm_gb10_params

    base = vllm_gb10_params() if base is None else base
    points = list(load_burst_points() if points is None else points)
    rows, params = [], {}
    for source in dict.fromkeys(p.source for p in points):
        pts = sorted((p for p in points if p.source == source), key=lambda p: p.concurrency)
        anchor = pts[0]
        if anchor.concurrency != 1:
            raise ValueError(f"{source}: no C = 1 point to fit on")
        params[source] = fit_bandwidth(anchor, base, **options)
        cm = cost_model(source, params[source], **options)
        for p in pts:
            run = replay(p, cm)
            p99 = float(np.quantile(run["ttft"], 0.99))
            rows.append(BurstRow(p, run["rate"], p is anchor, p99))
    return rows, params


def _summary(rows: Sequence[BurstRow]) -> str:
    errs = [abs(r.error) for r in rows if not r.fitted]
    return (
        f"{len(errs)} points not fitted, median |error| {statistics.median(errs):.1%}, "
        f"worst {max(errs):.1%}, {sum(e > 0.3 for e in errs)} beyond 30%"
    )


def format_report(
    rows: Sequence[BurstRow], params: dict[str, CostParams], ablation: bool = True
) -> str:
    """The table per source; with ``ablation``, the same replay under other assumptions
    (gpt-oss-20b's measured routing shape, uniform routing, weight-only GEMMs) for comparison."""
    from research.perf.routing import LOAD_SIGMA

    lines = []
    for source, prm in params.items():
        rs = [r for r in rows if r.point.source == source]
        lines += [
            f"\n### {rs[0].point.model} ({source}), vLLM profile  bandwidth_efficiency "
            f"{prm.bandwidth_efficiency:.3f} (fitted on C=1), per_step_overhead "
            f"{prm.per_step_overhead_s * 1e3:.2f} ms (vLLM GB10 calibration), lognormal routing "
            f"shape {serving(source).routing_shape:.2f} (random tokens)\n",
            "| point | published tok/s | predicted tok/s | error | predicted p99 TTFT (s) |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in rs:
            mark = " (fitted)" if r.fitted else ""
            lines.append(
                f"| {r.point.label}{mark} | {r.point.published:.1f} | {r.predicted:.1f} | "
                f"{r.error:+.1%} | {r.ttft_p99_s:.2f} |"
            )
        lines.append(f"\n{_summary(rs)}; growth C=32 / C=1: {_growth(rs)}")
        if ablation:
            points = [r.point for r in rs]
            for name, options in (
                (f"gpt-oss-20b's measured shape {LOAD_SIGMA:.2f}", {"moe_load_sigma": LOAD_SIGMA}),
                ("uniform routing", {"moe_routing": "uniform"}),
                ("W4A16 (Marlin-style) kernels", {"weight_only": True}),
            ):
                alt, _ = validate(points, **options)
                lines.append(f"- with {name}: {_summary(alt)}; growth {_growth(alt)}")
    return "\n".join(lines)


def _growth(rows: Sequence[BurstRow], lo: int = 1, hi: int = 32) -> str:
    by_c = {r.point.concurrency: r for r in rows}
    if lo not in by_c or hi not in by_c:
        return "n/a"
    pub = by_c[hi].point.published / by_c[lo].point.published
    pred = by_c[hi].predicted / by_c[lo].predicted
    return f"published {pub:.2f}x, predicted {pred:.2f}x ({pred / pub - 1:+.1%})"


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--routing", default=None, help="MoE routing law (default: the tokens')")
    args = ap.parse_args(argv)
    options = {} if args.routing is None else {"moe_routing": args.routing}
    rows, params = validate(**options)
    print(format_report(rows, params))


if __name__ == "__main__":
    main()
