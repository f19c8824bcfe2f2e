"""Single-sequence speed of SmolLM2-135M on CPU, ours against HF transformers in the same run.

    python -m benchmarks.bench_decode [--prompt-len 128] [--gen-len 128] [--repeats 3]
                                       [--dtype float32|bfloat16]

Prints prefill time and decode tok/s for each engine and their ratio. Both run in ``--dtype`` on
the same dequantized GGUF weights, greedy, with EOS ignored so each generates exactly --gen-len.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _ours(prompt: list[int], gen_len: int, repeats: int, dtype: str) -> tuple[float, float]:
    from research import LLM, SamplingParams

    # No prefix caching: the repeats send the same prompt, and a cached prefix is no prefill.
    llm = LLM("smollm2-135m", max_model_len=2048, dtype=dtype, enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], sp)  # compile
    ttfts, rates = [], []
    for _ in range(repeats):
        m = llm.generate([prompt], sp)[0].metrics
        ttfts.append(m.first_token_time - m.arrival_time)
        rates.append((gen_len - 1) / (m.finished_time - m.first_token_time))
    return statistics.median(ttfts), statistics.median(rates)


def _hf(prompt: list[int], gen_len: int, repeats: int, dtype: str) -> tuple[float, float]:
    import torch

    from research.bench.hf_peer import load_hf_model

    model, _ = load_hf_model("smollm2-135m", dtype)
    ids = torch.tensor([prompt])
    ttfts, rates = [], []
    with torch.no_grad():
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            out = model(ids, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1)
            t1 = time.perf_counter()
            for _ in range(gen_len - 1):
                out = model(nxt[:, None], past_key_values=out.past_key_values, use_cache=True)
                nxt = out.logits[:, -1].argmax(-1)
            t2 = time.perf_counter()
            ttfts.append(t1 - t0)
            rates.append((gen_len - 1) / (t2 - t1))
    return statistics.median(ttfts[1:]), statistics.median(rates[1:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)

    import numpy as np

    prompt = np.random.RandomState(0).randint(3, 49152, size=args.prompt_len).tolist()
    rows = [("ours (JAX, jit)", *_ours(prompt, args.gen_len, args.repeats, args.dtype))]
    if not args.skip_hf:
        hf = _hf(prompt, args.gen_len, args.repeats, args.dtype)
        rows.append(("HF transformers (torch)", *hf))
    print(
        f"SmolLM2-135M {args.dtype}, CPU, {args.prompt_len} prompt / {args.gen_len} generated, "
        f"one sequence, median of {args.repeats}"
    )
    print(f"{'engine':<26}{'prefill ms':>12}{'decode tok/s':>14}")
    for name, ttft, rate in rows:
        print(f"{name:<26}{ttft * 1e3:>12.1f}{rate:>14.1f}")
    if len(rows) == 2:
        print(f"decode speed ratio ours / HF: {rows[0][2] / rows[1][2]:.2f}x")


if __name__ == "__main__":
    main()
