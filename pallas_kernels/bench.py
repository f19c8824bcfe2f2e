"""Both kernels' benchmarks: ``python -m pallas_kernels.bench [--kernel NAME] [--iters N]``.

On a GPU each prints achieved GB/s against the device's peak memory bandwidth (the machines of
``research.perf.hardware``): paged attention at batch 64 with 2k context and more, with bf16 /
fp8 / int4 KV; grouped experts at Qwen3-30B-A3B expert shapes for 8 to 256 tokens, per weight
format. On CPU the kernels run in Pallas' interpreter at small sizes, for correctness only, and
say so.
"""

from __future__ import annotations

import argparse
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.grouped_experts import grouped_experts, grouped_experts_reference
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.tuning import INTERPRET, target_for_kind
from research.perf.hardware import HARDWARE
from research.quant import FORMATS, QTensor, quantize
from research.quant.kv import quantize_kv

KV_FORMATS = ("bf16", "fp8", "int4")
_quantize_kv = jax.jit(quantize_kv, static_argnums=1)


def peak_bandwidth(device: jax.Device) -> float | None:
    """Spec-sheet bandwidth of the machine whose name is in the device kind, if we have it."""
    kind = device.device_kind.upper()
    return next((hw.peak_bandwidth for hw in HARDWARE.values() if hw.name.upper() in kind), None)


def _time(fn, *args, iters: int, **kwargs) -> float:
    """Seconds per call: best of 3 runs of ``iters`` back-to-back calls, after 2 warmup calls."""
    for _ in range(2):
        jax.block_until_ready(fn(*args, **kwargs))
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args, **kwargs)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / iters)
    return best


# ---- paged attention ------------------------------------------------------------------------


def _bench_inputs(
    key: jax.Array,
    kv: str,
    *,
    batch: int,
    context: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
) -> tuple[tuple[jax.Array, ...], dict[str, jax.Array], int]:
    """Random bf16 q and K/V (quantized to ``kv``), pages shuffled in the pool, every sequence
    ``context`` tokens long. Returns the positional args, the scale kwargs and the useful bytes
    (K/V rows below the lengths, their scales, block tables, lengths, q and out)."""
    pages_per_seq = context // page_size
    num_pages = batch * pages_per_seq
    kq, kk, kv_key, kt = jax.random.split(key, 4)
    q = jax.random.normal(kq, (batch, heads, head_dim), jnp.bfloat16)
    shape = (kv_heads, num_pages, page_size, head_dim)
    k, v = (jax.random.normal(x, shape, jnp.bfloat16) for x in (kk, kv_key))
    tables = jax.random.permutation(kt, num_pages).reshape(batch, pages_per_seq)
    lengths = jnp.full((batch,), context, jnp.int32)
    scales = {}
    if kv != "bf16":
        k, scales["k_scales"] = _quantize_kv(k, kv)
        v, scales["v_scales"] = _quantize_kv(v, kv)
    rows = batch * context * kv_heads  # K (or V) vectors read
    row_bytes = k.shape[-1] * k.dtype.itemsize + (4 if scales else 0)
    nbytes = 2 * rows * row_bytes + tables.size * 4 + batch * 4 + 2 * q.size * q.dtype.itemsize
    return (q, k, v, tables.astype(jnp.int32), lengths), scales, nbytes


def paged_attention_bench(iters: int = 20) -> list[dict]:
    """Sweep batch/context/KV format on the default device, print achieved bandwidth and return
    one row per case (kv, batch, context, k_splits, seconds, gb_per_s, peak_fraction)."""
    device = jax.devices()[0]
    interpret = device.platform != "gpu"
    peak = peak_bandwidth(device)
    model = dict(heads=32, kv_heads=8, head_dim=128, page_size=16)  # Llama-3-8B-like attention
    if interpret:
        print(
            f"{device.platform} ({device.device_kind}): no GPU, the kernel runs in Pallas' "
            "interpreter, for correctness only; times and GB/s say nothing about a GPU."
        )
        model = dict(heads=8, kv_heads=2, head_dim=64, page_size=16)
        sizes, splits, iters = [(2, 256)], (4,), 2
    else:
        sizes, splits = [(64, 2048), (8, 8192), (128, 512), (1, 32768)], (1, 4, 16)
    peak_text = f"{peak / 1e9:.0f} GB/s" if peak else "unknown (not in research.perf.hardware)"
    print(f"device {device.device_kind}, peak bandwidth {peak_text}; attention {model}")
    print(f"{'kv':>5} {'batch':>5} {'context':>7} {'splits':>6} {'us':>9} {'GB/s':>8} {'%peak':>6}")
    target = INTERPRET if interpret else target_for_kind(device.device_kind)
    key = jax.random.key(0)
    results = []
    for batch, context in sizes:
        for kv in KV_FORMATS:
            args, scales, nbytes = _bench_inputs(key, kv, batch=batch, context=context, **model)
            q, k_pages = args[0], args[1]
            blocks = target.paged_attention.kwargs(
                page_size=model["page_size"],
                head_dim=model["head_dim"],
                code_dim=k_pages.shape[-1],
                q_dtype=q.dtype,
                page_dtype=k_pages.dtype,
            )
            for k_splits in splits:
                blocks = {**blocks, "k_splits": k_splits}
                fn = functools.partial(paged_attention, **blocks, interpret=interpret)
                seconds = _time(fn, *args, iters=iters, **scales)
                gbps = nbytes / seconds / 1e9
                pct = f"{100 * nbytes / seconds / peak:6.1f}" if peak else f"{'-':>6}"
                print(
                    f"{kv:>5} {batch:>5} {context:>7} {k_splits:>6} {seconds * 1e6:9.1f} "
                    f"{gbps:8.1f} {pct}"
                )
                results.append(
                    dict(
                        kv=kv,
                        batch=batch,
                        context=context,
                        k_splits=k_splits,
                        seconds=seconds,
                        gb_per_s=gbps,
                        peak_fraction=nbytes / seconds / peak if peak else None,
                    )
                )
            del args, scales
    return results


# ---- grouped experts ------------------------------------------------------------------------


def _route(rng: np.random.Generator, tokens: int, experts: int, top_k: int) -> np.ndarray:
    """Random top-k routing -> group_sizes int32 [E] (each token picks top_k distinct experts)."""
    picks = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    return np.bincount(picks.reshape(-1), minlength=experts).astype(np.int32)


def grouped_experts_bench(iters: int = 20) -> list[dict]:
    """Benchmark Qwen3-30B-A3B expert GEMMs (gate/up [E, 2048, 768], down [E, 768, 2048]) with
    the device's block configuration (``pallas_kernels.tuning``); print and return one row per
    case (tokens, matmul, format, experts, seconds, gb_per_s, peak_fraction, rel_err)."""
    device = jax.devices()[0]
    on_cpu = device.platform == "cpu"
    if on_cpu:
        print(
            "CPU: the kernel runs in interpret mode, for correctness only (timings mean nothing); "
            "shapes shrunk to 8 experts, hidden 256, expert width 128, top-2."
        )
        experts, hidden, width, top_k, token_counts, iters = 8, 256, 128, 2, (8, 32), 2
    else:
        experts, hidden, width, top_k = 128, 2048, 768, 8
        token_counts = (8, 16, 32, 64, 128, 256)
    peak = peak_bandwidth(device)
    peak_text = f"{peak / 1e9:.0f} GB/s" if peak else "unknown (not in research.perf.hardware)"
    print(f"device: {device.device_kind}; peak bandwidth: {peak_text}")

    rng = np.random.default_rng(0)
    shapes = {"gate/up": (hidden, width), "down": (width, hidden)}
    weights = {}
    for name, (k, n) in shapes.items():
        w = jnp.asarray(rng.standard_normal((experts, k, n), np.float32) * 0.02)
        weights[name] = {"bf16": w.astype(jnp.bfloat16)}
        weights[name].update({fmt: quantize(w, fmt) for fmt in FORMATS})

    print(
        f"{'tokens':>6} {'matmul':>8} {'format':>6} {'experts':>7} {'us':>9} {'GB/s':>8} "
        f"{'%peak':>6} {'rel err':>8}"
    )
    results = []
    target = INTERPRET if on_cpu else target_for_kind(device.device_kind)
    for tokens in token_counts:
        group_sizes = _route(rng, tokens, experts, top_k)
        touched = int(np.count_nonzero(group_sizes))
        rows = tokens * top_k
        # Rows per touched expert, rounded up to a power of two in [16, 64].
        block_m = min(max(16, 1 << (-(-rows // touched) - 1).bit_length()), 64)
        gs = jnp.asarray(group_sizes)
        for name, (k, n) in shapes.items():
            blocks = {**target.grouped_experts.kwargs(k, jnp.bfloat16), "block_m": block_m}
            kernel = functools.partial(grouped_experts, **blocks, interpret=on_cpu)
            lhs = jnp.asarray(rng.standard_normal((rows, k), np.float32), jnp.bfloat16)
            for fmt, w in weights[name].items():
                seconds = _time(kernel, lhs, w, gs, iters=iters)
                out = kernel(lhs, w, gs).astype(jnp.float32)
                ref = grouped_experts_reference(lhs, w, gs).astype(jnp.float32)
                err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))  # relative
                w_bytes = w.nbytes if isinstance(w, QTensor) else w.size * w.dtype.itemsize
                moved = touched * w_bytes / experts + lhs.nbytes + rows * n * lhs.dtype.itemsize
                frac = f"{100 * moved / seconds / peak:5.1f}%" if peak else "?"
                print(
                    f"{tokens:>6} {name:>8} {fmt:>6} {touched:>7} {seconds * 1e6:>9.1f} "
                    f"{moved / seconds / 1e9:>8.1f} {frac:>6} {err:>8.1e}"
                )
                results.append(
                    dict(
                        tokens=tokens,
                        matmul=name,
                        format=fmt,
                        experts=touched,
                        seconds=seconds,
                        gb_per_s=moved / seconds / 1e9,
                        peak_fraction=moved / seconds / peak if peak else None,
                        rel_err=err,
                    )
                )
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--kernel", choices=("all", "paged_attention", "grouped_experts"), default="all"
    )
    parser.add_argument("--iters", type=int, default=20, help="timed calls per case (GPU)")
    args = parser.parse_args(argv)
    if args.kernel in ("all", "paged_attention"):
        print("== paged attention ==")
        paged_attention_bench(args.iters)
    if args.kernel in ("all", "grouped_experts"):
        print("\n== grouped experts ==")
        grouped_experts_bench(args.iters)


if __name__ == "__main__":
    main()
