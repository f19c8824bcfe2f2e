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
from typing import Any

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


# ---- ragged paged attention (the engine's kernel) ---------------------------------------------


def measured_peak_bandwidth(device: jax.Device, nbytes: int = 2 << 30, iters: int = 10) -> float:
    """Bytes/s of a device-to-device copy of ``nbytes`` (read + write counted): the bandwidth
    this device reaches, against which the kernels' fractions are reported."""
    x = jax.device_put(jnp.zeros((nbytes // 4,), jnp.float32), device)
    copy = jax.jit(lambda a: a + 1.0)
    seconds = _time(copy, x, iters=iters)
    return 2 * nbytes / seconds


def ragged_step(
    key: jax.Array,
    kv: str,
    *,
    decodes: int,
    context: int,
    chunks: int = 0,
    chunk: int = 0,
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    page_size: int = 16,
) -> tuple[tuple[jax.Array, ...], dict[str, jax.Array], int]:
    """A step of ``decodes`` decode rows and ``chunks`` prefill chunks of ``chunk`` tokens, every
    row with ``context`` cached tokens (bf16 q, K/V quantized to ``kv``, pages shuffled).
    Returns the kernel's positional args, the scale kwargs and the bytes it must move: the
    cached K/V (and scales) each row reads once per kv head, q, the new K/V and the output."""
    rows = decodes + chunks
    new = [1] * decodes + [chunk] * chunks
    n = sum(new)
    per_row = -(-(context) // page_size)
    num_pages = rows * per_row
    kq, kk, kv_key, kt, kn = jax.random.split(key, 5)
    q = jax.random.normal(kq, (n, heads, head_dim), jnp.bfloat16)
    k_new, v_new = (jax.random.normal(x, (n, kv_heads, head_dim), jnp.bfloat16) for x in (kn, kt))
    shape = (kv_heads, num_pages, page_size, head_dim)
    k, v = (jax.random.normal(x, shape, jnp.bfloat16) for x in (kk, kv_key))
    tables = jax.random.permutation(kt, num_pages).reshape(rows, per_row).astype(jnp.int32)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(new)]), jnp.int32)
    ctx = jnp.full((rows,), context, jnp.int32)
    scales = {}
    if kv != "bf16":
        k, scales["k_scales"] = _quantize_kv(k, kv)
        v, scales["v_scales"] = _quantize_kv(v, kv)
    row_bytes = k.shape[-1] * k.dtype.itemsize + (4 if scales else 0)
    nbytes = 2 * rows * context * kv_heads * row_bytes + 2 * q.nbytes + 2 * k_new.nbytes
    return (q, k_new, v_new, k, v, tables, qsl, ctx), scales, nbytes


RAGGED_STEPS = {  # name -> ragged_step arguments
    "decode 64 x 2k": dict(decodes=64, context=2048),
    "mixed 60 x 2k + 4 x 256-token chunks": dict(decodes=60, context=2048, chunks=4, chunk=256),
}


def ragged_attention_bench(
    iters: int = 20,
    configs: dict[str, Any] | None = None,
    steps: dict | None = None,
    kv_formats: tuple[str, ...] = KV_FORMATS,
) -> list[dict]:
    """The ragged kernel on ``RAGGED_STEPS`` (Llama/Qwen attention: 32 heads, 8 kv heads, head
    dim 128) with each KV format, under the table's configuration for this device (or each of
    ``configs``: name -> kernel kwargs). One row per case with the achieved bandwidth as a
    fraction of the measured peak (a device copy) and of the spec sheet."""
    from pallas_kernels.ragged_attention import ragged_paged_attention
    from pallas_kernels.tuning import ragged_attention_config

    device = jax.devices()[0]
    if device.platform != "gpu":
        print("no GPU: the ragged attention benchmark times nothing on a CPU (the tests check it)")
        return []
    steps = steps or RAGGED_STEPS
    measured = measured_peak_bandwidth(device)
    spec = peak_bandwidth(device)
    target = target_for_kind(device.device_kind)
    print(
        f"device {device.device_kind}: measured copy bandwidth {measured / 1e9:.0f} GB/s"
        + (f" (spec {spec / 1e9:.0f} GB/s)" if spec else "")
    )
    print(f"{'step':<40} {'kv':>5} {'config':<28} {'us':>9} {'GB/s':>8} {'%meas':>6}")
    key = jax.random.key(0)
    results = []
    for step, kwargs in steps.items():
        decode = "chunks" not in kwargs
        for kv in kv_formats:
            args, scales, nbytes = ragged_step(key, kv, **kwargs)
            rows = args[5].shape[0]
            if configs is None:
                config, _ = ragged_attention_config(
                    target,
                    q_dtype=jnp.bfloat16,
                    kv="auto" if kv == "bf16" else kv,
                    head_dim=128,
                    group=4,
                    decode=decode,
                    num_rows=rows,
                )
                cases = {"table": config.kwargs(page_size=16, group=4)}
            else:
                cases = configs
            for name, blocks in cases.items():
                fn = functools.partial(ragged_paged_attention, **blocks)
                seconds = _time(fn, *args, iters=iters, **scales)
                frac = nbytes / seconds / measured
                print(
                    f"{step:<40} {kv:>5} {name:<28} {seconds * 1e6:9.1f} "
                    f"{nbytes / seconds / 1e9:8.1f} {100 * frac:6.1f}"
                )
                results.append(
                    dict(
                        step=step,
                        kv=kv,
                        config=name,
                        seconds=seconds,
                        gb_per_s=nbytes / seconds / 1e9,
                        measured_fraction=frac,
                        peak_fraction=nbytes / seconds / spec if spec else None,
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
        "--kernel",
        choices=("all", "ragged_attention", "paged_attention", "grouped_experts"),
        default="all",
    )
    parser.add_argument("--iters", type=int, default=20, help="timed calls per case (GPU)")
    args = parser.parse_args(argv)
    if args.kernel in ("all", "ragged_attention"):
        print("== ragged paged attention ==")
        ragged_attention_bench(args.iters)
    if args.kernel in ("all", "paged_attention"):
        print("\n== paged attention (decode kernel) ==")
        paged_attention_bench(args.iters)
    if args.kernel in ("all", "grouped_experts"):
        print("\n== grouped experts ==")
        grouped_experts_bench(args.iters)


if __name__ == "__main__":
    main()
