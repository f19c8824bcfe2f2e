"""Prefix-cache hit ratio against KV pool size, per shipped trace:
``python -m benchmarks.prefix_cache_curve [--out DIR]``.

Each trace's prompts go through the engine's block manager in order
(``research.bench.cache_replay``) at ``--length-scale`` of their lengths (default 1/32: a
Mooncake 512-token block becomes 16 tokens, one engine block, so sharing is kept and hashing
is 32x cheaper), with pools of ``--pool-tokens`` full-length tokens (the scaled pool holds the
same fraction of the trace). A vertical line marks the pool vLLM's memory profile gives
Qwen3-Coder-30B-A3B AWQ on one GB10 at utilization 0.9 (``research.perf.vllm_memory``).
Writes ``hit_ratio_vs_pool.png`` (with PDF and SVG) and ``hit_ratio_vs_pool.csv``, and prints
the table. Azure's traces carry no prefix information: they are listed with 0 sharing.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from research.bench.cache_replay import replay_prefix_cache
from research.bench.datasets import SHIPPED_TRACES, load_trace, trace_requests

# From the longest prompt up (a pool below it cannot admit every request).
POOL_TOKENS = (2**18, 2**19, 2**20, 2**21, 2**22, 2**23, 2**24)
TRACES = ("mooncake_conversation", "mooncake_synthetic")
PUBLISHED = {"mooncake_conversation": 0.40, "mooncake_synthetic": 0.66}  # FAST'25 Table 2
BLOCK = 16


def curve(name: str, pools: tuple[int, ...], length_scale: float) -> list[dict]:
    reqs = trace_requests(load_trace(name), vocab_size=151936, length_scale=length_scale)
    rows = []
    for tokens in (*pools, None):
        blocks = None if tokens is None else max(1, round(tokens * length_scale / BLOCK))
        r = replay_prefix_cache(reqs, blocks, BLOCK)
        rows.append(
            {
                "trace": name,
                "pool_tokens": "unbounded" if tokens is None else tokens,
                "hit_ratio": r.hit_rate,
                "evictions": r.evictions,
                "too_long": r.too_long,
                "length_scale": length_scale,
                "published_unbounded": PUBLISHED.get(name),
            }
        )
    return rows


def figure(rows: list[dict], vllm_pool: int | None, path: Path) -> Path:
    from matplotlib.figure import Figure

    from research.bench import plots

    fig = Figure(figsize=(plots.WIDTH_IN * 0.6, 2.6), layout="constrained")
    ax = fig.subplots()
    for name in dict.fromkeys(r["trace"] for r in rows):
        pts = [r for r in rows if r["trace"] == name and r["pool_tokens"] != "unbounded"]
        (line,) = ax.plot(
            [r["pool_tokens"] for r in pts],
            [100 * r["hit_ratio"] for r in pts],
            marker="o",
            markersize=3,
            label=name,
        )
        top = next(r for r in rows if r["trace"] == name and r["pool_tokens"] == "unbounded")
        ax.axhline(100 * top["hit_ratio"], color=line.get_color(), linestyle=":", linewidth=1)
        if top["published_unbounded"] is not None:
            ax.axhline(
                100 * top["published_unbounded"],
                color=line.get_color(),
                linestyle="--",
                linewidth=0.8,
            )
    if vllm_pool:
        ax.axvline(vllm_pool, color="grey", linewidth=0.8)
        ax.text(vllm_pool, 45, " one GB10's pool,\n Qwen3-Coder AWQ", fontsize=5, color="grey")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV pool (tokens)", fontsize=7)
    ax.set_ylabel("prefix-cache hit ratio (% of prompt tokens)", fontsize=7)
    ax.tick_params(labelsize=6)
    ax.legend(fontsize=5)
    import textwrap

    text = (
        "dotted: unbounded pool; dashed: Mooncake FAST'25 Table 2; prompts replayed in trace "
        "order through the engine's block manager (no overlap in time)"
    )
    chars = int(fig.get_figwidth() * 72 / (plots.CAPTION_FONTSIZE * 0.55))
    fig.supxlabel(textwrap.fill(text, chars), fontsize=plots.CAPTION_FONTSIZE)
    return plots._save(fig, path)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/prefix_cache_curve"))
    parser.add_argument("--length-scale", type=float, default=1 / 32)
    parser.add_argument("--pool-tokens", type=int, nargs="+", default=list(POOL_TOKENS))
    parser.add_argument("--traces", nargs="+", default=list(TRACES), choices=sorted(SHIPPED_TRACES))
    args = parser.parse_args(argv)
    rows = [r for t in args.traces for r in curve(t, tuple(args.pool_tokens), args.length_scale)]
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "hit_ratio_vs_pool.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    from research.perf.vllm_memory import vllm_memory_profile

    pool = vllm_memory_profile("qwen3-coder-30b-a3b", "awq", "gb10", 0.9).kv.num_blocks * 16
    print(f"{'trace':<24} {'pool tokens':>12} {'hit ratio':>9} {'evictions':>10}")
    for r in rows:
        pool_text = (
            r["pool_tokens"] if isinstance(r["pool_tokens"], str) else f"{r['pool_tokens']:,}"
        )
        print(f"{r['trace']:<24} {pool_text:>12} {r['hit_ratio']:>9.1%} {r['evictions']:>10,}")
    print(f"figure: {figure(rows, pool, args.out / 'hit_ratio_vs_pool.png')}")
    return rows


if __name__ == "__main__":
    main()
