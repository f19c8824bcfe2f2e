"""Both kernels' benchmarks in one run: ``python -m pallas_kernels.bench``.

On a GPU each prints achieved GB/s against the device's peak memory bandwidth (paged attention:
batch 64 at 2k context with bf16 / fp8 / int4 KV, and more; grouped experts: Qwen3-30B-A3B expert
shapes for 8 to 256 tokens, per weight format). On CPU the kernels run in Pallas' interpreter at
small sizes, for correctness only, and say so.
"""

from __future__ import annotations


def main() -> None:
    from pallas_kernels import grouped_experts, paged_attention

    print("== paged attention ==")
    paged_attention.main()
    print("\n== grouped experts ==")
    grouped_experts.main([])


if __name__ == "__main__":
    main()
