"""bfloat16 projections of SmolLM2-135M on this CPU: XLA's dot against the native kernels (the
vector kernel, and AMX where the CPU has it), side by side in one process (and torch's, which
calls oneDNN, where torch is installed).

    python -m benchmarks.bench_gemm [--rows 1 16 64 2048] [--repeats 20]
    python -m benchmarks.bench_gemm --chain [--rows 1] [--dtype bfloat16] [--kernel vector]

For each (rows, in, out) shape of the model's projections it prints GFLOP/s and GB/s of weight
reads (median of ``--repeats`` calls), and the larger of their fractions of the machine's
measured bf16 GEMM and read peaks (``research.perf.host_peaks``), for: ``xla`` (a 2-D dot with a
float32 result, as ``layers.matmul`` runs it), ``xla+cast`` (the same with its bfloat16 cast, as ``layers.linear``
runs it inside a step, where the cast fuses into the dot), ``vector`` and ``amx``
(``research.native.gemm`` writing bfloat16) and ``torch``. Weights stay warm in cache between calls: this is the kernels'
speed, not a step's (a read fraction past 1 means the weights came from cache, not memory).

``--chain`` times what a decode step's projections read instead: every layer's weights (30
layers of distinct random weights, 269 MB in bfloat16) and the output head, each product
feeding the next, against ``jnp.sum`` over a buffer of the same bytes and against the same
weight buffers streamed one by one on the kernels' own threads (``gemm.stream``, integer sums
of their words), the three alternating in one process; the ratios of their times are how close
the projections come to a plain read (the stream is the sharper yardstick: the same buffers,
threads and calls, only the arithmetic and access order differ).
``--dtype q4_1`` chains GGUF's Q4_1 blocks as stored (a Q8_0 head) through the block kernel,
with float32 activations or (``--activations int8``) llama.cpp's int8 ones.
"""

from __future__ import annotations

import argparse
from typing import Any

# (in, out) of SmolLM2-135M's projections: q|k|v fused, o, gate|up fused, down, tied lm_head
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 2048])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--chain", action="store_true", help="a step's projections vs a read")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "q4_1"],
                        help="--chain's weights (q4_1: GGUF's blocks as stored, a Q8_0 "
                        "head, bfloat16 activations)")  # fmt: skip
    parser.add_argument("--kernel", default="vector", choices=["auto", "vector", "amx"])
    parser.add_argument("--activations", default="float", choices=["float", "int8"],
                        help="--dtype q4_1: float32 activations, or int8 per 32-k block "
                        "(llama.cpp's arithmetic)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.chain:
        for m in args.rows:
            chain(m, args.dtype, args.kernel, args.repeats, activations=args.activations)
        return

    import jax
    import jax.numpy as jnp
    import numpy as np

    from research.native import gemm
    from research.perf.host_peaks import host_peaks, median_seconds

    try:
        import torch
    except ImportError:
        torch = None
    bf16, dims = jnp.bfloat16, (((1,), (0,)), ((), ()))
    xla = jax.jit(lambda x, w: jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32))
    cast = jax.jit(lambda x, w: xla(x, w).astype(bf16))
    kernels = {
        name: jax.jit(lambda x, w, name=name: gemm.matmul(x, w, bf16, kernel=name))
        for name in (("vector", "amx") if gemm.amx_available() else ("vector",))
    }
    if not gemm.available():
        print(f"native kernels unavailable: {gemm.unavailable_reason(bf16)}")
    peaks = host_peaks()  # the roofline: this machine's bf16 GEMM and read peaks, cached
    flop_peak, read_peak = peaks["bf16_flops"], peaks["bandwidth"]
    print(
        f"peaks: {flop_peak / 1e9:.0f} GFLOP/s bf16 GEMM, {read_peak / 1e9:.1f} GB/s reads; "
        "each cell: GFLOP/s (GB/s of weights) [fraction of the binding roof]"
    )
    print(f"{'rows':>5} {'in':>5} {'out':>6} | GFLOP/s (GB/s of weights) [roofline fraction]")
    rng = np.random.default_rng(0)
    for m in args.rows:
        for k, n in SHAPES:
            if m * n > 2048 * 3072 * 4:  # the lm_head at prefill sizes: rows never reach it
                continue
            x = jnp.asarray(rng.standard_normal((m, k)), bf16)
            w = jnp.asarray(rng.standard_normal((k, n)) * 0.05, bf16)
            runs = {
                "xla": lambda x=x, w=w: xla(x, w).block_until_ready(),
                "xla+cast": lambda x=x, w=w: cast(x, w).block_until_ready(),
            }
            if gemm.available():
                packed = gemm.pack(w)
                for name, fn in kernels.items():
                    runs[name] = lambda x=x, p=packed, fn=fn: fn(x, p).block_until_ready()
            if torch is not None:
                tx, tw = (
                    torch.from_numpy(np.asarray(x, np.float32)),
                    torch.from_numpy(np.asarray(w, np.float32)),
                )
                tx, tw = tx.to(torch.bfloat16), tw.to(torch.bfloat16)
                runs["torch"] = lambda tx=tx, tw=tw: tx @ tw
            cells = []
            for name, fn in runs.items():
                s = median_seconds(fn, args.repeats)
                flops, nbytes = 2 * m * k * n / s, k * n * 2 / s
                roof = max(flops / flop_peak, nbytes / read_peak)
                cells.append(f"{name} {flops / 1e9:7.0f} ({nbytes / 1e9:5.1f}) [{roof:.2f}]")
            print(f"{m:5d} {k:5d} {n:6d} | " + "  ".join(cells))


def chain(
    rows: int, dtype: str, kernel: str, repeats: int, layers: int = 30, activations: str = "float"
) -> None:
    """One decode step's projections of SmolLM2-135M's shapes (random weights, ``layers``
    layers and the head), chained, against a read of the same bytes, alternating."""
    import statistics
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    from research.native import gemm

    blocks = dtype == "q4_1"
    dt = jnp.dtype(jnp.bfloat16 if blocks else dtype)
    key = jax.random.key(0)

    def weight(k: int, n: int, sub: jax.Array, fmt: str = "q4_1") -> Any:
        w = 0.02 * jax.random.normal(sub, (k, n))
        if not blocks:
            return gemm.pack(w.astype(dt))
        import gguf

        kind = gguf.GGMLQuantizationType.Q4_1 if fmt == "q4_1" else gguf.GGMLQuantizationType.Q8_0
        rows = gguf.quants.quantize(np.asarray(w, np.float32).T, kind)
        return gemm.pack_blocks(rows, fmt, activations=activations)

    weights = []
    for _ in range(layers):
        for k, n in SHAPES[:4]:
            key, sub = jax.random.split(key)
            weights.append(weight(k, n, sub))
    head = weight(*SHAPES[4], key, "q8_0")
    nbytes = sum(w.packed.nbytes for w in weights) + head.packed.nbytes

    def product(x: jax.Array, w: Any, out: Any = jnp.float32) -> jax.Array:
        if blocks:
            return gemm.block_matmul(x, w, out)
        return gemm.matmul(x, w, out, kernel=kernel)

    @jax.jit
    def step(x, weights, head):
        for i in range(layers):
            qkv, o, gate_up, down = weights[4 * i : 4 * i + 4]
            h = product(x, qkv, dt)[:, : x.shape[1]]
            h = product(h, o, dt)
            h = product(h, gate_up, dt)[:, : down.shape[0]]
            x = x + product(h, down, dt)
        return product(x, head)

    @jax.jit
    def stream(weights, head):  # the same buffers read plainly, in the same order, one by one
        total = jnp.uint32(0)
        for w in [*weights, head]:
            total = gemm.stream(w.packed, total)
        return total

    buffer = jnp.ones(nbytes // 4, jnp.float32)
    read = jax.jit(jnp.sum)
    x = jnp.ones((rows, SHAPES[0][0]), dt)
    runs = {
        "step": lambda: step(x, weights, head),
        "read": lambda: read(buffer),
        "stream": lambda: stream(weights, head),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats + 1):  # the first round compiles and warms
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn().block_until_ready()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t[1:]) for name, t in times.items()}
    label = gemm.describe(dt) if kernel == "auto" or dt == jnp.float32 else kernel
    if blocks:
        label = f"GGUF blocks (Q4_1 layers, Q8_0 head; {activations} activations)"
    print(
        f"chain rows={rows} {label}: {nbytes / 1e6:.0f} MB; projections "
        f"{med['step'] * 1e3:.2f} ms ({nbytes / med['step'] / 1e9:.1f} GB/s), read "
        f"{med['read'] * 1e3:.2f} ms ({nbytes / med['read'] / 1e9:.1f} GB/s), stream "
        f"{med['stream'] * 1e3:.2f} ms ({nbytes / med['stream'] / 1e9:.1f} GB/s): "
        f"{med['read'] / med['step']:.2f} of a read, {med['stream'] / med['step']:.2f} of the "
        "stream"
    )


if __name__ == "__main__":
    main()
