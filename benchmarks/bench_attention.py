"""The native CPU attention at decode sizes: 30 layers of SmolLM2-135M's heads (9 query, 3 KV
heads of 64) over bf16 pages of 16 tokens, every row one new token attending to ``ctx`` cached
positions in pages scattered over the pool, each layer's output feeding the next's queries.

    python -m benchmarks.bench_attention [--cases 1x2000 16x256 64x256] [--repeats 40]

Prints, per case (rows x context), the median time of the 30 layers, the K/V bytes they read
per second, and that rate against a plain read of the same pages 30 times on the kernels' own
threads (``gemm.stream``), timed alternately in the same process: the roof for this working set.
A benchmark: its figures depend on the machine and what else runs on it (the pool here is one
layer's, reused by all 30, so it stays in cache more than a model's would; the plain read of it
does too).
"""

from __future__ import annotations

import argparse
import statistics
import time


def bench(rows: int, ctx: int, repeats: int, layers: int = 30) -> tuple[float, float, float]:
    """(median seconds of ``layers`` attention calls, K/V bytes they read, bytes/s of a plain
    read of the pages ``layers`` times, alternating with them)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from research.engine.attention import AttentionMetadata, native_attention
    from research.native import gemm

    heads, kv_heads, head_dim, page = 9, 3, 64, 16
    rng = np.random.default_rng(0)
    pages = ctx // page + 2
    blocks = rows * pages + 1
    bf16 = jnp.bfloat16

    def randn(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape), bf16)

    k_pages = randn(kv_heads, blocks, page, head_dim)
    v_pages = randn(kv_heads, blocks, page, head_dim)
    tables = jnp.asarray(1 + rng.permutation(rows * pages).reshape(rows, pages), jnp.int32)
    q = randn(rows, heads, head_dim)
    k_new, v_new = randn(rows, kv_heads, head_dim), randn(rows, kv_heads, head_dim)
    meta = AttentionMetadata(
        jnp.full((rows,), ctx, jnp.int32),
        jnp.arange(rows, dtype=jnp.int32),
        jnp.arange(rows + 1, dtype=jnp.int32),
        jnp.full((rows,), ctx + 1, jnp.int32),
        tables,
        None,
    )

    class Pool:  # the one layer every call reads
        k, v = [k_pages], [v_pages]

    @jax.jit
    def layers_of(q: jax.Array) -> jax.Array:
        for _ in range(layers):
            out = native_attention(q, k_new, v_new, Pool, 0, tables, meta, head_dim**-0.5)
            q = out.astype(bf16)
        return q

    @jax.jit
    def read_pages(k: jax.Array, v: jax.Array) -> jax.Array:
        total = jnp.uint32(0)
        for _ in range(layers):
            total = gemm.stream(v, gemm.stream(k, total))
        return total

    runs = {"attention": lambda: layers_of(q), "read": lambda: read_pages(k_pages, v_pages)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(repeats + 1):  # the first round compiles and warms
        for name, fn in runs.items():
            t = time.perf_counter()
            fn().block_until_ready()
            if i:
                times[name].append(time.perf_counter() - t)
    read_bytes = layers * 2 * k_pages.nbytes
    return (
        statistics.median(times["attention"]),
        layers * rows * ctx * kv_heads * head_dim * 2 * 2,
        read_bytes / statistics.median(times["read"]),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["1x2000", "16x256", "64x256"])
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args()
    for case in args.cases:
        rows, ctx = (int(v) for v in case.split("x"))
        seconds, nbytes, read = bench(rows, ctx, args.repeats)
        rate = nbytes / seconds
        print(
            f"{rows} rows x {ctx} positions: 30 layers {seconds * 1e3:.3f} ms, "
            f"K/V {nbytes / 1e6:.0f} MB at {rate / 1e9:.1f} GB/s, "
            f"{rate / read:.2f} of a plain read of the same pages ({read / 1e9:.1f} GB/s)"
        )


if __name__ == "__main__":
    main()
